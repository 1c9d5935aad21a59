"""What every importer (`ot-dist import onetrainer`, `ot-dist import kohya`, `ot-dist import simpletuner`) shares:
the result it fills (`Imported`: the raw ot_dist config, what is not honoured and why, notes), the other trainer's
arguments over its defaults with a record of what was read (`TrackedArgs`: whatever a user set and no section read
is listed, `list_unread`), the warmup in ot_dist's count, paths written on another machine, and writing the result:
validated first, so a file that is written is a config ot_dist accepts."""

from __future__ import annotations

import json
import os
import tomllib
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable
from pathlib import Path, PureWindowsPath

from ot_dist.errors import ConfigError, InputFileError

# ot_dist's T5 caption lengths (model.t5_max_tokens null: the pipelines' defaults), what the importers compare with
T5_DEFAULTS = {"flux": 512, "chroma": 512, "sd3": 256, "flux_kontext": 512}


@dataclass
class Imported:
    config: dict  # the raw ot_dist config
    not_honoured: list[str] = field(default_factory=list)  # "field: reason"
    notes: list[str] = field(default_factory=list)  # mapped, but worth knowing
    # ot_dist key (or the section above it) -> the other trainer's setting it came from, named in validation errors
    origins: dict[str, str] = field(default_factory=dict)
    # files the config needs beside it (kohya's fine-tuning captions), written once it validates
    after_validation: list[Callable[[], None]] = field(default_factory=list)


class TrackedArgs:
    """Another trainer's arguments (`values`, as its config sets them) over its own defaults, remembering which keys
    the import read, so that every key a user set and no section read is listed at the end: nothing is dropped
    without a line."""

    def __init__(self, values: dict[str, Any], defaults: dict[str, Any]):
        self.values, self.defaults, self.read = values, defaults, set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self.values.get(key, self.defaults.get(key))

    def given(self, key: str) -> bool:
        """Whether the setup sets `key` to something other than the trainer's default (read or not)."""
        return key in self.values and not _same(self.values[key], self.defaults.get(key))

    def unread(self) -> list[str]:
        return [key for key in self.values if key not in self.read and self.given(key)]


def _unset(value) -> bool:
    return value is None or value is False or (isinstance(value, (str, list)) and not value)


def _same(value, default) -> bool:
    return (_unset(value) and _unset(default)) or (value == default and isinstance(value, bool) == isinstance(default, bool))


def list_unread(args: TrackedArgs, out: Imported, no_effect: dict[str, str], trainer: str) -> None:
    """Every key set and not read: noted when it changes how the other trainer runs but not what it trains
    (`no_effect`: key -> what it changes), else listed as not honoured."""
    for key in args.unread():
        value = args.values[key]
        if key in no_effect:
            out.notes.append(f"{key}: {value!r} is ignored ({no_effect[key]}: it does not change what trains)")
        elif key not in args.defaults:
            out.not_honoured.append(f"{key}: {value!r} is not an argument of {trainer}")
        else:
            out.not_honoured.append(f"{key}: {value!r} has no ot_dist counterpart")


def warmup_micro_steps(warmup, accumulation: int, key: str, skip) -> int | float:
    """A warmup in optimizer steps (or a ratio below 1) as ot_dist's scheduler.warmup_steps, which counts micro steps
    above 1 (OneTrainer's unit)."""
    if not warmup:
        return 0
    if isinstance(warmup, float) and warmup < 1:
        return warmup
    micro = int(warmup) * accumulation
    if micro == 1:  # ot_dist reads 1 as the whole run
        skip(f"{key}: 1 (the first step at learning rate 0) cannot be written (ot_dist reads a warmup of 1 as the "
             "whole run); no warmup")
        return 0
    return micro


# accelerate's --mixed_precision values (kohya, SimpleTuner and the diffusers scripts take them) -> train_dtype
ACCELERATE_PRECISION = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}
WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def is_windows_path(value: str) -> bool:
    return os.name != "nt" and ("\\" in value or bool(WINDOWS_DRIVE.match(value)))


