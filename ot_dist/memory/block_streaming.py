"""`<denoiser>.offload_fraction` (OneTrainer's layer offloading): the frozen weights of the denoiser's last blocks (a
LoRA's base) live in CPU memory and are copied to the device for each forward of their block.

The blocks are the family's repeated units (`Family.shard_units`: FSDP2's units, the blocks gradient checkpointing
recomputes). The first blocks stay on the device while their frozen bytes fit in (1 - fraction) of all blocks'
frozen bytes; the rest stream. Before a streamed block's forward a device copy of each frozen parameter takes its
place in the module (memory/offload.py `Visitor`); after it the CPU parameter is put back. Trained parameters (the
LoRA adapters inside the block) and buffers stay on the device; in a full finetune the trained weights stream too
and are stepped inside backward (memory/trained_streaming.py).

Why gradient checkpointing is required, and why no copy is released by hand: a checkpointed block keeps nothing for
backward from its first forward, so its copies are freed as soon as it returns; in backward the block's forward runs
again (the pre-hook copies again) and autograd keeps that second set of copies exactly until the block's backward has
used them. A copy can never be freed while backward still reads it. The copies come from pinned memory without a
host wait; the Prefetcher makes the next block's while a block computes (on a GPU on a stream of its own), so the
device holds at most about three streamed blocks' weights at a time (the current one's, the next one's, and in
backward the previous recomputation's until its backward is done).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ot_dist.memory.offload import Visitor, device_copies
from ot_dist.memory.trained_streaming import TrainedStreaming

STREAMED_ATTR = "streamed_block_names"  # on the denoiser: the names of its streamed blocks (sampling copies them)
PREFETCHER_ATTR = "streamed_block_prefetcher"  # on the denoiser: its streamed blocks' Prefetcher


def streamed_entries(block: torch.nn.Module, trained: bool = False) -> list[tuple[dict, str]]:
    """What a streamed block moves: (the owner's dict of parameters, name) of each frozen parameter in `block`, each
    tensor once; with `trained`, of the trained ones too (memory/trained_streaming.py)."""
    entries, seen = [], set()
    for owner in block.modules():
        for name, param in owner._parameters.items():
            if param is not None and (trained or not param.requires_grad) and id(param) not in seen:
                seen.add(id(param))
                entries.append((owner._parameters, name))
    return entries


def streamed_bytes_of(block: torch.nn.Module, trained: bool = False) -> int:
    """The bytes `streamed_entries` moves."""
    return sum(table[name].numel() * table[name].element_size() for table, name in streamed_entries(block, trained))


def streamed_blocks(blocks: list[torch.nn.Module], fraction: float, trained: bool = False) -> list[torch.nn.Module]:
    """The blocks that stream: the last ones, once the first ones' streamed bytes (frozen; with `trained`, all)
    reach (1 - fraction) of all."""
    if fraction <= 0:
        return []
    return blocks[first_streamed([streamed_bytes_of(b, trained) for b in blocks], fraction):]


def first_streamed(sizes: list[float], fraction: float) -> int:
    """The index of the first streamed block of blocks of these sizes (len(sizes): none streams): the first one that
    no longer fits in (1 - fraction) of all, after the ones before it. The memory table counts with it too."""
    budget, resident = (1.0 - fraction) * sum(sizes), 0
    for i, size in enumerate(sizes):
        if resident + size > budget:
            return i
        resident += size
    return len(sizes)


def denoiser_streamed_blocks(model, config) -> list[torch.nn.Module]:
    """The denoiser's blocks that stream under `<denoiser>.offload_fraction`, from its family's units and their
    frozen bytes as stored (call after store_component)."""
    from ot_dist.parallel.fsdp import family_units

    name = model.family.denoiser
    return streamed_blocks(family_units(model.family, name, model.denoiser), getattr(config, name).offload_fraction,
                           trained=config.streams_trained_weights())


def streamed_in(root: torch.nn.Module) -> list[torch.nn.Module]:
    """`root`'s streamed blocks, by the names `stream_blocks` left on it (a deep copy of `root` finds its own)."""
    return [root.get_submodule(name) for name in getattr(root, STREAMED_ATTR, ())]


@contextlib.contextmanager
def kept_home(blocks: list[torch.nn.Module], trained: bool = False):
    """The blocks' streamed parameters out of their modules while the component moves to the device (`Module.to`
    skips an empty entry), so a model larger than the device never lands on it whole; put back afterwards."""
    entries = [(table, name, table[name]) for block in blocks for table, name in streamed_entries(block, trained)]
    for table, name, _ in entries:
        table[name] = None
    try:
        yield
    finally:
        for table, name, param in entries:
            table[name] = param


def stream_blocks(root: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device,
                  trained: bool = False) -> "Prefetcher":
    """Attach the copy-on-forward to each of `root`'s streamed `blocks` (their frozen parameters in CPU memory; with
    `trained`, the trained ones too, stepped inside backward: memory/trained_streaming.py), with one Prefetcher for
    them all. The TrainedStreaming, if any, is the prefetcher's `trained`."""
    device = torch.device(device)
    pin = device.type == "cuda"
    names = {id(m): n for n, m in root.named_modules()}
    prefetcher = Prefetcher(device, TrainedStreaming(device, pin) if trained else None)
    for block in blocks:
        StreamedBlock(block, device, pin=pin, entries=streamed_entries(block, trained), prefetcher=prefetcher).attach()
    setattr(root, STREAMED_ATTR, tuple(names[id(b)] for b in blocks))
    setattr(root, PREFETCHER_ATTR, prefetcher)
    return prefetcher


def connect_trained_streaming(root: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Hand the optimizer to `root`'s streamed trained blocks (they step inside backward). Returns whether any."""
    prefetcher = getattr(root, PREFETCHER_ATTR, None)
    if prefetcher is None or prefetcher.trained is None:
        return False
    prefetcher.trained.connect(optimizer)
    for block in streamed_in(root):
        for table, name in streamed_entries(block, trained=True):
            if table[name].requires_grad:
                prefetcher.trained.streams(table[name])
    return True


class StreamedBlock(Visitor):
    """A streamed block's visitor: its copies come from the Prefetcher, which may have made them already."""

    def __init__(self, module, device, pin, entries, prefetcher: "Prefetcher"):
        super().__init__(module, device, pin, entries)
        self.prefetcher = prefetcher

    def device_copies(self, homes: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.prefetcher.copies_for(self, homes)

    def placed(self, home: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
        trained = self.prefetcher.trained
        if trained is not None and home.requires_grad and torch.is_grad_enabled():
            return trained.placed(home, moved)
        return super().placed(home, moved)


class Prefetcher:
    """While a streamed block computes, the copies of the block that runs after it are made: the next one in the
    order the first forward ran them, or in backward (whose recomputations run in reverse) the previous one. On a
    GPU they are made on a stream of their own, so the copy overlaps the block's compute; the block that takes them
    waits for that copy only (an event) and marks them used on its stream (`record_stream`), so the allocator does not
    hand their memory out again while its kernels may still read it. So the device holds one more block's weights.
    Copies made for a block whose home tensors have changed since (another module assigned into it) are dropped.

    The order is recorded in the first forward (no prefetch there), as FSDP2's prefetch in this code base records it:
    a UNet runs its blocks in another order than it registers them."""

    def __init__(self, device: torch.device, trained: TrainedStreaming | None = None):
        self.device = device
        self.trained = trained  # the trained weights' steps, when the blocks' weights train
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.order: list[StreamedBlock] = []
        self.complete = False  # the order is known
        # block id -> (home ids, copies, event, the trained weights' update count when made)
        self.ready: dict[int, tuple[list[int], list[torch.Tensor], object, int]] = {}
        self.taken = self.made = 0  # copies taken from a prefetch, made on arrival (blocks)

    def __deepcopy__(self, memo) -> "Prefetcher":
        # A copy of the module (sampling's, its template) streams with a prefetcher of its own: nothing made here, no
        # CUDA stream or event, is copied (neither can be), and the order is recorded again.
        return Prefetcher(self.device, copy.deepcopy(self.trained, memo))

    def copies_for(self, block: StreamedBlock, homes: list[torch.Tensor]) -> list[torch.Tensor]:
        backward = torch._C._current_graph_task_id() != -1  # a recomputation inside backward
        self._record(block, backward)
        ready = self.ready.pop(id(block), None)
        if ready is not None and ready[0] == [id(h) for h in homes] and self._still_current(ready):
            copies = self._take(ready)
            self.taken += 1
        else:
            copies = device_copies(homes, self.device, block.pin)
            self.made += 1
        if self.complete:
            self._prefetch(self.order.index(block) + (-1 if backward else 1))
        return copies

    def _record(self, block: StreamedBlock, backward: bool) -> None:
        if self.complete:
            return
        if backward or block in self.order:
            self.complete = True
        else:
            self.order.append(block)

    def _prefetch(self, position: int) -> None:
        if not 0 <= position < len(self.order):
            return
        block = self.order[position]
        if id(block) in self.ready or block.depth:
            return
        homes = [table[name] for table, name in block.entries]
        if self.stream is None:
            self.ready[id(block)] = ([id(h) for h in homes], device_copies(homes, self.device, block.pin), None,
                                     self._updates())
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after what was queued before it
        with torch.cuda.stream(self.stream):
            copies = device_copies(homes, self.device, block.pin)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ready[id(block)] = ([id(h) for h in homes], copies, event, self._updates())

    def _updates(self) -> int:
        return self.trained.updates if self.trained is not None else 0

    def _still_current(self, ready) -> bool:
        """Whether no weight of these copies was stepped since they were made. A block whose copies were prefetched
        in backward but that runs no recomputation (not checkpointed) would otherwise take them in the next
        forward, from before its step."""
        home_ids, _, _, made_at = ready
        return self.trained is None or self.trained.unchanged_since(home_ids, made_at)

    def _take(self, ready) -> list[torch.Tensor]:
        _, copies, event, _ = ready
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in copies:
                tensor.record_stream(current)
        return copies
