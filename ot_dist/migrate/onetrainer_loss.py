"""OneTrainer's loss settings (loss functions, offset noise, loss weighting, prediction overrides), its timestep
draw and its masked training as ot_dist's `loss` and `masked_training` sections: what each step's objective is."""

from __future__ import annotations

TIMESTEP_DISTRIBUTIONS = {"UNIFORM": "uniform", "LOGIT_NORMAL": "logit_normal", "HEAVY_TAIL": "heavy_tail",
                          "SIGMOID": "sigmoid", "COS_MAP": "cos_map", "INVERTED_PARABOLA": "inverted_parabola"}


def import_loss(ot: dict, c: dict, skip) -> None:
    from ot_dist.config.loss import LossConfig

    loss = {}
    if ot["offset_noise_weight"]:
        loss["offset_noise_weight"] = ot["offset_noise_weight"]
    flow = is_flow(c["model"]["family"])
    if ot["generalized_offset_noise"]:
        # OneTrainer falls back to plain offset noise on a flow family, and scales nothing without an offset
        if flow:
            skip("generalized_offset_noise: true needs DDPM betas; on a flow-matching model OneTrainer applies plain "
                 "offset noise, which offset_noise_weight gives")
        elif not ot["offset_noise_weight"]:
            skip("generalized_offset_noise: true scales the offset noise, and offset_noise_weight is 0")
        else:
            _mapped_if_known(loss, LossConfig, "generalized_offset_noise", True, skip)
    if ot["perturbation_noise_weight"]:
        loss["input_perturbation"] = ot["perturbation_noise_weight"]
    _timesteps(ot, c, loss, skip)
    weight_fn, strength = ot["loss_weight_fn"], ot["loss_weight_strength"]
    if weight_fn != "CONSTANT" and (weight_fn == "SIGMA") != flow:
        # OneTrainer stops at the first step there (NotImplementedError): SNR weights need DDPM, SIGMA flow matching
        skip(f"loss_weight_fn: {weight_fn} is not defined for {c['model']['family']} "
             f"({'flow matching: SIGMA or CONSTANT' if flow else 'DDPM: MIN_SNR_GAMMA, P2, DEBIASED_ESTIMATION'})")
    elif weight_fn == "MIN_SNR_GAMMA":
        loss["min_snr_gamma"] = strength
    elif weight_fn != "CONSTANT":
        _mapped_if_known(loss, LossConfig, "weight_fn", weight_fn, skip)
        if "weight_fn" in loss and weight_fn == "P2":  # OneTrainer stores a strength for every function; P2 uses it
            loss["weight_strength"] = strength
    _loss_functions(ot, loss, skip)
    if c["model"]["family"] in ("pixart_alpha", "pixart_sigma") and ot["vb_loss_strength"] != 1.0:
        loss["vb_loss_strength"] = ot["vb_loss_strength"]  # the learned-variance loss only PixArt has
    if ot["loss_scaler"] not in (None, "NONE"):
        _mapped_if_known(loss, LossConfig, "scaler", ot["loss_scaler"], skip)  # the same names and factors
    rescale = ot["rescale_noise_scheduler_to_zero_terminal_snr"]
    if rescale and c["model"]["family"] in ZERO_TERMINAL_SNR_FAMILIES:
        # OneTrainer's setups rescale the schedule and force v-prediction (over force_epsilon_prediction), as
        # model.zero_terminal_snr does with prediction_type auto
        c["model"]["zero_terminal_snr"] = True
    elif rescale:
        skip(f"rescale_noise_scheduler_to_zero_terminal_snr: true: OneTrainer's {c['model']['family']} training "
             "ignores it (only its SD 1.x / 2.x / SDXL setups rescale the schedule)")
    for key, prediction in (("force_v_prediction", "v_prediction"), ("force_epsilon_prediction", "epsilon")):
        if ot[key] and c["model"].get("zero_terminal_snr"):
            continue  # v-prediction, whichever is forced
        if ot[key] and c["model"]["family"] in ZERO_TERMINAL_SNR_FAMILIES and c.get("method") == "full":
            c["model"]["prediction_type"] = prediction  # OneTrainer overrides the noise scheduler's the same way
            break  # the first wins (its FineTuneSetups: elif)
        elif ot[key] and c["model"]["family"] in FORCED_PREDICTION_IGNORED:
            skip(f"{key}: true: OneTrainer's {c['model']['family']} {c.get('method')} training ignores it (only its "
                 "SD 1.x / 2.x / SDXL FINE_TUNE setups force a prediction type); the model's own is trained")
        elif ot[key]:
            skip(f"{key}: true: {c['model']['family']} has a fixed target")
    if ot.get("custom_conditioning_image"):
        skip("custom_conditioning_image: true (an inpainting model's conditioning image from a file) is not supported")
    if loss:
        c["loss"] = loss
    if ot["masked_training"]:
        c["masked_training"] = {"enabled": True, "unmasked_probability": ot["unmasked_probability"],
                                "unmasked_weight": ot["unmasked_weight"],
                                "normalize_masked_area_loss": ot["normalize_masked_area_loss"]}
        prior = ot.get("masked_prior_preservation_weight") or 0.0
        if prior and c.get("method") == "lora":
            c["masked_training"]["prior_preservation_weight"] = prior
        elif prior:
            skip(f"masked_prior_preservation_weight: {prior}: OneTrainer uses it with LORA only (the prior is the "
                 "model without the LoRA)")


