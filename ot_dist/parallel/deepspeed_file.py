"""The user's own DeepSpeed JSON (deepspeed.config_file, or accelerate's deepspeed_config_file): read, its "auto"
values resolved, and what ot_dist cannot follow refused by key, before any process group starts.

"auto" is HF's convention (transformers integrations/deepspeed.py, HfTrainerDeepSpeedConfig; accelerate's
DeepSpeedPlugin fills the same keys): the trainer's own value. ot_dist gives each "auto" the value of the same key in
the DeepSpeed config it generates from its YAML (batch sizes, accumulation, gradient_clipping, bf16 / fp16 enabled,
ZeRO-1/2 bucket sizes); where it generates none (HF derives ZeRO-3's bucket sizes and persistence threshold from the
model's hidden size) the key is left out and DeepSpeed's default applies. Left in, DeepSpeed 0.19 compares the
string with numbers and stops with a TypeError that names no key.

ot_dist runs the training loop and hands DeepSpeed its own optimizer and learning-rate schedule, so the file cannot
set another micro batch, accumulation, global batch or ZeRO stage than the YAML (DeepSpeed would count accumulation
boundaries the loop does not take, or refuse the batch arithmetic with an assertion), nor an optimizer (DeepSpeed
ignores it beside ot_dist's) or a scheduler (DeepSpeed would step it after ot_dist's and overwrite its learning
rates)."""

from __future__ import annotations

import json
from pathlib import Path

from ot_dist.errors import ConfigError

AUTO = "auto"
# key of the DeepSpeed config -> the ot_dist setting that decides it (the loop follows it)
LOOP_KEYS = {
    "train_micro_batch_size_per_gpu": "batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "batch_size x gradient_accumulation_steps x processes",
}
OWN_SECTIONS = {"optimizer": "the optimizer section", "scheduler": "the scheduler section"}


def read_deepspeed_json(path: str, key: str) -> dict:
    try:
        loaded = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{key}: cannot read {path}: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{key}: {path} is not a JSON object")
    return loaded


def resolve_auto(user: dict, generated: dict) -> dict:
    """The user's config with each "auto" replaced by the generated value of the same key, or left out."""
    resolved = {}
    for key, value in user.items():
        ours = generated.get(key)
        if isinstance(value, dict):
            resolved[key] = resolve_auto(value, ours if isinstance(ours, dict) else {})
        elif isinstance(value, str) and value.strip().lower() == AUTO:
            if key in generated and not isinstance(ours, dict):
                resolved[key] = ours
        else:
            resolved[key] = value
    return resolved


def users_deepspeed_config(path: str, generated: dict) -> dict:
    """The file at `path`, "auto" resolved against `generated`; refused where the loop cannot follow it."""
    shown = f"deepspeed.config_file: {path}"
    user = resolve_auto(read_deepspeed_json(path, "deepspeed.config_file"), generated)
    for section, ours in OWN_SECTIONS.items():
        if section in user:
            raise ConfigError(f"{shown} sets {section!r}: ot_dist hands DeepSpeed its own optimizer and learning-rate "
                              f"schedule ({ours} of the ot_dist config); remove it from the file")
    for key, setting in LOOP_KEYS.items():
        if key in user and user[key] != generated[key]:
            raise ConfigError(f"{shown} sets {key} {user[key]}, the ot_dist config gives {generated[key]} ({setting}); "
                              f"set it in the ot_dist config, or write \"auto\" (or nothing) in the file")
    stage = user.get("zero_optimization", {}).get("stage") if isinstance(user.get("zero_optimization"), dict) else None
    ours = generated["zero_optimization"]["stage"]
    if stage is not None and str(stage) != str(ours):
        raise ConfigError(f"{shown} sets zero_optimization.stage {stage}, the ot_dist config strategy zero{ours}; make "
                          "them agree (or leave the stage out of the file)")
    return user


def check_against_config(config, world_size: int) -> None:
    """Build the DeepSpeed config as the workers will (refusals included), before any process group starts."""
    from ot_dist.parallel.deepspeed import deepspeed_config

    deepspeed_config(config, int(config.strategy[-1]), world_size)
