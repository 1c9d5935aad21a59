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
    def __init__(self, ownership: Ownership, decay: float, update_interval: int, device: torch.device | None = None,
                 staged: bool | None = None):
        self.ownership = ownership
        self.decay = decay
        self.update_interval = update_interval
        self._values = [
            o.local().detach().to(device=device, dtype=torch.float32, copy=True) for o in ownership.owned
        ]
        # An average in CPU memory of weights on a GPU (ema.device: cpu): a plain `.to("cpu")` of the weights would
        # make the host wait for the device at every update. Instead they are copied into pinned host buffers with
        # non_blocking (stream-ordered after the optimizer step that made them, before the next one changes them)
        # and the lerp with this update's weight runs at the next update or read, after the copy's event, which
        # the device passed long before. Same result, bit for bit; the buffers cost one more copy of the average
        # in (pinned) host memory. `staged` forces the path (tests on the CPU) or turns it off.
        if staged is None:
            staged = any(v.device.type == "cpu" for v in self._values) and any(
                o.local().device.type == "cuda" for o in ownership.owned)
        self.staged = staged
        self._buffers: list[torch.Tensor] | None = None
        self._pending: tuple[object, float] | None = None  # (the copy's event or None, the lerp weight)

    def current_decay(self, step: int) -> float:
        return min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Called after optimizer step `step` (0-based). Returns whether the average moved."""
        if (step + 1) % self.update_interval:
            return False
        sources = [o.local() for o in self.ownership.owned]
        weight = 1.0 - self.current_decay(step)
        if self.staged:
            self._stage(sources, weight)
            return True
        sources = [
            s if (s.device, s.dtype) == (v.device, v.dtype) else s.to(v.device, v.dtype)
            for s, v in zip(sources, self._values)
        ]
        if self._values:
            torch._foreach_lerp_(self._values, sources, weight)
        return True

    def _stage(self, sources: list[torch.Tensor], weight: float) -> None:
        """Queue the copy of this update's weights into the host buffers; the previous update's lerp goes first
        (its copy finished an update interval ago), so the buffers are free again."""
        self.settle()
        on_gpu = any(s.device.type == "cuda" for s in sources)
        if self._buffers is None:
            self._buffers = [torch.empty_like(v, pin_memory=on_gpu) for v in self._values]
        for buffer, source in zip(self._buffers, sources):
            buffer.copy_(source.detach(), non_blocking=True)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        self._pending = (event, weight)

    def settle(self) -> None:
        """Apply a staged update (waits for its copy: recorded at least a step ago, so the device is past it)."""
        if self._pending is None:
            return
        event, weight = self._pending
        if event is not None:
            event.synchronize()
        if self._values:
            torch._foreach_lerp_(self._values, self._buffers, weight)
        self._pending = None

    @property
    def values(self) -> list[torch.Tensor]:
        """The averages (each rank's owned tensors), with any staged update applied."""
        self.settle()
        return self._values

    def full_weights(self) -> dict[str, torch.Tensor]:
        """{"<part>.<parameter name>": full EMA tensor}. A collective when sharded: every rank calls it."""
        return self.ownership.gather_full(self.values)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values)

    def state_dict(self) -> dict:
        return {"values": [v.clone() for v in self.values], "decay": self.decay, "update_interval": self.update_interval}

    def load_state_dict(self, state: dict) -> None:
        values = state["values"]
        self._pending = None  # replaced by the saved averages
        if len(values) != len(self._values) or any(a.shape != b.shape for a, b in zip(values, self._values)):
            raise ValueError("ema: the saved averages do not match this run's layout of the trained weights")
        for target, saved in zip(self._values, values):
            target.copy_(saved)
