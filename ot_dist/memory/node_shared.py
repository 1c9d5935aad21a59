"""Frozen weights that live in CPU memory are held once per node, not once per rank (`share_frozen_cpu_weights`).

Under ddp every rank loads the whole model. What stays in CPU memory afterwards is frozen: the streamed blocks' homes
(`<denoiser>.offload_fraction`, a LoRA's base) and the components `offload_frozen_components` keeps there (a T5-XXL,
the VAE). Each rank held its own copy, pinned on a GPU: 8 ranks streaming half of Flux.1 dev held 8 x 12 GB of
page-locked memory for one set of bytes. Here the ranks of a node agree on one file in a memory filesystem
(`/dev/shm`, which the k8s manifests mount as an in-memory emptyDir): the node's first rank writes the frozen tensors
into it, every rank maps it and its tensors become views of the mapping (the same Parameter objects, so modules,
peft and the visitors' entries see no change), and the file is removed as soon as all have mapped it, so nothing
is left behind by a crash afterwards. On a GPU each rank page-locks its mapping (`cudaHostRegister`, what
torch.distributed.checkpoint does with shared memory), so the copies to the device stay asynchronous.

Nothing here changes a result: each rank checks that the node's bytes are its own before it switches to them (the
frozen weights come from the same files on every rank), and a node whose memory filesystem cannot hold them keeps one
copy per rank, said in the log. What is shared is found through the visitors that copy it to the device
(memory/offload.py `Visitor`, memory/block_streaming.py): the tensors they carry home that are frozen and CPU
resident. Weights that train (a full finetune's streamed blocks) are stepped by each rank and are never shared."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from ot_dist.memory.offload import Visitor
from ot_dist.memory.placement import CPU_KERNEL_ALIGNMENT as ALIGNMENT  # CPU kernels' (oneDNN / MKL) alignment
from ot_dist.parallel.runtime import gather_objects

SHARED_MEMORY_DIR = "/dev/shm"
FILE_PREFIX = "ot_dist-frozen-"


@dataclass
class NodeSharing:
    """What `share_frozen_cpu_weights` did on this rank."""

    tensors: int = 0  # frozen CPU tensors now views of the node's mapping
    bytes: int = 0  # their bytes (held once per node)
    ranks_on_node: int = 1
    pinned: bool = False
    skipped: int = 0  # frozen CPU tensors that stay private (tensor subclasses, layouts without a dense view)
    reason: str | None = None  # why nothing was shared, where something could have been
    storage: torch.UntypedStorage | None = field(default=None, repr=False)  # keeps the mapping (and its pin) alive


def frozen_cpu_entries(modules: Iterable[torch.nn.Module]) -> tuple[list[tuple[dict, str]], int]:
    """(the owner's dict, name) of each frozen CPU tensor a visitor carries to the device, each tensor once, in module
    order (the same on every rank); and how many such tensors cannot be shared (tensor subclasses such as
    bitsandbytes' Params4bit carry state beside their bytes; a layout that is not dense has no view of a flat file)."""
    entries, seen, skipped = [], set(), 0
    for root in modules:
        for module in root.modules():
            for hook in module._forward_pre_hooks.values():
                visitor = getattr(hook, "__self__", None)
                if not isinstance(visitor, Visitor):
                    continue
                for table, name in visitor.entries:
                    tensor = table[name]
                    if tensor is None or id(tensor) in seen or tensor.device.type != "cpu" or tensor.requires_grad:
                        continue
                    seen.add(id(tensor))
                    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or not dense(tensor):
                        skipped += 1
                        continue
                    if tensor.numel():
                        entries.append((table, name))
    return entries, skipped


def qualified_names(modules: Iterable[torch.nn.Module], entries: list[tuple[dict, str]]) -> list[str]:
    """Each entry's name as its component's state dict has it (what an error names)."""
    owners = {}
    for root in modules:
        for prefix, module in root.named_modules():
            for table in (module._parameters, module._buffers):
                owners.setdefault(id(table), prefix)
    return [f"{owners.get(id(table), '?')}.{name}".lstrip(".") for table, name in entries]


def dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill exactly numel() places of memory in some order (contiguous, channels_last),
    so a view with its strides over a run of numel() elements holds it."""
    return (tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last)
            or tensor.is_contiguous(memory_format=torch.channels_last_3d))


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the file (aligned) and the file's size."""
    offsets, end = [], 0
    for tensor in tensors:
        end = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(end)
        end += tensor.nbytes
    return offsets, end


def signature(tensors: list[torch.Tensor]) -> str:
    """The layout's identity: ranks share only what has the same shapes, strides and dtypes in the same order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(f"{tuple(tensor.shape)}{tensor.stride()}{tensor.dtype};".encode())
    return digest.hexdigest()


def view_in(storage: torch.UntypedStorage, offset: int, like: torch.Tensor) -> torch.Tensor:
    """`like`'s shape, strides and dtype over `storage` from byte `offset`."""
    return torch.empty(0, dtype=like.dtype).set_(storage, offset // like.element_size(), like.shape, like.stride())


def bytes_in(storage: torch.UntypedStorage, offset: int, count: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (count,))


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes, in memory order."""
    return bytes_in(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), tensor.nbytes)


def node_key(directory: str) -> str | None:
    """Which ranks can share: the same host and the same memory filesystem (two containers on one host with the
    same name have filesystems of their own). None where the directory is missing."""
    try:
        return f"{socket.gethostname()}:{os.stat(directory).st_dev}"
    except OSError:
        return None


def free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def headroom(directory: str) -> int:
    """What the weights leave free: NCCL's intra-node buffers and the loader workers' batches live in /dev/shm too.
    A quarter of the filesystem, at most 1 GiB. (A Kubernetes memory emptyDir reports its sizeLimit as its size; going
    past it gets the pod evicted, not an error, hence checking here.)"""
    stats = os.statvfs(directory)
    return min(2**30, stats.f_blocks * stats.f_frsize // 4)


def remove_stale_files(directory: str) -> list[str]:
    """Files a node's first rank made and did not live to remove (killed while writing: by the OOM killer, say): a
    memory filesystem keeps them, and their memory, until the machine restarts. Their names carry the creator's
    pid; those of processes that no longer exist are removed. Returns their names."""
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(FILE_PREFIX):
            continue
        try:
            pid = int(name[len(FILE_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:  # no such process: its file is stale
            remove(os.path.join(directory, name))
            removed.append(name)
        except (ValueError, PermissionError):  # not our name, or another user's live process
            continue
    return removed


def write_node_file(directory: str, tensors: list[torch.Tensor], offsets: list[int], size: int,
                    log: Callable[[str], None] = print) -> tuple[str | None, str | None]:
    """The node's first rank: a new file holding the tensors' bytes at their offsets. Returns (path, None) or
    (None, why not). The space is reserved before anything is written: a memory filesystem that runs out while a
    mapping is written kills the process (SIGBUS) instead of failing a call."""
    stale = remove_stale_files(directory)
    if stale:
        log(f"share_frozen_cpu_weights: removed {len(stale)} file(s) of ranks that died while writing them: "
            f"{', '.join(stale)}")
    free, reserve = free_bytes(directory), headroom(directory)
    if free - reserve < size:
        return None, (f"{directory} has {free / 2**30:.2f} GiB free, {size / 2**30:.2f} GiB are needed and "
                      f"{reserve / 2**30:.2f} GiB left for NCCL and the loader workers (in Kubernetes: a larger "
                      "emptyDir with medium: Memory at /dev/shm)")
    path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # weights: this user's processes only
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        storage = torch.UntypedStorage.from_file(path, True, size)
        for tensor, offset in zip(tensors, offsets):
            view_in(storage, offset, tensor).copy_(tensor)
        return path, None
    except OSError as err:
        remove(path)
        return None, f"{path}: {err.strerror or err}"


def remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def pin_mapping(storage: torch.UntypedStorage) -> None:
    """Page-lock this process's mapping so copies from it to the GPU are asynchronous (the pages are the node's; each
    process registers its own mapping of them)."""
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1))  # Portable
    if code != 0:
        # A failed runtime call stays the thread's "last error" until read, and torch reads it after its next kernel
        # launch: that launch would fail with this error, far from here.
        if (read_last_error := getattr(cudart, "cudaGetLastError", None)) is not None:
            read_last_error()
        raise RuntimeError(f"share_frozen_cpu_weights: cudaHostRegister of {storage.nbytes()} bytes failed with CUDA "
                           f"error {code} (the shell's `ulimit -l` or the container's locked-memory limit?); "
                           "share_frozen_cpu_weights: false keeps a copy per rank")


def share_frozen_cpu_weights(modules: Iterable[torch.nn.Module], pin: bool, log: Callable[[str], None] = print,
                             directory: str = SHARED_MEMORY_DIR) -> NodeSharing:
    """Make each frozen CPU tensor the visitors of `modules` carry a view of one mapping per node. Every rank of the
    process group calls this at the same point. `pin`: page-lock the mapping (CUDA)."""
    modules = list(modules)
    entries, skipped = frozen_cpu_entries(modules)
    tensors = [table[name] for table, name in entries]
    offsets, size = layout(tensors)
    result = NodeSharing(skipped=skipped)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return result
    rank = dist.get_rank()
    key = node_key(directory) if size else None
    everyone = gather_objects((key, signature(tensors), size))
    node = [r for r, (k, sig, _) in enumerate(everyone) if key is not None and k == key and sig == everyone[rank][1]]
    result.ranks_on_node = max(len(node), 1)
    leader = node[0] if len(node) > 1 else None

    path, why = write_node_file(directory, tensors, offsets, size, log) if rank == leader else (None, None)
    leaders_files = gather_objects((path, why))
    storage = None
    if leader is not None:
        path, why = leaders_files[leader]
        if path is not None:
            try:
                storage = torch.UntypedStorage.from_file(path, True, size)
            except (OSError, RuntimeError) as err:
                why = f"{path} could not be mapped on rank {rank}: {err}"
    differing = None
    if storage is not None and rank != leader:  # the leader wrote them. Bytes, not values: NaN equals itself
        index = next((i for i, (tensor, offset) in enumerate(zip(tensors, offsets))
                      if not torch.equal(bytes_in(storage, offset, tensor.nbytes), bytes_of(tensor))), None)
        differing = None if index is None else qualified_names(modules, entries)[index]
    outcomes = gather_objects((storage is not None, why, differing))  # each rank has mapped the file or failed to
    if rank == leader:
        remove(path)  # the mappings keep the pages; the name is gone, so no crash can leave it behind
    mismatch = [(r, d) for r, (_, _, d) in enumerate(outcomes) if d is not None]
    if mismatch:
        r, name = mismatch[0]
        raise RuntimeError(f"share_frozen_cpu_weights: rank {r}'s frozen weight {name!r} differs from the one its "
                           "node's first rank loaded: the ranks did not load the same model")
    pin_error = None
    if storage is not None:
        for (table, name), tensor, offset in zip(entries, tensors, offsets):
            tensor.data = view_in(storage, offset, tensor)
        if pin:
            try:
                pin_mapping(storage)
            except RuntimeError as err:
                pin_error = str(err)
    if pin:  # every rank learns of a failure: the others would wait for the failed one in their next collective
        failed = [(r, error) for r, error in enumerate(gather_objects(pin_error)) if error]
        if failed:
            raise RuntimeError(f"rank {failed[0][0]}: {failed[0][1]}")
    if storage is None:
        if leader is not None:
            result.reason = why or next((w for _, w, _ in outcomes if w), "the node's file was not mapped")
        elif size and key is None:
            result.reason = f"{directory} does not exist"
        if result.reason:
            log(f"share_frozen_cpu_weights: rank {rank} keeps its own copy of {size / 2**30:.2f} GiB of frozen "
                f"weights: {result.reason}")
        return result
    result.tensors, result.bytes, result.pinned, result.storage = len(tensors), size, pin, storage
    if rank == leader:
        log(f"share_frozen_cpu_weights: {len(tensors)} frozen tensors in CPU memory ({size / 2**30:.2f} GiB) held "
            f"once for the {len(node)} ranks on this node{', page-locked' if pin else ''}"
            + (f"; {skipped} stay per rank (tensor subclasses or layouts without a dense view)" if skipped else ""))
    return result
