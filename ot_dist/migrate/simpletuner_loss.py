"""SimpleTuner's noise and loss arguments as ot_dist's `loss` section: offset noise (offset_noise with noise_offset,
drawn with noise_offset_probability; DDPM families only), input_perturbation, snr_gamma (min-SNR, DDPM families), and
the flow-matching families' timestep draw (helpers/models/common.py: sigma = sigmoid(flow_sigmoid_scale x N(0, 1)),
or uniform with flow_use_uniform_schedule, shifted by flow_schedule_shift (3.0) or, with shift 0 and
flow_schedule_auto_shift, by the resolution as Flux's scheduler shifts)."""

from __future__ import annotations

from ot_dist.migrate.common import Imported
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs

FLOW = ("sd3", "flux", "chroma")


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
    if args["loss_type"] != "l2":
        skip(f"loss_type: {args['loss_type']}: ot_dist trains with the MSE (l2) loss only")
    if args["timestep_bias_strategy"] not in (None, "none"):
        skip(f"timestep_bias_strategy: {args['timestep_bias_strategy']}: timestep bias is not supported")
    if flow:
        _flow(args, loss, out)
    if loss:
        c["loss"] = loss


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
