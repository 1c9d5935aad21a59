"""A plain LoRA Linear layer's forward with the up projection fused into the layer's output.

peft computes `result + lora_B(lora_A(x)) * scaling`: after the up projection, a multiply and an add, each a pass
over the layer's full output (and the multiply again in backward). `torch.addmm(result, down * scaling, B^T)` does
the same sum in the matmul's epilogue, the scale applied to the rank-wide features (none when it is 1). On SDXL LoRA
at 1024 px (about 720 adapted layers) the full-size multiplies and adds were ~80 ms of a 0.54 s step's kernel time
(docs/performance.md, issue 21). The sum is the same up to rounding: the epilogue adds in float32 and rounds once.

Anything the fused form would not reproduce keeps peft's forward: adapters disabled or merged, another active
adapter, extra arguments, a variant, input dropout, a bias on the up projection, hooks on the up projection
(DeepSpeed ZeRO-3 gathers a module's partitioned weight in one); mixed dtypes outside autocast take peft's promoted
sum."""

from __future__ import annotations

import types

import torch

from ot_dist.methods.block_casts import copies_for, shared_projection_for
from ot_dist.methods.lora_autocast import autocast_on, plain_lora_layers


def fuse_up_projections(module: torch.nn.Module, adapter: str) -> list[torch.nn.Module]:
    """Give every plain peft LoRA Linear of `module` the fused forward. Returns those layers."""
    from peft.tuners.lora.layer import Linear

    layers = [layer for layer in plain_lora_layers(module, adapter)
              if type(layer) is Linear and layer.lora_B[adapter].bias is None and not layer.fan_in_fan_out]
    for layer in layers:
        layer.forward = types.MethodType(_fused_forward, layer)
        layer._fused_adapter = adapter
    return layers


def _fused_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapter = layer._fused_adapter
    up = layer.lora_B[adapter]
    if (args or kwargs or layer.disable_adapters or layer.merged or list(layer.active_adapters) != [adapter]
            or up._forward_pre_hooks or up._forward_hooks):
        return type(layer).forward(layer, x, *args, **kwargs)
    result = layer.base_layer(x)
    scaling = layer.scaling[adapter]
    # q / k / v: one down projection of their input (shared_inputs.py), also when a module inside the block
    # recomputes after the block's copies are gone
    shared = shared_projection_for(layer, x)
    copies = copies_for(layer)
    if copies is not None:  # its block cast the adapters together (lora_block_casts.py): no per-weight casts
        down_weight, up_weight = copies
        down = shared if shared is not None else torch.nn.functional.linear(x, down_weight)
        return _add_up_projection(result, down, up_weight, scaling)
    if shared is not None:
        return _add_up_projection(result, shared, up.weight, scaling)
    down_layer = layer.lora_A[adapter]
    down = down_layer(layer._cast_input_dtype(x, down_layer.weight.dtype))  # its hooks (rank dropout) run
    if not autocast_on(x) and not (result.dtype == down.dtype == up.weight.dtype):
        return (result + up(down) * scaling).to(result.dtype)  # peft's own sum: promoted, then cast back
    return _add_up_projection(result, down, up.weight, scaling)


def _add_up_projection(result: torch.Tensor, down: torch.Tensor, up_weight: torch.Tensor, scaling: float):
    if scaling != 1:  # on the rank-wide features: alpha=scaling would multiply both matmul gradients in backward
        down = down * scaling
    fused = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), up_weight.t())
    return fused.view(result.shape).to(result.dtype)
