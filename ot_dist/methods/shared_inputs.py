"""Layers of a block that take the very same input tensor compute their input-side projections as one matmul.

In an attention block q, k and v read one tensor (k and v alone in cross-attention; Flux's single blocks add their
MLP's input projection). With LoRA each of those layers runs its own down projection of that input: for q / k / v,
three rank-wide matmuls forward and six backward (weight and input gradients), and the input's gradient summed from
three. Concatenating the down weights (which the block casts copy anyway, block_casts.py) makes it one matmul
forward, two backward and one add, its output split among the layers: 560 fewer ops per SDXL LoRA step
(issue 21: SDXL LoRA's steps are paced by the host that launches them).

Which layers share an input is learned, not assumed: the first forward of a block runs ungrouped and records the
input each layer received (by identity). Layers that received the same tensor, each exactly once, form a group. A
recomputation in backward (activation checkpointing) must save the same tensors as the forward it replays, so the
groups take effect only once no ungrouped forward awaits its backward; a forward and its recomputation then always
run the same layout. A group whose layers no longer share their input (another code path) stays correct: each such
layer computes the group's projection of its own input and takes its part."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def in_backward() -> bool:
    """Whether this forward runs inside backward: a recomputation of activation checkpointing."""
    return torch._C._current_graph_task_id() != -1


class SharedInputs:
    """The groups of one block's layers (by their index in the block) whose first weights are concatenated, and
    during a forward the projections computed so far."""

    def __init__(self):
        self.groups: tuple[tuple[int, ...], ...] = ()  # in effect once learned
        self.member_of: dict[int, tuple[int, int]] = {}  # layer -> (group, position in it), once learned
        self.sizes: list[list[int]] = []  # the widths of each group's parts, once learned
        self.learned = False
        self.found: tuple[tuple[int, ...], ...] | None = None  # recorded, waiting for the ungrouped backwards
        self.awaiting = 0  # ungrouped forwards whose backward has not run yet
        self.counted = False  # whether the forward under way is one of them
        self.recording: dict[int, tuple[torch.Tensor, list[int]]] | None = None  # id(input) -> (input, layers)
        self.weights: list[torch.Tensor] | None = None  # each group's concatenated weight copy, while a forward shares
        self.cache: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]]] = {}

    def layout(self) -> tuple[tuple[int, ...], ...]:
        """At a forward's start: the groups this forward concatenates (none until learned)."""
        self.counted, self.recording, self.cache = False, None, {}
        if in_backward() or self.learned:  # in backward: a recomputation, whose forward had this layout
            return self.groups
        if self.found is None:
            self.recording = {}
        if torch.is_grad_enabled():
            self.counted = True
            self.awaiting += 1
        return ()

    def backward_done(self) -> None:
        """The casts of a counted forward received their gradients: its backward (and recomputation) is over."""
        self.awaiting -= 1
        self._take_found()

    def start(self, weights: list[torch.Tensor]) -> None:
        """This forward's concatenated weight copy of each group (in layout's order)."""
        self.weights = weights

    def projection(self, layer: int, x: torch.Tensor,
                   weight_of: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> torch.Tensor | None:
        """`x @ W^T` for the layer's first weight W, computed once for its group and this input; None where the
        layer computes its own. `weight_of` makes a group's concatenated weight where no forward shares one: in the
        recomputation of a module inside the block (a checkpointed attention), whose forward shared."""
        if self.recording is not None:
            self.recording.setdefault(id(x), (x, []))[1].append(layer)  # the tensor held: its id stays unique
            return None
        where = self.member_of.get(layer)
        if where is None or (weight_of is None and self.weights is None):
            return None
        group, position = where
        cached = self.cache.get(group)
        if cached is None or cached[0] is not x or layer in cached[2]:
            weight = self.weights[group] if weight_of is None else weight_of(self.groups[group])
            cached = (x, F.linear(x, weight).split(self.sizes[group], dim=-1), set())
            self.cache[group] = cached
        cached[2].add(layer)
        if len(cached[2]) == len(self.groups[group]):  # every member served: the input is not held any longer
            del self.cache[group]
        return cached[1][position]

    def end(self, weights_of: Callable[[], list[tuple[torch.Tensor, ...]]]) -> None:
        """At the forward's end: drop what it held; a recording gives the groups found."""
        if self.recording is None and self.weights is None and not self.cache:
            return  # nothing held (a forward that did not share: no autocast, compiled blocks)
        if self.recording is not None:
            weights = weights_of()
            self.found = _groups(self.recording, weights)
            self.sizes = [[weights[layer][0].shape[0] for layer in members] for members in self.found]
        self.recording, self.weights, self.cache = None, None, {}
        self._take_found()

    def _take_found(self) -> None:
        if self.found is not None and self.awaiting == 0:
            self.groups, self.found, self.learned = self.found, None, True
            self.member_of = {layer: (g, position) for g, members in enumerate(self.groups)
                              for position, layer in enumerate(members)}


def _groups(recording: dict[int, tuple[torch.Tensor, list[int]]],
            weights: list[tuple[torch.Tensor, ...]]) -> tuple[tuple[int, ...], ...]:
    """Layers that received the same input, each once in the forward, with first weights that concatenate."""
    calls: dict[int, int] = {}
    for _, layers in recording.values():
        for layer in layers:
            calls[layer] = calls.get(layer, 0) + 1
    groups = []
    for _, layers in recording.values():
        members = sorted(layer for layer in set(layers) if calls[layer] == 1)
        first = [weights[layer][0] for layer in members]
        if len(members) >= 2 and all(w.shape[1:] == first[0].shape[1:] and w.dtype == first[0].dtype
                                     and w.is_contiguous() for w in first):
            groups.append(tuple(members))
    return tuple(sorted(groups))
