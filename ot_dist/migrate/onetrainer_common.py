"""What every section of the OneTrainer import shares: the result it fills (`Imported`), the part sections OneTrainer
stores, and the files and paths a OneTrainer config names (its JSON files, paths saved on Windows). Kept apart so
the section modules need not import the entry module that imports them."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

from ot_dist.errors import InputFileError

# Every part section OneTrainer has stored (TrainConfig's TrainModelPartConfig fields).
PART_SECTIONS = ("unet", "prior", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4",
                 "vae", "effnet_encoder", "decoder", "decoder_text_encoder", "decoder_vqgan")


@dataclass
class Imported:
    config: dict  # the raw ot_dist config
    not_honoured: list[str] = field(default_factory=list)  # "field: reason"
    notes: list[str] = field(default_factory=list)  # mapped, but worth knowing


WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def is_windows_path(value: str) -> bool:
    return os.name != "nt" and ("\\" in value or bool(WINDOWS_DRIVE.match(value)))


def local_path(value: str, key: str, out: Imported) -> str:
    """A path as this machine reads it. OneTrainer configs saved on Windows write backslashes: a relative path is
    converted; an absolute one (C:\\..., \\\\server\\...) names a file on that machine and is listed."""
    if not value or not is_windows_path(value):
        return value
    windows = PureWindowsPath(value)
    if windows.drive or windows.root:
        out.not_honoured.append(f"{key}: {value} is a Windows path; replace it with this machine's path")
        return value
    return windows.as_posix()


def read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"{what}: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputFileError(f"{what}: {path} is not JSON ({err})") from None
