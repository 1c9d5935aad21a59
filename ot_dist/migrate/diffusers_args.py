"""A diffusers example script's training arguments as the script reads them: the saved command line (`accelerate
launch [its options] train_dreambooth_lora.py --key value ...`) parsed by an argparse parser built from the script's
own arguments (diffusers_defaults: names, defaults, store_true / int / float / list), and the launcher's settings
that change what trains (mixed precision, number of processes) from its options or the accelerate config file.
`DiffusersArgs` (common.TrackedArgs) remembers which keys the import read, so that every argument a user set and
nothing read is listed at the end: nothing is dropped without a line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import TrackedArgs, split_command_line
from ot_dist.migrate.diffusers_defaults import KINDS, SCRIPT_ARGS, defaults

# accelerate launch's options that take no value (the others take one)
LAUNCH_FLAGS = frozenset({"--multi_gpu", "--cpu", "--use_deepspeed", "--use_fsdp", "--use_megatron_lm", "--tpu",
                          "--quiet", "-q", "--debug", "--no_python", "-m", "--module", "--rdzv_conf"})


class DiffusersArgs(TrackedArgs):
    def __init__(self, values: dict[str, Any], script: str, launch: dict[str, Any]):
        super().__init__(values, defaults(script))
        self.script, self.launch = script, launch  # launch: the launcher's settings (_launch)


def read_args(command_line: str, script: str | None, accelerate_config: str | None) -> DiffusersArgs:
    named, words, launch_words = split_command_line(Path(command_line), "command_line")
    script = Path(script or named or "").name
    if script not in SCRIPT_ARGS:
        raise ConfigError(f"--script: {script or 'no script'} is not a diffusers example script ot_dist imports "
                          f"({', '.join(SCRIPT_ARGS)}); the command line names none of them" if not named else
                          f"--script: {script} is not a diffusers example script ot_dist imports "
                          f"({', '.join(SCRIPT_ARGS)})")
    values = parse_words(words, script)
    launch = _launch(launch_words, accelerate_config)
    return DiffusersArgs(values, script, launch)


def parse_words(words: list[str], script: str) -> dict[str, Any]:
    """The arguments the words give, typed as the script's argparse types them (`--key=value`, a prefix of a name,
    and bool's reading of text included); an argument the script does not have is an error naming it."""
    parser = argparse.ArgumentParser(prog=script, add_help=False, exit_on_error=False)
    for key in sorted(SCRIPT_ARGS[script]):
        kind = KINDS[key]
        option = f"--{key}"
        if kind == "flag":
            parser.add_argument(option, action="store_true", default=argparse.SUPPRESS)
        elif kind == "list":
            parser.add_argument(option, nargs="+", default=argparse.SUPPRESS)
        else:
            parser.add_argument(option, type={"int": int, "float": float, "bool": bool}.get(kind, str),
                                default=argparse.SUPPRESS)
    try:
        parsed, unknown = parser.parse_known_args(words)
    except argparse.ArgumentError as err:  # a value argparse cannot type, or a missing value
        raise InputFileError(f"command_line: {err}") from None
    if unknown:
        raise InputFileError(f"command_line: {unknown[0]} is not an argument of {script}")
    return vars(parsed)


def _launch(words: list[str], accelerate_config: str | None) -> dict[str, Any]:
    """The launcher's settings ot_dist reads: mixed_precision, num_processes (from `accelerate launch`'s options,
    else its config file), distributed_type and its DeepSpeed stage (from the config file), and the other options,
    kept to be listed."""
    options, i, config_file = {}, 0, accelerate_config
    rest = []
    while i < len(words):
        word = words[i]
        if word.startswith("-") and word not in LAUNCH_FLAGS:
            key, sep, value = word.partition("=")
            if not sep and i + 1 < len(words):
                value, i = words[i + 1], i + 1
            if key == "--config_file":
                config_file = accelerate_config or value
            elif key in ("--mixed_precision", "--num_processes"):
                options[key[2:]] = value
            else:
                rest.append(f"{key} {value}")
        elif word.startswith("-"):
            rest.append(word)
        i += 1
    from_file = _accelerate_config(config_file) if config_file else {}
    launch = {"mixed_precision": options.get("mixed_precision", from_file.get("mixed_precision")),
              "num_processes": int(options.get("num_processes", from_file.get("num_processes")) or 1),
              "distributed_type": from_file.get("distributed_type"),
              "zero_stage": (from_file.get("deepspeed_config") or {}).get("zero_stage"),
              "config_file": config_file, "other": [w for w in rest if w not in ("accelerate", "launch")]}
    if "--multi_gpu" in words and not launch["distributed_type"]:
        launch["distributed_type"] = "MULTI_GPU"
    return launch


def _accelerate_config(path: str) -> dict:
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"--accelerate_config: {path} does not exist") from None
    except yaml.YAMLError as err:
        raise InputFileError(f"--accelerate_config: {path} is not YAML ({err})") from None
    return loaded if isinstance(loaded, dict) else {}
