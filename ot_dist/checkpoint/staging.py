"""Host copies of the tensors a checkpoint saves.

Written at once (`independent=False`), a checkpoint may save a CPU tensor as it is: nothing changes it before the
write ends. Written in the background (checkpoint/writer.py), training goes on and changes the weights, moments and
averages while the file is written, so each tensor gets its own copy, taken at the step the checkpoint is of. Tensors
on a GPU are copied into pinned host memory with non_blocking: the copies are queued on the current stream, after
the optimizer step that made the values and before the next one changes them, and the host does not wait for them;
the writer thread waits for their event before it writes. CPU tensors (DeepSpeed's offloaded partitions, an EMA in
CPU memory, runs on the CPU) are copied at once, which costs a memory copy, not a device sync."""

from __future__ import annotations

import torch

from ot_dist.parallel.ownership import local


class HostCopies:
    def __init__(self, independent: bool):
        self.independent = independent
        self._on_gpu = False
        self._seen: set[int] = set()  # storages already in this checkpoint (see __call__)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = local(tensor).detach()
        if not self.independent:
            copy = tensor.to("cpu").contiguous()
            # safetensors refuses tensors sharing memory (a ZeRO-3 master is its partition's storage)
            if copy.untyped_storage().data_ptr() in self._seen:
                copy = copy.clone()
            self._seen.add(copy.untyped_storage().data_ptr())
            return copy
        on_gpu = tensor.device.type == "cuda"
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu)
        copy.copy_(tensor, non_blocking=on_gpu)
        self._on_gpu |= on_gpu
        return copy

    def ready(self) -> "CopiesDone":
        """Something to wait on before the copies are read: the event after the last GPU copy queued so far."""
        if not self._on_gpu:
            return CopiesDone(None)
        event = torch.cuda.Event()
        event.record()
        return CopiesDone(event)


class CopiesDone:
    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def release(self) -> None:
        """After the copies were written and dropped: give their pinned memory back. torch's caching host allocator
        would otherwise keep it pinned for the rest of the run (one copy of the rank's state: tens of GB for a full
        finetune on one GPU), where a blocking write's pageable copies are freed after each save."""
        if self.event is not None:
            empty_pinned_cache()


def empty_pinned_cache() -> None:
    """Give torch's cached pinned host memory back to the system, where this torch has a way to. The public
    name (`torch.accelerator.empty_host_cache`, torch 2.13) is recent: older releases (the lent GPU machines run
    2.11) have only the private `torch._C._host_emptyCache` that it replaced."""
    release = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()
