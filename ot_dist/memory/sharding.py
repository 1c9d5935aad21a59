"""Per-rank model-state bytes and all-gather sizes of a module sharded by FSDP2 (`fully_shard`), counted from
parameter shapes alone, so the real Flux / SD3.5 architectures can be measured on the meta device.

FSDP2 shards every parameter on dim 0: `torch.chunk` into N pieces, each padded to the size of the first
(`_fsdp_param.py`: `padded_sharded_param_size = chunks[0].size()`), so rank 0 holds ceil(d0 / N) rows of each
parameter and an all-gather returns N padded shards. A sharding unit is one `fully_shard` call: its
parameters are all-gathered together before its forward (and again in backward, under full_shard); the
root's own call takes what no unit took (embedders, final norm and projection) and, as the root, keeps them
gathered from forward to the end of backward.

    units(transformer, ("transformer_blocks",))               # one unit per block (the family's shard_units)
    units(transformer, ("transformer_blocks",), per_block=False)  # the whole list as one unit
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STATE_BYTES = 16  # float32 weight + float32 gradient + AdamW exp_avg + exp_avg_sq
GATHER_BYTES = 2  # bfloat16 compute copy (MixedPrecisionPolicy param_dtype)


def units(module: torch.nn.Module, patterns: tuple[str, ...], per_block: bool = True) -> list[torch.nn.Module]:
    """The modules fsdp wraps for these patterns (ot_dist.parallel.fsdp.wrap_units: a ModuleList gives its items),
    or with per_block=False each matching module whole (what a block list gives without block granularity)."""
    from ot_dist.parallel.fsdp import wrap_units

    if per_block:
        return wrap_units(module, patterns)
    return [sub for name, sub in module.named_modules()
            if name and any(name == p or name.endswith("." + p) for p in patterns)]


def sharded_numel(shape: torch.Size | tuple[int, ...], ranks: int) -> int:
    """Elements rank 0 holds of a parameter of this shape (the largest, padded shard)."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def gathered_numel(params: list[torch.nn.Parameter], ranks: int) -> int:
    """Elements of an all-gather of these parameters: N padded shards each."""
    return sum(ranks * sharded_numel(p.shape, ranks) for p in params)


@dataclass
class Sharding:
    parameters: int  # of the module
    unit_parameters: list[int]  # per unit, in registration (= execution) order
    root_parameters: int  # left to the root's own fully_shard call
    unit_params: list[list[torch.nn.Parameter]]
    root_params: list[torch.nn.Parameter]
    all_params: list[torch.nn.Parameter]

    @property
    def largest(self) -> int:
        return max(self.unit_parameters + [self.root_parameters])

    @property
    def largest_fraction(self) -> float:
        return self.largest / self.parameters

    def state_bytes_per_rank(self, ranks: int) -> int:
        """Rank 0's float32 weights + gradients + 2 AdamW moments (the padded shards)."""
        return STATE_BYTES * sum(sharded_numel(p.shape, ranks) for p in self.all_params)

    def largest_gather_bytes(self, ranks: int) -> int:
        """The biggest single all-gather, in bfloat16."""
        groups = self.unit_params + [self.root_params]
        return GATHER_BYTES * max(gathered_numel(g, ranks) for g in groups)

    def gather_peak_bytes(self, ranks: int) -> int:
        """Gathered bfloat16 parameters at the worst moment: the root's (held for the whole step) + the unit
        computing + the one prefetched (the largest pair of consecutive units)."""
        sizes = [gathered_numel(g, ranks) for g in self.unit_params]
        pair = max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
        return GATHER_BYTES * (gathered_numel(self.root_params, ranks) + pair)


def sharding(module: torch.nn.Module, patterns: tuple[str, ...], per_block: bool = True) -> Sharding:
    wrapped = units(module, patterns, per_block)
    unit_params = [list(u.parameters()) for u in wrapped]
    taken = {id(p) for ps in unit_params for p in ps}
    all_params = list(module.parameters())
    root_params = [p for p in all_params if id(p) not in taken]
    if len(taken) != sum(len(ps) for ps in unit_params):
        raise ValueError(f"units of {patterns} overlap")
    return Sharding(
        parameters=sum(p.numel() for p in all_params),
        unit_parameters=[sum(p.numel() for p in ps) for ps in unit_params],
        root_parameters=sum(p.numel() for p in root_params),
        unit_params=unit_params, root_params=root_params, all_params=all_params,
    )
