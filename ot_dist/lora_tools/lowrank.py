"""The best rank-r approximation of a weight change (truncated SVD), as a LoRA pair, with the share of the
change's energy (squared Frobenius norm) it keeps; and the per-module ranks of a dynamic resize."""

from __future__ import annotations

import torch

from ot_dist.lora_tools.files import Pair

DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative")
ZERO_CHANGE = 1e-6  # a largest singular value at or below this: a zero change, kept at rank 1


def dynamic_rank(s: torch.Tensor, method: str, param: float, cap: int) -> int:
    """The rank kohya sd-scripts' resize_lora.py keeps for the singular values `s` (descending) with
    `--dynamic_method method --dynamic_param param --new_rank cap`, so a file resized either way has the same ranks.
    Its rule keeps one value more than those meeting the criterion: n = the count of values above s_max / param
    (sv_ratio), or the fewest leading values whose sum (sv_cumulative) or sum of squares (sv_fro, against param^2)
    reaches that share of the whole; rank = min(max(n, 1), len(s) - 1) + 1, at most `cap`, and 1 for a zero change."""
    if method == "sv_ratio":
        n = int((s > s[0] / param).sum())
    elif method in ("sv_cumulative", "sv_fro"):
        values, target = (s, param) if method == "sv_cumulative" else (s**2, param**2)
        share = torch.cumsum(values, dim=0) / float(values.sum())
        n = int(torch.searchsorted(share, torch.tensor(target, dtype=share.dtype))) + 1
    else:
        raise ValueError(f"unknown dynamic method {method!r} (one of {', '.join(DYNAMIC_METHODS)})")
    if float(s[0]) <= ZERO_CHANGE:
        return 1
    return min(max(1, min(n, s.numel() - 1)) + 1, cap, s.numel())


def low_rank_pair(delta: torch.Tensor, rank: int, dynamic: tuple[str, float] | None = None) -> tuple[Pair, float]:
    """delta (Linear [out, in] or Conv2d [out, in, kh, kw]) -> (Pair with alpha = its rank, kept energy in [0, 1]).
    `dynamic` (method, param): the rank is chosen per change by `dynamic_rank`, `rank` its upper limit.
    The singular values are split evenly (sqrt on each side) so neither matrix dwarfs the other in half precision."""
    matrix = delta.float().flatten(1)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    r = min(rank, s.numel()) if dynamic is None else dynamic_rank(s, *dynamic, rank)
    total = float((s**2).sum())
    kept = float((s[:r] ** 2).sum()) / total if total > 0 else 1.0
    root = s[:r].sqrt()
    up = u[:, :r] * root
    down = root[:, None] * vh[:r]
    if delta.dim() == 4:
        down = down.reshape(r, *delta.shape[1:])
        up = up.reshape(delta.shape[0], r, 1, 1)
    return Pair(down.contiguous(), up.contiguous(), float(r)), kept
