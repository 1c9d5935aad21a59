"""kohya's loss and noise arguments (noise_offset, ip_noise_gamma, min_snr_gamma, debiased_estimation_loss,
min / max_timestep, zero_terminal_snr, loss_type with huber_schedule / huber_c / huber_scale, ...) and the
flow-matching scripts' timestep draw (Flux and Lumina:
timestep_sampling with sigmoid_scale, discrete_flow_shift, model_prediction_type; SD3: weighting_scheme with
logit_mean / logit_std / mode_scale, training_shift) as ot_dist's `loss` section."""

from __future__ import annotations

from ot_dist.migrate.common import Imported
from ot_dist.migrate.kohya_args import KohyaArgs

FLOW = ("flux", "chroma", "sd3", "lumina2")


def import_loss(args: KohyaArgs, c: dict, family: str, out: Imported) -> None:
    skip = out.not_honoured.append
    loss = {}
    v_prediction = c["model"].get("prediction_type") == "v_prediction"
    if args["noise_offset"] and family in FLOW:  # flux / sd3_train_network.py draw plain N(0, 1) noise
        skip(f"noise_offset: {args['noise_offset']}: kohya's {family} training ignores it")
    elif args["noise_offset"]:
        loss["offset_noise_weight"] = args["noise_offset"]  # kohya: offset x N(0, 1) per sample and channel
    for key, reason in (("noise_offset_random_strength", "an offset strength drawn in [0, noise_offset]"),
                        ("adaptive_noise_scale", "an offset that grows with the latents' mean"),
                        ("multires_noise_iterations", "multi-resolution (pyramid) noise"),
                        ("ip_noise_gamma_random_strength", "an input perturbation strength drawn in [0, gamma]"),
                        ("scale_v_pred_loss_like_noise_pred", "the v-prediction loss scaled like the noise one"),
                        ("v_pred_like_loss", "a v-prediction-like loss added to the noise one"),
                        ("masked_loss", "masks from conditioning_data_dir / alpha_mask (ot_dist reads -masklabel.png "
                         "files: masked_training)"),
                        ("weighted_captions", "prompt weighting in captions")):
        if args[key]:
            skip(f"{key}: {args[key]}: {reason} is not supported")
    if args["multires_noise_discount"] != 0.3 and not args["multires_noise_iterations"]:
        out.notes.append("multires_noise_discount: ignored without multires_noise_iterations, as in kohya")
    if args["ip_noise_gamma"] and family == "sd3":  # sd3_train_utils' noisy input has no perturbation
        skip(f"ip_noise_gamma: {args['ip_noise_gamma']}: kohya's sd3 training ignores it")
    elif args["ip_noise_gamma"]:
        loss["input_perturbation"] = args["ip_noise_gamma"]
    if args["min_snr_gamma"]:
        if family in FLOW:
            skip(f"min_snr_gamma: {args['min_snr_gamma']}: kohya's {family} training ignores it")
        else:
            loss["min_snr_gamma"] = args["min_snr_gamma"]  # min(SNR, g) / SNR, / (SNR + 1) for v: kohya's formulas
            if args["zero_terminal_snr"] and v_prediction:
                # kohya's get_noise_scheduler keeps the SNR table (all_snr) it computed before rescaling the betas
                skip(f"min_snr_gamma: {args['min_snr_gamma']} with zero_terminal_snr: kohya weighs by the SNR of the "
                     "schedule before the rescale, ot_dist by the rescaled schedule's (the one it trains on): the "
                     "weights differ at almost every timestep (5x at t = 900, 0 instead of 0.005 at t = 999); "
                     "min_snr_gamma is written")
    if args["debiased_estimation_loss"]:
        if family in FLOW:
            skip(f"debiased_estimation_loss: kohya's {family} training ignores it")
        elif loss.get("min_snr_gamma"):  # kohya multiplies both weights; ot_dist has one weight function
            skip(f"debiased_estimation_loss: kohya multiplies its weight 1 / sqrt(SNR) with min_snr_gamma's; ot_dist "
                 f"weighs by one function: min_snr_gamma {loss['min_snr_gamma']} alone is written")
        elif v_prediction:  # kohya weighs v by 1 / (SNR + 1), ot_dist (OneTrainer) by 1 / sqrt(SNR + 1)
            skip("debiased_estimation_loss: kohya's v-prediction weight 1 / (SNR + 1) differs from ot_dist's "
                 "DEBIASED_ESTIMATION (1 / sqrt(SNR + 1)); not written")
        else:
            loss["weight_fn"] = "DEBIASED_ESTIMATION"  # 1 / sqrt(min(SNR, 1000)) in both
    _loss_function(args, family, loss, skip, out.notes)
    if family in FLOW:
        _flow(args, c, family, loss, skip)
    else:
        _ddpm_timesteps(args, loss)
        if args["zero_terminal_snr"]:
            if v_prediction:
                c["model"]["zero_terminal_snr"] = True
            else:
                skip("zero_terminal_snr: with epsilon prediction (kohya trains it so) ot_dist refuses it; it trains "
                     "v-prediction on a zero-terminal-SNR schedule: add v_parameterization")
    if loss:
        c["loss"] = loss


