"""Optimizer from config and parameter groups. (The full OneTrainer optimizer list is its own issue.)"""

from __future__ import annotations

import torch

from ot_dist.config.schema import OptimizerConfig
from ot_dist.methods.base import ParamGroup


def build_optimizer(config: OptimizerConfig, groups: list[ParamGroup]) -> torch.optim.Optimizer:
    param_groups = [
        {"params": g.params, "lr": g.learning_rate, "initial_lr": g.learning_rate, "name": g.name} for g in groups
    ]
    return torch.optim.AdamW(
        param_groups,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        # foreach keeps the step to a handful of kernels; fused is only faster on CUDA.
        foreach=True,
    )
