"""SimpleTuner's noise and loss arguments as ot_dist's `loss` section: offset noise (offset_noise with noise_offset,
drawn with noise_offset_probability; DDPM families only), input_perturbation, snr_gamma (min-SNR, DDPM families),
loss_type with huber_schedule / huber_c (helpers/models/common.py: conditional_loss, compute_scheduled_huber_c), and
the flow-matching families' timestep draw (helpers/models/common.py: sigma = sigmoid(flow_sigmoid_scale x N(0, 1)),
or uniform with flow_use_uniform_schedule, shifted by flow_schedule_shift (3.0) or, with shift 0 and
flow_schedule_auto_shift, by the resolution as Flux's scheduler shifts; Sana's own: uniform over its scheduler's
unshifted table)."""

from __future__ import annotations

from ot_dist.migrate.common import Imported
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs

FLOW = ("sd3", "flux", "chroma", "sana", "qwen_image", "z_image", "hidream", "lumina2", "flux2", "flux2_klein", "wan")
FLOW += ("ernie_image",)
FLOW += ("ideogram4",)
# The flow settings SimpleTuner's Sana resets (setup_training_noise_schedule) before drawing its timesteps
SANA_IGNORES = ("flow_schedule_shift", "flow_schedule_auto_shift", "flow_use_beta_schedule",
                "flow_use_uniform_schedule", "flow_sigmoid_scale")


def import_loss(args: SimpleTunerArgs, c: dict, family: str, out: Imported) -> None:
    skip = out.not_honoured.append
    loss = {}
    flow = family in FLOW
    if args["offset_noise"]:
        offset, probability = args["noise_offset"], args["noise_offset_probability"]
        if flow:
            skip(f"offset_noise: SimpleTuner adds no offset noise to flow-matching models ({family})")
        elif probability != 1.0:
            skip(f"noise_offset_probability: {probability}: SimpleTuner adds the offset ({offset}) to that share of "
                 "the steps; ot_dist to every step; not written (set noise_offset_probability 1.0 to keep it)")
        else:
            loss["offset_noise_weight"] = offset
    else:
        for key in ("noise_offset", "noise_offset_probability"):
            if args.given(key):
                out.notes.append(f"{key}: {args[key]} is not used without offset_noise, as in SimpleTuner")
    if args["input_perturbation"]:
        loss["input_perturbation"] = args["input_perturbation"]
    if args["snr_gamma"]:
        if flow:
            skip(f"snr_gamma: {args['snr_gamma']}: min-SNR weighting of a flow-matching model is not supported")
        else:
            loss["min_snr_gamma"] = args["snr_gamma"]
    _loss_type(args, loss, family, out)
    if args["timestep_bias_strategy"] not in (None, "none"):
        skip(f"timestep_bias_strategy: {args['timestep_bias_strategy']}: timestep bias is not supported")
    if family == "sana":
        _sana_flow(args, loss, out)
    elif family == "ideogram4":
        _ideogram_flow(args, loss, out)
    elif flow:
        _flow(args, loss, out)
    if loss:
        c["loss"] = loss


