"""kohya's optimizer (optimizer_type, optimizer_args, learning_rate) and learning-rate schedule (lr_scheduler with
lr_warmup_steps, lr_scheduler_num_cycles, lr_scheduler_power, lr_scheduler_min_lr_ratio, or a class in
lr_scheduler_type) as ot_dist's `optimizer` and `scheduler` sections.

kohya builds each optimizer with the library's own defaults for the options optimizer_args leaves out; ot_dist's
defaults are OneTrainer's, so where they differ the library's value is written (LIBRARY_DEFAULTS). kohya's schedules
are diffusers' (get_scheduler), stepped once per optimizer step: linear, cosine and cosine_with_restarts (diffusers'
hard restarts) have ot_dist's shapes; the warmup is in optimizer steps (ot_dist counts a warmup > 1 in micro steps,
so it is multiplied by the accumulation), a float up to 1 ("10%", "100%") a ratio of the steps in both."""

from __future__ import annotations

import ast

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import Imported, warmup_micro_steps
from ot_dist.migrate.kohya_args import KohyaArgs

# kohya's optimizer_type (lower case, as it compares) -> (ot_dist optimizer, options kohya's get_optimizer sets)
OPTIMIZERS = {
    "adamw": ("ADAMW", {}), "adamw8bit": ("ADAMW_8BIT", {}), "pagedadamw8bit": ("ADAMW_8BIT", {"is_paged": True}),
    "pagedadamw": ("ADAMW", {}), "pagedadamw32bit": ("ADAMW", {}),  # paging places the state, the update is AdamW's
    "lion": ("LION", {}), "lion8bit": ("LION_8BIT", {}), "pagedlion8bit": ("LION_8BIT", {"is_paged": True}),
    "sgdnesterov": ("SGD", {"nesterov": True, "momentum": 0.9}),
    "dadaptadam": ("DADAPT_ADAM", {}), "dadaptadagrad": ("DADAPT_ADA_GRAD", {}), "dadaptadan": ("DADAPT_ADAN", {}),
    "dadaptlion": ("DADAPT_LION", {}), "dadaptsgd": ("DADAPT_SGD", {}), "prodigy": ("PRODIGY", {}),
    "adafactor": ("ADAFACTOR", {}), "adamwschedulefree": ("SCHEDULE_FREE_ADAMW", {}),
    "sgdschedulefree": ("SCHEDULE_FREE_SGD", {}),
}
# The implementation's default where ot_dist's (OneTrainer's) differs: what kohya trains with when optimizer_args
# leaves the option out (the classes' signatures: lion-pytorch and bitsandbytes' Lion8bit betas (0.9, 0.99),
# dadaptation's DAdaptLion, schedulefree's weight_decay 0, prodigyopt's slice_p 1, transformers' Adafactor with
# relative and parameter-scaled steps, as kohya's get_optimizer leaves it unless told otherwise).
LIBRARY_DEFAULTS = {
    "LION_8BIT": {"beta2": 0.99}, "DADAPT_LION": {"beta2": 0.99},
    "SCHEDULE_FREE_ADAMW": {"weight_decay": 0.0}, "SCHEDULE_FREE_SGD": {"weight_decay": 0.0},
    "PRODIGY": {"slice_p": 1}, "ADAFACTOR": {"relative_step": True, "scale_parameter": True},
}
SCHEDULES = {"constant": "CONSTANT", "constant_with_warmup": "CONSTANT", "linear": "LINEAR", "cosine": "COSINE",
             "cosine_with_restarts": "COSINE_WITH_HARD_RESTARTS", "polynomial": "LINEAR",
             "cosine_with_min_lr": "COSINE"}
POLYNOMIAL_LR_END = 1e-7  # diffusers' get_polynomial_decay_schedule_with_warmup, which kohya calls without lr_end


