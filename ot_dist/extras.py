"""Packages that only some features need, and the extra (`pip install 'ot_dist[EXTRA]'`) that brings each.

Everything else ot_dist imports is a core dependency: the core install trains, checkpoints and exports.
A feature whose package is missing says so in one line naming the extra, before any model loads.
tests/test_early_checks.py keeps this table, pyproject.toml and the imports in ot_dist in agreement.
"""

from __future__ import annotations

import importlib.util

from ot_dist.errors import ConfigError

# import name -> the extra of pyproject.toml that installs it
EXTRAS = {
    "deepspeed": "dist",
    "bitsandbytes": "optim",
    "prodigyopt": "optim",
    "dadaptation": "optim",
    "matplotlib": "optim",
    "mlflow": "tracking",
    "pillow_heif": "heic",
    "torchao": "float8",
    "pytorch_optimizer": "optim",
    "schedulefree": "optim",
    "prodigyplus": "optim",
    "s3fs": "s3",  # s3:// tars (data/remote.py)
    "gcsfs": "gcs",  # gs:// tars
    "aiohttp": "http",  # http(s):// tars
    "av": "video",  # video clips as samples (data/video.py)
}


def missing_extra(module: str) -> str | None:
    """None when `module` can be imported, else the one-line hint naming the extra that installs it."""
    top = module.split(".")[0]
    if top not in EXTRAS or importlib.util.find_spec(top) is not None:
        return None
    return f"needs the {top} package: pip install 'ot_dist[{EXTRAS[top]}]'"


def require(module: str, what: str) -> None:
    """Refuse `what` (a config key and its value) when the optional package it needs is not installed."""
    if (hint := missing_extra(module)) is not None:
        raise ConfigError(f"{what} {hint}")
