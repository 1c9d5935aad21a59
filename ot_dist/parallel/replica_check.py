"""Whether the ranks' replicas of the trained weights still hold the same values (strategy ddp).

Replicated training relies on every rank applying the same update to the same weights; nothing in the step checks it.
A rank that stops averaging, rounds differently or steps a weight the others do not, drifts away silently, and only
rank 0's copy reaches checkpoints and exports. `diverged` compares the ranks' copies by a fingerprint of each tensor's
bits: a sum of integers, so exact and independent of the order the device adds in, the same on every rank for equal
tensors. One small all-gather; called at checkpoints and before the exports, never per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view
CHUNK = 1 << 24  # elements fingerprinted at a time: the int64 copies of one chunk are the transient memory


def fingerprint(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """An int64 of the tensor's bits, each element weighted by its position (so that moved values count):
    equal tensors give equal fingerprints; a changed element changes it (wrapping int64 arithmetic). Computed on
    `device` (default: the tensor's): a weight streamed from CPU memory is fingerprinted on the GPU a chunk at a time,
    faster than the CPU would."""
    device = device or tensor.device
    bits = tensor.detach().contiguous().reshape(-1).view(BITS[tensor.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, bits.numel(), CHUNK):
        part = bits[start:start + CHUNK].to(device).to(torch.int64)
        position = torch.arange(start, start + part.numel(), dtype=torch.int64, device=device)
        total += (part * (position * 0x9E3779B1 + 1)).sum()
    return total


def diverged(named: dict[str, torch.Tensor], device: torch.device, group=None) -> dict[str, list[int]]:
    """The tensors whose copy differs between ranks: name -> the ranks whose copy differs from rank 0's. A collective:
    every rank calls it with the same names in the same order."""
    if not named:
        return {}
    mine = torch.stack([fingerprint(t, device) for t in named.values()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).tolist()  # one host read, at a checkpoint; then plain ints (no tensor per compare)
    apart = {}
    for k, name in enumerate(named):
        ranks = [rank for rank in range(1, len(table)) if table[rank][k] != table[0][k]]
        if ranks:
            apart[name] = ranks
    return apart
