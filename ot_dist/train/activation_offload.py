"""`activation_offloading` (OneTrainer's activation offloading): with gradient checkpointing, what a checkpointed
block keeps for backward is its inputs (the hidden states entering it, for a transformer block one image's tokens
at full width); everything inside the block is recomputed. Those inputs are copied to CPU memory during forward and
back to the device when backward recomputes the block, so the device holds one block's inputs instead of every
block's.

How: torch's non-reentrant checkpoint saves a block's inputs as saved tensors before it installs its own hooks for
the block's insides (`torch.utils.checkpoint._checkpoint_without_reentrant_generator`: `save_inputs` runs outside
`_checkpoint_hook`). Saved-tensor hooks around the checkpoint call therefore see exactly the inputs, and the
checkpoint's own hooks, innermost, keep handling what the block saves. The copies are asynchronous on a GPU: into
pinned memory on the compute stream in forward (the device memory freed afterwards is reused only by work queued
after the copy), back on the same stream in backward (the pinned allocator keeps the buffer until that copy is done).
Tensors under `MIN_OFFLOADED_BYTES` (timestep embeddings, rotary tables) stay: a copy costs more than they hold.
"""

from __future__ import annotations

import functools

import torch

MIN_OFFLOADED_BYTES = 1 << 20


class Offloaded:
    """A saved tensor's CPU copy and the device it goes back to."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device = host, device


def offload(tensor: torch.Tensor) -> torch.Tensor | Offloaded:
    if tensor.numel() * tensor.element_size() < MIN_OFFLOADED_BYTES or tensor.layout != torch.strided:
        return tensor
    # a fresh host tensor also when the device is the CPU: the same copies as on a GPU, which tests count
    host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.device.type == "cuda")
    host.copy_(tensor, non_blocking=True)
    return Offloaded(host, tensor.device)


def restore(packed: torch.Tensor | Offloaded) -> torch.Tensor:
    if isinstance(packed, Offloaded):
        return packed.host.to(packed.device, non_blocking=True, copy=True)
    return packed


def offloaded_inputs():
    """The context in which a checkpoint call's saved inputs go to CPU memory."""
    return torch.autograd.graph.saved_tensors_hooks(offload, restore)


def offloading_checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint (non-reentrant) with the checkpointed call's inputs kept in CPU memory (without
    gradients nothing is saved, so nothing is offloaded)."""
    with offloaded_inputs():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def diffusers_checkpointing_function(module: torch.nn.Module, *args):
    """diffusers' `gradient_checkpointing_func` signature: checkpoint `module`'s whole call (its hooks included,
    as diffusers' default does), inputs offloaded."""
    return offloading_checkpoint(module.__call__, *args)


def checkpoint_function(offload_activations: bool):
    """The checkpoint call ot_dist's own selective checkpointing uses."""
    if offload_activations:
        return offloading_checkpoint
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
