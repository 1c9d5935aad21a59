"""SimpleTuner's training arguments as it reads them: config/config.json (keys as command-line flags, `"--lora_rank":
16`), config/config.toml (the same keys, with or without `--`) or config/config.env (shell variables, each standing for
one flag: helpers/configuration/env_file.py, TRAINER_EXTRA_ARGS holding more flags), over its parser's defaults
(simpletuner_defaults.ARGS). Values are read as its argparse types them: a default's type decides (`"1e-4"` is a
float, `"true"` a bool), the keys it renames on the way (checkpointing_steps, validation_steps, save_total_limit) are
renamed, and the UI's own keys are dropped, as SimpleTuner does."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import TrackedArgs, read_json, read_toml
from ot_dist.migrate.simpletuner_defaults import ARGS, ENV_TO_ARGS

# cli_utils' legacy handlers: an older key passed on under its new name
RENAMED = {"checkpointing_steps": "checkpoint_step_interval", "validation_steps": "validation_step_interval",
           "save_total_limit": "checkpoints_total_limit", "vae_cache_preprocess": None}
# keys the web UI saves and SimpleTuner drops (the dataset-only ones belong to multidatabackend.json)
DROPPED = {"ez_model_type", "__disabled_fields__", "__active_tab__", "aspect_ratio_bucketing", "aspect_ratio_bucket_min",
           "aspect_ratio_bucket_max", "repeats"}
OTHER_VARIABLES = "config.env variables that stand for no flag"
TRUE, FALSE = {"1", "true", "yes", "y", "on"}, {"0", "false", "no", "n", "off"}


class SimpleTunerArgs(TrackedArgs):
    def __init__(self, values: dict[str, Any], source: Path, root: Path):
        super().__init__(values, ARGS)
        self.source = source  # the config file read
        self.root = root  # SimpleTuner's working folder: its relative paths start there
        self.other_variables: list[str] = []  # config.env's variables that stand for no flag

    def path(self, value: str) -> Path:
        """A path as SimpleTuner opens it: relative to the folder it runs in."""
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.root / path

    def file(self, given: str | None, key: str, out) -> Path | None:
        """A file named on ot-dist's command line (relative to here) or else by the setting `key` (relative to
        SimpleTuner's folder); the setting is read either way, so it is not listed."""
        from ot_dist.migrate.common import local_path

        setting = self[key]
        if given:
            return Path(given)
        return self.path(local_path(str(setting), key, out)) if setting else None


def read_args(config: str, root: str | None = None) -> SimpleTunerArgs:
    """config: config.json / config.toml / config.env, or the folder holding one (json first, as SimpleTuner looks)."""
    path = Path(config)
    if path.is_dir():
        found = [path / f"config.{kind}" for kind in ("json", "toml", "env") if (path / f"config.{kind}").is_file()]
        if not found:
            raise InputFileError(f"config: {path} holds no config.json, config.toml or config.env")
        path = found[0]
    if path.suffix == ".json":
        raw = read_json(path, "config")
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {path} is not a JSON object of SimpleTuner's arguments")
    elif path.suffix == ".toml":
        raw = _flatten(read_toml(path, "config"))
    elif path.suffix == ".env" or path.name.endswith("config.env"):
        raw = read_env(path)
    else:
        raise ConfigError(f"config: {path} is not a config.json, config.toml or config.env")
    other_variables = raw.pop(OTHER_VARIABLES, [])
    # SimpleTuner runs from its own folder, config/ beneath it: "config/multidatabackend.json" starts there
    default_root = path.parent.parent if path.parent.name == "config" else path.parent
    args = SimpleTunerArgs(normalise(raw), path, Path(root) if root else default_root)
    args.other_variables = other_variables
    return args


def _flatten(toml: dict) -> dict:
    flat = {}
    for key, value in toml.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def normalise(raw: dict) -> dict[str, Any]:
    values = {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name in DROPPED:
            continue
        if name == "ignore_final_epochs":  # renamed to its opposite
            name, value = "strict_epoch_limit", not parse_value("ignore_final_epochs", value)
        name = RENAMED.get(name, name)
        if name is None or value is None or value == "":
            continue
        values[name] = parse_value(name, value)
    if values.get("lr_scheduler") == "cosine_with_warmup":  # cli_utils' alias
        values["lr_scheduler"] = "cosine"
    return values


def parse_value(key: str, value: Any) -> Any:
    """A value as SimpleTuner's argparse types it: by the default's type, else a number or a bool when it reads as
    one."""
    default = ARGS.get(key)
    if not isinstance(value, str):
        return value
    text = value.strip().strip("'\"")
    lowered = text.lower()
    if isinstance(default, bool) or (default is None and lowered in TRUE | FALSE and not lowered.isdigit()):
        if lowered in TRUE | FALSE:
            return lowered in TRUE
        raise ConfigError(f"{key}: {value!r} is not true / false")
    if isinstance(default, str):
        return text
    try:
        number = float(text)
    except ValueError:
        return text
    if isinstance(default, float):
        return number
    return int(number) if number.is_integer() and not any(c in lowered for c in ".e") else number


def read_env(path: Path) -> dict[str, Any]:
    """config.env as SimpleTuner reads it (env_file.parse_env_file, load_env_config): `export KEY=value` lines, each
    known variable one flag (`true` passes a flag, `false` none), TRAINER_EXTRA_ARGS more flags."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputFileError(f"config: {path} does not exist") from None
    variables: dict[str, str] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        line = line.removeprefix("export ")
        if "+=" in line.split("=", 1)[0] + "=":
            key, value = line.split("+=", 1)
            variables[key.strip()] = (variables.get(key.strip(), "") + " " + value.strip().strip("'\"")).strip()
            continue
        key, value = line.split("=", 1)
        variables[key.strip()] = value.strip().strip("'\"")
    values: dict[str, Any] = {}
    for name, value in variables.items():
        if name == "TRAINER_EXTRA_ARGS":
            values.update(parse_flags(value))
        elif name in ENV_TO_ARGS:
            flag, _, fixed = ENV_TO_ARGS[name].partition("=")
            if value.lower() == "false":
                continue
            values[flag] = fixed or (True if value.lower() == "true" else value)
        else:
            values.setdefault(OTHER_VARIABLES, []).append(name)
    return values


def parse_flags(text: str) -> dict[str, Any]:
    """`--key=value`, `--key value` and bare `--flag` words (a saved command line's, TRAINER_EXTRA_ARGS')."""
    words, flags, i = shlex.split(text), {}, 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            i += 1
            continue
        key, sep, value = word.partition("=")
        if not sep:
            if i + 1 < len(words) and not words[i + 1].startswith("--"):
                value, i = words[i + 1], i + 1
            else:
                value = True
        flags[key] = value
        i += 1
    return flags
