"""Checkpoint write and read time of ot_dist's per-rank format against `torch.save` / `torch.load` of the
same tensors (weights, AdamW moments, EMA) in one state dict, side by side in one run (best of N).

Parameters shaped like an SD 1.x UNet's, width x scale (tests/benchmarks/bench_prodigy_ema.py).

    python tests/benchmarks/bench_checkpoint.py [--scale 0.25] [--rounds 3] [--dir /tmp/bench-ckpt]

Targets: write / torch.save <= 1.5 and read / torch.load <= 1.5 (the fragment bookkeeping that makes
resharding possible must not cost much over a plain dump). A third row: how long a save holds training up, written
in the background (checkpoint.write_in_background: the host copies, then a thread writes and commits) against a
blocking write and commit of the same state; the background write is waited for outside the timed part.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prodigy_ema import sd_unet_like_parameters  # noqa: E402

from ot_dist.checkpoint.shards import SavedShards, load_rank_state, rank_state, write_rank_state  # noqa: E402
from ot_dist.checkpoint.staging import HostCopies  # noqa: E402
from ot_dist.checkpoint.writer import BackgroundWriter, RankFiles, Ranks, write_and_commit  # noqa: E402
from ot_dist.parallel.ownership import Ownership, whole  # noqa: E402
from ot_dist.train.ema import ShardedEMA  # noqa: E402


def best(action, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/bench-ckpt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = sd_unet_like_parameters(args.scale)
    names = [f"unet.p{i}" for i in range(len(params))]
    ownership = Ownership([whole(p, n) for p, n in zip(params, names)], {n: p.shape for p, n in zip(params, names)})
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    ema = ShardedEMA(ownership, 0.999, 1)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    (root / "ours").mkdir(parents=True)
    plain = {}
    for p, n in zip(params, names):
        plain[n] = p.detach()
        plain[f"{n}.exp_avg"] = optimizer.state[p]["exp_avg"]
        plain[f"{n}.exp_avg_sq"] = optimizer.state[p]["exp_avg_sq"]
    for n, v in zip(names, ema.values):
        plain[f"{n}.ema"] = v
    size = sum(v.numel() * v.element_size() for v in plain.values())

    def ours_write():
        tensors, meta = rank_state(ownership, optimizer, ema, True, {}, {}, HostCopies(independent=False))
        write_rank_state(root / "ours", 0, tensors, meta)
        os.sync()

    def torch_write():
        torch.save(plain, root / "plain.pt")
        os.sync()

    def ours_read():
        load_rank_state(SavedShards(root / "ours"), ownership, optimizer, ema, "ADAMW")

    def torch_read():
        state = torch.load(root / "plain.pt", weights_only=True)
        with torch.no_grad():
            for p, n in zip(params, names):  # into place, as a resume must
                p.copy_(state[n])
                optimizer.state[p]["exp_avg"].copy_(state[f"{n}.exp_avg"])
                optimizer.state[p]["exp_avg_sq"].copy_(state[f"{n}.exp_avg_sq"])

    one_process = Ranks(False, 1)
    background = BackgroundWriter(SimpleNamespace(distributed=False, world_size=1), 10)
    step = [0]

    def files(independent: bool) -> RankFiles:
        step[0] += 1
        copies = HostCopies(independent)
        tensors, meta = rank_state(ownership, optimizer, ema, True, {}, {}, copies)
        return RankFiles(step[0], 0, tensors, meta, "{}", copies.ready())

    def blocking_save():
        write_and_commit(files(False), root / "commits", 2, None, one_process)

    def background_save():  # what training waits for; the write itself is waited for below, untimed
        work = files(True)
        background.start(lambda ranks: write_and_commit(work, root / "commits", 2, None, ranks))

    rows = []
    for label, ours, baseline in (("write", ours_write, torch_write), ("read into place", ours_read, torch_read),
                                  ("training held up by a save (background / blocking)", background_save, blocking_save)):
        a, b = [], []
        for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits both
            a.append(best(ours, 1))
            background.wait()
            b.append(best(baseline, 1))
        rows.append((label, min(a), min(b)))
    print(f"{len(params)} tensors, {size / 2**20:.0f} MiB of weights + AdamW moments + EMA, 1 CPU thread")
    print("| operation | ot_dist s | baseline s (torch.save / load; blocking save) | ratio |")
    print("|---|---|---|---|")
    for label, ours, baseline in rows:
        print(f"| {label} | {ours:.3f} | {baseline:.3f} | {ours / baseline:.2f} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
