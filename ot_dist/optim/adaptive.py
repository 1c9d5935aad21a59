"""What to watch with adaptive optimizers (Prodigy, D-Adaptation): they estimate a step size d, and the
step actually taken is d x lr. With a schedule that restarts, d keeps the size it grew to while the
learning rate was low, so d x lr can jump at every restart."""

from __future__ import annotations

import torch

from ot_dist.config.optim import CYCLIC


def d_times_lr(optimizer: torch.optim.Optimizer) -> dict[str, float | torch.Tensor]:
    """{group name: d x lr} for optimizers that estimate d; empty for the others. A d kept on the device
    (Prodigy's) gives a 0-dim device tensor, not read here: the step window copies it with the losses."""
    return {
        group.get("name", str(i)): (group["d"] * float(group["lr"]) if isinstance(group["d"], torch.Tensor)
                                    else float(group["d"]) * float(group["lr"]))
        for i, group in enumerate(optimizer.param_groups)
        if "d" in group
    }


def startup_warnings(config) -> list[str]:
    opt, sched = config.optimizer, config.scheduler
    warnings = []
    if opt.adaptive and sched.name in CYCLIC and (sched.cycles or 1) > 1:
        warnings.append(
            f"{opt.name} with {sched.name}: the step size it estimates (d) grows while the learning rate is low "
            "and is kept at each restart, so d*lr can blow up there. Watch d*lr in the progress lines, or lower "
            "optimizer.growth_rate / use a schedule without restarts"
        )
    if opt.adaptive and config.learning_rate != 1.0:
        warnings.append(
            f"{opt.name}: learning_rate is {config.learning_rate:g}; it multiplies the estimated step size, "
            "1.0 is usual" + (" (tune optimizer.d_coef instead)" if opt.name == "PRODIGY" else "")
        )
    return warnings
