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


def record_denoiser_inputs(trainer, path: str) -> None:
    """Write {input name: dtype} of the denoiser's first call in `trainer` to `path` (JSON)."""
    def record(module, args, kwargs):
        handle.remove()
        with open(path, "w") as f:
            json.dump({k: str(v.dtype) for k, v in floating_inputs(args, kwargs).items()}, f)

    handle = trainer.model.denoiser.register_forward_pre_hook(record, with_kwargs=True)
