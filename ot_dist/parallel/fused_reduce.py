"""The fused back pass under ddp (OneTrainer's fused gradient reduce): each gradient is averaged over the ranks as
soon as backward has completed it, and its parameter is stepped once the average is there, all inside backward; so
no rank ever holds the whole model's gradients, as with one GPU (optim/fused_backward.py).

Each complete gradient is all-reduced asynchronously. Its step waits until more than `buffer_bytes` of gradients are
in flight behind it (or backward ends), so the communication overlaps the rest of backward instead of stalling it;
the buffer bounds what the overlap costs in memory.

Gradients smaller than `coalesce_bytes` share their all-reduce, in a bucket per dtype; all are averaged in
`reduce_dtype` (ddp.reduce_dtype) and rounded back to their own.

Every rank must issue the same all-reduces in the same order, whatever order its gradients complete in and even
when its batch did not reach a parameter (an MoE expert no token chose on this rank): gradients are issued in one
order all ranks share, a gradient that completes early waits for the ones before it, and a parameter this rank does
not reach is reduced as zeros in its turn (known when backward starts: autograd says which gradient nodes it will run;
a node that runs without a gradient is found when backward ends). One tiny all-reduce of "reached" flags then tells whether
any rank reached it: one no rank reached gets no step, as in one process (read on the host only on a rank that
missed a parameter). The shared order is each trained module's parameters in reverse (backward runs a model
backwards), then, from the second step, the order rank 0 saw its gradients complete in the first (as torch's DDP
rebuilds its buckets after its first iteration).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ot_dist.optim.fused_backward import FusedSteps
from ot_dist.optim.stochastic_rounding import RoundingNoise, rounded_back


class FusedGradientReduce:
    """The averaging of one rank's trained parameters' gradients inside backward, for the fused back pass."""

    def __init__(self, modules: list[list[torch.nn.Parameter]], device: torch.device, group=None,
                 buffer_bytes: int = 0, coalesce_bytes: int = 0, reduce_dtype: torch.dtype = torch.float32,
                 rounding: RoundingNoise | None = None):
        """`modules`: each trained module's trained parameters, the modules in the order backward reaches them last
        (the denoiser, then the text encoders that feed it), the same on every rank. Gradients under `coalesce_bytes`
        are averaged together, in buckets of that size per dtype (a bias or a norm alone would cost a collective's
        latency for a few bytes); larger ones alone. Each is averaged in `reduce_dtype` (bfloat16 gradients widened to
        float32, as OneTrainer's default gradient_reduce_precision) and rounded back to its own dtype: to nearest, or
        stochastically with `rounding`'s noise keyed by the parameter's index (every rank holds the same average, so
        every rank rounds it the same way, whenever it settles it)."""
        self.params = [p for params in modules for p in params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.device, self.group, self.buffer_bytes, self.coalesce_bytes = device, group, buffer_bytes, coalesce_bytes
        self.reduce_dtype, self.rounding = reduce_dtype, rounding
        self.world = dist.get_world_size(group)
        starts = [0]
        for params in modules:
            starts.append(starts[-1] + len(params))
        # the shared issue order (indices into params): until the first step has shown it, each module backwards
        self.order = [i for a, b in zip(starts, starts[1:]) for i in reversed(range(a, b))]
        self.learning = True  # the first backward: record the order gradients complete in
        self.completed: list[int] = []
        self.fused: FusedSteps | None = None
        # Each parameter's gradient-accumulation node, held (as torch's DDP holds them) so that it stays the node a
        # backward would run: whether it will run tells, as backward starts, which parameters this rank's batch did
        # not reach, so that their zeros are issued in their turn instead of holding up every gradient after them.
        with torch.enable_grad():
            self.accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.params]
        self._reset()
        # What the tests read: how many gradient bytes waited here at most (in flight or for their turn).
        self.peak_held_bytes = 0

    def _reset(self) -> None:
        self.active: list[int] | None = None  # this backward's issue order: the parameters that train now
        self.position: dict[int, int] = {}  # index -> its place in `active`
        self.cursor = 0  # active[:cursor] are issued
        self.waiting: dict[int, torch.Tensor | None] = {}  # complete gradients whose turn has not come (None: zeros)
        self.in_flight: deque = deque()  # (members, work, averaged buffer, the gradients' dtype); members: (index,
        # shape, reached here)
        self.buckets: dict[torch.dtype, list] = {}  # small gradients waiting for their bucket: (index, gradient, reached)
        self.bucket_bytes: dict[torch.dtype, int] = {}
        self.held_bytes = 0
        self.reached_flags: list[int] = []  # per active parameter: 1 where this rank's batch reached it
        self.unreached: set[int] = set()  # active parameters whose gradient node this backward does not run
        self.undecided: list = []  # (index, averaged gradient) of parameters this rank missed, until backward ends

    def connect(self, fused: FusedSteps) -> None:
        """Route the fused back pass's complete gradients through the averaging."""
        self.fused = fused
        fused.route = self.submit

    # -- inside backward ------------------------------------------------------------------------------------------
    def submit(self, param: torch.Tensor, gradient: torch.Tensor) -> None:
        """A parameter's gradient is complete on this rank (the fused back pass's hook)."""
        if self.active is None:
            self._begin()
        i = self.index[id(param)]
        if i in self.unreached:
            raise RuntimeError(f"fused gradient reduce: parameter {i} ({tuple(param.shape)}) got a gradient although "
                               "backward was not to reach it; its zeros were averaged in its place already")
        if self.learning:
            self.completed.append(i)
        self.waiting[i] = gradient
        self._hold(gradient, +1)
        self._issue_in_turn()
        while self.in_flight and self.held_bytes > self.buffer_bytes:
            self._finish(self.in_flight.popleft(), everywhere=None)

    def _begin(self) -> None:
        # Parameters frozen mid-run (stop_training_after) get no gradient on any rank: the same list everywhere.
        self.active = [i for i in self.order if self.params[i].requires_grad]
        self.position = {i: k for k, i in enumerate(self.active)}
        self.reached_flags = [0] * len(self.active)
        self.unreached = {i for i in self.active if not torch._C._will_engine_execute_node(self.accumulators[i])}
        self.waiting |= dict.fromkeys(self.unreached)  # zeros, issued in their turn
        torch.autograd.Variable._execution_engine.queue_callback(self._end)  # once backward is done

    def _issue_in_turn(self) -> None:
        while self.cursor < len(self.active) and self.active[self.cursor] in self.waiting:
            i = self.active[self.cursor]
            gradient = self.waiting.pop(i)
            reached = gradient is not None
            self.cursor += 1
            self.reached_flags[self.position[i]] = int(reached)
            self._queue(i, gradient if reached else self._zeros(i), reached)

    def _zeros(self, i: int) -> torch.Tensor:
        param = self.params[i]
        gradient = torch.zeros(param.shape, dtype=param.dtype, device=self.device)
        self._hold(gradient, +1)
        return gradient

    def _queue(self, i: int, gradient: torch.Tensor, reached: bool) -> None:
        """A large gradient is reduced at once; a small one joins its dtype's bucket, reduced once it is full. Both
        follow from the shared order and the sizes alone, so every rank issues the same collectives."""
        if self._bytes(gradient) >= self.coalesce_bytes:
            self._reduce([(i, gradient, reached)])
            return
        dtype = gradient.dtype
        self.buckets.setdefault(dtype, []).append((i, gradient, reached))
        self.bucket_bytes[dtype] = self.bucket_bytes.get(dtype, 0) + self._bytes(gradient)
        if self.bucket_bytes[dtype] >= self.coalesce_bytes:
            self._reduce(self.buckets.pop(dtype))
            del self.bucket_bytes[dtype]

    def _flush_buckets(self) -> None:
        for dtype in list(self.buckets):  # created in the shared order: the same on every rank
            self._reduce(self.buckets.pop(dtype))
        self.bucket_bytes.clear()

    def _reduce(self, members: list) -> None:
        dtype = members[0][1].dtype
        if len(members) == 1:
            buffer = members[0][1].to(self.reduce_dtype)  # the gradient itself where it has that dtype
        else:  # one flat copy
            buffer = torch.cat([gradient.reshape(-1) for _, gradient, _ in members]).to(self.reduce_dtype)
        for i, gradient, _ in members:
            if buffer is not gradient and self.params[i].grad is gradient:
                self.params[i].grad = None  # the buffer holds its values now
        buffer.div_(self.world)  # the mean over the global batch: each rank's gradient is its share's mean
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self.in_flight.append(([(i, gradient.shape, reached) for i, gradient, reached in members], work, buffer,
                               dtype))

    def _finish(self, entry, everywhere: list[int] | None) -> None:
        members, work, buffer, dtype = entry
        work.wait()  # under NCCL: the compute stream waits for the reduce, the host does not
        offset = 0
        for i, shape, reached in members:
            size = shape.numel()
            averaged = buffer if len(members) == 1 else buffer[offset:offset + size].view(shape)
            averaged = rounded_back(averaged, dtype, self.rounding, i)  # to the gradient's own dtype, if widened
            offset += size
            if not reached and everywhere is None:  # whether any rank reached it is known when backward ends
                self.undecided.append((i, averaged))
                continue
            self._settle(i, averaged, reached or everywhere[self.position[i]])

    def _settle(self, i: int, averaged: torch.Tensor, step: bool) -> None:
        self._hold(averaged, -1)
        if step:
            self.fused.apply(self.params[i], averaged)  # steps it; the gradient is freed with it

    def _end(self) -> None:
        """Backward is done: issue what is left in the shared order (zeros for what this rank did not reach), agree
        on what was reached anywhere, and step the rest."""
        late = [i for i in self.active[self.cursor:] if i not in self.waiting]  # its node ran without a gradient
        self.waiting |= dict.fromkeys(late)
        self._issue_in_turn()
        self._flush_buckets()
        missed = bool(self.unreached or late)
        # From pinned memory without a host wait (the host allocator keeps the block until the copy has run).
        flags = torch.tensor(self.reached_flags, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        flags = flags.to(self.device, non_blocking=True)
        work = dist.all_reduce(flags, group=self.group, async_op=True)
        everywhere = None
        if missed:  # only a rank that missed a parameter asks the others (a host read)
            work.wait()
            everywhere = flags.tolist()
        while self.in_flight:
            self._finish(self.in_flight.popleft(), everywhere)
        for i, averaged in self.undecided:
            self._settle(i, averaged, bool(everywhere[self.position[i]]))
        work.wait()
        if self.learning:
            self._adopt_rank0_order()
        self._reset()

    def _adopt_rank0_order(self) -> None:
        """From the second step on, issue in the order rank 0's gradients completed in the first."""
        seen = dict.fromkeys(self.completed)
        local = list(seen) + [i for i in self.order if i not in seen]
        order = torch.tensor(local, dtype=torch.int64, device=self.device)
        dist.broadcast(order, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        self.order = order.tolist()  # once, after the first step
        self.learning, self.completed = False, []

    def _hold(self, gradient: torch.Tensor, sign: int) -> None:
        self.held_bytes += sign * self._bytes(gradient)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    @staticmethod
    def _bytes(gradient: torch.Tensor) -> int:
        return gradient.numel() * gradient.element_size()
