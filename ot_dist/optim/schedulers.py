"""Learning-rate schedules, counted in optimizer steps (not micro steps, not x world size), computed as
OneTrainer computes them (modules/util/lr_scheduler_util.py and create.create_lr_scheduler), so a
OneTrainer name gives OneTrainer's learning rate at every step.

A built-in schedule is a factor on each parameter group's base learning rate at optimizer step `step`
(0-based: the first optimizer step runs at factor(0)):

    step < warmup:  step / warmup                                 linear warmup (the first step runs at 0)
    otherwise:      min_factor + (1 - min_factor) * curve(s)      s = step - warmup, S = total - warmup

    CONSTANT                   curve = 1 (min_factor does not apply)
    LINEAR                     max(0, (S - s) / S)
    COSINE                     (1 + cos(pi p)) / 2,                       p = s / S
    COSINE_WITH_RESTARTS       (1 + cos(2 pi n p)) / 2,                   p = min(s, S - 1) / S: n smooth cycles,
                               lows at p = (k + 1/2) / n, S / n steps apart, ending near the top
    COSINE_WITH_HARD_RESTARTS  (1 + cos(pi ((n p) mod 1))) / 2:           n decays, each jumping back to 1
    REX                        (1 - p) / (0.1 + 0.9 (1 - p)), 0 from S on (https://arxiv.org/abs/2107.04197)
    REX_WITH_RESTARTS          REX of (n p) mod 1 (ot_dist's, OneTrainer has no REX with restarts)

`warmup_steps` > 1 is a count of micro steps (OneTrainer's unit): int(warmup_steps / gradient accumulation)
optimizer steps; <= 1 is a fraction of the total optimizer steps.

ADAFACTOR reports Adafactor's own relative step; CUSTOM runs a torch LRScheduler after the warmup.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

import torch

from ot_dist.config.optim import PLACEHOLDERS, SchedulerConfig
from ot_dist.train.steps import StepPlan


def curve(name: str, step: int, steps: int, cycles: float = 1.0) -> float:
    """The schedule's shape after warmup at `step` of `steps` (0-based), before min_factor. The expressions
    are OneTrainer's, in its order of operations, so that results agree to the last bit."""
    if name == "CONSTANT":
        return 1.0
    if name == "LINEAR":
        return max(0.0, float(steps - step) / float(steps))
    if name == "COSINE":
        return max(0.0, cosine(float(step) / float(steps)))
    if name == "REX":
        return rex(step / steps) if step < steps else 0.0
    # the cyclic ones stop at the last step: a step past the end repeats it
    progress = float(min(step, steps - 1)) / float(steps)
    if name == "COSINE_WITH_RESTARTS":
        return max(0.0, 0.5 * (1.0 + math.cos(progress * 2.0 * math.pi * cycles)))
    if name == "COSINE_WITH_HARD_RESTARTS":
        return max(0.0, cosine((progress * cycles) % 1.0))
    if name == "REX_WITH_RESTARTS":
        return rex((progress * cycles) % 1.0)
    raise ValueError(f"scheduler.name: {name} is not a factor schedule")


def cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(progress * math.pi))


def rex(progress: float) -> float:
    return (1 - progress) / ((1 - 0.9) + (0.9 * (1 - progress)))


def lr_factor(config: SchedulerConfig, step: int, total_steps: int, accumulation: int = 1) -> float:
    """The factor applied to every group's base learning rate at optimizer step `step` (0-based)."""
    warmup = config.resolved_warmup(total_steps, accumulation)
    if step < warmup:
        return float(step) / float(warmup)
    if config.name == "CONSTANT":
        return 1.0
    value = curve(config.name, step - warmup, max(1, total_steps - warmup), config.cycles or 1.0)
    low = config.min_factor or 0.0
    return low + (1.0 - low) * value


def cycle_lows(config: SchedulerConfig, total_steps: int, accumulation: int = 1) -> list[int]:
    """The optimizer steps (1-based: "after step N") whose learning rate is the lowest of its cycle, the last
    step included when it is one. A snapshot taken there is taken at the bottom of a cycle, never mid-descent.

    With 10000 steps and 20 cycles: COSINE_WITH_HARD_RESTARTS / REX_WITH_RESTARTS 500, 1000, ..., 10000;
    COSINE_WITH_RESTARTS 251, 751, ..., 9751 (OneTrainer's smooth cycles end near the top).
    """
    warmup = config.resolved_warmup(total_steps, accumulation)
    factors = [lr_factor(config, s, total_steps, accumulation) for s in range(total_steps)]
    lows = []
    for s in range(warmup, total_steps):
        before = factors[s - 1] if s > warmup else math.inf
        after = factors[s + 1] if s + 1 < total_steps else math.inf
        if factors[s] <= before and factors[s] < after:
            lows.append(s + 1)
    return lows