def _loss_function(args: KohyaArgs, family: str, loss: dict, skip, notes: list) -> None:
    """kohya's conditional_loss: l2, l1, or the pseudo-Huber huber / smooth_l1 with the threshold of
    get_huber_threshold_if_needed (huber_schedule, huber_c, huber_scale), the same formulas as ot_dist's
    pseudo_huber_* options. Its flow scripts (Flux, SD3) pass sigma x 1000 as the timestep over 1000 steps, as
    ot_dist's flow timesteps are, and stop on snr (their scheduler has no alphas_cumprod)."""
    loss_type, schedule = args["loss_type"], args["huber_schedule"]
    c, scale = args["huber_c"], args["huber_scale"]
    if loss_type == "l1":
        loss |= {"mse_strength": 0.0, "mae_strength": 1.0}
    elif loss_type in ("huber", "smooth_l1") and schedule == "snr" and family in FLOW:
        skip(f"loss_type: {loss_type} with huber_schedule snr (kohya's default): kohya's {family} training stops "
             "there (NotImplementedError: its flow scheduler has no alphas_cumprod); set huber_schedule exponential "
             "or constant. The MSE is written")
    elif loss_type in ("huber", "smooth_l1"):
        loss |= {"mse_strength": 0.0, "pseudo_huber_strength": 1.0, "pseudo_huber_form": loss_type,
                 "pseudo_huber_schedule": schedule, "pseudo_huber_c": c}
        if schedule != "snr":
            loss["pseudo_huber_scale"] = scale
        elif args.given("huber_scale"):
            notes.append(f"huber_scale: {scale}: kohya's snr schedule does not read it")
    elif loss_type != "l2":
        skip(f"loss_type: {loss_type} is not one of kohya's (l2, l1, huber, smooth_l1); the MSE is written")
    for key in ("huber_schedule", "huber_c", "huber_scale"):
        if args.given(key) and loss_type in ("l1", "l2"):
            notes.append(f"{key}: {args[key]} shapes the huber / smooth_l1 loss only; with {loss_type} kohya ignores it")


def _ddpm_timesteps(args: KohyaArgs, loss: dict) -> None:
    """kohya's get_timesteps: randint(min_timestep, max_timestep), or max_timestep alone when min_timestep is not
    below it (kohya accepts a minimum above the maximum)."""
    low, high = args["min_timestep"] or 0, args["max_timestep"]
    if high is not None and low >= high:
        loss["min_timestep"] = loss["max_timestep"] = high
        return
    _timestep_range(args, loss)


