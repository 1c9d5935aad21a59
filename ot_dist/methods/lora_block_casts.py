"""Cast a block's LoRA weights to the compute dtype in one op, not one per weight.

Adapters train in float32. Under autocast every adapted layer casts its two adapter weights to the compute dtype in
each forward, and backward casts their two gradients back: four small copies per layer, ~2,900 per SDXL LoRA step, a
fifth of the ops a step launches (issue 21). Tiny copies cost a GPU nothing but their launch, and SDXL LoRA is paced
by the host that launches them. So the adapters of one block are cast together: a forward pre-hook on each of the
family's blocks (its shard units) casts the block's adapter weights in one multi-tensor copy into the copies its
layers compute with, and backward casts their gradients back in another. Per block that is two ops instead of four
per layer. The values are the same bits (one rounding of the same weights), and
the gradients still arrive block by block, so ddp / ZeRO-1/2 reduce them overlapped with backward as before.

The copies exist only while their block's forward runs (a hook that always runs clears them): nothing can compute
with weights that an optimizer step has since changed. A block whose forward recomputes in backward
(`performance.checkpoint_every_n_blocks`: the hooks stay outside the recomputed forward) recomputes on the
per-layer casts, which save tensors of the same shapes and dtypes and give the same bits.

The per-layer casts stay where grouping would be wrong or pointless: no autocast, adapters already in the compute
dtype, hooks on an adapter module (DeepSpeed ZeRO-3 gathers partitioned weights in them), FSDP2 (each unit reduce-scatters
its gradients as backward leaves it; kept on the per-layer casts, which it was proven with), compiled blocks
(inductor fuses the casts itself), and layers outside any block."""

from __future__ import annotations

import torch

# Hooks on these would see partitioned weights or need per-layer calls: the layer keeps its own casts.
ADAPTER_MODULES = ("lora_A", "lora_B")


class BlockCasts:
    """The adapters of one block: their float32 weights, cast together at the block's forward."""

    def __init__(self, root: torch.nn.Module, layers: list[torch.nn.Module], adapter: str):
        self.root = root  # the part (FSDP2 shards it whole, so its class says whether the weights are sharded)
        self.layers = layers
        self.adapter = adapter
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.block: torch.nn.Module | None = None  # set when hooked

    def adapter_modules(self):
        for layer in self.layers:
            yield layer.lora_A[self.adapter]
            yield layer.lora_B[self.adapter]

    def weights(self) -> list[torch.Tensor]:
        return [module.weight for module in self.adapter_modules()]

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype to cast to, or None where the layers keep their own casts."""
        if torch.compiler.is_compiling():
            return None
        weights = self.weights()
        device = weights[0].device
        if device.type == "meta" or not torch.is_autocast_enabled(device.type):
            return None
        dtype = torch.get_autocast_dtype(device.type)
        if any(w.dtype != torch.float32 or w.device != device for w in weights):
            return None
        if any(m._forward_pre_hooks or m._forward_hooks for m in self.adapter_modules()):
            return None
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.root, FSDPModule):
            return None
        return dtype

    def before(self, block, args) -> None:
        self.copies = None
        dtype = self.compute_dtype()
        if dtype is None:
            return
        copies = CastTogether.apply(dtype, *self.weights())
        self.copies = list(zip(copies[0::2], copies[1::2]))

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

    def copies_of(self, layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's (down, up) weights in the compute dtype while its block runs, else None."""
        if self.copies is None:
            return None
        return self.copies[layer._block_cast_index]


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


def cast_adapters_per_block(root: torch.nn.Module, blocks: list[torch.nn.Module], layers: list[torch.nn.Module],
                            adapter: str) -> int:
    """Group `layers` (plain LoRA Linear layers of `root`) by the innermost of `blocks` holding them and hook each
    block with two or more. Returns how many blocks cast together."""
    remaining = {id(layer): layer for layer in layers}
    hooked = 0
    # innermost first: a layer belongs to the smallest block around it
    for block in sorted(blocks, key=lambda b: sum(1 for _ in b.modules())):
        members = [m for m in block.modules() if id(m) in remaining]
        if len(members) < 2:
            continue
        for m in members:
            del remaining[id(m)]
        casts = BlockCasts(root, members, adapter)
        for index, layer in enumerate(members):
            layer._block_casts = casts
            layer._block_cast_index = index
        casts.block = block
        block.register_forward_pre_hook(casts.before)
        block.register_forward_hook(casts.after, always_call=True)
        hooked += 1
    return hooked