def _loss_type(args: SimpleTunerArgs, loss: dict, family: str, out: Imported) -> None:
    """l2, or huber / smooth_l1: conditional_loss's 2 c (sqrt(d^2 + c^2) - c) and 2 (sqrt(d^2 + c^2) - c), c from
    compute_scheduled_huber_c: constant huber_c, exponential exp(-alpha t) with alpha = -ln(huber_c) / N (a flow
    model's t = sigma N), snr (1 - huber_c) / (1 + sigma)^2 + huber_c with a DDPM sigma sqrt((1 - abar) / abar).
    These are kohya's formulas (its huber_scale 1), ot_dist's pseudo_huber_* options. A flow model's snr differs:
    SimpleTuner's sigma there is sqrt((1 - s) / (s + 1e-4)) of the flow sigma s, which ot_dist has no schedule for
    (ot_dist refuses snr on flow models, as kohya's scripts stop there)."""
    loss_type, schedule, c = args["loss_type"], args["huber_schedule"], args["huber_c"]
    skip = out.not_honoured.append
    if loss_type == "l2":
        for key in ("huber_schedule", "huber_c"):
            if args.given(key):
                out.notes.append(f"{key}: {args[key]} shapes the huber / smooth_l1 loss only; with l2 SimpleTuner "
                                 "ignores it")
        return
    if family == "sana":  # Sana's loss() is its own weighted MSE, which reads no loss_type
        out.notes.append(f"loss_type: {loss_type}: SimpleTuner's Sana trains with the MSE whatever it says; the MSE "
                         "is written")
    elif loss_type not in ("huber", "smooth_l1"):
        skip(f"loss_type: {loss_type} is not one of SimpleTuner's (l2, huber, smooth_l1); the MSE is written")
    elif schedule == "snr" and family in FLOW:
        skip(f"loss_type: {loss_type} with huber_schedule snr (SimpleTuner's default) on {family}: SimpleTuner "
             f"takes sigma = sqrt((1 - s) / (s + 1e-4)) of the flow sigma s, (1 - c) / (1 + sigma)^2 + c; ot_dist's "
             "snr schedule is the DDPM one (refused on flow models); the MSE is written (set huber_schedule "
             "exponential or constant to keep the pseudo-Huber loss)")
    elif schedule not in ("constant", "exponential", "snr"):
        skip(f"huber_schedule: {schedule} is not one of SimpleTuner's (snr, exponential, constant); the MSE is "
             "written")
    else:
        loss |= {"mse_strength": 0.0, "pseudo_huber_strength": 1.0, "pseudo_huber_form": loss_type,
                 "pseudo_huber_schedule": schedule, "pseudo_huber_c": float(c)}


def _sana_flow(args: SimpleTunerArgs, loss: dict, out: Imported) -> None:
    """SimpleTuner's Sana (sample_flow_sigmas): u uniform, the sigma at index u x N of its scheduler's table, which
    FlowMatchEulerDiscreteScheduler builds unshifted from Sana's DPM-solver config (its flow_shift is not read)."""
    for key in SANA_IGNORES:
        if args.given(key):
            out.notes.append(f"{key}: {args[key]}: SimpleTuner's Sana resets it and draws uniform timesteps from "
                             "its scheduler's unshifted table")
        args[key]
    loss |= {"timestep_distribution": "uniform", "timestep_shift": 1.0, "dynamic_timestep_shifting": False}


def _ideogram_flow(args: SimpleTunerArgs, loss: dict, out: Imported) -> None:
    """SimpleTuner's Ideogram 4 (sample_flow_sigmas): sigma = sigmoid(m + s z), z = ndtri(u) of a uniform u, m =
    ideogram_schedule_mu + 0.5 ln(pixels / 512^2): ot_dist's logit-normal (mean mu, std s) at the family's resolution
    shift (nothing written for it). Its common flow settings are not read there."""
    for key in SANA_IGNORES:
        if args.given(key):
            out.notes.append(f"{key}: {args[key]}: SimpleTuner's Ideogram 4 draws from ideogram_schedule_mu / _std")
        args[key]
    loss |= {"timestep_distribution": "logit_normal", "logit_normal_mean": float(args["ideogram_schedule_mu"]),
             "logit_normal_std": float(args["ideogram_schedule_std"])}


def _flow(args: SimpleTunerArgs, loss: dict, out: Imported) -> None:
    skip = out.not_honoured.append
    shift, auto = args["flow_schedule_shift"], args["flow_schedule_auto_shift"]
    if args["flow_use_beta_schedule"]:
        skip("flow_use_beta_schedule: a Beta timestep distribution is not supported; the logit-normal is written")
    if args["flux_fast_schedule"]:
        skip("flux_fast_schedule: its fixed sigmas are not supported; the logit-normal is written")
    if args["flow_use_uniform_schedule"]:
        loss["timestep_distribution"] = "uniform"
    else:
        loss |= {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                 "logit_normal_std": float(args["flow_sigmoid_scale"])}
    if shift is not None and shift > 0:  # a static shift wins over auto shift, as in apply_flow_schedule_shift
        loss["timestep_shift"] = float(shift)
        loss["dynamic_timestep_shifting"] = False
        if auto:
            out.notes.append("flow_schedule_auto_shift: ignored while flow_schedule_shift is set (> 0), as in "
                             "SimpleTuner")
    elif auto:
        loss["dynamic_timestep_shifting"] = True
    else:
        loss["timestep_shift"] = 1.0
        loss["dynamic_timestep_shifting"] = False
