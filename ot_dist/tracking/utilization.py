"""Model FLOPs utilisation per log window (issue 21): the FLOPs of the micro steps a window ran, over its seconds
and the device's peak FLOP/s (`ot_dist.bench.flops.PEAK_FLOPS`, by device name).

The FLOPs of a micro step are counted with torch's FlopCounterMode, without its per-module hooks (as `ot-dist bench`
counts them: `TotalFlopCounter`), on the first micro step of each batch shape (aspect buckets differ), during that real
step (with compiled blocks run eagerly: see `uncompiled`): no extra pass, no host sync. Later micro steps of a shape
add the cached count. With gradient checkpointing the backward re-runs forwards, which the counter sees: the value is
then hardware FLOPs utilisation and is logged as `hfu`, not `mfu`. On a device with no
known peak (CPUs, GPUs missing from the table) nothing is counted and the log says so once."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from ot_dist.bench.flops import TotalFlopCounter, peak_flops


def batch_shape(batch: dict) -> tuple:
    """What the FLOPs of a micro batch depend on: the shapes of its tensors (host metadata, no sync)."""
    return tuple(sorted((k, tuple(v.shape)) for k, v in batch.items() if isinstance(v, torch.Tensor)))


class UtilizationMeter:
    def __init__(self, device: torch.device, train_dtype: str, recomputes: bool, log=print,
                 peak: Callable[[torch.device, str], float | None] = peak_flops, root: torch.nn.Module | None = None):
        """`root`: the module whose compiled blocks (performance.compile) run eagerly while a step is counted."""
        self.peak = peak(device, train_dtype)
        self.root = root
        self.name = "hfu" if recomputes else "mfu"
        self.flops_of: dict[tuple, int] = {}
        self.window_flops = 0
        if self.peak is None:
            log(f"{self.name}: no peak FLOP/s known for this device ({device_label(device)}): "
                f"{self.name} is not logged (known: {', '.join(known_devices())})")

    @property
    def enabled(self) -> bool:
        return self.peak is not None

    def micro_step(self, batch: dict, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one micro step (forward + backward) and add its FLOPs to the window."""
        if not self.enabled:
            return run()
        key = batch_shape(batch)
        if key in self.flops_of:
            loss = run()
        else:
            counter = TotalFlopCounter()  # no per-module hooks on the model that trains
            with uncompiled(self.root), counter:
                loss = run()
            self.flops_of[key] = counter.get_total_flops()
        self.window_flops += self.flops_of[key]
        return loss

    def take(self, seconds: float) -> dict[str, float]:
        """The window's utilisation and achieved TFLOP/s (this rank's work on this rank's device); starts afresh."""
        flops, self.window_flops = self.window_flops, 0
        if not self.enabled or seconds <= 0 or flops == 0:
            return {}
        achieved = flops / seconds
        return {self.name: achieved / self.peak, "tflops_per_s": achieved / 1e12}


@contextmanager
def uncompiled(root: torch.nn.Module | None):
    """`root`'s compiled sub-modules call their plain forward meanwhile. A compiled frame that dynamo meets under a
    dispatch mode (the FLOP counter), or while disabled, is skipped for good, and compiled blocks share their code
    (nn.Module._call_impl, their class's forward): no block would ever be compiled after the count. A block
    compiled whole has its call compiled (`_compiled_call_impl`), a streamed one its forward (train/fast_path.py
    `compile_forward`)."""
    from ot_dist.train.fast_path import EAGER_FORWARD

    modules = [] if root is None else list(root.modules())
    calls = [(m, m._compiled_call_impl) for m in modules if getattr(m, "_compiled_call_impl", None) is not None]
    forwards = [(m, m.forward) for m in modules if EAGER_FORWARD in m.__dict__]
    for module, _ in calls:
        module._compiled_call_impl = None
    for module, _ in forwards:
        module.forward = getattr(module, EAGER_FORWARD)
    try:
        yield
    finally:
        for module, impl in calls:
            module._compiled_call_impl = impl
        for module, forward in forwards:
            module.forward = forward


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def known_devices() -> list[str]:
    from ot_dist.bench.flops import PEAK_FLOPS

    return list(PEAK_FLOPS)
