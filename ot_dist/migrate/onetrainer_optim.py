"""OneTrainer's optimizer, learning-rate schedule, learning_rate_scaler and EMA as ot_dist's `optimizer`,
`scheduler` and `ema` sections: what decides how the trained weights move. ot_dist uses OneTrainer's optimizer and
scheduler names and counts (warmup in OneTrainer's steps), so most fields map one to one; the rest are listed."""

from __future__ import annotations

from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import Imported
from ot_dist.migrate.onetrainer_common import PART_SECTIONS
from ot_dist.optim.registry import SCHEDULE_FREE


def import_optimizer(ot: dict, c: dict, skip) -> None:
    from ot_dist.config.optim import OPTIMIZER_NAMES
    from ot_dist.optim.registry import SPECS

    settings = {**defaults.OPTIMIZER, **(ot.get("optimizer") or {})}
    name = settings.pop("optimizer")
    if name not in OPTIMIZER_NAMES:
        skip(f"optimizer: {name} is not in ot_dist's optimizer stack; ADAMW is written instead")
        c["optimizer"] = {"name": "ADAMW"}
        return
    options = {"name": name}
    lacking = defaults.OPTIMIZER_OPTIONS_NOT_IN_OT_DIST.get(name, {})
    for key, value in settings.items():
        if value is None or key.startswith("__"):
            continue
        if key in SPECS[name].defaults:
            options[key] = _adv_value(key, value)
        elif key in lacking and value == lacking[key]:
            continue  # OneTrainer's default of an option ot_dist's implementation does not have: the same update
        elif key not in lacking and _unset_optimizer_option(key, value):
            continue  # a UI-saved section holds every optimizer's options; one this optimizer has not is unset
        elif key in defaults.ADV_REMOVED and key in lacking:
            skip(f"optimizer.{key}: {value!r}: adv_optm 2.5 (ot_dist's {name}) no longer has it; OneTrainer runs 2.2")
        else:
            skip(f"optimizer.{key}: {value!r} is not an option of ot_dist's {name}")
    if options.get("kourkoutas_beta"):  # OneTrainer hands Kourkoutas-beta its warmup in optimizer steps
        options["k_warmup_steps"] = ot["learning_rate_warmup_steps"] / ot["gradient_accumulation_steps"]
    if "muon_adam_lr" in SPECS[name].defaults and settings.get("muon_adam_lr") is None:
        options["muon_adam_lr"] = ot["learning_rate"]  # OneTrainer's AdamW side of Muon: unset = the learning rate
    c["optimizer"] = options


def streamed_trained_denoiser(c: dict, denoiser: str, out) -> None:
    """A full finetune whose denoiser streams its blocks (OneTrainer's layer offloading of a trained part): its
    weights are stepped inside backward, so the fused back pass is on, as OneTrainer requires for it too
    (modules/util/create.py refuses the run without it). Without an optimizer that can, or with gradient accumulation
    (the streamed weights' gradients would wait in CPU memory), the blocks stay on the device."""
    from ot_dist.optim.registry import FUSED_BACK_PASS

    fraction = c.get(denoiser, {}).get("offload_fraction")
    if not fraction or c["method"] != "full" or c[denoiser].get("train") is False:
        return
    optimizer = c["optimizer"]
    lacking = (f"which {optimizer['name']} has not ({', '.join(FUSED_BACK_PASS)} have)"
               if optimizer["name"] not in FUSED_BACK_PASS else
               "which ot_dist does not run with train_dtype float16 (its loss scale must see every gradient first)"
               if c["train_dtype"] == "float16" else
               f"in each backward, which ot_dist does not do with gradient_accumulation_steps "
               f"{c['gradient_accumulation_steps']} (the gradients would wait in CPU memory)"
               if c["gradient_accumulation_steps"] > 1 else None)
    if lacking:
        del c[denoiser]["offload_fraction"]
        out.not_honoured.append(f"{denoiser}.offload_fraction: {fraction}: the {denoiser} trains, and its streamed "
                                f"weights are stepped in backward with the fused back pass, {lacking}; it stays on "
                                "the device")
        return
    if not optimizer.get("fused_back_pass"):
        optimizer["fused_back_pass"] = True
        out.notes.append(f"{denoiser}.offload_fraction: {fraction} with the {denoiser} training -> "
                         "optimizer.fused_back_pass: true (each streamed weight is stepped in backward while its copy "
                         "is on the device; OneTrainer refuses this run without it)")


