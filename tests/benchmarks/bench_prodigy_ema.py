"""Step time of ot_dist's Prodigy against AdamW and prodigyopt, and of an EMA update against the
optimizer step, on the same parameters in one run (interleaved rounds, median per step).

The parameters have the shapes of a Stable Diffusion 1.x UNet's, scaled down in width so a CPU
run takes a minute: the same mix of conv kernels, attention projections, norms and biases, hence
the same ratio of per-tensor overhead to element work as the real model.

    python tests/benchmarks/bench_prodigy_ema.py [--scale 0.25] [--rounds 5] [--json FILE]

Targets: ot_dist Prodigy / AdamW <= 1.6; EMA update / AdamW step <= 0.25.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import prodigyopt
import torch

from ot_dist.optim.prodigy import ShardedProdigy
from ot_dist.parallel.ownership import Ownership, whole
from ot_dist.train.ema import ShardedEMA


def sd_unet_like_parameters(scale: float) -> list[torch.nn.Parameter]:
    """Tensor shapes of an SD 1.x UNet (down, mid, up blocks), channel widths x scale."""
    generator = torch.Generator().manual_seed(0)
    shapes = []
    channels = [int(c * scale) for c in (320, 640, 1280, 1280)]
    text = int(768 * scale)
    for level, c in enumerate(channels):
        for _ in range(3 if level < 3 else 2):  # resnets (down + up, roughly)
            shapes += [(c, c, 3, 3), (c,), (c, c, 3, 3), (c,), (c,), (c,), (c,), (c,), (c, int(1280 * scale)), (c,)]
        if level < 3:
            for _ in range(2):  # transformer blocks: self and cross attention, feed-forward
                shapes += [(c, c)] * 4 + [(c, text), (c, text), (c, c), (c, c), (c,), (c,), (c,)]
                shapes += [(c * 8, c), (c * 8,), (c, c * 4), (c,), (c, c), (c,), (c, c), (c,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in shapes]
    return params


def time_steps(step, rounds: int, steps: int) -> list[float]:
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        per_round.append((time.perf_counter() - start) / steps)
    return per_round


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)

    runs = {}
    for name, make in {
        "AdamW (torch, foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
        "Prodigy (ot_dist)": lambda ps: ShardedProdigy(ps, lr=1.0),
        "Prodigy (prodigyopt 1.1)": lambda ps: prodigyopt.Prodigy(ps, lr=1.0),
    }.items():
        params = sd_unet_like_parameters(args.scale)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = make(params)
        optimizer.step()  # state allocation outside the timing
        runs[name] = optimizer.step
    params = sd_unet_like_parameters(args.scale)
    ema = ShardedEMA(Ownership([whole(p, str(i)) for i, p in enumerate(params)], {}), 0.999, 1)
    runs["EMA update"] = lambda: ema.update(100)

    timings = {name: [] for name in runs}
    for _ in range(args.rounds):  # interleaved, so drifts of the machine hit all alike
        for name, step in runs.items():
            timings[name] += time_steps(step, 1, args.steps)
    median = {name: statistics.median(t) for name, t in timings.items()}
    adamw = median["AdamW (torch, foreach)"]
    elements = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {elements / 1e6:.1f} M elements (SD 1.x UNet shapes x {args.scale}), "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds x {args.steps} steps")
    for name, seconds in median.items():
        print(f"  {name:26s} {seconds * 1e3:8.1f} ms/step   {seconds / adamw:5.2f} x AdamW")
    result = {
        "prodigy_over_adamw": median["Prodigy (ot_dist)"] / adamw,
        "prodigyopt_over_adamw": median["Prodigy (prodigyopt 1.1)"] / adamw,
        "ema_over_adamw": median["EMA update"] / adamw,
        "ms": {k: v * 1e3 for k, v in median.items()},
    }
    print(f"targets: Prodigy/AdamW {result['prodigy_over_adamw']:.2f} (<= 1.6), "
          f"EMA/AdamW {result['ema_over_adamw']:.2f} (<= 0.25)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
