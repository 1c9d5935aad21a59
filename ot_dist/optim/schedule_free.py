"""Schedule-free optimizers (SCHEDULE_FREE_ADAMW, SCHEDULE_FREE_SGD, PRODIGY_PLUS_SCHEDULE_FREE) take their
gradients at one point y and keep an average x, the weights that training produces: the parameters hold y
in train mode and x after `optimizer.eval()`. Everything that reads the weights for use (samples, exports,
checkpoints) does so inside `averaged_weights`, and training goes on at y afterwards. A checkpoint thus
holds x (so `ot-dist export CHECKPOINT` writes the average too), with the optimizer groups in eval mode;
`resume_training_mode` turns the loaded weights back into y."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer, schedule_free: bool):
    """The parameters hold the averaged weights inside the block (a no-op for other optimizers)."""
    if not schedule_free:
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


def resume_training_mode(optimizer: torch.optim.Optimizer, schedule_free: bool) -> None:
    """After loading a checkpoint saved inside `averaged_weights`: back to the training point y."""
    if schedule_free:
        optimizer.train()
