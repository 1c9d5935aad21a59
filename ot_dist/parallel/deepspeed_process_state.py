"""What DeepSpeed keeps for the rest of the process, beyond the engine that made it, and how ot_dist gives it back
or refreshes it, so that the process trains again as a fresh one would: a notebook that trains more than once, a test
process running several cases. Each function says what it undoes and where DeepSpeed 0.19 keeps it."""

from __future__ import annotations

import torch


def restore_torch_linear(before) -> None:
    """ZeRO-3 replaces torch.nn.functional.linear with its own for the rest of the process: building the engine
    partitions the module through zero.Init(module=...) (parameter_offload.py `_convert_to_zero_parameters`), which
    installs DeepSpeed's zero3_linear_wrap (partition_parameters.py `_enable_mem_efficient_linear`: "This will persist
    unless manually reset"). Its linear adds a float32 bias to a bfloat16 product where torch's adds it in bfloat16,
    so a later training in the same process (a notebook's sweep, a test process running several cases) rounded
    differently from a fresh process.
    The function in place before the engine was built (`before`) is put back, but only while DeepSpeed's is the one
    in place: a replacement made since by anyone else is theirs to undo. DeepSpeed installs its own again for the
    next ZeRO-3 engine (it does so whenever torch.nn.functional.linear is the one it saved first)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    if torch.nn.functional.linear is zero3_linear_wrap:
        torch.nn.functional.linear = before


def forget_closed_engine(module: torch.nn.Module) -> None:
    """Drop what DeepSpeed's module-level state keeps of a destroyed ZeRO-3 engine. Without this a closed ZeRO-3
    trainer stayed alive for the rest of the process: the model's weights, the optimizer's state and ~47 k objects
    that every later full collection walked again (a notebook that trains twice held both models; a test process
    running several cases grew slower with each). destroy() only removes the hooks; two references remain:
    - FWD_MODULE_STACK (parameter_offload.py), a module-level list: DeepSpeedZeRoOffload pushes the engine's module
      there when it is built and never takes it off. Entries of other, live engines stay.
    - PartitionedParameterCoordinator.__params_to_release, a functools.lru_cache on the class whose keys are
      (coordinator, submodule, step). lru_cache clears only as a whole: another live engine in the process (ot_dist
      has one at a time) recomputes its entries on their next use, a set of parameter ids it may release; the
      values trained do not depend on it.
    tests/test_zero3_collectives.py checks that the closed trainer is collected."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    mine = {id(m) for m in module.modules()}
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in mine]
    # the cached function sits in the closure of DeepSpeed's instrument_w_nvtx wrapper (no functools.wraps)
    wrapper = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(wrapper, "__closure__", None) or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def forget_stale_world_group() -> None:
    """DeepSpeed clones the world process group once per process and keeps the clone (utils/groups.py
    `_clone_world_group`: torch's get_global_rank does not take the WORLD group itself). A process that ends its
    process group and starts another (a notebook calling ot_dist.train.train twice: each run's Runtime.shutdown
    destroys the group it started) kept the clone of the ended one, which torch.distributed no longer knows: the next
    engine failed as it started ("Group ... is not registered, please create group with torch.distributed.new_group
    API", from DeepSpeedEngine._broadcast_model). A clone of an ended group is dropped before an engine is built;
    DeepSpeed clones the live world group at its next use (a collective every rank makes, as each builds its
    engine). A clone of the live group stays."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    clone = groups._WORLD_GROUP
    if clone is None:
        return
    try:
        dist.get_process_group_ranks(clone)
    except KeyError:  # not among the live groups (distributed_c10d `_world.pg_group_ranks`)
        groups._WORLD_GROUP = None
