"""What the denoiser's forward receives, for the tests that compare strategies' inputs.

The hook is registered without `prepend`, so it runs after every pre-forward hook a strategy put on the module
(FSDP2 prepends its own, which casts inputs when its MixedPrecisionPolicy says so): it sees what the module's own
forward sees."""

from __future__ import annotations

import json

import torch


def floating_inputs(args: tuple, kwargs: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The floating-point tensors among a call's inputs, by position ("0", "1", ...) or keyword, nested dicts as
    "outer.inner"."""
    named = {f"{prefix}{i}": a for i, a in enumerate(args)}
    named |= {f"{prefix}{k}": v for k, v in kwargs.items()}
    found = {}
    for name, value in named.items():
        if isinstance(value, dict):
            found |= floating_inputs((), value, prefix=f"{name}.")
        elif torch.is_tensor(value) and value.is_floating_point():
            found[name] = value
    return found


def autocast_state(device_type: str) -> str:
    """The autocast dtype in force ("torch.bfloat16"), or "off"."""
    return str(torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else "off"


def record_denoiser_inputs(trainer, path: str) -> None:
    """Write {input name: dtype} of the denoiser's first call in `trainer` to `path` (JSON), and under "(autocast)"
    the autocast the call ran under: inputs in float32 with autocast off would be a float32 forward."""
    def record(module, args, kwargs):
        handle.remove()
        inputs = floating_inputs(args, kwargs)
        device_type = next(iter(inputs.values())).device.type
        with open(path, "w") as f:
            json.dump({k: str(v.dtype) for k, v in inputs.items()} | {"(autocast)": autocast_state(device_type)}, f)

    handle = trainer.model.denoiser.register_forward_pre_hook(record, with_kwargs=True)
