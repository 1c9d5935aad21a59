"""Tracking-overhead benchmark: the wall time of `ot-dist train` (tiny SD 1.x, 64 px, batch 1, 20
steps by default, one process, CPU) untracked, tracked in the local store, and tracked against a
port where nothing listens (every value then ends in the local fallback store, with a warning).

A standalone script (not a pytest test). The variants run alternately, `--repeats` times each, and
the script prints the median wall time of each and its ratio to the untracked run (target for the
closed port: <= 1.10), and the steady-state throughput: samples/s of the windows after the first
(from the progress lines). The wall time includes the fixed costs tracking adds to a run (importing
MLflow, creating a store), which a longer run amortizes; `--steps` changes the length.

    python tests/benchmarks/bench_tracking_overhead.py --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))

import yaml  # noqa: E402
from conftest import base_config  # noqa: E402

from ot_dist.demo import make_demo_dataset  # noqa: E402
from ot_dist.models.tiny import make_tiny_model  # noqa: E402
from ot_dist.parallel.runtime import free_port  # noqa: E402

TARGET = 1.10


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "sd1", "sd1")
        data = make_demo_dataset(root / "shapes", count=16)
        variants = {
            "untracked": {"mlflow.enabled": False},
            "local store": {"mlflow.enabled": True},
            "closed port": {"mlflow.enabled": True, "mlflow.tracking_uri": f"http://127.0.0.1:{free_port()}"},
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for repeat in range(args.repeats):
            for name, settings in variants.items():
                out = root / f"out-{repeat}-{name.replace(' ', '_')}"
                raw = base_config(model, data, out, batch_size=1, epochs=-(-args.steps // 16), max_steps=args.steps,
                                  log_every_steps=5, **settings)
                config = root / "config.yaml"
                config.write_text(yaml.safe_dump(raw))
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "ot_dist", "train", str(config)], env=env,
                                      capture_output=True, text=True)
                times[name].append(time.perf_counter() - start)
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-2000:])
                    return 1
                windows = [float(line.split(" samples/s")[0].split()[-1]) for line in done.stdout.splitlines()
                           if line.startswith("step ")]
                rates[name].extend(windows[1:])  # the first window holds the warm-up
                print(f"repeat {repeat + 1} {name}: {times[name][-1]:.1f} s", flush=True)
    base = statistics.median(times["untracked"])
    print(f"\n{args.steps} steps, median of {args.repeats}:")
    for name, values in times.items():
        print(f"  {name:12s} {statistics.median(values):6.1f} s  ratio {statistics.median(values) / base:.2f}   "
              f"steady state {statistics.median(rates[name]):.2f} samples/s")
    ratio = statistics.median(times["closed port"]) / base
    print(f"closed port / untracked: {ratio:.2f} (target <= {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
