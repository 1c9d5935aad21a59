"""kohya sd-scripts' training arguments as its scripts read them: a `--config_file` TOML (kohya flattens its sections:
`[model] pretrained_model_name_or_path = ...` is the argument pretrained_model_name_or_path) under a saved command
line, whose arguments win (argparse parses them over the TOML's namespace), over the scripts' defaults
(kohya_defaults.ARGS). `KohyaArgs` remembers which keys the import read, so that every key a user set and no
section read is listed at the end: nothing is dropped without a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import TrackedArgs, read_toml, split_command_line
from ot_dist.migrate.kohya_defaults import ARGS, FLAGS, SEVERAL_VALUES, script_defaults


class KohyaArgs(TrackedArgs):
    def __init__(self, values: dict[str, Any], script: str, launch: list[str] | None = None):
        super().__init__(values, script_defaults(script))
        self.script = script
        self.launch = launch or []  # a saved command line's words before the script (accelerate launch ...)


def read_args(config_file: str | None, command: str | None, script: str | None) -> KohyaArgs:
    values, named_script, launch = {}, None, []
    if command:
        named_script, cli, launch = parse_command_line(Path(command))
        config_file = config_file or cli.pop("config_file", None)
        cli.pop("config_file", None)
    if config_file:
        path = Path(config_file if str(config_file).endswith(".toml") else f"{config_file}.toml")  # as kohya reads it
        values.update(flatten(read_toml(path, "--config_file")))
    if command:
        values.update(cli)
    script = Path(script or named_script or "").name
    if not script:
        raise ConfigError("--script: which kohya script does this setup run (train_network.py, sdxl_train_network.py, "
                          "sdxl_train.py, train_db.py, fine_tune.py, flux_train_network.py, sd3_train_network.py, "
                          "flux_train.py, sd3_train.py, lumina_train_network.py, lumina_train.py, "
                          "train_textual_inversion.py, sdxl_train_textual_inversion.py)? The TOML does not say; give "
                          "--script or a --command_line that names it")
    args = KohyaArgs(values, script, launch)
    for key in ("config_file", "output_config"):
        args.read.add(key)
    return args


def flatten(toml: dict) -> dict:
    """kohya's read_config_from_file: a table's keys are arguments; the table names are only for reading."""
    flat = {}
    for key, value in toml.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def parse_command_line(path: Path) -> tuple[str | None, dict, list[str]]:
    """(the script, its arguments, the launcher's words before it) of a saved command line."""
    script, words, launch = split_command_line(path)
    values, i = {}, 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise InputFileError(f"--command_line: {word!r} is not a --key of {script or 'the script'}")
        key, _, inline = word[2:].partition("=")
        i += 1
        if inline:
            values[key] = _value(key, inline)
        elif key in SEVERAL_VALUES:
            several = []
            while i < len(words) and not words[i].startswith("--"):
                several.append(words[i])
                i += 1
            values[key] = [_value(key, w) for w in several] if key == "text_encoder_lr" else several
        elif key in FLAGS:
            values[key] = True
        elif i < len(words):
            values[key] = _value(key, words[i])
            i += 1
        else:
            raise InputFileError(f"--command_line: --{key} has no value")
    return script, values, launch


def _value(key: str, text: str):
    """A command-line value as kohya's argparse types it: numbers for numeric arguments, the text otherwise."""
    default = ARGS.get(key)
    if key in ("lr_warmup_steps", "lr_decay_steps"):  # kohya's int_or_float: "10%", 0.1 (a ratio) or 100 (steps)
        if text.endswith("%"):
            return float(text[:-1]) / 100
        return int(text) if float(text) >= 1 else float(text)
    if isinstance(default, str) or key in STRING_ARGS:
        return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# Arguments without a default whose value is text, even when it looks like a number.
STRING_ARGS = frozenset({"output_name", "output_dir", "pretrained_model_name_or_path", "train_data_dir", "reg_data_dir",
                         "dataset_config", "sample_prompts", "network_module", "network_weights", "vae", "resume",
                         "logging_dir", "log_prefix", "training_comment", "mixed_precision", "save_precision",
                         "gemma2", "ae", "clip_l", "clip_g", "t5xxl"})
