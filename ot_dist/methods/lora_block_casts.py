"""A block's LoRA adapters cast to the compute dtype together (the mechanism: block_casts.py). Adapters train in
float32, so under autocast each adapted layer would cast its two adapter weights down in forward and their two
gradients back in backward: four copies per layer, two per block instead. The layers are the plain LoRA Linear layers
with the fused forward (lora_forward.py), which computes with the copies. Layers of a block that take the same input
(q / k / v) also share their down projection: its weights concatenated in the cast, one matmul (shared_inputs.py)."""

from __future__ import annotations

import torch

from ot_dist.methods.block_casts import block_casts_in, cast_per_block
from ot_dist.methods.shared_inputs import SharedInputs


def cast_adapters_per_block(root: torch.nn.Module, blocks: list[torch.nn.Module], layers: list[torch.nn.Module],
                            adapter: str) -> int:
    """Hook each of `blocks` holding two or more of `layers` (plain peft LoRA Linear layers with the fused forward).
    Returns how many blocks cast together."""

    def adapter_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight

    def adapter_modules(layer):  # ZeRO-3 gathers a partitioned weight in its own module's hooks
        return layer.lora_A[adapter], layer.lora_B[adapter]

    return cast_per_block(root, blocks, layers, adapter_weights, adapter_modules)


def share_down_projections(root: torch.nn.Module) -> int:
    """Let the adapted layers of each block of `root` that take the same input (q / k / v) compute their down
    projections as one matmul (shared_inputs.py). Returns how many blocks may share."""
    found = block_casts_in(root)
    for casts in found:
        casts.sharing = SharedInputs()
    return len(found)
