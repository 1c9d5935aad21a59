"""Randomness that belongs to samples and steps, not to processes.

Every random choice is drawn from a generator keyed by what it is about: (seed, epoch, sample id)
for a sample's noise, timestep and crop; (seed, epoch) for the shuffle. The same sample therefore
gets the same noise whatever the world size, batch composition or resume point, which is what lets
runs be compared across world sizes and resumed exactly.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*key: object) -> int:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*key))
