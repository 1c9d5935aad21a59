"""What every importer (`ot-dist import onetrainer`, `ot-dist import kohya`) shares: the result it fills
(`Imported`: the raw ot_dist config, what is not honoured and why, notes), paths written on another machine, and
writing the result: validated first, so a file that is written is a config ot_dist accepts."""

from __future__ import annotations

import json
import os
import tomllib
import re
import sys
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path, PureWindowsPath

from ot_dist.errors import ConfigError, InputFileError


@dataclass
class Imported:
    config: dict  # the raw ot_dist config
    not_honoured: list[str] = field(default_factory=list)  # "field: reason"
    notes: list[str] = field(default_factory=list)  # mapped, but worth knowing
    # ot_dist key (or the section above it) -> the other trainer's setting it came from, named in validation errors
    origins: dict[str, str] = field(default_factory=dict)
    # files the config needs beside it (kohya's fine-tuning captions), written once it validates
    after_validation: list[Callable[[], None]] = field(default_factory=list)


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
