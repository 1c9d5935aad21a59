"""The process group: who am I, how many are we, which device. Read from the environment that
torchrun / `accelerate launch` / DeepSpeed's launcher set (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). With no such environment there is no process group at all: `single`
needs none, which keeps the one-GPU path free of distributed machinery. A process group the caller made
before calling ot_dist (a notebook, Ray, a launcher of its own) is used as it is: its rank and size, and it is
left to its maker when the run ends."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.ports import free_port


@dataclass
class Runtime:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    distributed: bool = False
    owns_group: bool = False  # ot_dist started the process group: shutdown ends it (a caller's group is theirs)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a tensor over all ranks (every rank must call this at the same point)."""
        if not self.distributed:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def waiting_group(self, seconds: float):
        """A gloo group of its own whose collectives wait up to `seconds`, for work one rank does while the others
        wait (building the shard set, merging its parts: hours, where the default group's timeout,
        distributed.timeout_minutes, is for collectives that follow one another closely). Every rank makes it at the
        same point before that work starts: made after, the waiting ranks would wait for the working rank's
        address within the store's own timeout. None when not distributed."""
        if not self.distributed:
            return None
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))

    def from_main(self, value):
        """Rank 0's `value` (a small object of plain types: str, numbers, lists, dicts) on every rank; the others'
        `value` is ignored. Every rank calls this at the same point."""
        if not self.distributed:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def main_answer(self, compute, what: str):
        """`compute()` run by rank 0 alone, its result (a small object of plain types) on every rank. Where it raised,
        every rank raises: rank 0 its own error, the others a ConfigError / InputFileError with its message, or an
        InputFileError "`what` failed on rank 0" for any other error. Every rank calls this at the same point."""
        if not self.distributed:
            return compute()
        answer, error = None, None
        if self.is_main:
            try:
                answer = {"value": compute()}
            except Exception as err:  # noqa: BLE001 - the other ranks wait for rank 0's answer: they get one either way
                error = err
                answer = ({"error": str(err), "kind": type(err).__name__} if isinstance(err, (ConfigError, InputFileError))
                          else {"error": f"{what} failed on rank 0 (see its error)", "kind": "InputFileError"})
        answer = self.from_main(answer)
        if error is not None:
            raise error
        if "error" in answer:
            raise (ConfigError if answer["kind"] == "ConfigError" else InputFileError)(answer["error"])
        return answer["value"]

    def any_rank(self, flag: bool, group=None) -> bool:
        """Whether any rank's `flag` is set (every rank of `group` calls this at the same point)."""
        if not self.distributed:
            return flag
        value = torch.tensor([float(flag)])  # CPU memory: `group` is a gloo one (waiting_group)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())

    def fail_together(self, error: BaseException | None, group, what: str) -> None:
        """After work the main process did while the others waited in `group` (a waiting_group, which this ends):
        every rank learns whether it failed; that rank raises its `error`, the others an InputFileError naming
        `what`."""
        failed = self.any_rank(error is not None, group)
        if group is not None:
            dist.destroy_process_group(group)
        if error is not None:
            raise error
        if failed:
            raise InputFileError(f"{what} failed on the main process (see its error)")

    def shutdown(self) -> None:
        if self.owns_group and _peer_watch is not None:
            _peer_watch.stop()  # the group's work is over; rank 0, which may host the store, may now end first
        if self.owns_group and dist.is_initialized():
            # Work objects nobody refers to any more are freed now, not during interpreter finalization
            # (where freeing their tensors can abort the process, see Strategy.close).
            gc.collect()
            dist.destroy_process_group()


