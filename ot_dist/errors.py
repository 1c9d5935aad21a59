"""Errors a user can fix. The CLI prints their message (no traceback) and exits with `exit_code`."""

from __future__ import annotations

import errno
import re


class UserError(Exception):
    """Bad input from the user: a config key, a file, a sample. The message names the culprit."""

    exit_code = 2


class ConfigError(UserError):
    """The config is invalid: unknown key, wrong type, impossible combination."""


class InputFileError(UserError):
    """A file the user pointed at is missing, unreadable or corrupt (model, image, caption)."""

    exit_code = 3


class OpenFileLimit(UserError):
    """The process may open no more files (`ulimit -n`): the machine's limit, not a bad input file, so no sample is
    skipped for it."""

    exit_code = 3


class ShardSetChanged(UserError):
    """A shard or cache file was replaced while a run read it (the set rebuilt in place by another run or build): the
    run's index no longer describes it. Not one bad sample: the run stops."""

    exit_code = 3


class TrainingHalted(UserError):
    """Training stopped itself to protect the weights (a non-finite loss); a checkpoint was kept."""

    exit_code = 4


# Writes the storage refused: the user's to fix (free space, quota, `ulimit -f`, a read-only mount), not a defect.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
_RUST_IO_ERROR = re.compile(r"I/O error: (.*) \(os error (\d+)\)")


def os_error_of(err: BaseException) -> OSError | None:
    """The OS error behind `err`: itself, or the one safetensors (a Rust library) reports only in the text of its
    SafetensorError ("I/O error: No space left on device (os error 28)")."""
    if isinstance(err, OSError):
        return err
    found = _RUST_IO_ERROR.search(str(err))
    return OSError(int(found.group(2)), found.group(1)) if found else None


def storage_refusal(err: BaseException) -> OSError | None:
    """The storage's refusal behind `err` (STORAGE_ERRNOS), or None."""
    refused = os_error_of(err)
    return refused if refused is not None and refused.errno in STORAGE_ERRNOS else None


def exit_code_of(err: BaseException) -> int:
    """The exit code `ot-dist` ends with for `err`: a user error's own, 130 for an interrupt, 3 for a write the
    storage refused, 1 for anything else (a defect, or a library's error)."""
    if isinstance(err, UserError):
        return err.exit_code
    if isinstance(err, KeyboardInterrupt):
        return 130
    return 3 if storage_refusal(err) is not None else 1
