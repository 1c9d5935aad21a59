"""Which elements of which trained parameter each rank updates, whatever the strategy.

The optimizer on a rank steps a list of tensors: whole parameters (single, ddp), the local shard of
each DTensor (fsdp), or one flat fp32 partition per parameter group that concatenates slices of many
parameters (ZeRO-1/2: parameter after parameter, split at arbitrary offsets; ZeRO-3: every parameter's
own partition, back to back). `Owned` describes one such tensor as `Fragment`s: contiguous runs of
elements, each a slice of one named parameter. With that, sharding-aware code can

- select the same global elements on every layout (Prodigy's `slice_p`: every p-th element of each
  parameter, counted from the parameter's start, not from the shard's), and
- rebuild full parameters from per-rank values shaped like the owned tensors (the EMA's export): each
  rank writes its fragments into zeros and one all-reduce sums the disjoint pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Fragment:
    name: str  # "<part>.<parameter name>", e.g. "unet.conv_in.weight"
    param_offset: int  # where the run starts in the flattened full parameter
    local_offset: int  # where it starts in the flattened owned tensor
    numel: int


@dataclass
class Owned:
    param: torch.Tensor  # the object the optimizer steps (a Parameter, a DTensor or a flat partition)
    fragments: list[Fragment]

    def local(self) -> torch.Tensor:
        """The plain tensor holding this rank's values (read anew: strategies may swap `.data`)."""
        return local(self.param)

    def selection(self, every: int) -> Selection:
        """Every `every`-th element of each parameter (counted from the parameter's start) among the
        elements of the flattened owned tensor."""
        runs, position, indices = [], 0, []
        for f in self.fragments:
            first, end = f.local_offset + (-f.param_offset) % every, f.local_offset + f.numel
            if first >= end:
                continue
            length = (end - first + every - 1) // every
            runs.append(Run(position, length, (f.param_offset + first - f.local_offset) // every))
            indices.append((first, end))
            position += length
        if len(indices) == 1 and self.fragments[0].numel == self.local().numel():
            first, end = indices[0]
            return Selection(slice(first, end, every), runs)  # a strided view, no index tensor
        device = self.local().device
        index = torch.cat([torch.arange(a, b, every) for a, b in indices]) if indices else torch.zeros(0, dtype=torch.long)
        return Selection(index.to(device), runs)


@dataclass(frozen=True)
class Run:
    """Consecutive selected elements of one parameter within a selected vector."""

    start: int  # position in the selected vector
    length: int
    first: int  # index of its first element among the parameter's selected elements


@dataclass(frozen=True)
class Selection:
    index: slice | torch.Tensor  # applied to the flattened owned tensor
    runs: list[Run]


def sum_by_parameter_blocks(values: torch.Tensor, runs: list[Run], block: int = 256) -> torch.Tensor:
    """The float64 sum of a selected vector, layout-independently: float32 sums over blocks of
    `block` consecutive selected elements of a parameter, aligned to the parameter's start, added in
    float64. A block is the same on every layout unless a shard boundary cuts it, so where the
    parameters are cut changes the result only at float32 rounding of a few blocks; and one long flat
    partition is never summed in float32 end to end (cancellation would ruin it)."""
    parts = []
    for run in runs:
        piece = values[run.start : run.start + run.length]
        head = min(run.length, (-run.first) % block)
        body = (run.length - head) // block * block
        if head:
            parts.append(piece[:head].sum().reshape(1))
        if body:
            parts.append(piece[head : head + body].view(-1, block).sum(dim=1))
        if run.length - head - body:
            parts.append(piece[head + body :].sum().reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=values.device)
    return torch.cat(parts).to(torch.float64).sum()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass that wraps one tensor, as that tensor: the same values and storage. Under fsdp with float8
    matmuls each trained Linear weight is torchao's float8 all-gather wrapper around its float32 master, which has no
    storage of its own to save, copy into or read."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t) and not isinstance(t, DTensor):
        inner, _ = t.__tensor_flatten__()
        if len(inner) == 1:
            return plain(getattr(t, inner[0]))
    return t


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one storage (a gathered tensor that is the local one, not a copy of it)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in CPU memory, made at once (a blocking copy from a GPU: the values are there when it returns).
    Always a copy, also of a CPU tensor: what a gather hands over may be storage the strategy releases or reuses (ZeRO-3
    partitions a gathered parameter again). Exports move each gathered tensor here before the next is gathered
    (torch's full state dict with cpu_offload does the same), so the device holds one at a time."""
    return t.detach().to("cpu", copy=True)


def whole(param: torch.Tensor, name: str) -> Owned:
    return Owned(param, [Fragment(name, 0, 0, param.numel())])


@dataclass
class Ownership:
    """What this rank owns, plus what is needed to reassemble: every trained parameter's full shape
    (identical on all ranks, in the same order) and the group the pieces are spread over (None:
    every rank owns everything, nothing to combine)."""

    owned: list[Owned]
    shapes: dict[str, torch.Size]
    group: dist.ProcessGroup | None = None
    sharded: bool = False
    device: torch.device = torch.device("cpu")  # where collectives run (the runtime's device)
    _index: dict[int, Owned] = field(default_factory=dict, repr=False)

    def of(self, param: torch.Tensor) -> Owned | None:
        if not self._index:
            self._index.update({id(o.param): o for o in self.owned})
        return self._index.get(id(param))

    def gatherer(self, values: list[torch.Tensor], dtype=torch.float32) -> Callable[[str], torch.Tensor]:
        """`gather(name)`: one full parameter from per-rank tensors shaped like `owned`, built on the values' device
        (a collective when sharded: every rank calls it for the same names in the same order; one all-reduce). One
        parameter at a time, so a caller that moves each to CPU memory (`to_host`) before the next holds one full
        parameter on the device, never the whole set."""
        by_name: dict[str, list[tuple[Fragment, torch.Tensor]]] = {}
        for owned, value in zip(self.owned, values, strict=True):
            flat = value.reshape(-1)
            for f in owned.fragments:
                by_name.setdefault(f.name, []).append((f, flat))
        device = values[0].device if values else torch.device("cpu")

        def gather(name: str) -> torch.Tensor:
            shape = self.shapes[name]
            out = torch.zeros(shape.numel(), dtype=dtype, device=device)
            for f, flat in by_name.get(name, []):
                out[f.param_offset : f.param_offset + f.numel] = flat[f.local_offset : f.local_offset + f.numel]
            if self.sharded:
                dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
            return out.view(shape)

        return gather

    def gather_full(self, values: list[torch.Tensor], dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Every full parameter from per-rank tensors shaped like `owned`, on the values' device (a collective when
        sharded: every rank calls it; one all-reduce per parameter, in the same order everywhere). Holds them all:
        exports and samples take them one at a time through `gatherer`."""
        gather = self.gatherer(values, dtype)
        return {name: gather(name) for name in self.shapes}


def dtensor_fragment(param: DTensor, name: str) -> Owned:
    """An FSDP2 parameter: its local shard is rows [offset, offset + n) of the full parameter."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    row = param.shape[1:].numel() if param.dim() > 1 else 1
    numel = torch.Size(local_shape).numel()
    start = offset[0] * row if param.dim() else 0
    return Owned(param, [Fragment(name, start, 0, numel)])
