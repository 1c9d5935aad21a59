"""Time training steps: CUDA events around each step on a GPU (read once, after the last step), the wall clock on
a CPU; peak memory of the device (or the process's peak RSS on a CPU)."""

from __future__ import annotations

import math
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class StepTimes:
    seconds: list[float]  # per timed step
    peak_memory_bytes: int
    memory_kind: str  # "cuda_max_allocated" or "cpu_peak_rss"
    final_loss: float

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)


def time_steps(step: Callable[[], torch.Tensor], device: torch.device, warmup: int, steps: int) -> StepTimes:
    if steps < 1 or warmup < 0:
        raise ValueError("bench: --steps must be at least 1 and --warmup at least 0")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    loss = None
    if cuda:
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            loss = step()
            end.record()
        torch.cuda.synchronize(device)
        seconds = [start.elapsed_time(end) / 1000 for start, end in events]
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    else:
        seconds = []
        for _ in range(steps):
            begin = time.perf_counter()
            loss = step()
            seconds.append(time.perf_counter() - begin)
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"
    final = float(loss)
    if not math.isfinite(final):
        raise FloatingPointError(f"bench: the loss became {final}: the step is broken, its timing would be meaningless")
    return StepTimes(seconds, peak, kind, final)
