"""Exponential moving average of the trained weights, sharded like the optimizer.

Each rank averages exactly the fp32 tensors its optimizer steps (see parallel/ownership.py): the
whole model in one process or under ddp, the local DTensor shards under fsdp, the flat fp32
partitions under ZeRO. An update is one fused lerp over those tensors, with no collective; the
memory per rank shrinks with the world size like the optimizer state does. Full EMA weights are
assembled only when asked for (export, sampling), by one all-reduce per parameter.

OneTrainer's semantics: at optimizer step n (0-based) the average moves when (n + 1) is a multiple
of the update interval, with decay min((1 + n) / (10 + n), ema.decay), so early steps follow the
weights closely instead of averaging in the random start.
"""

from __future__ import annotations

import torch

from ot_dist.parallel.ownership import Ownership


class ShardedEMA:
    def __init__(self, ownership: Ownership, decay: float, update_interval: int, device: torch.device | None = None):
        self.ownership = ownership
        self.decay = decay
        self.update_interval = update_interval
        self.values = [
            o.local().detach().to(device=device, dtype=torch.float32, copy=True) for o in ownership.owned
        ]

    def current_decay(self, step: int) -> float:
        return min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Called after optimizer step `step` (0-based). Returns whether the average moved."""
        if (step + 1) % self.update_interval:
            return False
        sources = [o.local() for o in self.ownership.owned]
        sources = [
            s if (s.device, s.dtype) == (v.device, v.dtype) else s.to(v.device, v.dtype)
            for s, v in zip(sources, self.values)
        ]
        if self.values:
            torch._foreach_lerp_(self.values, sources, 1.0 - self.current_decay(step))
        return True

    def full_weights(self) -> dict[str, torch.Tensor]:
        """{"<part>.<parameter name>": full EMA tensor}. A collective when sharded: every rank calls it."""
        return self.ownership.gather_full(self.values)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values)

    def state_dict(self) -> dict:
        return {"values": [v.clone() for v in self.values], "decay": self.decay, "update_interval": self.update_interval}

    def load_state_dict(self, state: dict) -> None:
        values = state["values"]
        if len(values) != len(self.values) or any(a.shape != b.shape for a, b in zip(values, self.values)):
            raise ValueError("ema: the saved averages do not match this run's layout of the trained weights")
        for target, saved in zip(self.values, values):
            target.copy_(saved)
