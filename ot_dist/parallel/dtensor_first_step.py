"""The first optimizer step over FSDP2's DTensor parameters in time linear in their number, not quadratic.

A foreach optimizer (torch's AdamW / Adam / SGD with foreach, and the fused ones) applies each of its ops to the list of
every parameter of a group at once. DTensor plans such an op once per list of shardings (then caches the plan): for a
list of n tensors, torch 2.13's `ShardingPropagator` calls `_propagate_use_strided_shard_flag(child, op_schema)` for
each of the n children of the tuple strategy, and that function scans every input spec of the whole op
(`op_schema.args_spec`, itself a fresh flattening of the argument lists) for a `_StridedShard` placement: n scans of
~3n specs. Measured on a CPU (one rank, 2-layer blocks of a 64-wide Linear and a LayerNorm under fully_shard, AdamW):
the first step over 1,200 parameters took 36.3 s with foreach (9.9 s fused) and later steps 0.07 s; an SDXL UNet holds
~1,700 trained tensors, so its first step under fsdp would spend about a minute planning, on every rank, at each start
and resume.

The scan's answer is the same for every child of one op: whether any input carries a `_StridedShard` (FSDP2's
`Shard(0)` does not; tensor parallelism combined with FSDP may). `linear_first_step()` wraps the function so that the
scan runs once per op (per thread: planning may run in a checkpoint's background thread too); where no input has a
`_StridedShard`, the original would return without changing anything, and the wrapper returns at once; otherwise it
calls the original. Applied by the fsdp strategy; a torch whose sharding propagation has no such function, or another
signature, is left as it is."""

from __future__ import annotations

import inspect
import threading

def linear_first_step() -> bool:
    """Wrap torch's `_propagate_use_strided_shard_flag` (once per process). True where it is wrapped."""
    try:
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return False
    original = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    if original is None or list(inspect.signature(original).parameters) != ["op_strategy", "op_schema"]:
        return False
    if not hasattr(original, "__wrapped__"):  # not wrapped yet
        _sharding_prop._propagate_use_strided_shard_flag = scanned_once_per_op(original, _StridedShard)
    return True


def scanned_once_per_op(original, strided_shard_type):
    """`original` called only for ops with a `strided_shard_type` placement among their inputs, that answer kept for the
    calls that follow with the same op schema (the tuple strategy's children, one after another)."""
    last = threading.local()

    def propagate_use_strided_shard_flag(op_strategy, op_schema) -> None:
        if getattr(last, "schema", None) is not op_schema:
            # the schema is held until the next op's: its id cannot be reused by another meanwhile
            last.schema = op_schema
            last.strided = any(isinstance(placement, strided_shard_type)
                               for spec in op_schema.args_spec for placement in spec.placements)
        if last.strided:
            original(op_strategy, op_schema)

    propagate_use_strided_shard_flag.__wrapped__ = original
    return propagate_use_strided_shard_flag