def optimizer_args(args: KohyaArgs, key: str = "optimizer_args") -> dict:
    """"key=value" words as kohya reads them: the value is a Python literal (ast.literal_eval)."""
    parsed = {}
    for word in args[key] or []:
        name, sep, value = str(word).partition("=")
        if not sep:
            raise ConfigError(f"{key}: {word!r} is not key=value")
        try:
            parsed[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed[name.strip()] = value.strip()
    return parsed


def import_optimizer(args: KohyaArgs, c: dict, out: Imported) -> None:
    from ot_dist.optim.registry import SPECS

    skip = out.not_honoured.append
    kind = str(args["optimizer_type"] or "")
    if not kind:
        kind = "AdamW8bit" if args["use_8bit_adam"] else "Lion" if args["use_lion_optimizer"] else "AdamW"
    name, fixed = OPTIMIZERS.get(kind.lower(), _by_class(kind, SPECS))
    c["learning_rate"] = args["learning_rate"]  # kohya's default 2e-6 included (ot_dist's is 1e-5)
    if name is None:
        skip(f"optimizer_type: {kind} is not in ot_dist's optimizer stack; ADAMW is written instead")
        c["optimizer"] = {"name": "ADAMW"}
        args["optimizer_args"]  # read: they belong to the optimizer that is not written
        return
    spec = SPECS[name]
    options = {"name": name, **LIBRARY_DEFAULTS.get(name, {}), **fixed}
    renamed = {keyword: option for option, keyword in spec.renames}  # the library's keyword -> ot_dist's option
    for key, value in optimizer_args(args).items():
        key = renamed.get(key, key)
        if key == "betas" and isinstance(value, (tuple, list)) and len(value) <= len(spec.betas):
            options.update(zip(spec.betas, value))
        elif key == "eps" and spec.eps_pair and isinstance(value, (tuple, list)):
            options["eps"], options["eps2"] = value
        elif key == "nesterov" and name == "SGD_8BIT":
            skip("optimizer_args nesterov: bitsandbytes' SGD8bit in ot_dist takes no nesterov")
        elif key in spec.defaults:
            options[key] = value
        elif key == "warmup_steps" and spec.schedule_free:
            c.setdefault("scheduler", {})["warmup_steps"] = int(value) * args["gradient_accumulation_steps"]
        else:
            skip(f"optimizer_args {key}={value!r}: not an option of ot_dist's {name}")
    if kind.lower() == "sgdnesterov8bit":
        skip("optimizer_type: SGDNesterov8bit: ot_dist's SGD_8BIT has no Nesterov momentum; SGD_8BIT is written")
    if name == "ADAFACTOR" and options.get("warmup_init"):
        options["relative_step"] = True  # kohya turns relative steps on for warmup_init
    if spec.adaptive:
        _one_learning_rate(c, name, skip)
    if "." in kind:
        out.notes.append(f"optimizer_type: {kind} is ot_dist's {name}; options optimizer_args leaves out take "
                         "ot_dist's defaults (OneTrainer's), which may differ from the class's own")
    c["optimizer"] = options


def _one_learning_rate(c: dict, name: str, skip) -> None:
    """D-Adaptation and Prodigy estimate one step size for all parameter groups (ot_dist refuses groups with other
    learning rates; kohya warns that only the first group's counts)."""
    from ot_dist.config.schema import PART_FIELDS

    parts = [p for p in PART_FIELDS if (c.get(p) or {}).get("learning_rate") not in (None, c["learning_rate"])]
    for part in parts:
        skip(f"{part} learning rate {c[part].pop('learning_rate')}: {name} takes one learning rate for every part "
             f"(learning_rate {c['learning_rate']} is used)")


def _by_class(kind: str, specs) -> tuple[str | None, dict]:
    """A class path (bitsandbytes.optim.AdEMAMix8bit) that is the implementation of one of ot_dist's optimizers."""
    if kind.lower() == "sgdnesterov8bit":
        return "SGD_8BIT", {"momentum": 0.9}
    module, _, cls = kind.rpartition(".")
    for name, spec in specs.items():
        if module and spec.target == f"{module}:{cls}":
            return name, {}
    return None, {}


def import_scheduler(args: KohyaArgs, c: dict, out: Imported) -> None:
    from ot_dist.optim.registry import SPECS

    skip = out.not_honoured.append
    name = str(args["lr_scheduler"])
    warmup, accumulation = args["lr_warmup_steps"], c["gradient_accumulation_steps"]
    optimizer = c["optimizer"]["name"]
    custom, lr_args = args["lr_scheduler_type"], optimizer_args(args, "lr_scheduler_args")
    cycles, power, min_ratio = (args["lr_scheduler_num_cycles"], args["lr_scheduler_power"],
                                args["lr_scheduler_min_lr_ratio"])
    processes = launch_processes(args.launch)
    if processes > 1 and warmup and not (isinstance(warmup, float) and warmup <= 1):
        # accelerate's AcceleratedScheduler steps the schedule once per process at each optimizer step, and
        # get_scheduler_fix sizes it max_train_steps x processes: the decay spans the run, a warmup in steps shrinks
        steps = -(-int(warmup) // processes)
        out.notes.append(f"lr_warmup_steps: {warmup} on {processes} processes (the launcher's --num_processes): "
                         f"kohya's warmup ends after {steps} optimizer steps (accelerate steps its schedule once per "
                         f"process); {steps} is written{' (rounded up)' if int(warmup) % processes else ''}")
        warmup = steps
    for key in ("lr_decay_steps", "lr_scheduler_timescale"):
        if args[key] and name not in ("warmup_stable_decay", "inverse_sqrt", "piecewise_constant"):
            out.notes.append(f"{key}: {args[key]} is not read by kohya's {name}")
    if SPECS[optimizer].schedule_free:  # kohya gives a schedule-free optimizer a constant dummy schedule
        if name != "constant" or warmup:
            skip(f"lr_scheduler: {name} (warmup {warmup}): kohya schedules {optimizer} constantly; its warmup is "
                 "optimizer_args warmup_steps")
        c["scheduler"] = {"name": "CONSTANT", "warmup_steps": c.get("scheduler", {}).get("warmup_steps", 0)}
        return
    if optimizer == "ADAFACTOR" and c["optimizer"].get("relative_step"):
        # kohya replaces the schedule by AdafactorSchedule: Adafactor's own relative step, its warmup_init
        if name not in ("constant", "adafactor") and not name.startswith("adafactor"):
            skip(f"lr_scheduler: {name}: with Adafactor's relative steps kohya uses Adafactor's own schedule")
        c["scheduler"] = {"name": "ADAFACTOR", "warmup_steps": 0}
        return
    if custom:
        class_name = custom if "." in custom else f"torch.optim.lr_scheduler.{custom}"
        c["scheduler"] = {"name": "CUSTOM", "class_name": class_name, "params": lr_args, "warmup_steps": 0}
        if not class_name.startswith("torch.optim.lr_scheduler."):
            skip(f"lr_scheduler_type: importing {class_name} runs its code; set scheduler.allow_custom_code: true "
                 "after reading it")
        return
    for key, value in lr_args.items():
        skip(f"lr_scheduler_args {key}={value!r}: not an option of ot_dist's schedules")
    # get_scheduler_fix reads any float as a ratio of the run ("100%", 1.0: all of it), as ot_dist reads one up to 1
    ratio = isinstance(warmup, float) and warmup <= 1
    scheduler = {"name": SCHEDULES.get(name, "CONSTANT"),
                 "warmup_steps": warmup if ratio else warmup_micro_steps(warmup, accumulation, "lr_warmup_steps", skip)}
    if name not in SCHEDULES:
        skip(f"lr_scheduler: {name} has no ot_dist schedule (constant, linear, cosine, cosine_with_restarts, "
             "polynomial with power 1, cosine_with_min_lr); CONSTANT is written")
    elif name == "constant" and warmup:
        skip(f"lr_warmup_steps: {warmup} with lr_scheduler constant: kohya refuses it (constant_with_warmup warms "
             "up); the warmup is written")
    elif name == "cosine_with_restarts":
        scheduler["cycles"] = cycles
    elif name == "polynomial":
        if power != 1:
            skip(f"lr_scheduler_power: {power}: ot_dist's decays are linear, cosine and REX; LINEAR is written")
        scheduler["min_factor"] = min(1.0, POLYNOMIAL_LR_END / c["learning_rate"])  # diffusers decays to lr_end
    elif name == "cosine_with_min_lr":
        if cycles != 1:
            skip(f"lr_scheduler_num_cycles: {cycles}: ot_dist's COSINE decays once (kohya's cosine_with_min_lr "
                 f"turns {cycles / 2} times)")
        if min_ratio is None:
            skip("lr_scheduler_min_lr_ratio: not set, which kohya's cosine_with_min_lr refuses; 0 is written")
        scheduler["min_factor"] = min_ratio or 0.0
    c["scheduler"] = scheduler


def launch_processes(launch: list[str]) -> int:
    """The process count a saved command line's `accelerate launch --num_processes N` gives (1 without one)."""
    for i, word in enumerate(launch):
        key, sep, value = word.partition("=")
        if key == "--num_processes":
            value = value if sep else (launch[i + 1] if i + 1 < len(launch) else "")
            return int(value) if value.isdigit() else 1
    return 1

