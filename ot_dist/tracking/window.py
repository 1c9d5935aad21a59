"""Per-step values gathered between two log points, copied to the host in one go.

Losses and gradient norms stay tensors while steps run (reading one would wait for the device);
every `log_every_steps` steps the trainer pulls the window: one average over ranks for the losses
(a collective every rank joins) and one host copy for losses and norms together."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ot_dist.optim.adaptive import d_times_lr


def applied_learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float | torch.Tensor]:
    """`lr/<group>` (and `d_lr/<group>` for optimizers that estimate d) as the next optimizer step
    will apply them: read before the step, since the scheduler moves them right after it. A d kept on the
    device (Prodigy's) gives a 0-dim tensor, copied to the host with the window."""
    rates = {f"lr/{g.get('name', i)}": float(g["lr"]) for i, g in enumerate(optimizer.param_groups)}
    rates.update({f"d_lr/{name}": value for name, value in d_times_lr(optimizer).items()})
    return rates


@dataclass
class StepRecord:
    step: int
    epoch: int
    loss: torch.Tensor  # this rank's mean over the accumulation
    grad_norm: torch.Tensor | None  # global norm before clipping, same on every rank
    rates: dict[str, float | torch.Tensor]  # tensors (a device-side d x lr) are read when the window is pulled
    wall_time: float = field(default_factory=time.time)


@dataclass
class PulledStep:
    step: int
    epoch: int
    wall_time: float
    metrics: dict[str, float]


class StepWindow:
    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.started = time.perf_counter()

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def __len__(self) -> int:
        return len(self.records)

    @contextmanager
    def paused(self):
        """Time that is not training (samples, validation, checkpoints, snapshot exports) is left out of the
        window's seconds: samples_per_s and mfu measure training, whatever else a window happened to hold."""
        paused_at = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - paused_at

    def pull(self, mean_over_ranks) -> tuple[list[PulledStep], float]:
        """The window's steps with host values, and its duration in seconds; then it starts afresh.
        `mean_over_ranks` is a collective: every rank calls pull at the same step."""
        records, self.records = self.records, []
        duration, self.started = time.perf_counter() - self.started, time.perf_counter()
        if not records:
            return [], duration
        losses = mean_over_ranks(torch.stack([r.loss.float() for r in records]))
        with_norm = [r for r in records if r.grad_norm is not None]
        norms = [r.grad_norm.detach().float().reshape(()).to(losses.device) for r in with_norm]
        on_device = [(r, key, v) for r in records for key, v in r.rates.items() if isinstance(v, torch.Tensor)]
        rates = [v.detach().double().reshape(()).to(losses.device) for _, _, v in on_device]  # d in float64
        parts = [losses, *([torch.stack(norms)] if norms else []), *([torch.stack(rates)] if rates else [])]
        values = torch.cat([p.double() for p in parts]) if rates else torch.cat(parts)
        host = values.tolist()  # the one host copy of the window
        norm_of = {id(r): host[len(records) + i] for i, r in enumerate(with_norm)}
        rate_of = {(id(r), key): host[len(records) + len(norms) + i] for i, (r, key, _) in enumerate(on_device)}
        pulled = []
        for record, loss in zip(records, host):
            rates_read = {key: rate_of.get((id(record), key), v) for key, v in record.rates.items()}
            metrics = {"loss": loss, "epoch": float(record.epoch + 1), **rates_read}  # 1-based, as shown on screen
            if id(record) in norm_of:
                metrics["grad_norm"] = norm_of[id(record)]
            pulled.append(PulledStep(record.step, record.epoch, record.wall_time, metrics))
        return pulled, duration


def window_mean_loss(steps: list[PulledStep]) -> float:
    losses = [s.metrics["loss"] for s in steps]
    return sum(losses) / len(losses) if losses else math.nan
