"""peft's LoRA layers copy their input to the adapter's dtype (float32 here: adapters train in float32) before the
down projection. Under autocast that copy is undone at once, because the down projection is an autocast op that casts
its input back to the compute dtype: on a GPU, a float32 copy of every adapted layer's input, written and read again,
forward and backward, for nothing (issue 21). Skipping the copy while autocast is on computes the same bits; without
autocast (float32 training, or sampling in the weights' own dtype) peft's cast stays."""

from __future__ import annotations

import types

import torch


def plain_lora_layers(module: torch.nn.Module, adapter: str) -> list[torch.nn.Module]:
    """The peft LoRA layers of `module` that carry `adapter` plainly: no DoRA or other variant, no input dropout
    (their ops on the layer's input are not autocast ops)."""
    from peft.tuners.lora.layer import LoraLayer

    return [layer for layer in module.modules()
            if isinstance(layer, LoraLayer) and adapter in layer.lora_A
            and adapter not in getattr(layer, "lora_variant", {})
            and isinstance(layer.lora_dropout[adapter], torch.nn.Identity)]


def autocast_on(x: torch.Tensor) -> bool:
    """Whether autocast is on for `x`'s device (never for meta tensors, which the FLOP count runs on)."""
    return x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)


def skip_input_copies_under_autocast(module: torch.nn.Module, adapter: str) -> int:
    """On every plain LoRA layer of `module`, replace peft's input cast with one that is skipped while autocast is on
    for the input's device. Returns how many layers."""
    layers = plain_lora_layers(module, adapter)
    for layer in layers:
        layer._cast_input_dtype = types.MethodType(_cast_unless_autocast, layer)
    return len(layers)


def _cast_unless_autocast(layer, x, dtype: torch.dtype):
    if x is None or x.dtype == dtype or not getattr(layer, "cast_input_dtype_enabled", True):
        return x
    if autocast_on(x):
        return x  # the down projection casts it to the autocast dtype itself
    return x.to(dtype=dtype)
