"""The best rank-r approximation of a weight change (truncated SVD), as a LoRA pair, with the share of the
change's energy (squared Frobenius norm) it keeps."""

from __future__ import annotations

import torch

from ot_dist.lora_tools.files import Pair


def low_rank_pair(delta: torch.Tensor, rank: int) -> tuple[Pair, float]:
    """delta (Linear [out, in] or Conv2d [out, in, kh, kw]) -> (Pair with alpha = rank, kept energy in [0, 1]).
    The singular values are split evenly (sqrt on each side) so neither matrix dwarfs the other in half precision."""
    matrix = delta.float().flatten(1)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    r = min(rank, s.numel())
    total = float((s**2).sum())
    kept = float((s[:r] ** 2).sum()) / total if total > 0 else 1.0
    root = s[:r].sqrt()
    up = u[:, :r] * root
    down = root[:, None] * vh[:r]
    if delta.dim() == 4:
        down = down.reshape(r, *delta.shape[1:])
        up = up.reshape(delta.shape[0], r, 1, 1)
    return Pair(down.contiguous(), up.contiguous(), float(r)), kept
