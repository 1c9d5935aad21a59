"""Errors a user can fix. The CLI prints their message (no traceback) and exits with `exit_code`."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a config key, a file, a sample. The message names the culprit."""

    exit_code = 2


class ConfigError(UserError):
    """The config is invalid: unknown key, wrong type, impossible combination."""


class InputFileError(UserError):
    """A file the user pointed at is missing, unreadable or corrupt (model, image, caption)."""

    exit_code = 3


class TrainingHalted(UserError):
    """Training stopped itself to protect the weights (a non-finite loss); a checkpoint was kept."""

    exit_code = 4
