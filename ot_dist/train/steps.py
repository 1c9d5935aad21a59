"""How many optimizer steps a run makes: one function, used by the trainer and by `ot-dist schedule`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ot_dist.errors import InputFileError


@dataclass(frozen=True)
class StepPlan:
    dataset_size: int  # samples drawn per epoch (after balancing)
    global_batch: int  # batch_size x gradient_accumulation_steps x world size
    steps_per_epoch: int  # optimizer steps; per bucket, the incomplete last global batch is dropped
    total_steps: int  # epochs x steps_per_epoch, capped by max_steps


def plan_steps(config, bucket_sizes: int | Sequence[int], world_size: int = 1) -> StepPlan:
    """`bucket_sizes`: samples per epoch of each aspect bucket (a single int: one bucket). Every global
    batch is of one bucket, as the data reader plans them (data.small_buckets: with move, the buckets' remainders
    are pooled, so an epoch has floor(samples / global batch) steps)."""
    sizes = [bucket_sizes] if isinstance(bucket_sizes, int) else list(bucket_sizes)
    global_batch = config.batch_size * config.gradient_accumulation_steps * world_size
    if config.data.small_buckets == "move":  # the buckets' remainders train together (data/small_buckets.py)
        steps_per_epoch = sum(sizes) // global_batch
    else:
        steps_per_epoch = sum(size // global_batch for size in sizes)
    if steps_per_epoch == 0:
        raise InputFileError(
            f"data: {sum(sizes)} images in {len(sizes)} aspect bucket(s) (largest {max(sizes, default=0)}) make no "
            f"optimizer step with a global batch of {global_batch} (batch_size {config.batch_size} x "
            f"gradient_accumulation_steps {config.gradient_accumulation_steps} x {world_size} processes)"
        )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    return StepPlan(sum(sizes), global_batch, steps_per_epoch, total_steps)