def fused_clipping(c: dict, out) -> None:
    """OneTrainer's fused back pass clips each parameter's gradient by its own norm before its step
    (GenericTrainer's __optimizer_step): ot_dist's clip_grad_norm_scope per_tensor."""
    if (c.get("optimizer") or {}).get("fused_back_pass") and c.get("clip_grad_norm") is not None:
        c["clip_grad_norm_scope"] = "per_tensor"
        out.notes.append(f"clip_grad_norm: {c['clip_grad_norm']} with the fused back pass -> clip_grad_norm_scope: "
                         "per_tensor (each gradient clipped by its own norm before its step, as OneTrainer does)")


def _adv_value(key: str, value):
    """OneTrainer's orthogonal_gradient is adv_optm 2.2's switch; adv_optm 2.5 names the mode (2.2's is flattened)."""
    if key == "orthogonal_gradient" and isinstance(value, bool):
        return "flattened" if value else "disabled"
    return value


def _unset_optimizer_option(key: str, value) -> bool:
    """TrainOptimizerConfig's default value: None, False, {} or the few True ones."""
    return value is False or value == {} or (value is True and key in defaults.OPTIMIZER_UNSET_TRUE)  # 0.0 is set


def import_scheduler(ot: dict, c: dict, skip) -> None:
    name = ot["learning_rate_scheduler"]
    warmup = ot["learning_rate_warmup_steps"]
    scheduler = {"name": name, "warmup_steps": int(warmup) if float(warmup).is_integer() and warmup > 1 else warmup}
    if name not in ("CONSTANT", "ADAFACTOR", "CUSTOM"):  # the decaying schedules take a floor
        scheduler["min_factor"] = ot["learning_rate_min_factor"]
    if "RESTARTS" in name:  # the only schedules with cycles (OneTrainer stores the field for all of them)
        scheduler["cycles"] = ot["learning_rate_cycles"]
    optimizer = c["optimizer"]["name"]
    if name == "ADAFACTOR" and not (optimizer == "ADAFACTOR" and c["optimizer"].get("relative_step")):
        # transformers' AdafactorSchedule only reports the step size: without Adafactor's relative steps it is the
        # learning rate, constant, and OneTrainer adds no warmup to it
        skip(f"learning_rate_scheduler: ADAFACTOR reports Adafactor's relative step size; with {optimizer}"
             f"{' relative_step false' if optimizer == 'ADAFACTOR' else ''} the learning rate stays constant: CONSTANT "
             "without warmup is written")
        scheduler = {"name": "CONSTANT", "warmup_steps": 0}
    elif name == "ADAFACTOR":
        scheduler["warmup_steps"] = 0  # Adafactor's schedule has its own warmup (optimizer.warmup_init)
    if optimizer in SCHEDULE_FREE:
        # OneTrainer forces a schedule-free optimizer's schedule to CONSTANT and gives SCHEDULE_FREE_ADAMW / _SGD the
        # warmup as their own, in optimizer steps (a fraction of 1 or less is then no warmup)
        if name != "CONSTANT":
            skip(f"learning_rate_scheduler: {name}: OneTrainer schedules {optimizer} constantly (CONSTANT is written)")
        own = optimizer != "PRODIGY_PLUS_SCHEDULE_FREE" and warmup > 1
        scheduler = {"name": "CONSTANT",
                     "warmup_steps": int(warmup) * c["gradient_accumulation_steps"] if own else 0}
    if name == "CUSTOM":
        scheduler["class_name"] = ot["custom_learning_rate_scheduler"]
        scheduler["params"] = {p["key"]: p["value"] for p in ot["scheduler_params"] or []}
        skip("custom_learning_rate_scheduler: importing a scheduler class runs its code; set scheduler."
             "allow_custom_code: true after reading it")
    c["scheduler"] = scheduler


