"""The fused back pass: each parameter is updated inside backward as soon as its gradient is complete,
and the gradient is freed right away, so the gradients of the whole model never exist at once.

Only for optimizers whose update of a parameter depends on that parameter alone (the registry says
which). Gradient-norm clipping is per tensor (`clip_to`: a global norm needs every gradient), as OneTrainer's
and kohya's fused steps clip; the config refuses float16 loss scaling (an overflow must be seen before any
update). With gradient accumulation the micro steps before the last accumulate as usual (`holding`) and the
last one's backward steps. Under ddp each gradient is averaged over the ranks first, also inside backward
(parallel/fused_reduce.py). `optimizer.step()` becomes a no-op: the step already happened.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch


class FusedSteps:
    """What happens to a parameter's gradient once backward has completed it.

    `ready(param, gradient)` is called by the parameter's post-accumulate hook, or by whoever collected the gradient
    elsewhere (a streamed block's weight gets it on a device copy, never on the parameter:
    memory/trained_streaming.py). It hands the gradient to `route`: by default the parameter's `appliers` entry at
    once; under ddp the averaging over ranks, which calls the same entry when the average is there. An applier
    steps its parameter with the gradient; `steppers` holds each parameter's own step of what its `.grad` holds."""

    def __init__(self):
        self.steppers: dict[int, Callable[[torch.Tensor], None]] = {}  # id(param) -> steps param with its .grad
        self.appliers: dict[int, Callable[[torch.Tensor], None]] = {}  # id(param) -> steps it with a gradient
        self.route: Callable[[torch.Tensor, torch.Tensor], None] = self.apply
        self.clip_to: float | None = None  # each gradient's own norm is clipped to this before its step
        self.holding = False  # a micro step before an accumulation's last: gradients accumulate, nothing steps

    def accumulated(self, param: torch.Tensor) -> None:
        """The post-accumulate hook. It also runs for a streamed weight's CPU parameter, which gets no gradient (its
        step already took the device copy's): nothing to do then."""
        if param.grad is not None and not self.holding:
            self.ready(param, param.grad)

    def ready(self, param: torch.Tensor, gradient: torch.Tensor) -> None:
        self.route(param, gradient)

    def apply(self, param: torch.Tensor, gradient: torch.Tensor) -> None:
        if self.clip_to is not None:  # torch's clipping rule (clip_grad_norm_), on this gradient alone, no host read
            norm = torch.linalg.vector_norm(gradient, dtype=torch.float32)
            gradient.mul_(torch.clamp(self.clip_to / (norm + 1e-6), max=1.0).to(gradient.dtype))
        self.appliers[id(param)](gradient)


def install_fused_back_pass(optimizer: torch.optim.Optimizer) -> None:
    step = type(optimizer).step  # the class's step, with the optimizer's pre/post hooks
    fused = FusedSteps()
    hook = _weakly(fused)
    for group in optimizer.param_groups:
        for p in group["params"]:
            fused.steppers[id(p)] = _stepper(optimizer, group, step)
            fused.appliers[id(p)] = _applier(p, fused.steppers[id(p)])
            p.register_post_accumulate_grad_hook(hook)

    def already_stepped(self, closure=None):
        return None

    # A bound method (not a lambda): LR schedulers wrap `optimizer.step` and need its __func__.
    optimizer.step = types.MethodType(already_stepped, optimizer)
    optimizer.fused_steps = fused


def _weakly(fused: FusedSteps) -> Callable[[torch.Tensor], None]:
    """The parameters' hook, holding `fused` weakly (the optimizer holds it: `optimizer.fused_steps`). torch keeps a
    tensor's hooks where the garbage collector cannot see them, and `fused`'s closures hold the optimizer, its groups
    and the parameters: a hook holding it kept a finished run's weights and optimizer state alive for the rest of
    the process, on the GPU too (the bench's runs one after another, a test comparing two runs)."""
    ref = weakref.ref(fused)

    def accumulated(param: torch.Tensor) -> None:
        if (steps := ref()) is not None:
            steps.accumulated(param)

    return accumulated


def _stepper(optimizer, group, step):
    def stepper(p: torch.Tensor) -> None:
        # Step this parameter alone, with its group's current learning rate: the other groups' parameters may hold
        # gradients too (under ddp, ones still being averaged), which are not theirs to apply yet.
        held = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = [p] if g is group else []
        try:
            step(optimizer)
        finally:
            for g, params in zip(optimizer.param_groups, held):
                g["params"] = params
        p.grad = None

    return stepper


def _applier(p: torch.Tensor, stepper):
    def applier(gradient: torch.Tensor) -> None:
        p.grad = gradient  # the parameter's own accumulated gradient, or its average over the ranks (the same tensor)
        stepper(p)

    return applier
