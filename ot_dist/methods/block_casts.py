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

from ot_dist.methods.shared_inputs import SharedInputs, in_backward

TensorsOf = Callable[[torch.nn.Module], tuple[torch.Tensor, ...]]
HookedOf = Callable[[torch.nn.Module], Iterable[torch.nn.Module]]


class CastTogether(torch.autograd.Function):
    """Cast tensors to `dtype` and their gradients back to the tensors' dtypes, each in one multi-tensor copy
    (`torch._foreach_copy_`: a few launches on a GPU for the whole list) and one autograd node (a concatenation
    would add a view and its backward node per tensor, host work that costs about what it saves).

    `layout` lists the outputs, each by the indices of the tensors it holds: one (its copy) or several, copied into
    one tensor along the first dimension (shared_inputs.py). `on_backward` is called when the gradients are back."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, layout: tuple[tuple[int, ...], ...], on_backward: Callable[[], None] | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.layout, ctx.on_backward = layout, on_backward
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.rows = [t.shape[0] for t in tensors]
        ctx.set_materialize_grads(False)  # a layer that did not run sends no gradient: nothing to cast
        outputs, targets, sources = [], [], []
        for members in layout:
            first = tensors[members[0]]
            if len(members) == 1:
                output = torch.empty_like(first, dtype=dtype)
                targets.append(output)
            else:
                output = first.new_empty((sum(ctx.rows[i] for i in members), *first.shape[1:]), dtype=dtype)
                targets.extend(output.split([ctx.rows[i] for i in members]))
            sources.extend(tensors[i] for i in members)
            outputs.append(output)
        torch._foreach_copy_(targets, sources)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        result: list[torch.Tensor | None] = [None] * len(ctx.dtypes)
        targets, sources = [], []
        for members, grad in zip(ctx.layout, grads):
            if grad is None:
                continue
            parts = (grad,) if len(members) == 1 else grad.split([ctx.rows[i] for i in members])
            for i, part in zip(members, parts):
                result[i] = torch.empty_like(part, dtype=ctx.dtypes[i])
                targets.append(result[i])
                sources.append(part)
        if targets:
            torch._foreach_copy_(targets, sources)
        if ctx.on_backward is not None:
            ctx.on_backward()
        return (None, None, None, *result)


class CastPlan:
    """CastTogether's layout for a block's weights (each layer's tuple) with the first weights of each group of
    layers concatenated: the groups' outputs first, then one per other weight (`single`: its layer and position).
    The groups' row counts are the sharing's (SharedInputs.sizes)."""

    def __init__(self, weights: list[tuple[torch.Tensor, ...]], groups: tuple[tuple[int, ...], ...]):
        index = {}  # (layer, position) -> index in the flat list of tensors
        for layer, ws in enumerate(weights):
            for position in range(len(ws)):
                index[layer, position] = len(index)
        grouped = {layer for members in groups for layer in members}
        self.single = [key for key in index if key[1] or key[0] not in grouped]
        self.layout = (tuple(tuple(index[layer, 0] for layer in members) for members in groups)
                       + tuple((index[key],) for key in self.single))


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
        self.sharing: SharedInputs | None = None  # layers taking the same input share a projection (opt-in)
        self.cast_in_forward = False  # the block's (checkpointed) forward casts, not its hooks: cast_inside_forward
        self.plans: dict[tuple[tuple[int, ...], ...], CastPlan] = {}  # by the groups concatenated

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
        if not self.cast_in_forward:
            self.begin()

    def after(self, block, args, output) -> None:
        if not self.cast_in_forward:
            self.end()

    def begin(self) -> None:
        """At the block's forward: its layers' copies, each shared input group's first weights in one."""
        self.copies = None
        weights = self.weights()
        dtype = self.compute_dtype(weights)
        if dtype is None:
            return
        groups = self.sharing.layout() if self.sharing is not None else ()
        plan = self.plans.get(groups)
        if plan is None:  # made once per layout: this runs at every forward of every block
            plan = self.plans[groups] = CastPlan(weights, groups)
        on_backward = self.sharing.backward_done if self.sharing is not None and self.sharing.counted else None
        outputs = CastTogether.apply(dtype, plan.layout, on_backward, *(w for ws in weights for w in ws))
        copies: list[list[torch.Tensor | None]] = [[None] * len(ws) for ws in weights]
        for (layer, position), output in zip(plan.single, outputs[len(groups):]):
            copies[layer][position] = output
        if groups:  # a grouped layer's own first weight: its rows of the group's
            for members, sizes, output in zip(groups, self.sharing.sizes, outputs):
                for layer, part in zip(members, output.split(sizes)):
                    copies[layer][0] = part
            self.sharing.start(list(outputs[:len(groups)]))
        self.copies = [tuple(c) for c in copies]

    def end(self) -> None:
        self.copies = None
        if self.sharing is not None:
            self.sharing.end(self.weights)

    def shared_projection(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """`x @ W^T` for the layer's first weight, computed once for the layers of this block that take this same
        `x` (shared_inputs.py); None where the layer computes its own (no copies, no group, no sharing)."""
        if self.sharing is None:
            return None
        if self.copies is not None:
            return self.sharing.projection(layer._block_cast_index, x)
        if not (self.sharing.groups and in_backward()):
            return None
        # A module inside the block recomputes on its own (performance.checkpoint_only_attention, or a model's own
        # checkpointing finer than its blocks), after the block's copies are gone. Its forward shared (the groups
        # never change while a forward awaits its backward): so does the recomputation, on the same bits.
        weights = self.weights()
        dtype = self.compute_dtype(weights)
        if dtype is None:
            return None
        return self.sharing.projection(layer._block_cast_index, x,
                                       lambda members: torch.cat([weights[m][0] for m in members]).to(dtype))

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


def block_casts_in(root: torch.nn.Module) -> list[BlockCasts]:
    """Every BlockCasts of `root`'s layers, once each (a block's layers share one)."""
    found = {id(m._block_casts): m._block_casts for m in root.modules() if "_block_casts" in m.__dict__}
    return list(found.values())


def shared_projection_for(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's part of the projection its block computed once for the layers taking this same `x`, or None."""
    casts = layer.__dict__.get("_block_casts")
    return casts.shared_projection(layer, x) if casts is not None else None


def casts_of(block: torch.nn.Module) -> BlockCasts | None:
    """The casts hooked on `block`, if any (found by the hook's owner: see BlockCasts.remove)."""
    for hook in block._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, BlockCasts):
            return owner
    return None


def cast_inside_forward(block: torch.nn.Module, forward: Callable) -> Callable:
    """`forward` casting the block's weights itself (its hooks no longer do), for a block whose forward alone
    recomputes in backward (performance.checkpoint_every_n_blocks): the recomputation then casts again and computes
    with the same copies and the same shared projections as the forward it replays, as diffusers' checkpointing
    (which recomputes the block's whole call, hooks included) does. Without casts on the block: `forward`."""
    casts = casts_of(block)
    if casts is None:
        return forward
    casts.cast_in_forward = True

    def forward_with_casts(*args, **kwargs):
        casts.begin()
        try:
            return forward(*args, **kwargs)
        finally:
            casts.end()

    return forward_with_casts


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
