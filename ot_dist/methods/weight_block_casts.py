"""A full finetune's Linear and Conv2d weights cast to the compute dtype a block at a time (the mechanism:
block_casts.py). Under autocast each of these layers would cast its float32 weight and bias down in every forward
(and recomputation) and their gradients back: on an SDXL UNet ~1,200 layers, ~3,700 casts per step with gradient
checkpointing, over a third of the ops the step launches. Normalisation layers are left out: autocast runs them in
float32, their weights are never cast.

Each such layer inside a block computes with its block's copies while they exist (`F.linear` / the convolution with
the copied weight and bias, exactly what autocast would have computed on its own casts), else with its class's own
forward."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ot_dist.methods.block_casts import cast_per_block, copies_for

CAST_LAYERS = (torch.nn.Linear, torch.nn.Conv2d)  # exact classes: a subclass may compute something else


def cast_weights_per_block(root: torch.nn.Module, blocks: list[torch.nn.Module]) -> int:
    """Hook each of `blocks` holding two or more trainable Linear / Conv2d layers. Returns how many blocks."""
    layers = [m for block in blocks for m in block.modules()
              if type(m) in CAST_LAYERS and all(p.requires_grad for p in m.parameters(recurse=False))]
    hooked = cast_per_block(root, blocks, layers, layer_weights, lambda layer: (layer,))
    for layer in layers:
        if "_block_casts" in layer.__dict__:
            layer.forward = types.MethodType(_forward_on_copies, layer)
    return hooked


def layer_weights(layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return (layer.weight,) if layer.bias is None else (layer.weight, layer.bias)


def _forward_on_copies(layer, x: torch.Tensor) -> torch.Tensor:
    copies = copies_for(layer)
    if copies is None:
        return type(layer).forward(layer, x)
    weight, bias = copies if len(copies) == 2 else (copies[0], None)
    if type(layer) is torch.nn.Linear:
        return F.linear(x, weight, bias)
    return layer._conv_forward(x, weight, bias)
