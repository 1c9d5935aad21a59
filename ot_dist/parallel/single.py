"""One process, no process group: the single-GPU path (and the reference the others must match)."""

from __future__ import annotations

import torch

from ot_dist.parallel.base import Strategy


class SingleStrategy(Strategy):
    name = "single"

    def held_tensors(self):
        return held_plain(self)


def held_plain(strategy: Strategy):
    params = [p for m in strategy.trained_modules.values() for p in m.parameters()]
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer_state": [
            v for state in strategy.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        ],
    }