ZERO_TERMINAL_SNR_FAMILIES = ("sd1", "sd2", "sdxl")  # OneTrainer's StableDiffusion(XL) *Setup.py rescale
# DDPM families whose OneTrainer setups do not read force_v_prediction / force_epsilon_prediction: PixArt's, and SD's /
# SDXL's LoRA and embedding setups (only StableDiffusion(XL)FineTuneSetup.py calls force_*_prediction)
FORCED_PREDICTION_IGNORED = ("sd1", "sd2", "sdxl", "pixart_alpha", "pixart_sigma")


def is_flow(family: str) -> bool:
    """A flow-matching family: OneTrainer shifts its draw by timestep_shift (Flux and Qwen-Image also dynamically)."""
    from ot_dist.models.families.registry import get_family

    return get_family(family).objective_kind() == "flow"


# The flow families whose OneTrainer setups read dynamic_timestep_shifting (FluxBaseSetup, BaseQwenSetup,
# BaseZImageSetup: the shift from the model's calculate_timestep_shift instead of timestep_shift)
DYNAMIC_SHIFT_FAMILIES = ("flux", "qwen_image", "z_image", "flux2", "flux2_klein")  # + BaseFlux2Setup
DYNAMIC_SHIFT_FAMILIES += ("krea2",)  # BaseKrea2Setup
DYNAMIC_SHIFT_FAMILIES += ("ernie_image",)  # BaseErnieSetup: ErnieModel.calculate_timestep_shift
DYNAMIC_SHIFT_FAMILIES += ("ideogram4",)  # BaseIdeogramSetup: e^mu of the pipeline's _resolution_aware_mu
LOSS_FUNCTIONS = (("mse_strength", 1.0), ("mae_strength", 0.0), ("log_cosh_strength", 0.0), ("huber_strength", 0.0))


def _loss_functions(ot: dict, loss: dict, skip) -> None:
    """OneTrainer's sum of strength x loss function (its ModelSetupDiffusionLossMixin): the same names, formulas and
    defaults in ot_dist's loss section; huber_delta where the Huber term is on (OneTrainer stores it always)."""
    strengths = {key: ot.get(key, off) for key, off in LOSS_FUNCTIONS}
    if not any(strengths.values()):
        skip("mse_strength, mae_strength, log_cosh_strength, huber_strength: all 0, no loss to train (OneTrainer "
             "fails on its first step); the MSE is written")
        return
    loss.update({key: value for (key, off), value in zip(LOSS_FUNCTIONS, strengths.values()) if value != off})
    if strengths["huber_strength"] and ot.get("huber_delta", 1.0) != 1.0:
        loss["huber_delta"] = ot["huber_delta"]


