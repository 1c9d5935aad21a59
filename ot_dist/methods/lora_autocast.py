"""peft's LoRA layers copy their input to the adapter's dtype (float32 here: adapters train in float32) before the
down projection. Under autocast that copy is undone at once, because the down projection is an autocast op that casts
its input back to the compute dtype: on a GPU, a float32 copy of every adapted layer's input, written and read again,
forward and backward, for nothing (issue 21). Skipping the copy while autocast is on computes the same bits; without
autocast (float32 training, or sampling in the weights' own dtype) peft's cast stays."""

from __future__ import annotations

import types

import torch


def skip_input_copies_under_autocast(module: torch.nn.Module, adapter: str) -> int:
    """On every plain peft LoRA layer of `module` (no DoRA or other variant, no input dropout: their ops on the float32
    copy are not autocast ops), replace peft's input cast with one that is skipped while autocast is on for the
    input's device. Returns how many layers."""
    from peft.tuners.lora.layer import LoraLayer

    count = 0
    for layer in module.modules():
        if not (isinstance(layer, LoraLayer) and adapter in layer.lora_A):
            continue
        if adapter in getattr(layer, "lora_variant", {}):
            continue
        if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity):
            continue
        layer._cast_input_dtype = types.MethodType(_cast_unless_autocast, layer)
        count += 1
    return count


def _cast_unless_autocast(layer, x, dtype: torch.dtype):
    if x is None or x.dtype == dtype or not getattr(layer, "cast_input_dtype_enabled", True):
        return x
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):  # meta: FLOP counting
        return x  # the down projection casts it to the autocast dtype itself
    return x.to(dtype=dtype)