def local_path(value: str, key: str, out: Imported) -> str:
    """A path as this machine reads it. Configs saved on Windows write backslashes: a relative path is converted; an
    absolute one (C:\\..., \\\\server\\...) names a file on that machine and is listed."""
    if not value or not is_windows_path(value):
        return value
    windows = PureWindowsPath(value)
    if windows.drive or windows.root:
        out.not_honoured.append(f"{key}: {value} is a Windows path; replace it with this machine's path")
        return value
    return windows.as_posix()


def note_local_model(path: str, key: str, out: Imported) -> None:
    """A hub id (`org/model`) is read as a local path: ot_dist does not download."""
    if "/" in path and not is_windows_path(path) and not Path(path).exists():
        out.notes.append(f"{key}: {path} is read as a local path; ot_dist does not download (give a diffusers folder "
                         "or a single file)")


def read_json(path: Path, what: str):
    return _read(path, what, json.loads, "JSON", json.JSONDecodeError)


def read_toml(path: Path, what: str) -> dict:
    return _read(path, what, tomllib.loads, "TOML", tomllib.TOMLDecodeError)


def _read(path: Path, what: str, parse, kind: str, error: type[Exception]):
    """A file another trainer wrote, parsed; a missing or unreadable one is an input error naming `what` points at it."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"{what}: {path} does not exist") from None
    except (error, UnicodeDecodeError) as err:
        raise InputFileError(f"{what}: {path} is not {kind} ({err})") from None


ERROR_KEY = re.compile(r"^(\s*-\s*)([\w.\[\]]+):")


def with_origins(message: str, origins: dict[str, str]) -> str:
    """A validation error whose lines name ot_dist keys (`  - data.bucket_step: ...`), each with the setting of the
    other trainer it was imported from (the key's own or its nearest section's)."""
    lines = []
    for line in message.splitlines():
        match = ERROR_KEY.match(line)
        key = match.group(2) if match else ""
        while key and key not in origins:
            key = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", key) if re.search(r"[.\[]", key) else ""
        lines.append(f"{match.group(1)}{match.group(2)} (from {origins[key]}):{line[match.end():]}" if key else line)
    return "\n".join(lines)


def write_imported(imported: Imported, out: Path, force: bool, what: str) -> None:
    """Validates the imported config and writes it with its notes and NOT HONOURED lines as a comment header (the
    lines go to stderr too). `what` names the other trainer's settings in those lines ("OneTrainer fields")."""
    import yaml

    from ot_dist.config.load import validate

    if out.exists() and not force:
        raise ConfigError(f"--out: {out} exists (--force replaces it)")
    try:
        validate(imported.config)  # what is written is a config ot_dist accepts, or nothing is written
    except ConfigError as err:
        raise ConfigError(with_origins(str(err), imported.origins)) from None
    for write in imported.after_validation:
        write()
    header = [f"# {line}" for line in imported.notes]
    if imported.not_honoured:
        header.append(f"# NOT HONOURED ({what} this config does not reproduce):")
        header += [f"#   - {line}" for line in imported.not_honoured]
    body = yaml.safe_dump(imported.config, sort_keys=False, allow_unicode=True)
    out.write_text("\n".join(header) + "\n" + body, encoding="utf-8")
    for line in imported.not_honoured:
        print(f"not honoured: {line}", file=sys.stderr)
    print(f"wrote {out} ({len(imported.not_honoured)} {what} not honoured, listed in it)", file=sys.stderr)


# A line continued on the next: `\` (POSIX shells), `^` (cmd.exe), a backtick (PowerShell).
CONTINUATION = re.compile(r"[\\^`][ \t]*\r?\n")


def split_command_line(path: Path, what: str = "--command_line") -> tuple[str | None, list[str], list[str]]:
    """(the script, its words, the launcher's words before it) of a saved command line (`accelerate launch ...
    train.py --key value ...`, continued over lines); the script is the first word ending in .py."""
    import shlex

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"{what}: {path} does not exist") from None
    try:
        words = shlex.split(CONTINUATION.sub(" ", text), comments=False)
    except ValueError as err:
        raise InputFileError(f"{what}: {path} is not a command line ({err})") from None
    at = next((i for i, word in enumerate(words) if word.endswith(".py")), None)
    if at is None:
        return None, words, []
    return words[at], words[at + 1:], words[:at]