def _timesteps(ot: dict, c: dict, loss: dict, skip) -> None:
    """OneTrainer's draw: a continuous t in [N min_noising_strength, N max_noising_strength), floored (N: the
    scheduler's 1000 steps; 10000 for Würstchen / Stable Cascade's continuous time); LOGIT_NORMAL is
    sigmoid(N(noising_bias, noising_weight + 1)); then t is shifted by timestep_shift (Flux, Qwen-Image: by the resolution with
    dynamic_timestep_shifting; the DDPM / Würstchen setups ignore that switch). SIGMOID, COS_MAP and
    INVERTED_PARABOLA pick a step of [N min, N max) by weights with that shift in them: the same window and shift
    settings."""
    family = c["model"]["family"]
    _distribution(ot, loss, skip)
    steps = 10000 if family in ("stable_cascade", "wuerstchen_v2") else 1000
    if ot["min_noising_strength"] or ot["max_noising_strength"] < 1:
        loss["min_timestep"] = int(steps * ot["min_noising_strength"])
        loss["max_timestep"] = int(steps * ot["max_noising_strength"]) - 1  # ot_dist's bound is inclusive
    shift = ot["timestep_shift"]
    if family in DYNAMIC_SHIFT_FAMILIES and ot["dynamic_timestep_shifting"]:  # its SD3 / Chroma / Sana setups ignore it
        loss["dynamic_timestep_shifting"] = True  # and then ignore timestep_shift
    elif is_flow(family):
        loss["timestep_shift"] = shift  # 1.0 included: unshifted, where the family's scheduler would shift
    elif shift != 1.0:  # DDPM and Würstchen's discretized continuous draw: 1.0 is unshifted there as ot_dist's auto
        loss["timestep_shift"] = shift


def _distribution(ot: dict, loss: dict, skip) -> None:
    """timestep_distribution with the noising_weight / noising_bias it reads (LOGIT_NORMAL: as the normal's mean and
    std - 1); settings ot_dist refuses (a draw that leaves the range, weights that are 0 everywhere) are listed."""
    from pydantic import ValidationError

    from ot_dist.config.loss import SHAPE_FIELDS, LossConfig

    distribution, weight, bias = ot["timestep_distribution"], ot["noising_weight"], ot["noising_bias"]
    if distribution not in TIMESTEP_DISTRIBUTIONS:
        skip(f"timestep_distribution: {distribution} (ot_dist draws {', '.join(TIMESTEP_DISTRIBUTIONS)})")
        return
    name = TIMESTEP_DISTRIBUTIONS[distribution]
    drawn = {"timestep_distribution": name}
    if name == "logit_normal" and (bias or weight):
        drawn["logit_normal_mean"], drawn["logit_normal_std"] = bias, weight + 1.0
    for key, value in (("noising_weight", weight), ("noising_bias", bias)):
        if value and key in SHAPE_FIELDS.get(name, ()):  # 0, OneTrainer's default, is ot_dist's null
            drawn[key] = value
    try:
        LossConfig(**drawn)
    except ValidationError as error:
        first = error.errors()[0]
        reason = first["msg"].removeprefix("Value error, ")
        if first["loc"]:  # a field's own check (logit_normal_std > 0): name it as the model validator's messages do
            reason = f"loss.{'.'.join(map(str, first['loc']))}: {reason}"
        skip(f"timestep_distribution: {distribution} with noising_weight {weight}, noising_bias {bias}: {reason}")
        return
    loss.update(drawn)


def _mapped_if_known(section: dict, model, key: str, value, skip) -> None:
    if key in model.model_fields:
        section[key] = value
    else:
        skip(f"{key}: {value} is not supported by this ot_dist version")
