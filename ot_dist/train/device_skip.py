"""Which step guard a run uses (ot_dist/train/stopping.py), and handing the device-side skip flag to the optimizer.

The lagged guard needs an optimizer step that can skip its update on the device, given a 0-dim float tensor
(1.0 = skip): torch's fused Adam / AdamW / SGD take it as `found_inf` (GradScaler's protocol: the attribute
`optimizer.found_inf` during `step`; they leave parameters and moments as they are and take the step count
back), and ot_dist's Prodigy does the same (`skips_on_found_inf`); under ZeRO-1/2/3 DeepSpeed steps that same
optimizer object and its host checks of the gradient norm move onto the device (ot_dist/parallel/zero_skip.py),
except with float16 (DeepSpeed's loss scaler) or DeepSpeed's CPU offload. Everything else keeps the blocking guard,
which reads the flags on the host before the step (one host sync per step). What each path does:
docs/performance.md, "The step guard"."""

from __future__ import annotations

import contextlib

import torch

from ot_dist.errors import ConfigError
from ot_dist.parallel.zero_skip import zero_device_skip_unavailable


def device_skip_unavailable(config, strategy, optimizer: torch.optim.Optimizer) -> str | None:
    """Why this run cannot skip a non-finite step on the device (None: it can)."""
    if strategy.name.startswith("zero") and (reason := zero_device_skip_unavailable(config)):
        return f"strategy {strategy.name}, {reason}"
    if strategy.precision.scaler is not None:
        return "train_dtype float16: the loss scaler decides the step on its own overflow check"
    device = strategy.runtime.device
    if device.type != "cpu" and any(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"]):
        # the flag is on the GPU and the step on the CPU: torch's fused step copies the flag without waiting for the
        # copy (found_inf.to(cpu, non_blocking=True)), so the step could read it before it lands
        return ("the optimizer steps weights held in CPU memory (fsdp.cpu_offload, DeepSpeed's offload): the flag on "
                "the GPU cannot reach that step without a host sync")
    options = config.optimizer.options()
    if options.get("fused_back_pass"):
        return "optimizer.fused_back_pass: parameters are stepped during backward, before the loss is checked"
    if getattr(optimizer, "skips_on_found_inf", False):
        return None
    # every group's own setting: a checkpoint's group settings (loaded after construction) may say otherwise
    if getattr(optimizer, "_step_supports_amp_scaling", False) and all(g.get("fused") for g in optimizer.param_groups):
        return None
    if config.optimizer.name in ("ADAM", "ADAMW", "SGD"):
        return (f"optimizer {config.optimizer.name} runs its foreach kernels (torch's fused kernel is chosen on CUDA, "
                "or with optimizer.fused: true), which cannot skip an update on the device")
    return f"optimizer {config.optimizer.name} cannot skip an update on the device"


def choose_lagged(config, strategy, optimizer: torch.optim.Optimizer) -> tuple[bool, str]:
    """(lagged, the startup log line) for `checkpoint.step_guard`; `lagged` that cannot be honoured is an error."""
    mode = config.checkpoint.step_guard
    reason = device_skip_unavailable(config, strategy, optimizer)
    if mode == "blocking":
        return False, "step guard: blocking (checkpoint.step_guard: blocking): one host sync per optimizer step"
    if reason is not None:
        if mode == "lagged":
            raise ConfigError(f"checkpoint.step_guard: lagged needs an optimizer step that skips on the device; {reason}. "
                              "Use auto or blocking")
        return False, f"step guard: blocking, one host sync per optimizer step ({reason})"
    return True, ("step guard: lagged, no host sync per optimizer step (a non-finite step is skipped on the device; "
                  "a stop signal or time-based save acts one step later)")


@contextlib.contextmanager
def skipping_on_device(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None):
    """During the step, `optimizer.found_inf` is `found_inf` (where it is not None)."""
    if found_inf is None:
        yield
        return
    optimizer.found_inf = found_inf
    try:
        yield
    finally:
        del optimizer.found_inf