def scale_learning_rates(ot: dict, c: dict, out: Imported) -> None:
    """OneTrainer's learning_rate_scaler multiplies every parameter group's learning rate by sqrt(scale) (its
    NamedParameterGroup); the GLOBAL_ ones also count the GPUs, one here."""
    scaler = ot["learning_rate_scaler"]
    if scaler in (None, "NONE"):
        return
    batch, accumulation = c["batch_size"], c["gradient_accumulation_steps"]
    scale = {"BATCH": batch, "GLOBAL_BATCH": batch, "GRADIENT_ACCUMULATION": accumulation, "BOTH": batch * accumulation,
             "GLOBAL_BOTH": batch * accumulation}[scaler]
    factor = scale ** 0.5
    for section in (c, *(c.get(p) for p in PART_SECTIONS), c.get("embedding"), *c.get("additional_embeddings", [])):
        if section and section.get("learning_rate"):
            section["learning_rate"] = section["learning_rate"] * factor
    out.notes.append(f"learning_rate_scaler: {scaler}: the learning rates are multiplied by sqrt({scale})")
    if scaler.startswith("GLOBAL"):
        out.not_honoured.append(f"learning_rate_scaler: {scaler} also counts the GPUs: for N of them multiply the "
                                "learning rates by sqrt(N)")


def import_ema(ot: dict, c: dict) -> None:
    if ot["ema"] == "OFF":
        return
    c["ema"] = {"enabled": True, "decay": ot["ema_decay"], "update_step_interval": ot["ema_update_step_interval"],
                "device": "cpu" if ot["ema"] == "CPU" else "accelerator"}


def import_fused_reduce(ot: dict, c: dict, out) -> None:
    """The fused back pass on several GPUs: OneTrainer's fused gradient reduce (each gradient reduced, then its
    parameter stepped, inside backward), asynchronous within a buffer, is ot_dist's under ddp."""
    if ot.get("async_gradient_reduce", True):
        buffer = ot.get("async_gradient_reduce_buffer", 100)
        how = f"async_gradient_reduce_buffer: {buffer}"
    else:
        buffer, how = 0, "async_gradient_reduce: false"
    c.setdefault("ddp", {})["fused_reduce_buffer_mb"] = buffer
    out.notes.append(f"optimizer.fused_back_pass with multi_gpu -> each gradient averaged over the GPUs and its weight "
                     f"stepped inside backward (OneTrainer's fused gradient reduce); {how} -> "
                     f"ddp.fused_reduce_buffer_mb: {buffer}")


def import_reduce_precision(ot: dict, c: dict, out) -> None:
    """OneTrainer's gradient_reduce_precision (default FLOAT_32_STOCHASTIC): the dtype gradients are averaged in,
    ddp.reduce_dtype, and with bfloat16 weights how the float32 average is rounded back, ddp.reduce_rounding."""
    precision = ot.get("gradient_reduce_precision", "FLOAT_32_STOCHASTIC")
    weights = c.get("trained_weight_dtype", "float32")
    dtype = "float32" if precision.startswith("FLOAT_32") else weights
    ddp = c.setdefault("ddp", {})
    ddp["reduce_dtype"] = dtype
    if precision.endswith("_STOCHASTIC") and weights == "bfloat16":
        if dtype == "float32":
            ddp["reduce_rounding"] = "stochastic"
        else:  # summed in bfloat16: OneTrainer then divides in float32 and rounds stochastically
            out.notes.append(f"gradient_reduce_precision: {precision} -> ddp.reduce_dtype: bfloat16; each rank's "
                             "gradient is divided by the number of GPUs before the bfloat16 sum (OneTrainer divides "
                             "the sum and rounds it stochastically): the same values with a power-of-two GPU count")