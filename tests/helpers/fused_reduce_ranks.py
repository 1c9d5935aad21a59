"""Under 2 gloo ranks: the fused back pass under ddp (ot_dist/parallel/fused_reduce.py) on a small routed model, against
one process of the global batch (tests/test_fused_reduce.py).

    fused_reduce_ranks.py OUT_DIR [cuda]

With `cuda` (pytest -m gpu): one rank on the GPU in a group of gloo and NCCL, as a CUDA run makes it (the flags copied
from pinned memory, the zeros and the reduces on the device); started without torchrun's environment.

A "text encoder" feeds a "denoiser" (two trained modules, as a full finetune with its text encoder). The denoiser
routes every sample through expert 0, rank 0's samples through expert 1 too, and nobody's through expert 2: rank 1
misses expert 1 (reduced as zeros, its average still rank 0's half), and no rank reaches expert 2 (no step: AdamW's
weight decay would move it). Small gradients are averaged in shared buckets ("sgd_alone": each alone). Each rank writes
OUT_DIR/rank<R>.json: per run, the weights after STEPS steps and
the one-process weights (computed here on both halves of the batch), the events in order (gradient complete /
all-reduce issued / parameter stepped) and the reducer's peak of held gradient bytes per step; and, under "bfloat16",
the weights after STEPS SGD steps of the model in bfloat16 rounded stochastically, its gradients averaged in float32
and rounded back to nearest or stochastically, with the fused reduce and with DDP's reducer."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ot_dist.optim.fused_backward import install_fused_back_pass
from ot_dist.optim.stochastic_rounding import RoundingNoise, install_stochastic_rounding
from ot_dist.parallel.ddp import Replica
from ot_dist.parallel.fused_reduce import FusedGradientReduce

STEPS = 3
BUFFER_BYTES = 2048
COALESCE_BYTES = 1024  # the biases (and the text encoder's small weight) share buckets; "alone": none does


class TextEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.mix(torch.tanh(self.embed(x)))


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.out = torch.nn.Linear(32, 4)

    def forward(self, h, chosen: list[int]):
        h = torch.tanh(self.inp(h))
        return self.out(sum(torch.tanh(self.experts[e](h)) for e in chosen))


ROUTES = {0: [0, 1], 1: [0]}  # rank -> experts its samples go through (expert 2: nobody's)


DEVICE = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")


def build():
    torch.manual_seed(0)
    return TextEncoder().to(DEVICE), Denoiser().to(DEVICE)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g).to(DEVICE), torch.randn(4, 4, generator=g).to(DEVICE)


def loss_of(te, den, x, y, rank):
    return torch.nn.functional.mse_loss(den(te(x), ROUTES[rank]), y)


def make_optimizer(name, modules):
    """A parameter group per module, each its own learning rate (a full finetune's denoiser and text encoder)."""
    lr = 0.5 if name == "sgd" else 0.01
    groups = [{"params": list(m.parameters()), "lr": lr * share} for m, share in zip(modules, (1.0, 0.5))]
    if name == "sgd":
        return torch.optim.SGD(groups, foreach=False)
    return torch.optim.AdamW(groups, weight_decay=0.5, foreach=False)


def one_process(name):
    """The reference: both ranks' samples in one step (the mean of the two halves' mean losses), a plain step."""
    te, den = build()
    optimizer = make_optimizer(name, (den, te))
    ranks = range(dist.get_world_size())
    for step in range(STEPS):
        loss = sum(loss_of(te, den, *batch(step, rank), rank) for rank in ranks) / len(ranks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {f"{part}.{n}": p.detach().cpu().tolist() for part, m in (("denoiser", den), ("te", te))
            for n, p in m.named_parameters()}


def fused_ddp(name, rank, coalesce_bytes):
    te, den = build()
    modules = [list(den.parameters()), list(te.parameters())]  # the denoiser first, as Strategy.trained_modules
    optimizer = make_optimizer(name, (den, te))
    install_fused_back_pass(optimizer)
    reduce = FusedGradientReduce(modules, DEVICE, buffer_bytes=BUFFER_BYTES, coalesce_bytes=coalesce_bytes)
    reduce.connect(optimizer.fused_steps)
    names = {id(p): f"{part}.{n}" for part, m in (("denoiser", den), ("te", te)) for n, p in m.named_parameters()}

    events, peaks = [], []
    original_route, original_apply = optimizer.fused_steps.route, optimizer.fused_steps.apply
    all_reduce = dist.all_reduce

    def route(param, gradient):
        events.append(("complete", names[id(param)]))
        original_route(param, gradient)

    def apply(param, gradient):
        events.append(("stepped", names[id(param)]))
        original_apply(param, gradient)

    def counted_all_reduce(tensor, *args, **kwargs):
        events.append(("all_reduce", tuple(tensor.shape)))
        return all_reduce(tensor, *args, **kwargs)

    optimizer.fused_steps.route, optimizer.fused_steps.apply = route, apply
    dist.all_reduce = counted_all_reduce
    try:
        for step in range(STEPS):
            events.append(("step", step))
            reduce.peak_held_bytes = 0
            loss_of(te, den, *batch(step, rank), rank).backward()
            optimizer.step()
            peaks.append(reduce.peak_held_bytes)
            assert all(p.grad is None for params in modules for p in params), "a gradient outlived backward"
    finally:
        dist.all_reduce = all_reduce
    weights = {names[id(p)]: p.detach().cpu().tolist() for params in modules for p in params}
    sizes = {names[id(p)]: p.numel() * p.element_size() for params in modules for p in params}
    return {"weights": weights, "events": events, "peaks": peaks, "sizes": sizes,
            "untouched_state": [names[id(p)] for params in modules for p in params if p not in optimizer.state]}


def bfloat16_run(rank, fused: bool, gradient_rounding: str):
    """bfloat16 weights rounded stochastically after each SGD step (the fused back pass steps rank 1's missed expert
    last, after the ranks agree on it), each gradient averaged in float32 and rounded back (`gradient_rounding`), by
    the fused reduce or by DDP's reducer; the noise keyed to each step as the trainer keys it."""
    te, den = (m.to(torch.bfloat16) for m in build())
    modules = [list(den.parameters()), list(te.parameters())]
    optimizer = make_optimizer("sgd", (den, te))
    rounding = RoundingNoise(7, "gradient_average") if gradient_rounding == "stochastic" else None
    noises = [noise for noise in (install_stochastic_rounding(optimizer, seed=7), rounding) if noise is not None]
    if fused:
        install_fused_back_pass(optimizer)
        FusedGradientReduce(modules, DEVICE, buffer_bytes=BUFFER_BYTES, coalesce_bytes=COALESCE_BYTES,
                            rounding=rounding).connect(optimizer.fused_steps)
    else:
        for key, module in enumerate((den, te)):
            Replica(module, dist.new_group(), bucket_mb=COALESCE_BYTES / 2**20, rounding=rounding, key=key)
    for step in range(STEPS):
        for noise in noises:
            noise.at_step(step)
        x, y = batch(step, rank)
        loss_of(te, den, x.to(torch.bfloat16), y.to(torch.bfloat16), rank).float().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {f"{part}.{n}": p.detach().float().cpu().tolist() for part, m in (("denoiser", den), ("te", te))
            for n, p in m.named_parameters()}


def main():
    out = Path(sys.argv[1])
    if DEVICE.type == "cuda":
        from ot_dist.ports import free_port

        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1,
                                rank=0, device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = {"sgd": ("sgd", COALESCE_BYTES), "adamw": ("adamw", COALESCE_BYTES), "sgd_alone": ("sgd", 0)}
    result = {run: {"reference": one_process(name), **fused_ddp(name, rank, coalesce)}
              for run, (name, coalesce) in runs.items()}
    result["bfloat16"] = {f"{'fused' if fused else 'ddp'}-{rounding}": bfloat16_run(rank, fused, rounding)
                          for fused in (True, False) for rounding in ("nearest", "stochastic")}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


main()