def _timestep_range(args: KohyaArgs, loss: dict) -> None:
    """kohya draws randint(min_timestep, max_timestep): the maximum is excluded; ot_dist's is included."""
    low, high = args["min_timestep"], args["max_timestep"]
    if low:
        loss["min_timestep"] = low
    if high is not None and high < 1000:
        loss["max_timestep"] = max(high - 1, low or 0)


def _flow(args: KohyaArgs, c: dict, family: str, loss: dict, skip) -> None:
    if args["zero_terminal_snr"]:
        skip(f"zero_terminal_snr: {family} trains flow matching, which ends in pure noise already")
    if family == "sd3":
        _sd3(args, loss, skip)
        return
    if family == "lumina2":
        _lumina(args, loss, skip)
    else:
        _flux(args, c, family, loss, skip)
    for key in ("min_timestep", "max_timestep"):
        if args[key] is not None:
            skip(f"{key}: {args[key]}: kohya's {family} training ignores it (timestep_sampling decides)")


def _flux(args: KohyaArgs, c: dict, family: str, loss: dict, skip) -> None:
    """flux_train_network.py: sigma (default: the scheduler's 1000 steps, shifted by discrete_flow_shift, drawn by
    weighting_scheme), uniform, sigmoid (sigmoid of N(0, sigmoid_scale)), shift (that, shifted by discrete_flow_shift)
    or flux_shift (that, shifted by the resolution as Flux's scheduler does)."""
    if family == "flux":
        c["model"]["guidance_scale"] = args["guidance_scale"]  # kohya shows the transformer 3.5 unless told (ot_dist: 1)
    elif args["guidance_scale"]:  # kohya's docs: Chroma trains with guidance_scale 0.0
        skip(f"guidance_scale: {args['guidance_scale']}: kohya feeds it to Chroma's modulation approximator; "
             "diffusers' ChromaTransformer2DModel (ot_dist) feeds 0, what kohya's guidance_scale 0.0 does")
    _flow_draw(args, loss, skip, "noise - latents")


def _lumina(args: KohyaArgs, loss: dict, skip) -> None:
    """lumina_train_network.py / lumina_train.py draw the noise level as flux_train_network.py does (at their own
    defaults: shift, raw, discrete_flow_shift 6.0), plus nextdit_shift (a uniform draw shifted by the resolution), and
    show NextDiT 1 - sigma against latents - noise: ot_dist's reversed Lumina 2 objective (docs/families.md)."""
    if args["timestep_sampling"] == "nextdit_shift":
        loss |= {"timestep_distribution": "uniform", "dynamic_timestep_shifting": True}
        args["sigmoid_scale"]  # nextdit_shift draws uniformly: kohya reads no scale
        args["discrete_flow_shift"]  # the resolution's shift replaces it
        _prediction(args, skip, "latents - noise")
        _unread_weighting(args)
        return
    _flow_draw(args, loss, skip, "latents - noise")


def _flow_draw(args: KohyaArgs, loss: dict, skip, target: str) -> None:
    """kohya's flow draw shared by its Flux and Lumina scripts (flux_train_utils / lumina_train_util's
    get_noisy_model_input_and_timesteps): sigma is the noise level x_t = (1 - sigma) x + sigma n, ot_dist's."""
    sampling, scale, shift = args["timestep_sampling"], args["sigmoid_scale"], args["discrete_flow_shift"]
    prediction = args["model_prediction_type"]
    if sampling == "sigma" and prediction == "raw" and args["weighting_scheme"] in ("sigma_sqrt", "cosmap"):
        # kohya weighs the loss by them with sigma_scaled only (apply_model_prediction_type); raw: uniform, unweighted
        loss |= {"timestep_distribution": "uniform", "timestep_shift": shift}
    elif sampling == "sigma":
        weighting_scheme(args, loss, skip, descending=True)  # the scheduler's timesteps[(u x 1000)]
        loss["timestep_shift"] = shift
    elif sampling == "uniform":
        loss |= {"timestep_distribution": "uniform", "timestep_shift": 1.0}
    elif sampling in ("sigmoid", "shift", "flux_shift"):
        loss |= {"timestep_distribution": "logit_normal", "logit_normal_std": scale}
        if sampling == "flux_shift":
            loss["dynamic_timestep_shifting"] = True
        else:
            loss["timestep_shift"] = shift if sampling == "shift" else 1.0
    else:
        skip(f"timestep_sampling: {sampling} is not one of kohya's (sigma, uniform, sigmoid, shift, flux_shift; "
             "Lumina: nextdit_shift)")
    _prediction(args, skip, target)
    if sampling != "sigma":
        _unread_weighting(args)


