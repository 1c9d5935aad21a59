"""Streaming the blocks of a denoiser that trains (`<denoiser>.offload_fraction` in a full finetune; OneTrainer's
layer offloading of a trained part): the streamed blocks' weights (the master weights themselves) live in CPU
memory and visit the device for their block's forward and recomputation, as a LoRA's frozen base does
(memory/block_streaming.py). Each weight is updated on the device inside backward, while its copy is there, by the
fused back pass (optim/fused_backward.py), and the result is copied home. Its optimizer state stays on the device
(small for Adafactor, OneTrainer's choice for these runs; Adam's two moments would be twice the weights).

Why the device copy is not a leaf that collects the gradient: with non-reentrant checkpointing, backward runs the
nodes of the block's *first* forward, fed with the recomputation's saved tensors. A leaf copy would be the first
forward's, held by its gradient-accumulation node from forward to backward: every streamed block's weights on the
device at once. `StreamIn` instead is a node that holds no tensor: its input is the CPU parameter, its output the
device copy. Its backward gets the weight's whole gradient (autograd sums a tensor's gradients before its node
runs, so every use of the weight in the block is in it), takes the recomputation's copy of the weight (the same
values, already on the device, and read by no node that is still to run), steps it there and copies it home.

The copies home are asynchronous on a GPU (pinned memory, the compute stream). Device work that reads the weights
next (the next forward's copies, the EMA's) is queued behind them on a stream that waits for this one; a reader on
the host (a checkpoint, an export, an EMA in CPU memory) is not, so `settle()` waits for the last copy once per
optimizer step.
"""

from __future__ import annotations

import types

import torch

from ot_dist.memory.offload import device_copies


class TrainedStreaming:
    """What the streamed blocks of a training denoiser share: the optimizer's per-parameter steps, the copies their
    recomputation made (kept until the weight's step), and the last copy home."""

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin
        self.fused = None  # the optimizer's fused back pass (optim/fused_backward.py)
        self.optimizer: torch.optim.Optimizer | None = None
        self.recomputed: dict[int, torch.Tensor] = {}  # id(home) -> its copy in the current recomputation
        self.unsettled = False  # weights stepped (and their copies home queued) since the last settle()
        self.updates = 0  # weights stepped on the device so far
        self.updated_at: dict[int, int] = {}  # id(home) -> `updates` after its last step

    def __deepcopy__(self, memo) -> "TrainedStreaming":
        # A copy of the module (sampling's, its template) never trains: nothing here, the optimizer least of all.
        return TrainedStreaming(self.device, self.pin)

    def unchanged_since(self, home_ids: list[int], updates: int) -> bool:
        """Whether none of these weights was stepped after the `updates`-th step."""
        return all(self.updated_at.get(i, 0) <= updates for i in home_ids)

    def connect(self, optimizer: torch.optim.Optimizer) -> None:
        """Step with `optimizer` (built with the fused back pass), and wait for the copies home in its `step`."""
        fused = getattr(optimizer, "fused_steps", None)
        if fused is None:
            raise ValueError("a denoiser whose trained blocks stream needs optimizer.fused_back_pass: true")
        self.fused, self.optimizer = fused, optimizer
        stepped = optimizer.step  # the fused back pass's: the steps already happened in backward

        def settle_then_step(opt, *args, **kwargs):
            self.settle()
            return stepped(*args, **kwargs)

        optimizer.step = types.MethodType(settle_then_step, optimizer)  # bound: LR schedulers read __func__

    def streams(self, home: torch.nn.Parameter) -> None:
        """`home` is a streamed weight: its complete gradient (averaged over ranks under ddp) steps its device copy."""
        self.fused.appliers[id(home)] = lambda gradient: self.step(home, gradient)

    def placed(self, home: torch.nn.Parameter, moved: torch.Tensor) -> torch.Tensor:
        """The device copy of a trained weight as the module uses it while gradients are recorded."""
        if torch._C._current_graph_task_id() != -1:  # the recomputation inside backward: the copy the step takes
            self.recomputed[id(home)] = moved
        return StreamIn.apply(home, moved, self)

    def step(self, home: torch.nn.Parameter, gradient: torch.Tensor) -> None:
        """The weight's update on the device with its whole `gradient`, then its copy home."""
        weight = self.recomputed.pop(id(home), None)
        if weight is None:  # no recomputation kept a copy (a block that was not checkpointed): make one
            weight = device_copies([home], self.device, self.pin)[0]
        cpu = home.data
        home.data, home.grad = weight, gradient.to(weight.dtype)
        try:
            self._state_beside(home)
            self.fused.steppers[id(home)](home)  # the optimizer's step of this one parameter; frees its gradient
            # the stepped values are whatever the parameter holds now: a step hook may have replaced the tensor
            # (stochastic rounding steps a float32 copy and rounds it into a new bfloat16 one)
            cpu.copy_(home.data, non_blocking=True)
        finally:
            home.data, home.grad = cpu, None
        self.updates += 1
        self.updated_at[id(home)] = self.updates
        self.unsettled = True

    def _state_beside(self, home: torch.nn.Parameter) -> None:
        """Optimizer state next to the weight it updates: a resumed checkpoint loads it beside the CPU parameter.
        Scalars stay where the optimizer made them (torch keeps Adam's step count on the host unless fused)."""
        state = self.optimizer.state.get(home, {})  # connect() set the optimizer before any step
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != home.device:
                state[key] = value.to(home.device, non_blocking=True)

    def settle(self) -> None:
        """After backward: the weights at home are the stepped ones (one host wait per step, on a GPU only), and no
        recomputation's copy outlives the step (a weight no output depended on got no step and left its copy)."""
        self.recomputed.clear()
        if self.unsettled and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # every copy home was queued on this stream
        self.unsettled = False


class StreamIn(torch.autograd.Function):
    """home (a CPU parameter that trains) -> its device copy; in backward, the weight's step (see the module doc)."""

    @staticmethod
    def forward(ctx, home: torch.Tensor, moved: torch.Tensor, streaming: TrainedStreaming) -> torch.Tensor:
        ctx.home, ctx.streaming = home, streaming  # no tensor saved: the node keeps no device memory alive
        return moved.view_as(moved)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        streaming = ctx.streaming
        if streaming.fused is None:
            raise RuntimeError("a streamed trained weight got its gradient before TrainedStreaming.connect")
        streaming.fused.ready(ctx.home, gradient)  # -> step(), once the gradient is averaged over ranks (ddp)
        return None, None, None  # nothing accumulates on the CPU parameter: the step already used the gradient