def ranks_on_this_node(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE (a launch without it: every rank on one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def gather_objects(value) -> list:
    """Every rank's `value` (small Python objects), by rank; every rank of the default group calls it."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# Whether this process ever started a process group (see exit_process).
_group_started = False
# This rank's watch over the others' failures (parallel/peer_failure.py), where ot_dist started a group of several.
_peer_watch = None


def exit_process(code: int) -> NoReturn:
    """End this process with `code` once its work is done and committed.

    A process that had a process group skips the interpreter's finalization and the C++ static destructors:
    there, after training succeeded and everything was written, gloo / DeepSpeed teardown now and then aborts a
    rank ("terminate called without an active exception", SIGABRT, seen in 2-rank zero2 / zero3 runs after
    `destroy_process_group`; faulthandler prints nothing, so it happens after Python's own teardown). torchrun
    and Kubernetes would report that finished run as failed and restart it. Output streams and logging are
    flushed first; files the run wrote are closed by then (checkpoints fsync, the tracker closes its outbox).
    A process without a process group exits normally.
    A rank of a group ot_dist started that ends with a non-zero `code` tells the others first, which end too instead
    of waiting for it in a collective until the timeout (parallel/peer_failure.py)."""
    if not _group_started:
        sys.exit(code)
    if code:
        announce_failure(code)
    elif _peer_watch is not None:
        _peer_watch.stop()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a pipe whose reader is gone: nothing more can be said
            pass
    os._exit(code)


def announce_failure(code: int) -> None:
    """This rank is failing with exit `code`: the other ranks of the group ot_dist started end too, within seconds,
    instead of waiting for it in a collective (parallel/peer_failure.py). Called as soon as the error is caught,
    before the cleanup that may itself wait on the others; again by exit_process, where the first call wins."""
    if _peer_watch is not None:
        _peer_watch.announce(code)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_runtime(timeout_minutes: float, needs_group: bool = False) -> Runtime:
    """`needs_group`: the strategy needs a process group even when started as one process (FSDP
    or ZeRO on one GPU, e.g. for their CPU offload); one is made on a free local port."""
    if dist.is_initialized():
        return runtime_of_existing_group(needs_group)
    world_size = launched_world_size()
    if world_size == 1 and needs_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ["WORLD_SIZE"] = "1"
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = this_rank_device(local_rank)
    if world_size == 1 and not needs_group:
        return Runtime(device=device)
    global _group_started, _peer_watch
    _group_started = True
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(
        backend=process_group_backend(device),
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        **restart_safe_store(rank, world_size, timeout),
    )
    if world_size > 1 and dist.is_initialized():
        from ot_dist.parallel.peer_failure import start_watch

        _peer_watch = start_watch(rank, world_size)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device, distributed=True,
                   owns_group=True)


def runtime_of_existing_group(needs_group: bool) -> Runtime:
    """The caller's process group, which may have been made without torchrun's environment (init_method tcp://,
    explicit rank and world size): its own rank and size count, not WORLD_SIZE. The local rank is LOCAL_RANK's, else
    the rank modulo the GPUs of this machine, and is written to LOCAL_RANK where missing, since DeepSpeed's engine
    reads it from there (it refuses to start without it). A 1-process group trains as `single` unless the strategy
    needs a group. The group is not ours to end (Runtime.owns_group)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank % gpus if gpus else 0))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    device = this_rank_device(local_rank)
    if world_size == 1 and not needs_group:
        return Runtime(device=device)
    backend = str(dist.get_backend())
    if device.type == "cuda" and "cpu:" not in backend and backend != "gloo":
        raise ConfigError(
            f"the process group this process was given has backend {backend!r}, which carries no CPU tensors: "
            "ot_dist reduces some in CPU memory (checkpoint agreement, ema.device: cpu, offloaded optimizer state, "
            "fsdp.cpu_offload's gradient norms). Make it with init_process_group(backend=\"cpu:gloo,cuda:nccl\", "
            "...), or let ot_dist make it (start without a group)"
        )
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device, distributed=True)


def this_rank_device(local_rank: int) -> torch.device:
    """The GPU of this local rank, made the current one (so that NCCL and the caching allocator use it), or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def process_group_backend(device: torch.device) -> str:
    """The backends of the process group. On GPUs NCCL carries CUDA tensors and gloo the CPU ones: the sharded
    EMA with `ema.device: cpu`, DeepSpeed's offloaded partitions and `fsdp.cpu_offload`'s gradient norms are
    reduced as CPU tensors, which NCCL alone cannot. Groups made later (device meshes, `new_group`) inherit both."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def restart_safe_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """After torchrun restarted the worker group (a rank died, --max-restarts), the rendezvous store still
    holds the previous attempt's keys, among them the dead ranks' gloo addresses, which the new ranks
    would read and fail on ("connectFullMesh failed ... Connection refused"). Each attempt gets its own
    key prefix. The first attempt uses the default env:// initialisation."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        return {}
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_store and rank == 0, timeout=timeout)
    return {"store": dist.PrefixStore(f"ot_dist/attempt_{attempt}", store), "rank": rank, "world_size": world_size}
