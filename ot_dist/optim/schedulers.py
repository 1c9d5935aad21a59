"""Learning-rate schedules as multipliers of each group's base rate, counted in optimizer steps."""

from __future__ import annotations

import math

import torch

from ot_dist.config.schema import SchedulerConfig


def lr_factor(name: str, step: int, total_steps: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if name == "CONSTANT":
        return 1.0
    if name == "LINEAR":
        return 1.0 - progress
    if name == "COSINE":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"scheduler.name: unknown schedule {name!r}")


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(config.name, step, total_steps, config.warmup_steps)
    )