def _prediction(args: KohyaArgs, skip, target: str) -> None:
    prediction = args["model_prediction_type"]
    if prediction != "raw":
        skip(f"model_prediction_type: {prediction}: kohya compares "
             f"{'noisy input - sigma x prediction' if prediction == 'sigma_scaled' else 'noisy input + prediction'} "
             f"with {target}; ot_dist trains the plain flow-matching prediction (kohya's raw)")


def _unread_weighting(args: KohyaArgs) -> None:
    for key in ("weighting_scheme", "logit_mean", "logit_std", "mode_scale"):
        args[key]  # kohya reads them only for timestep_sampling sigma


def _sd3(args: KohyaArgs, loss: dict, skip) -> None:
    """sd3_train_network.py: u drawn by weighting_scheme, shifted by training_shift (default 1.0: unshifted, where
    ot_dist's auto takes the scheduler's 3.0), over [min_timestep, max_timestep)."""
    weighting_scheme(args, loss, skip)
    loss["timestep_shift"] = args["training_shift"]
    if args["min_timestep"] or args["max_timestep"] is not None:
        _timestep_range(args, loss)
        if args["training_shift"] != 1.0:  # kohya: t = min + (max - min) x shifted u; ot_dist shifts t in the window
            skip(f"min_timestep / max_timestep with training_shift {args['training_shift']}: kohya shifts the draw "
                 "before spreading it over the window, ot_dist shifts the time in the window (the noise levels "
                 "differ inside the window; its ends are the same)")


def weighting_scheme(args: KohyaArgs, loss: dict, skip, descending: bool = False) -> None:
    """diffusers' compute_density_for_timestep_sampling (kohya's copy; `ot-dist import diffusers` reads the diffusers
    scripts' own arguments of the same names through it): the draw; sigma_sqrt and cosmap weight the
    loss instead (compute_loss_weighting_for_sd3).
    `descending`: the script picks the scheduler's timesteps[(u x N)], which run from sigma 1 down, so its noise level
    is about 1 - u (kohya's flux timestep_sampling sigma, the diffusers Flux / SD3 scripts); kohya's sd3 training
    uses u itself. ot_dist's sigma grows with u: a logit_mean m there is -m here (uniform and mode are symmetric
    about 1/2)."""
    scheme = args["weighting_scheme"]
    if scheme in ("uniform", "none"):
        loss["timestep_distribution"] = "uniform"
    elif scheme == "logit_normal":
        mean = args["logit_mean"]
        loss |= {"timestep_distribution": "logit_normal", "logit_normal_mean": -mean if descending and mean else mean,
                 "logit_normal_std": args["logit_std"]}
    elif scheme == "mode":  # 1 - u - s (cos^2(pi u / 2) - 1 + u): ot_dist's heavy_tail with noising_weight s
        loss |= {"timestep_distribution": "heavy_tail", "noising_weight": args["mode_scale"]}
    else:
        loss["timestep_distribution"] = "uniform"
        skip(f"weighting_scheme: {scheme} weighs the loss by sigma (kohya's compute_loss_weighting_for_sd3); ot_dist "
             "has no such weight: uniform timesteps, unweighted")
