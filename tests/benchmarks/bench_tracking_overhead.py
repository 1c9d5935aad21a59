"""Tracking-overhead benchmark: the wall time of `ot-dist train` (tiny SD 1.x, 64 px, batch 1, 20
steps by default, one process, CPU) untracked, tracked in the local store, and tracked against a
port where nothing listens (every value then ends in the local fallback store, with a warning).

A standalone script (not a pytest test). The variants run interleaved (untracked, local store,
closed port, then again in a rotated order), `--repeats` times each, so that load from other processes on a shared
machine hits them alike. It prints the median wall time of each variant, the median of the
per-repeat ratios to the untracked run of the same repeat with their spread (min-max), the CPU
time of the training process alone (the sender process not included; this does not depend on the
machine's other load), and the steady-state throughput: samples/s of the windows after the first (from the progress lines).
Target for the closed port: <= 1.10. `--steps` changes the run's length.

    python tests/benchmarks/bench_tracking_overhead.py --steps 20 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import re
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
from ot_dist.ports import free_port  # noqa: E402

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
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for repeat in range(args.repeats):
            names = list(variants)
            for name in names[repeat % 3:] + names[: repeat % 3]:  # rotated: no variant always runs first
                settings = variants[name]
                out = root / f"out-{repeat}-{name.replace(' ', '_')}"
                raw = base_config(model, data, out, batch_size=1, epochs=-(-args.steps // 16), max_steps=args.steps,
                                  log_every_steps=5, **settings)
                config = root / "config.yaml"
                config.write_text(yaml.safe_dump(raw))
                log = root / "train.log"
                start = time.perf_counter()
                with open(log, "w") as output:
                    process = subprocess.Popen([sys.executable, "-m", "ot_dist", "train", str(config)], env=env,
                                               stdout=output, stderr=subprocess.STDOUT)
                    _, status, usage = os.wait4(process.pid, 0)
                times[name].append(time.perf_counter() - start)
                # CPU seconds of the training process alone (the sender is not its waited-for child):
                # what tracking costs on the training path, whatever else loads the machine.
                cpu[name].append(usage.ru_utime + usage.ru_stime)
                stdout = log.read_text()
                if os.waitstatus_to_exitcode(status) != 0:
                    print(stdout[-4000:])
                    return 1
                windows = [float(line.split(" samples/s")[0].split()[-1]) for line in stdout.splitlines()
                           if re.match(r"step \d+/\d+ ", line)]
                rates[name].extend(windows[1:])  # the first window holds the warm-up
                print(f"repeat {repeat + 1} {name}: {times[name][-1]:.1f} s, training process CPU {cpu[name][-1]:.1f} s",
                      flush=True)
    print(f"\n{args.steps} steps, {args.repeats} interleaved repeats (ratio: to the untracked run of the same repeat):")
    for name, values in times.items():
        ratios = [v / u for v, u in zip(values, times["untracked"])]
        print(f"  {name:12s} median {statistics.median(values):6.1f} s (min {min(values):.1f}, max {max(values):.1f})  "
              f"ratio median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})   "
              f"training process CPU median {statistics.median(cpu[name]):.1f} s   "
              f"steady state {statistics.median(rates[name]):.2f} samples/s")
    ratio = statistics.median(t / u for t, u in zip(times["closed port"], times["untracked"]))
    print(f"closed port / untracked: {ratio:.2f} (target <= {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
