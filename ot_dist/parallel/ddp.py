"""Data parallel with replicated weights: every rank holds the whole model and optimizer state;
gradients are averaged over ranks once per optimizer step (not per micro step), in buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ot_dist.parallel.base import Strategy
from ot_dist.parallel.single import held_plain

BUCKET_BYTES = 32 * 1024 * 1024


class DDPStrategy(Strategy):
    name = "ddp"

    def step(self, optimizer, params):
        self.all_reduce_gradients(params)
        return super().step(optimizer, params)

    def all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        # A parameter without a gradient on this rank still takes part (as zeros): every rank must
        # issue identical collectives, whatever its own batch touched.
        trainable = [p for p in params if p.requires_grad]
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in buckets(trainable):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= self.runtime.world_size
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def held_tensors(self):
        return held_plain(self)


def buckets(params: list[torch.nn.Parameter]):
    """Consecutive runs of same-dtype gradients up to BUCKET_BYTES each."""
    bucket, size = [], 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and (size + nbytes > BUCKET_BYTES or p.grad.dtype != bucket[0].grad.dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket
