"""Data parallel with replicated weights: every rank holds the whole model and optimizer state;
gradients are averaged over ranks once per optimizer step (not per micro step).

With optimizer.fused_back_pass each gradient is averaged and its parameter stepped inside backward instead
(parallel/fused_reduce.py); the reducer below would keep every gradient until the step.

The averaging is torch's DistributedDataParallel reducer: each bucket of gradients is all-reduced as
soon as backward has produced it, so communication overlaps the rest of backward. The reducer is driven
by forward hooks on each trained module (as torch's composable `replicate` does), so the module keeps
its class, its parameter names and its state dict; micro steps of a gradient accumulation run without
synchronising (DDP's `no_sync`), which must be decided before their forward (`prepare_micro_step`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ot_dist.optim.stochastic_rounding import RoundingNoise, rounded_back
from ot_dist.parallel.base import Strategy
from ot_dist.parallel.fused_reduce import FusedGradientReduce
from ot_dist.parallel.replica_check import diverged
from ot_dist.parallel.single import held_plain
from ot_dist.precision import DTYPES

MB = 1 << 20


class DDPStrategy(Strategy):
    name = "ddp"

    def _wrap_modules(self, model) -> None:
        self.replicas, self.fused_reduce = {}, None
        settings = self.config.ddp
        if settings.reduce_rounding == "stochastic":  # the same noise on every rank: they hold the same averages
            self.rounding_noise = RoundingNoise(self.config.seed, "gradient_average")
        if self.config.optimizer.fused_back_pass:
            trained = [[p for p in module.parameters() if p.requires_grad] for module in self.trained_modules.values()]
            self.fused_reduce = FusedGradientReduce(trained, self.runtime.device,
                                                    buffer_bytes=int(settings.fused_reduce_buffer_mb * MB),
                                                    coalesce_bytes=int(settings.bucket_mb * MB),
                                                    reduce_dtype=DTYPES[settings.reduce_dtype],
                                                    rounding=self.rounding_noise)
            return
        # One reducer per trained module; each gets its own process group when there are several, so the
        # reducers' all-reduces can never interleave differently on different ranks.
        several = len(self.trained_modules) > 1
        self.replicas = {
            name: Replica(module, dist.new_group() if several else None, settings.bucket_mb,
                          DTYPES[settings.reduce_dtype], self.rounding_noise, key=k)
            for k, (name, module) in enumerate(self.trained_modules.items())
        }

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.fused_reduce is not None:
            self.fused_reduce.connect(optimizer.fused_steps)
        return super().wrap_optimizer(optimizer)

    def prepare_micro_step(self, last_micro_step: bool) -> None:
        super().prepare_micro_step(last_micro_step)
        for replica in self.replicas.values():
            replica.synchronise = last_micro_step

    def held_tensors(self):
        return held_plain(self)

    def diverged_replicas(self) -> dict[str, list[int]]:
        return diverged(self.trained_parameters(), self.runtime.device)


class Replica:
    """DistributedDataParallel's reducer over one module's trainable parameters.

    Parameters a rank's batch did not reach (a part whose output one rank's loss ignored, a parameter
    frozen mid-run by `stop_training_after`) are found after forward and reduced as zeros on that rank, so
    every rank issues the same collectives; one no rank reached keeps no gradient, as in one process."""

    def __init__(self, module: torch.nn.Module, group, bucket_mb: float = 32,
                 reduce_dtype: torch.dtype = torch.float32, rounding: RoundingNoise | None = None, key: int = 0):
        """`rounding`: where averages rounded back into bfloat16 get their noise (stochastic rounding; None: to
        nearest), each bucket keyed by `key` (this replica's place) and its index."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.synchronise = True
        # The reducer's module is a list of the trainable parameters alone (no buffers to broadcast). No device_ids:
        # with them DDP's forward moves its inputs to the device and takes the first, and the reducer's forward has
        # none (an IndexError on every CUDA rank); the parameters are on the device already.
        self.ddp = DistributedDataParallel(
            torch.nn.ParameterList(self.params),
            device_ids=None,
            process_group=group,
            bucket_cap_mb=bucket_mb,
            find_unused_parameters=True,
            gradient_as_bucket_view=True,
        )
        if any(p.dtype != reduce_dtype for p in self.params):  # else DDP's own all-reduce, in the gradients' dtype
            self.ddp.register_comm_hook(group, reduced_in(reduce_dtype, rounding, key))
        module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        module.register_forward_hook(self._after_forward)

    def _active(self) -> bool:
        # A module whose parameters all left training (stop_training_after) no longer takes part: every
        # rank stops at the same step.
        return any(p.requires_grad for p in self.params)

    def _before_forward(self, module, args, kwargs):
        if self._active():
            self.ddp.require_backward_grad_sync = self.synchronise
            self.ddp._pre_forward()
        return None

    def _after_forward(self, module, args, output):
        if self._active():
            return self.ddp._post_forward(output)
        return None


def reduced_in(dtype: torch.dtype, rounding: RoundingNoise | None = None, key: int = 0):
    """A DDP communication hook that averages each bucket in `dtype` and rounds the result back into the bucket:
    bfloat16 gradients (trained_weight_dtype bfloat16) summed in float32, as OneTrainer's default
    gradient_reduce_precision, instead of accumulating a rounding at every hop of the ring. With `rounding`, back into
    bfloat16 stochastically, with noise keyed by (`key`, the bucket's index): DDP builds the same buckets on every
    rank, so every rank rounds the same average the same way."""

    def hook(group, bucket):  # unannotated: DDP checks the annotations against the classes, not strings
        buffer = bucket.buffer()
        bucket_key = (key << 32) + bucket.index()
        wide = buffer.to(dtype)
        group = group if group is not None else dist.group.WORLD
        wide.div_(dist.get_world_size(group))
        future = dist.all_reduce(wide, group=group, async_op=True).get_future()

        def narrowed(done) -> torch.Tensor:
            if wide is not buffer:  # a bucket already in `dtype` was reduced in place
                buffer.copy_(rounded_back(done.value()[0], buffer.dtype, rounding, bucket_key))
            return buffer

        return future.then(narrowed)

    return hook
