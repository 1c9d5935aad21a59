"""The loss of the validation concepts (`type: validation`): never trained, measured at fixed noise.

Every sample is measured alone, with the noise, timestep, crop and caption line of a fixed key (the evaluation
epoch, -1, which no training epoch uses), at the largest training resolution, with the trained modules in eval
mode (no dropout) and without gradients: the same inputs at every validation point, so two values differ only
because the weights did.

Across ranks: sample k of the list is measured on rank k mod world size; every rank measures the same number of
samples (the last ones repeat sample 0 and are discarded), since a sharded or data-parallel model runs
collectives in every forward. The per-sample losses are summed over the ranks in a vector with one slot per
sample (every other rank adds an exact 0), so every rank holds the same values as one process would, and the mean
per concept is taken in sample order: the result does not depend on the world size.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from ot_dist.data.reader import collate
from ot_dist.train.evaluate import EVAL_EPOCH
from ot_dist.train.fast_path import eager_unless_training_step


class ValidationLoss:
    def __init__(self, config, table, runtime, log=print):
        self.settings, self.runtime, self.log = config.validation, runtime, log
        names = table.validation_names()
        self.concepts = {names[c]: indices for c, indices in table.validation_samples.items()}  # metric name -> samples
        self.samples = [i for indices in self.concepts.values() for i in indices]
        self.resolution = max(config.resolutions())
        self.done: set[int] = set()
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) of every validation point

    def __bool__(self) -> bool:
        return bool(self.samples)

    def due(self, step: int, steps_per_epoch: int, total_steps: int) -> bool:
        """Before the first step (step 0), at the interval, after the last step."""
        if not self.samples or step in self.done:
            return False
        if step in (0, total_steps):
            return True
        if self.settings.every_n_steps:
            return step % self.settings.every_n_steps == 0
        every = self.settings.every_n_epochs
        return bool(every) and step % steps_per_epoch == 0 and (step // steps_per_epoch) % every == 0

    def maybe_run(self, trainer, step: int) -> None:
        if self.due(step, trainer.steps_per_epoch, trainer.total_steps):
            self.run(trainer, step)

    @torch.no_grad()
    def run(self, trainer, step: int) -> dict[str, float]:
        """Every rank calls this at the same step. Logs validation/loss/<concept> at `step`; returns the values."""
        self.done.add(step)
        rank, world = self.runtime.rank, self.runtime.world_size
        losses = torch.zeros(len(self.samples), dtype=torch.float64)
        with (eval_mode(trainer.model.modules()), trainer.averaged_weights(),
              eager_unless_training_step(trainer.model, trainer.config.performance)):
            for slot in range(math.ceil(len(self.samples) / world)):
                k = slot * world + rank
                sample = self.samples[k if k < len(self.samples) else 0]
                batch = trainer.tokenize(collate([trainer.dataset.load(sample, EVAL_EPOCH, self.resolution)]))
                batch.pop("prior_prediction", None)  # a validation concept is none: no forward without the LoRA
                with trainer.strategy.autocast():
                    loss = trainer.loss(batch, EVAL_EPOCH)
                if k < len(self.samples):
                    losses[k] = float(loss)
        if self.runtime.distributed:
            reduced = losses.to(self.runtime.device)
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
            losses = reduced.cpu()
        metrics, start = {}, 0
        for name, indices in self.concepts.items():
            metrics[f"validation/loss/{name}"] = float(losses[start:start + len(indices)].mean())
            start += len(indices)
        self.history.append((step, metrics))
        trainer.tracker.log_metrics(metrics, step)
        self.log(f"validation at step {step}: " + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()))
        return metrics


@contextlib.contextmanager
def eval_mode(modules):
    """Modules in eval mode (no dropout) for the block, each back in its own mode afterwards."""
    modules = list(modules)
    before = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for m, training in before:
            m.training = training

