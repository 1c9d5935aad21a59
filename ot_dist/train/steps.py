"""How many optimizer steps a run makes: one function, used by the trainer and by `ot-dist schedule`."""

from __future__ import annotations

from dataclasses import dataclass

from ot_dist.errors import InputFileError


@dataclass(frozen=True)
class StepPlan:
    dataset_size: int
    global_batch: int  # batch_size x gradient_accumulation_steps x world size
    steps_per_epoch: int  # optimizer steps; the incomplete last global batch of an epoch is dropped
    total_steps: int  # epochs x steps_per_epoch, capped by max_steps


def plan_steps(config, dataset_size: int, world_size: int = 1) -> StepPlan:
    global_batch = config.batch_size * config.gradient_accumulation_steps * world_size
    steps_per_epoch = dataset_size // global_batch
    if steps_per_epoch == 0:
        raise InputFileError(
            f"data.path: {dataset_size} images make no optimizer step with a global batch of "
            f"{global_batch} (batch_size {config.batch_size} x gradient_accumulation_steps "
            f"{config.gradient_accumulation_steps} x {world_size} processes)"
        )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    return StepPlan(dataset_size, global_batch, steps_per_epoch, total_steps)
