"""What the per-family test files share: a trainer of one family on the test data, and a first batch of it.

A family's file binds its name once: `trainer_for = partial(family_trainer, FAMILY)`."""

from __future__ import annotations

import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


def family_trainer(family: str, model, data, out, method: str = "full", **overrides) -> Trainer:
    """A trainer of `family` on `data` (batch 2, learning rate 3e-4 unless `overrides` say otherwise)."""
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family=family, method=method, **settings)), log=quiet)


def first_batch(trainer: Trainer, size: int = 2) -> dict:
    """The first `size` samples of epoch 0, collated and tokenized as the training step receives them."""
    return trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(size)]))


def losses_around_training(trainer: Trainer) -> tuple[float, float]:
    """The first batch's loss with fixed draws (step 1, seed 0) before and after `trainer.train()`."""
    from ot_dist.train.loss import diffusion_loss

    batch = first_batch(trainer)
    with torch.no_grad():
        before = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss).item()
    trainer.train()
    with torch.no_grad():
        after = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss).item()
    return before, after
