"""Validation loss at fixed noise: the same samples, noise and timesteps every time it is computed,
so two values differ only because the weights did (noise-free progress measure)."""

from __future__ import annotations

import torch

from ot_dist.data.reader import collate

EVAL_EPOCH = -1  # a key no training epoch uses, so evaluation draws never coincide with training draws


@torch.no_grad()
def fixed_noise_loss(trainer, batch_size: int = 8) -> float:
    dataset, total, count = trainer.dataset, 0.0, 0
    for start in range(0, len(dataset), batch_size):
        samples = [dataset.load(i, EVAL_EPOCH) for i in range(start, min(start + batch_size, len(dataset)))]
        batch = trainer.tokenize(collate(samples))
        with trainer.precision.autocast():
            loss = trainer.loss(batch, EVAL_EPOCH)
        total += float(loss) * len(samples)
        count += len(samples)
    return total / count
