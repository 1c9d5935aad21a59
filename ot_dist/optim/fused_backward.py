"""The fused back pass: each parameter is updated inside backward as soon as its gradient is complete,
and the gradient is freed right away, so the gradients of the whole model never exist at once.

Only for optimizers whose update of a parameter depends on that parameter alone (the registry says
which). The config refuses it with gradient accumulation (the gradient is not complete after one
backward), gradient-norm clipping (a global norm needs every gradient), float16 loss scaling (an
overflow must be seen before any update) and data-parallel strategies (gradients are reduced after
backward). `optimizer.step()` becomes a no-op: the step already happened.
"""

from __future__ import annotations

import types

import torch


def install_fused_back_pass(optimizer: torch.optim.Optimizer) -> None:
    step = type(optimizer).step  # the class's step, with the optimizer's pre/post hooks

    # Each parameter's own step, also for a caller that hands it a gradient itself: a streamed block's weight gets
    # its gradient on a device copy, never on the parameter (memory/trained_streaming.py).
    optimizer.fused_steppers = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.fused_steppers[id(p)] = _stepper(optimizer, group, step)
            p.register_post_accumulate_grad_hook(optimizer.fused_steppers[id(p)])

    def already_stepped(self, closure=None):
        return None

    # A bound method (not a lambda): LR schedulers wrap `optimizer.step` and need its __func__.
    optimizer.step = types.MethodType(already_stepped, optimizer)
    optimizer.fused_back_pass = True


def _stepper(optimizer, group, step):
    def hook(p: torch.Tensor) -> None:
        params = group["params"]
        group["params"] = [p]  # step this parameter alone, with its group's current learning rate
        try:
            step(optimizer)
        finally:
            group["params"] = params
        p.grad = None

    return hook
