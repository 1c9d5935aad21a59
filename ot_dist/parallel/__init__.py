"""Parallel strategies behind one interface (see base.py)."""

from __future__ import annotations

from ot_dist.parallel.base import Strategy
from ot_dist.parallel.runtime import Runtime


def build_strategy(config, runtime: Runtime) -> Strategy:
    name = config.strategy
    if name == "single":
        from ot_dist.parallel.single import SingleStrategy

        return SingleStrategy(config, runtime)
    if name == "ddp":
        from ot_dist.parallel.ddp import DDPStrategy

        return DDPStrategy(config, runtime)
    if name == "fsdp":
        from ot_dist.parallel.fsdp import FSDPStrategy

        return FSDPStrategy(config, runtime)
    from ot_dist.parallel.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(config, runtime, stage=int(name[-1]))
