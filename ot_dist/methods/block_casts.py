"""Cast the trained float32 weights of a block to the compute dtype in one op, not one per weight.

Trained weights are float32 masters. Under autocast every layer casts its weights to the compute dtype in each
forward (and again when its block recomputes), and backward casts their gradients back: a copy per weight each way.
For LoRA that is ~2,900 tiny copies per SDXL step, a fifth of the ops it launches; for a full finetune ~3,700, over a
third (issue 21, docs/performance.md). A copy is one launch, and SDXL's steps are paced by the host that launches them.
So the layers of one block are cast together: a forward pre-hook on each of the family's blocks (its shard units)
casts the block's weights in one multi-tensor copy into the copies its layers compute with, and backward casts their
gradients back in another. The values are the same bits (one rounding of the same weights); gradients still arrive
block by block, so ddp / ZeRO-1/2 reduce them overlapped with backward as before.

The copies exist only while their block's forward runs (a hook that always runs clears them): nothing can compute
with weights that an optimizer step has since changed. A block whose forward alone recomputes in backward
(`performance.checkpoint_every_n_blocks`: the hooks stay outside the recomputed forward) recomputes on the
per-layer casts, which save tensors of the same shapes and dtypes and give the same bits; diffusers' own
checkpointing recomputes the block's whole call, hooks included.

The per-layer casts stay where grouping would be wrong or pointless: no autocast, weights not in float32, hooks on a
layer's weight-holding modules (DeepSpeed ZeRO-3 gathers partitioned weights in them), FSDP2 (each unit
reduce-scatters its gradients as backward leaves it; kept on the per-layer casts, which it was proven with), compiled
blocks (inductor fuses the casts itself), and layers outside any block. Which layers take part and what they
compute with: lora_block_casts.py (adapters), weight_block_casts.py (a full finetune's Linear and Conv2d layers)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

TensorsOf = Callable[[torch.nn.Module], tuple[torch.Tensor, ...]]
HookedOf = Callable[[torch.nn.Module], Iterable[torch.nn.Module]]


class CastTogether(torch.autograd.Function):
    """Cast tensors to `dtype` and their gradients back to the tensors' dtypes, each in one multi-tensor copy
    (`torch._foreach_copy_`: a few launches on a GPU for the whole list) and one autograd node (a concatenation
    would add a view and its backward node per tensor, host work that costs about what it saves)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.set_materialize_grads(False)  # a layer that did not run sends no gradient: nothing to cast
        copies = [torch.empty_like(t, dtype=dtype) for t in tensors]
        torch._foreach_copy_(copies, list(tensors))
        return tuple(copies)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        present = [i for i, g in enumerate(grads) if g is not None]
        cast = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in present]
        if cast:
            torch._foreach_copy_(cast, [grads[i] for i in present])
        result: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(present, cast):
            result[i] = g
        return (None, *result)


class BlockCasts:
    """The layers of one block whose float32 weights are cast together at the block's forward."""

    def __init__(self, root: torch.nn.Module, layers: list[torch.nn.Module], tensors_of: TensorsOf,
                 hooked_of: HookedOf):
        self.root = root  # the part (FSDP2 shards it whole, so its class says whether the weights are sharded)
        self.layers = layers
        self.tensors_of = tensors_of  # a layer's weights, in the order its forward takes their copies
        self.hooked_of = hooked_of  # the modules whose hooks would see (or gather) those weights
        self.copies: list[tuple[torch.Tensor, ...]] | None = None
        self.block: torch.nn.Module | None = None  # set when hooked

    def weights(self) -> list[tuple[torch.Tensor, ...]]:
        return [self.tensors_of(layer) for layer in self.layers]

    def compute_dtype(self, weights: list[tuple[torch.Tensor, ...]]) -> torch.dtype | None:
        """The dtype to cast to, or None where the layers keep their own casts."""
        if torch.compiler.is_compiling():
            return None
        device = weights[0][0].device
        if device.type == "meta" or not torch.is_autocast_enabled(device.type):
            return None
        if any(w.dtype != torch.float32 or w.device != device for ws in weights for w in ws):
            return None
        if any(m._forward_pre_hooks or m._forward_hooks for layer in self.layers for m in self.hooked_of(layer)):
            return None
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.root, FSDPModule):
            return None
        return torch.get_autocast_dtype(device.type)

    def before(self, block, args) -> None:
        self.copies = None
        weights = self.weights()
        dtype = self.compute_dtype(weights)
        if dtype is None:
            return
        copies = iter(CastTogether.apply(dtype, *(w for ws in weights for w in ws)))
        self.copies = [tuple(next(copies) for _ in ws) for ws in weights]

    def after(self, block, args, output) -> None:
        self.copies = None

    def remove(self) -> None:
        """Back to per-layer casts (the hooks removed, the layers unlinked). By the hooks' owner, not by handles:
        a deep copy of the model (the sampler's) copies this object, and a handle would still point at the
        original block's hooks."""
        block = self.block
        for hooks in (block._forward_pre_hooks, block._forward_hooks):
            for key in [k for k, hook in hooks.items() if getattr(hook, "__self__", None) is self]:
                del hooks[key]
                block._forward_hooks_always_called.pop(key, None)
        for layer in self.layers:
            del layer._block_casts, layer._block_cast_index
        self.copies = None

    def copies_of(self, layer) -> tuple[torch.Tensor, ...] | None:
        """The layer's weights in the compute dtype while its block runs, else None."""
        if self.copies is None:
            return None
        return self.copies[layer._block_cast_index]


def copies_for(layer: torch.nn.Module) -> tuple[torch.Tensor, ...] | None:
    """What a layer's forward computes with: its block's copies of its weights, or None (its own casts)."""
    casts = layer.__dict__.get("_block_casts")
    return casts.copies_of(layer) if casts is not None else None


def cast_per_block(root: torch.nn.Module, blocks: list[torch.nn.Module], layers: list[torch.nn.Module],
                   tensors_of: TensorsOf, hooked_of: HookedOf) -> int:
    """Group `layers` (of `root`) by the innermost of `blocks` holding them and hook each block with two or more.
    Returns how many blocks cast together."""
    remaining = {id(layer): layer for layer in layers}
    hooked = 0
    # innermost first: a layer belongs to the smallest block around it
    for block in sorted(blocks, key=lambda b: sum(1 for _ in b.modules())):
        members = [m for m in block.modules() if id(m) in remaining]
        if len(members) < 2:
            continue
        for m in members:
            del remaining[id(m)]
        casts = BlockCasts(root, members, tensors_of, hooked_of)
        for index, layer in enumerate(members):
            layer._block_casts = casts
            layer._block_cast_index = index
        casts.block = block
        block.register_forward_pre_hook(casts.before)
        block.register_forward_hook(casts.after, always_call=True)
        hooked += 1
    return hooked
