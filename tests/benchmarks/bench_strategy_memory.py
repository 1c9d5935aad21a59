"""Per-rank training memory of each strategy at 2 ranks, relative to ddp.

For every strategy it launches 2 gloo ranks on CPU (torchrun) training the tiny SD 1.x UNet in full
(AdamW, float32), and just before the third optimizer step each rank sums the bytes of what it holds
for training: parameters, gradients and optimizer state (DTensor local shards, DeepSpeed partitions
and flat buffers), de-duplicated by storage. The figures are exact, not sampled: no timing noise.

    python tests/benchmarks/bench_strategy_memory.py [--json FILE] [--set KEY=VALUE ...] [--strategies zero2,zero3]

--set applies to every strategy's run (e.g. train_dtype=bfloat16 deepspeed.mixed_precision=autocast); the targets
are checked on the full default table only.

Targets: zero3 and fsdp full-shard total <= 0.55 x ddp; zero2 and fsdp shard-grad-op optimizer
state <= 0.55 x ddp's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "fsdp (full_shard)": ["strategy=fsdp"],
    "fsdp (shard_grad_op)": ["strategy=fsdp", "fsdp.sharding=shard_grad_op"],
    "zero1": ["strategy=zero1"],
    "zero2": ["strategy=zero2"],
    "zero3": ["strategy=zero3"],
}
KINDS = ("params", "grads", "optimizer_state")

PROBE = r'''
import json, os, sys
import torch
from ot_dist.train.trainer import Trainer

out_dir, probe_step = sys.argv.pop(1), 3
original = Trainer.optimizer_step
count = 0

def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total

def probed(self, step):
    global count
    count += 1
    if count == probe_step:
        held = self.strategy.held_tensors()
        sizes = {kind: storage_bytes(tensors) for kind, tensors in held.items()}
        with open(os.path.join(out_dir, f"rank{self.runtime.rank}.json"), "w") as f:
            json.dump(sizes, f)
    return original(self, step)

Trainer.optimizer_step = probed
from ot_dist.cli import main
sys.exit(main())
'''


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every strategy's run")
    parser.add_argument("--strategies", help="comma-separated names of STRATEGIES (default: all)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from ot_dist.demo import make_demo_dataset
    from ot_dist.models.tiny import make_tiny_model
    from ot_dist.ports import free_port

    work = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    model, data = make_tiny_model(work / "tiny-sd1", "sd1"), make_demo_dataset(work / "shapes", count=16)
    probe = work / "probe.py"
    probe.write_text(PROBE)
    config = work / "config.yaml"
    config.write_text(
        f"model: {{family: sd1, path: {model}}}\nmethod: full\noutput_dir: {work}/out\ndata: {{path: {data}}}\n"
        "resolution: 64\nbatch_size: 2\nmax_steps: 3\nlearning_rate: 1.0e-4\nlog_every_steps: 100\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    results = {}
    chosen = args.strategies.split(",") if args.strategies else list(STRATEGIES)
    for name in chosen:
        sets = STRATEGIES[name] + args.set
        out = work / name.replace(" ", "_").replace("(", "").replace(")", "")
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(probe), str(out), "train", str(config)]
        for s in sets + [f"output_dir={out}/run"]:
            cmd += ["--set", s]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:])
            raise SystemExit(f"{name}: training failed")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        results[name] = {kind: max(r[kind] for r in ranks) for kind in KINDS}  # the fuller rank
        results[name]["total"] = sum(results[name][k] for k in KINDS)
    if "ddp" not in results:
        for name, r in results.items():
            print(f"{name:<22}" + "".join(f"{r[k] / 2**20:>15.2f} MiB" for k in (*KINDS, "total")))
        if args.json:
            args.json.write_text(json.dumps({"results": results}, indent=2))
        return 0
    base = results["ddp"]
    print(f"{'strategy':<22}" + "".join(f"{k:>18}" for k in (*KINDS, "total")) + f"{'total/ddp':>11}{'optim/ddp':>11}")
    for name, r in results.items():
        r["total_ratio"] = r["total"] / base["total"]
        r["optimizer_state_ratio"] = r["optimizer_state"] / base["optimizer_state"]
        print(f"{name:<22}" + "".join(f"{r[k] / 2**20:>15.2f} MiB" for k in (*KINDS, "total"))
              + f"{r['total_ratio']:>11.2f}{r['optimizer_state_ratio']:>11.2f}")
    checks = {
        "zero3 total <= 0.55": results["zero3"]["total_ratio"] <= 0.55,
        "fsdp full_shard total <= 0.55": results["fsdp (full_shard)"]["total_ratio"] <= 0.55,
        "zero2 optimizer state <= 0.55": results["zero2"]["optimizer_state_ratio"] <= 0.55,
        "fsdp shard_grad_op optimizer state <= 0.55": results["fsdp (shard_grad_op)"]["optimizer_state_ratio"] <= 0.55,
    }
    for text, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {text}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "checks": checks}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
