"""What a run reports about itself: its config as flat params, its tags, the memory it uses.
Plain Python, no MLflow: non-main ranks and untracked runs never import it."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)


def flat_params(config) -> dict[str, str]:
    """The resolved config as `section.key: value` strings (the YAML artifact keeps the full text)."""
    params: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
            return
        text = node if isinstance(node, str) else json.dumps(node)
        if len(text) > MAX_PARAM_LENGTH:
            text = text[: MAX_PARAM_LENGTH - 3] + "..."
        params[prefix.rstrip(".")] = text

    walk(config.model_dump(mode="json"), "")
    # Options the chosen optimizer does not take stay None in the config; as params they would be
    # dozens of "null" rows of other optimizers.
    return {k: v for k, v in params.items() if not (k.startswith("optimizer.") and v == "null")}


def run_tags(config, world_size: int) -> dict[str, str]:
    tags = {
        "strategy": config.strategy,
        "world_size": str(world_size),
        "model_family": config.model.family,
        "method": config.method,
        # MLflow's UI fills "Source" and "Created by" from these system tags
        "mlflow.source.name": " ".join(["ot-dist", *sys.argv[1:]]) if sys.argv[1:] else "ot-dist",
        "mlflow.source.type": "LOCAL",
    }
    user = current_user()
    if user:
        tags["mlflow.user"] = user
    commit = git_commit(Path(__file__).resolve().parents[2])
    if commit:
        tags["git_commit"] = commit
    return tags


def current_user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        return None


def git_commit(directory: Path) -> str | None:
    """The commit of the ot_dist checkout that trains (with `-dirty` if it has local changes);
    None when it is not a git checkout (an installed wheel) or git is missing."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak CUDA memory on a GPU; the process's resident memory otherwise (read from /proc, no psutil)."""
    if device.type == "cuda":
        return {"memory/cuda_peak_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return {}
    return {"memory/rss_gb": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
