"""`<denoiser>.offload_fraction` (OneTrainer's layer offloading): the frozen weights of the denoiser's last blocks (a
LoRA's base) live in CPU memory and are copied to the device for each forward of their block.

The blocks are the family's repeated units (`Family.shard_units`: FSDP2's units, the blocks gradient checkpointing
recomputes). The first blocks stay on the device while their frozen bytes fit in (1 - fraction) of all blocks'
frozen bytes; the rest stream. Before a streamed block's forward a device copy of each frozen parameter takes its
place in the module (memory/offload.py `Visitor`); after it the CPU parameter is put back. Trained parameters (the
LoRA adapters inside the block) and buffers stay on the device.

Why gradient checkpointing is required, and why no copy is released by hand: a checkpointed block keeps nothing for
backward from its first forward, so its copies are freed as soon as it returns; in backward the block's forward runs
again (the pre-hook copies again) and autograd keeps that second set of copies exactly until the block's backward has
used them. So at most a block's copies or two are on the device at a time, and a copy can never be freed while
backward still reads it. The copies come from pinned memory with non_blocking on the current stream: ordered
before the kernels that read them, no host wait.
"""

from __future__ import annotations

import contextlib

import torch

from ot_dist.memory.offload import Visitor

STREAMED_ATTR = "streamed_block_names"  # on the denoiser: the names of its streamed blocks (sampling copies them)


def frozen_entries(block: torch.nn.Module) -> list[tuple[dict, str]]:
    """(the owner's dict of parameters, name) of each frozen parameter in `block`, each tensor once."""
    entries, seen = [], set()
    for owner in block.modules():
        for name, param in owner._parameters.items():
            if param is not None and not param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                entries.append((owner._parameters, name))
    return entries


def frozen_bytes(block: torch.nn.Module) -> int:
    return sum(table[name].numel() * table[name].element_size() for table, name in frozen_entries(block))


def streamed_blocks(blocks: list[torch.nn.Module], fraction: float) -> list[torch.nn.Module]:
    """The blocks that stream: the last ones, once the first ones' frozen bytes reach (1 - fraction) of all."""
    if fraction <= 0:
        return []
    sizes = [frozen_bytes(b) for b in blocks]
    budget, resident = (1.0 - fraction) * sum(sizes), 0
    for i, size in enumerate(sizes):
        if resident + size > budget:
            return blocks[i:]
        resident += size
    return []


@contextlib.contextmanager
def kept_home(blocks: list[torch.nn.Module]):
    """The blocks' frozen parameters out of their modules while the component moves to the device (`Module.to`
    skips an empty entry), so a model larger than the device never lands on it whole; put back afterwards."""
    entries = [(table, name, table[name]) for block in blocks for table, name in frozen_entries(block)]
    for table, name, _ in entries:
        table[name] = None
    try:
        yield
    finally:
        for table, name, param in entries:
            table[name] = param


def stream_blocks(root: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device) -> None:
    """Attach the copy-on-forward to each of `root`'s streamed `blocks` (their frozen parameters in CPU memory)."""
    device = torch.device(device)
    names = {id(m): n for n, m in root.named_modules()}
    for block in blocks:
        Visitor(block, device, pin=device.type == "cuda", entries=frozen_entries(block)).attach()
    setattr(root, STREAMED_ATTR, tuple(names[id(b)] for b in blocks))
