"""An overflow injected into one optimizer step, for the float16 loss-scaling tests.

The loss of the chosen step is multiplied by 1e30 on the last rank only (the one process: always). Under
float16 autocast its backward overflows to inf gradients, as a real loss spike does; the loss scaler must
then skip that step on every rank and halve its scale. A rank that stepped anyway would leave its replica or
its shards one update away from the others, and from the one-process run, which skips the step too."""

from __future__ import annotations

import os

FACTOR = 1e30


def world_and_last_rank() -> tuple[int, bool]:
    """The number of processes, and whether this one is the last (the one process: always)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("RANK", "0")) == world - 1


def inject(trainer, overflow_at: int | None = None, inf_gradient_element_at: int | None = None) -> None:
    """Apply the injections asked for (each a 1-based optimizer step, or None)."""
    if overflow_at:
        inject_overflow(trainer, overflow_at)
    if inf_gradient_element_at:
        poison_gradient_element(trainer, inf_gradient_element_at)


def inject_overflow(trainer, at_step: int) -> None:
    """Make optimizer step `at_step` (1-based) overflow on the last rank."""
    _, on_this_rank = world_and_last_rank()
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

    world, last_rank = world_and_last_rank()
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
