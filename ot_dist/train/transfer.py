"""Host -> device copies of a training step's inputs without blocking the host (issue 21).

`tensor.to(cuda_device)` from ordinary (pageable) host memory waits until the copy is done: the host stalls on
everything queued before it, every micro step. From pinned memory with `non_blocking=True` the copy is queued on
the stream like a kernel (torch's pinned-memory allocator keeps the buffer until the copy has run)."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device` (and in `dtype`, converted there), copied without a host sync."""
    device = torch.device(device)
    if tensor.device == device or (device.type == "cuda" and device.index is None and tensor.device.type == "cuda"):
        moved = tensor
    elif tensor.device.type == "cpu" and device.type == "cuda":
        moved = tensor.pin_memory().to(device=device, non_blocking=True)
    else:  # e.g. device -> host: the values must be there when this returns
        moved = tensor.to(device=device)
    return moved if dtype is None else moved.to(dtype)
