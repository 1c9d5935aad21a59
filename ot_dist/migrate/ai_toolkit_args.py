"""Reading an ostris ai-toolkit job file (YAML or JSON: `job`, `config.name`, `config.process[0]` with its `network`,
`train`, `model`, `datasets`, `sample`, `save` sections) for `ot-dist import ai-toolkit`: the process to import, its
sections as `Section`s that remember which keys the import read, and errors that name the field
(`config.process[0].train.steps`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import Imported

# ai-toolkit's trainer process types (jobs/ExtensionJob / TrainJob); extract, generate, slider and mod jobs train
# nothing ot_dist does
P = "config.process[0]"
TRAINER_TYPES = ("sd_trainer", "diffusion_trainer", "ui_trainer")


class Section:
    """One section of the process (`train`, `model`, a dataset, ...): its values with ai-toolkit's defaults
    (toolkit/config_modules.py) for the keys the import reads, and the set of keys it read, so that every key a
    config sets and nothing read is listed (`unread`)."""

    def __init__(self, values: dict | None, where: str):
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: {values!r} is not a mapping")
        self.values, self.where, self.read = values, where, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.values.get(key, default)
        return default if value is None and default is not None else value

    def given(self, key: str) -> bool:
        return key in self.values and self.values[key] not in (None, "", [], {})

    def number(self, key: str, default, kind=float):
        """A number ai-toolkit reads (`1e-4` and `"1e-4"` alike: YAML reads the first as a string); anything else is
        an error naming the field."""
        value = self.get(key, default)
        if value is None:
            return None
        try:
            number = kind(float(value)) if kind is int else kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.where}.{key}: {value!r} is not a number") from None
        if kind is int and float(value) != number:
            raise ConfigError(f"{self.where}.{key}: {value!r} is not a whole number")
        return number

    def unread(self, defaults: dict[str, Any]) -> list[str]:
        """Keys set, not read, and not at ai-toolkit's default (`defaults`, where known)."""
        unset = (None, False, "", [], {})
        return [key for key, value in self.values.items() if key not in self.read and value not in unset
                and not (key in defaults and value == defaults[key])]


def read_process(path: str) -> tuple[dict, str, Path]:
    """(the first trainer process of the job, its run name, the file), read as ai-toolkit's toolkit/config.py reads a
    job: `${VAR}` replaced by the environment's value, YAML's `1e-4` read as a number, `[name]` replaced by the job's
    name; the process's own `name` wins over the job's."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"ai-toolkit config: {file} does not exist") from None
    job = _parse(_environment(text), file)
    if not isinstance(job, dict) or not isinstance(job.get("config"), dict):
        raise ConfigError(f"config: {file} has no `config` mapping (an ai-toolkit job file: job, config.name, "
                          "config.process)")
    if "job" not in job:
        raise ConfigError(f"job: not set in {file} (ai-toolkit refuses a job file without it: extension or train)")
    name = job["config"].get("name")
    if not name:
        raise ConfigError("config.name: not set (ai-toolkit names the run's folder training_folder/name after it)")
    processes = job["config"].get("process")
    if not isinstance(processes, list) or not processes or not isinstance(processes[0], dict):
        raise ConfigError("config.process: not a list of processes (ai-toolkit runs config.process[0], ...)")
    process = _named(processes[0], str(name))
    kind = process.get("type")
    if kind not in TRAINER_TYPES:
        raise ConfigError(f"config.process[0].type: {kind!r} is not a trainer process ot_dist imports "
                          f"({', '.join(TRAINER_TYPES)})")
    if len(processes) > 1:
        process["__more_processes"] = len(processes) - 1
    return process, str(process.get("name") or name), file


ENVIRONMENT = re.compile(r"\$\{([^}]+)\}")
# YAML 1.1 reads 1e-4 (no dot) as a string; ai-toolkit's loader adds this float form, and so does the import's
EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _environment(text: str) -> str:
    def value(match) -> str:
        if match.group(1) not in os.environ:
            raise ConfigError(f"${{{match.group(1)}}}: the environment variable is not set (ai-toolkit stops too)")
        return os.environ[match.group(1)]

    return ENVIRONMENT.sub(value, text)


def _parse(text: str, file: Path):
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT, list("-+0123456789"))
    try:
        return yaml.load(text, Loader=Loader)  # JSON is YAML too
    except yaml.YAMLError as err:
        raise InputFileError(f"ai-toolkit config: {file} is not YAML or JSON ({err})") from None


def _named(value, name: str):
    if isinstance(value, str):
        return value.replace("[name]", name)
    if isinstance(value, list):
        return [_named(item, name) for item in value]
    if isinstance(value, dict):
        return {key: _named(item, name) for key, item in value.items()}
    return value


# Keys that change how ai-toolkit runs, not what it trains: noted, not listed.
NO_EFFECT = {
    "device": "the device (ot_dist: the launch)", "logging": "logging (ot_dist: MLflow)", "log_dir": "logging",
    "performance_log_every": "logging", "xformers": "attention kernel", "sdp": "attention kernel",
    "attention_backend": "attention kernel", "low_vram": "memory", "layer_offloading": "memory",
    "layer_offloading_transformer_percent": "memory", "layer_offloading_text_encoder_percent": "memory",
    "auto_memory": "memory", "vae_device": "memory", "te_device": "memory", "quantize_te": "the text encoders' storage",
    "qtype_te": "the text encoders' storage", "push_to_hub": "upload", "hf_repo_id": "upload", "hf_private": "upload",
    "num_workers": "loader workers", "prefetch_factor": "loader", "cache_latents_num_workers": "caching",
    "unload_text_encoder": "memory", "torch_profiler": "profiling", "max_loss_debug": "debugging",
    "fast_image_size": "image loading", "debug": "debugging", "skip_first_sample": "the samples before training",
    "force_first_sample": "the samples before training", "disable_sampling": "the samples",
    "sample_start_step": "the samples' first step", "format": "the sample file format",
}


# ai-toolkit's defaults of keys a UI-saved config writes (an unread key at its default is not listed)
DEFAULTS = {"quantize_te": False, "qtype_te": "qfloat8", "low_vram": False, "push_to_hub": False,
            "max_step_saves_to_keep": 5, "walk_seed": False, "neg": "", "sampler": "ddpm", "skip_first_sample": False,
            "cache_text_embeddings": False, "unload_text_encoder": False, "diff_output_preservation": False,
            "bypass_guidance_embedding": False, "weight_jitter": 0.0, "guidance_rescale": 0.0,
            "network_multiplier": 1, "num_frames": 1, "fps": 16, "do_cfg_norm": False, "lokr_full_rank": True,
            "lokr_factor": -1, "transformer_only": True, "save_format": "safetensors", "reg_weight": 1.0,
            "linear_timesteps": False, "linear_timesteps2": False, "disable_sampling": False, "ema_decay": 0.999}


def list_unread(section: Section, out: Imported) -> None:
    for key in section.unread(DEFAULTS):
        value = section.values[key]
        label = f"{section.where.removeprefix(P + '.')}.{key}"
        if key in NO_EFFECT:
            out.notes.append(f"{label}: {value!r} is ignored ({NO_EFFECT[key]}: it does not change what trains)")
        else:
            out.not_honoured.append(f"{label}: {value!r} has no ot_dist counterpart")
