"""SimpleTuner's optimizer (--optimizer with its default_settings, --optimizer_config `key=value,...`,
--optimizer_beta1 / _beta2), learning rate and schedule (--lr_scheduler with lr_warmup_steps, lr_num_cycles, lr_power,
lr_end) as ot_dist's `optimizer` and `scheduler` sections.

SimpleTuner builds each optimizer from its own default_settings (helpers/training/optimizer_param.py), updated by
optimizer_config: those settings are written where they differ from ot_dist's. Its schedules are diffusers' (linear,
constant, constant_with_warmup) or its own (polynomial with lr_power and lr_end; cosine, sine and
cosine_with_restarts, which restart every lr_warmup_steps steps); warmup and length are optimizer steps (it multiplies
both by the processes, as accelerate steps a scheduler once per process)."""

from __future__ import annotations

from ot_dist.migrate.common import Imported, warmup_micro_steps
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs, parse_value

# SimpleTuner's optimizer -> (ot_dist's, SimpleTuner's default_settings in ot_dist's option names)
OPTIMIZERS = {
    "adamw_bf16": ("ADAMW", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 1e-2, "eps": 1e-6}),
    "torch-adamw": ("ADAMW", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 1e-2, "eps": 1e-8}),
    "torch-adam": ("ADAM", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8}),
    "torch-sgd": ("SGD", {"momentum": 0.0, "weight_decay": 0.0, "dampening": 0.0, "nesterov": False}),
    "torch-rmsprop": ("RMSPROP", {"alpha": 0.99, "weight_decay": 0.0, "eps": 1e-8, "momentum": 0.0}),
    "torch-adagrad": ("ADAGRAD", {"lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10}),
    "adamw_schedulefree": ("SCHEDULE_FREE_ADAMW", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 1e-2, "eps": 1e-8}),
    "bnb-adamw": ("ADAMW", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 1e-2, "eps": 1e-6}),
    "bnb-adamw8bit": ("ADAMW_8BIT", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 1e-2, "eps": 1e-6}),
    "bnb-adamw8bit-paged": ("ADAMW_8BIT", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 1e-2, "eps": 1e-6,
                                           "is_paged": True}),
    "bnb-adam8bit": ("ADAM_8BIT", {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8}),
    "bnb-lion": ("LION", {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}),
    "bnb-lion8bit": ("LION_8BIT", {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}),
    "optimi-lion": ("LION", {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}),
    "prodigy": ("PRODIGY_PLUS_SCHEDULE_FREE", {
        "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "weight_decay_by_lr": True, "use_bias_correction": False,
        "d0": 1e-6, "d_coef": 1.0, "prodigy_steps": 0, "use_speed": False, "eps": 1e-8, "split_groups": True,
        "split_groups_mean": True, "factored": True, "factored_fp32": True, "use_stableadamw": True,
        "use_cautious": False, "use_grams": False, "use_adopt": False, "stochastic_rounding": True}),
}
# Implementations that differ from ot_dist's optimizer of the same update, noted.
DIFFERENT_STATE = {"adamw_bf16": "bfloat16 weights with a compensation buffer (ot_dist: float32 master weights)",
                   "adamw_schedulefree": "Kahan-summed bfloat16 updates",
                   "optimi-lion": "optimi's Kahan-summed bfloat16 updates"}
SCHEDULES = {"constant": "CONSTANT", "constant_with_warmup": "CONSTANT", "linear": "LINEAR", "polynomial": "LINEAR"}