def adafactor_relative_step(step: int, warmup_init: bool) -> float:
    """Adafactor's relative step size at optimizer step `step` (1-based), before the parameter scale."""
    return min(1e-6 * step if warmup_init else 1e-2, 1.0 / math.sqrt(step))


class WarmupThen:
    """Linear warmup, then a torch LRScheduler that starts where the warmup ends (its step 0 is the first
    step after warmup), as OneTrainer composes them: a LambdaLR of step / warmup on each group's `initial_lr`, then the
    class (torch's SequentialLR with the milestone at the warmup). Built at step 0, after the class, so the warmup
    climbs to the `initial_lr` the class left (OneCycleLR sets its own), not to the class's first learning rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, inner):
        self.optimizer, self.warmup, self.inner = optimizer, warmup, inner
        self.start_lrs = [group["initial_lr"] for group in optimizer.param_groups]  # what the warmup climbs to
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        step, groups = self.last_epoch, self.optimizer.param_groups
        if step < self.warmup:
            for group, lr in zip(groups, self.start_lrs):
                group["lr"] = lr * float(step) / float(self.warmup)
        elif step == self.warmup:
            if self.warmup:  # without a warmup the class's construction made its step 0
                # SequentialLR starts the class at its milestone as step(0) does: the closed form at 0 where the
                # class has one, else its get_lr() from the learning rates the warmup left (CyclicLR: base_lr)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # step(epoch) is deprecated; it is what SequentialLR does
                    self.inner.step(0)
        else:
            self.inner.step()

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "start_lrs": self.start_lrs, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch, self.start_lrs = state["last_epoch"], state["start_lrs"]
        self.inner.load_state_dict(state["inner"])


class AdafactorStepSize(torch.optim.lr_scheduler.LRScheduler):
    """Schedule ADAFACTOR: Adafactor (relative_step) computes its own step size and ignores the groups'
    learning rates; this reports, as each group's lr, the step size of its first parameter's last update
    (relative step x parameter RMS), so the progress line shows what is applied."""

    def get_lr(self) -> list[float]:
        opt = self.optimizer
        lrs = []
        for group in opt.param_groups:
            state = opt.state.get(group["params"][0], {})
            lrs.append(float(opt._get_lr(group, state)) if state.get("step") else group["lr"])
        return lrs


def placeholder_values(config, plan: StepPlan) -> dict[str, Any]:
    """CUSTOM's placeholders, as OneTrainer fills them (create.create_lr_scheduler): %STEPS_PER_EPOCH% is the length
    of its data loader, the batches one process draws in an epoch, before gradient accumulation, while the
    schedule is stepped once per optimizer step (so StepLR(step_size=%STEPS_PER_EPOCH%) with accumulation 4 steps
    every 4 epochs, in OneTrainer and here); %TOTAL_STEPS% and %SCHEDULER_STEPS% count optimizer steps."""
    accumulation = config.gradient_accumulation_steps
    warmup = config.scheduler.resolved_warmup(plan.total_steps, accumulation)
    values = {
        "%LR%": config.learning_rate,
        "%EPOCHS%": config.epochs,
        "%STEPS_PER_EPOCH%": plan.steps_per_epoch * accumulation,
        "%TOTAL_STEPS%": plan.total_steps,
        "%SCHEDULER_STEPS%": max(1, plan.total_steps - warmup),
    }
    assert set(values) == set(PLACEHOLDERS)
    return values


def substitute(value: Any, values: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return values.get(value, value)
    if isinstance(value, list):
        return [substitute(v, values) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, values) for k, v in value.items()}
    return value


def build_scheduler(config, optimizer: torch.optim.Optimizer, plan: StepPlan):
    """The scheduler the trainer steps once per optimizer step. `config` is the whole TrainConfig (CUSTOM
    placeholders need the learning rate and epochs)."""
    sched = config.scheduler
    if sched.name == "ADAFACTOR":
        return AdafactorStepSize(optimizer)
    if sched.name == "CUSTOM":
        module, _, name = sched.class_name.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        params = substitute(sched.params, placeholder_values(config, plan))
        warmup = sched.resolved_warmup(plan.total_steps, config.gradient_accumulation_steps)
        return WarmupThen(optimizer, warmup, cls(optimizer, **params))
    total, accumulation = plan.total_steps, config.gradient_accumulation_steps
    return FactorSchedule(optimizer, lambda step: lr_factor(sched, step, total, accumulation))


class FactorSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A built-in schedule. On resume the position comes from the checkpoint and the learning rates are
    recomputed from it with this run's schedule, so a run resumed with a larger max_steps continues on the
    new curve (not at the rate the old one had planned for its last step)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        for group, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base * factor(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
