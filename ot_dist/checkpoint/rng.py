"""The process-wide random number generators of one rank, as tensors and JSON (no pickle).

Noise, timesteps, crops and shuffles come from generators keyed by (seed, epoch, sample) and need no
saving (ot_dist/randomness.py); these are for whatever else draws from the global streams (dropout,
library code), so that a resumed run continues them where the saved one stopped."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, state, gauss = random.getstate()
    return tensors, {"numpy": [kind, int(position), int(has_gauss), float(cached)],
                     "python": [version, list(state), gauss]}


def restore_rng(tensors: dict[str, torch.Tensor], saved: dict) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    if torch.cuda.is_available() and "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    kind, position, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), position, has_gauss, cached))
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
