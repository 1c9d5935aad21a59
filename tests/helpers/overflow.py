"""An overflow injected into one optimizer step, for the float16 loss-scaling tests.

The loss of the chosen step is multiplied by 1e30 on the last rank only (the one process: always). Under
float16 autocast its backward overflows to inf gradients, as a real loss spike does; the loss scaler must
then skip that step on every rank and halve its scale. A rank that stepped anyway would leave its replica or
its shards one update away from the others, and from the one-process run, which skips the step too."""

from __future__ import annotations

import os

FACTOR = 1e30


def inject_overflow(trainer, at_step: int) -> None:
    """Make optimizer step `at_step` (1-based) overflow on the last rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_this_rank = int(os.environ.get("RANK", "0")) == world - 1
    accumulation = trainer.config.gradient_accumulation_steps
    original = trainer.strategy.backward
    calls = [0]

    def backward(loss, accumulation_steps, last_micro_step):
        step = calls[0] // accumulation + 1
        calls[0] += 1
        if on_this_rank and step == at_step:
            loss = loss * FACTOR
        return original(loss, accumulation_steps, last_micro_step)

    trainer.strategy.backward = backward


def poison_gradient_element(trainer, at_step: int) -> None:
    """Make optimizer step `at_step` (1-based) hold one inf gradient element, after the gradients are
    reduced, on the rank(s) that hold it: under FSDP only the rank owning that shard sees it (a float16
    overflow in one element of one reduce-scatter output), so only a scaler that agrees across ranks skips
    the step everywhere."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    last_rank = int(os.environ.get("RANK", "0")) == world - 1
    original = trainer.strategy.step
    calls = [0]

    def step(optimizer, params):
        calls[0] += 1
        if calls[0] == at_step:
            param = next(p for p in params if p.grad is not None and p.dim() >= 2 and p.shape[0] >= world)
            grad = param.grad
            if hasattr(grad, "to_local"):  # a DTensor sharded on dim 0: the last element is on the last rank
                if last_rank:
                    grad.to_local().view(-1)[-1] = torch.inf
            else:  # replicated (ddp) or whole (one process): every rank holds it
                grad.view(-1)[-1] = torch.inf
        return original(optimizer, params)

    trainer.strategy.step = step