def import_optimizer(args: SimpleTunerArgs, c: dict, out: Imported) -> None:
    from ot_dist.optim.registry import SPECS

    skip = out.not_honoured.append
    kind = str(args["optimizer"])
    c["learning_rate"] = args["learning_rate"]  # SimpleTuner's default 4e-7 included (ot_dist's is 1e-5)
    for key in ("lr_scale", "lr_scale_sqrt"):
        if args[key]:
            skip(f"{key}: SimpleTuner scales the learning rate by the batch size x accumulation x processes (the "
                 "processes are the launch's); multiply learning_rate yourself")
    settings = optimizer_config(args)
    if kind not in OPTIMIZERS:
        skip(f"optimizer: {kind} is not in ot_dist's optimizer stack (or has another update); ADAMW is written")
        c["optimizer"] = {"name": "ADAMW"}
        return
    name, defaults = OPTIMIZERS[kind]
    spec = SPECS[name]
    options = {"name": name, **defaults}
    for key, value in settings.items():
        if key == "betas" and isinstance(value, (tuple, list)) and len(value) <= len(spec.betas):
            options.update(zip(spec.betas, value))
        elif key in spec.defaults:
            options[key] = value
        else:
            skip(f"optimizer_config {key}={value!r}: not an option of ot_dist's {name}")
    if kind in DIFFERENT_STATE:
        out.notes.append(f"optimizer: {kind} is ot_dist's {name}; SimpleTuner's keeps {DIFFERENT_STATE[kind]}")
    c["optimizer"] = options


def optimizer_config(args: SimpleTunerArgs) -> dict:
    """convert_arg_to_parameters: `eps=1e-6,weight_decay=0.0` (numbers, true / false / none), the betas of
    optimizer_beta1 / _beta2 when both are set."""
    settings = {}
    for word in str(args["optimizer_config"] or "").split(","):
        key, sep, value = word.partition("=")
        if sep:
            settings[key.strip()] = _setting(value.strip())
    beta1, beta2 = args["optimizer_beta1"], args["optimizer_beta2"]
    if beta1 is not None and beta2 is not None:
        settings["betas"] = (beta1, beta2)
    return settings


def _setting(value: str):
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    return parse_value("", value)


def import_scheduler(args: SimpleTunerArgs, c: dict, out: Imported) -> None:
    from ot_dist.optim.registry import SPECS

    skip = out.not_honoured.append
    name, warmup = str(args["lr_scheduler"]), args["lr_warmup_steps"]
    if name == "constant" and warmup:
        name = "constant_with_warmup"  # normalize_lr_scheduler_value
    optimizer = c["optimizer"]["name"]
    warmup_steps = warmup_micro_steps(warmup, c["gradient_accumulation_steps"], "lr_warmup_steps", skip)
    if SPECS[optimizer].schedule_free:  # SimpleTuner disables the scheduler of a schedule-free optimizer
        c["scheduler"] = {"name": "CONSTANT", "warmup_steps": warmup_steps}
        if name not in ("constant", "constant_with_warmup"):
            out.notes.append(f"lr_scheduler: {name} is not used with {args['optimizer']} (schedule-free), as in "
                             "SimpleTuner")
        return
    scheduler = {"name": SCHEDULES.get(name, "CONSTANT"), "warmup_steps": warmup_steps}
    lr, lr_end, power = c["learning_rate"], args["lr_end"], args["lr_power"]
    if name == "polynomial":
        scheduler["min_factor"] = min(1.0, lr_end / lr) if lr else 0.0  # it decays to lr_end
        if power != 1:
            skip(f"lr_power: {power} (SimpleTuner's polynomial decay, default 0.8): ot_dist's decays are linear, "
                 "cosine and REX; LINEAR to lr_end is written")
    elif name in ("cosine", "sine", "cosine_with_restarts"):
        skip(f"lr_scheduler: {name}: SimpleTuner's restarts every lr_warmup_steps ({warmup}) steps down to lr_end "
             "with no warmup; ot_dist's cosines decay over the run; CONSTANT is written")
        scheduler["warmup_steps"] = 0
    elif name not in SCHEDULES:
        skip(f"lr_scheduler: {name} has no ot_dist schedule; CONSTANT is written")
    for key in ("lr_end", "lr_power", "lr_num_cycles"):
        args[key]  # read by the schedules above that use them; the others ignore them, as SimpleTuner's do
    c["scheduler"] = scheduler
