"""FLOPs of a training step, counted once with torch's FlopCounterMode (matmuls, convolutions, attention), and the
peak FLOP/s MFU divides by.

The count is of the model's work: forward + backward without activation recomputation (gradient checkpointing
re-runs the forward, which is work the hardware does but not progress; MFU, not HFU). It runs on meta-device builds
of the same denoiser and method, so it costs no memory and no time on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from ot_dist.errors import UserError


class FlopCountError(UserError):
    """A FLOP count that cannot be right for the step it claims to describe."""


@dataclass(frozen=True)
class StepFlops:
    forward: int  # one forward pass of the batch
    train: int  # forward + backward of the batch (what one optimizer step computes, the update aside)


class TotalFlopCounter(FlopCounterMode):
    """FlopCounterMode without its per-module breakdown, which the bench does not read: its ModuleTracker hooks every
    module call and adds each op's FLOPs to every enclosing module, a third of the counting time on the real-size
    models (the per-op counting and the total are FlopCounterMode's own)."""

    def __init__(self):
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()  # read by FlopCounterMode for the modules an op runs in


class _GlobalOnly(ModuleTracker):
    """A ModuleTracker that never hooks a module: its `parents` stay {"Global"}, so every op counts once, towards the
    total. A subclass, so whatever else a torch version reads of its tracker is there."""

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def count_step_flops(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None]) -> StepFlops:
    """`forward()` returns the loss; `backward(loss)` propagates it. Counted in one pass: the total when the loss is
    there is the forward's, the total after backward the train step's."""
    counter = TotalFlopCounter()
    with counter:
        loss = forward()
        forward_flops = counter.get_total_flops()
        backward(loss)
    return StepFlops(forward_flops, counter.get_total_flops())


# Backward costs about twice the forward when weights train (gradients of inputs and of weights), about once when
# only small adapters train (gradients of inputs only). Outside these bounds the count missed something.
TRAIN_TO_FORWARD = {"full": (2.6, 3.4), "lora": (1.8, 3.0)}


def check_step_flops(flops: StepFlops, method: str) -> None:
    """Refuse a count whose train / forward ratio cannot be the method's (e.g. backward not counted)."""
    if flops.forward <= 0:
        raise FlopCountError("bench: counted no forward FLOPs (the model ran outside the FLOP counter?)")
    low, high = TRAIN_TO_FORWARD[method]
    ratio = flops.train / flops.forward
    if not low <= ratio <= high:
        raise FlopCountError(
            f"bench: the counted train step is {ratio:.2f}x its forward pass; method {method} should give "
            f"{low}-{high}x (is the backward pass counted?)")


# Dense (no sparsity) peak FLOP/s per compute dtype, by a substring of torch.cuda.get_device_name(). float32 trains
# with TF32 matmuls (tf32: true, the default).
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
}


def peak_flops(device: torch.device, dtype: str, override_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s for `dtype`; `override_tflops` wins; None when unknown (CPUs)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks[dtype]
    return None
