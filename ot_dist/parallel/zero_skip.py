"""ZeRO-1/2/3 steps without a host sync: DeepSpeed's own decision to skip a step, taken on the device.

DeepSpeed 0.19's ZeRO optimizers decide on the host whether a step is applied: they read whether the global
gradient norm is valid (`is_invalid_grad_norm`: `bool(...)` of a device tensor) in `step` (stage_1_and_2.py:3043,
stage3.py:2888) and again before clipping (stage_1_and_2.py:3203, when gradient_clipping > 0), and under bf16
ZeRO-1/2 read an all-reduced overflow flag (`has_overflow`, stage_1_and_2.py:3248, `.item()`). No configuration
removes the first two (only `zero_optimization.compute_grad_norm: false`, ZeRO-1/2 without clipping, which also
drops the norm ot_dist logs). Where the lagged step guard hands the optimizer a `found_inf` (the all-ranks
non-finite-loss flag, ot_dist/train/device_skip.py), DeepSpeed's ZeRO optimizer steps that same optimizer object
(ours: torch's fused Adam / AdamW / SGD, ot_dist's Prodigy), which then skips on the device. So for the engine's
step those host reads become device work: an invalid norm is OR-ed into `found_inf` and the check answers
"valid"; DeepSpeed goes on to clip (with a NaN norm the gradients turn NaN) and calls the optimizer, which changes
no master weight, moment or step count. DeepSpeed's copy of the unchanged fp32 master partition back into the
model's (bf16) weights then gives the same weights: they were made from that master copy at the last step.
The norm is the all-reduced global one, so every rank skips alike, and it sees every non-finite gradient
element the bf16 overflow check sees (a NaN or inf element makes the L2 norm NaN or inf): that check is left out.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

# the ZeRO modules whose `step` reads `is_invalid_grad_norm` (imported by name into each, so replaced there)
NORM_CHECKING_MODULES = ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3")


def zero_device_skip_unavailable(config) -> str | None:
    """Why a ZeRO run of `config` cannot skip a non-finite step on the device (None: it can, given an optimizer
    that skips on `found_inf`)."""
    if config.train_dtype == "float16":
        return "train_dtype float16: DeepSpeed's loss scaler decides the step on its own overflow check"
    if config.deepspeed.offload_optimizer:
        return "deepspeed.offload_optimizer: DeepSpeed sums the gradient norm on the host (.item() per parameter)"
    if config.deepspeed.offload_params:
        return "deepspeed.offload_params: ZeRO-3's parameter offload step is not checked for host syncs"
    return None


@contextlib.contextmanager
def norm_checks_on_device(zero_optimizer, optimizer: torch.optim.Optimizer):
    """During one engine step: when `optimizer.found_inf` is set (the lagged step guard), DeepSpeed's host checks
    of the gradient norm and of overflow become device work folded into it. Otherwise DeepSpeed's own checks."""
    if getattr(optimizer, "found_inf", None) is None:
        yield
        return

    def invalid_norm_to_found_inf(norm) -> bool:
        found_inf = optimizer.found_inf
        norm = torch.as_tensor(norm, device=found_inf.device)  # a Python float stays a host value: no sync
        invalid = (~torch.isfinite(norm) | (norm < 0)).any()  # DeepSpeed marks an invalid group norm -1
        optimizer.found_inf = torch.maximum(found_inf, invalid.to(found_inf.dtype))  # the guard's flag is kept
        return False

    modules = [importlib.import_module(name) for name in NORM_CHECKING_MODULES]
    originals = [module.is_invalid_grad_norm for module in modules]
    checks_overflow = getattr(zero_optimizer, "check_grad_overflow", False)
    try:
        for module in modules:
            module.is_invalid_grad_norm = invalid_norm_to_found_inf
        if checks_overflow:
            # bf16 ZeRO-1/2: the norm check above covers it (and runs only while check_grad_overflow is on)
            zero_optimizer.check_overflow = lambda partition_gradients=True: None
        yield
    finally:
        for module, original in zip(modules, originals):
            module.is_invalid_grad_norm = original
        if checks_overflow:
            del zero_optimizer.check_overflow  # the class's method again
