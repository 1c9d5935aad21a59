"""The latent / text cache index at 100k, 1M and 10M samples (issue 25; not a pytest test).

For each size: synthetic chunk tables (what each committed chunk of 1024 samples records: sample id, member, data
offset, size; the chunk tars as sparse files of the right length, no tensors) for a latent cache (one resolution)
and a text cache, then, each in a fresh process:

1. index: `write_index` (cache_index.py) over the chunk tables: seconds and microseconds a sample (flat = linear).
2. open: the caches opened as a rank or loader worker opens them (`CacheIndex`), every page of the columns touched
   (as a long run reads every sample), and RSS growth from /proc/self/status: RssAnon (the process's own memory)
   and RssFile (mapped index pages: shared through the page cache by all ranks and loader workers of a node).
3. for comparison (up to 1M samples), the format-1 manifest: one JSON dict per sample
   (`{key: {suffix: [part, offset, size]}}`) for both caches, parsed with `json.loads`, RSS growth.

    python tests/benchmarks/bench_cache_index.py [--sizes 100000,1000000,10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHUNK = 1024
KINDS = {"latents": ["1024.latent.safetensors"], "text": ["text.safetensors"]}
SIZES = {"latents": 2 * 2 * 4 * 128 * 128 + 200, "text": 4 * (77 * 2048 + 1280) + 200}  # member bytes (SDXL)


def rss() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def write_chunks(folder: Path, count: int, members: list[str], size: int) -> None:
    """Chunk tables as ChunkWriter.commit writes them, and sparse tars of the length they describe."""
    from ot_dist.data.cache_index import chunk_count, chunk_name, chunk_samples

    folder.mkdir(parents=True)
    stride = 512 + -(-size // 512) * 512
    for chunk in range(chunk_count(count, CHUNK)):
        ids = np.array(chunk_samples(chunk, count, CHUNK), dtype=np.uint64)
        rows = np.zeros((len(ids) * len(members), 4), dtype=np.uint64)
        rows[:, 0] = np.repeat(ids, len(members))
        rows[:, 1] = np.tile(np.arange(len(members), dtype=np.uint64), len(ids))
        rows[:, 2] = 512 + stride * np.arange(len(rows), dtype=np.uint64)
        rows[:, 3] = size
        np.save(folder / f"{chunk_name(chunk)}.npy", rows)
        with open(folder / f"{chunk_name(chunk)}.tar", "wb") as f:
            f.truncate(stride * len(rows) + 1024)


def child(step: str, folder: Path, count: int) -> dict:
    from ot_dist.data.cache_index import CacheIndex, write_index

    if step == "index":
        seconds = 0.0
        for kind, members in KINDS.items():
            start = time.perf_counter()
            write_index(folder / kind, {"model_key": kind}, count, CHUNK, members)
            seconds += time.perf_counter() - start
        return {"seconds": seconds}
    if step == "open":
        before = rss()
        caches = [CacheIndex(folder / kind, json.loads((folder / kind / "manifest.json").read_text()), kind)
                  for kind in KINDS]
        total = sum(int(c.column(m, name).sum(dtype=np.uint64) % 7) for c in caches for m in c.members
                    for name in ("offset", "size"))  # every page read
        rng = np.random.default_rng(0)
        for i in rng.integers(0, count, 10000):
            [c.place(int(i), c.members[0]) for c in caches]
        after = rss()
        return {"nbytes": sum(c.nbytes() for c in caches), "touched": total, "before": before, "after": after}
    if step == "json":
        text = json.dumps({f"{i:09d}": {"1024.latent.safetensors": [f"part-{i % 8:05d}-of-00008.tar", 512 * i, SIZES["latents"]]}
                           for i in range(count)})
        text2 = json.dumps({f"{i:09d}": {"text.safetensors": [f"part-{i % 8:05d}-of-00008.tar", 512 * i, SIZES["text"]]}
                            for i in range(count)})
        before = rss()
        manifests = [json.loads(text), json.loads(text2)]
        after = rss()
        return {"count": sum(map(len, manifests)), "before": before, "after": after}
    raise ValueError(step)


def run(step: str, folder: Path, count: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", step, "--folder", str(folder), "--count", str(count)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--child", dest="step", default=None)
    parser.add_argument("--folder")
    parser.add_argument("--count", type=int)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(child(args.step, Path(args.folder), args.count)))
        return
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; latents (1 resolution) + text caches, "
          f"chunks of {CHUNK}")
    print("| samples | index build s | build µs/sample | index B/sample | RSS after opening + reading every page "
          "B/sample (anon / file) | format-1 JSON manifests RSS B/sample |")
    for count in map(int, args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="bench_cache_index_") as tmp:
            folder = Path(tmp)
            for kind, members in KINDS.items():
                write_chunks(folder / kind, count, members, SIZES[kind])
            built = run("index", folder, count)
            opened = run("open", folder, count)
            grow = {k: (opened["after"][k] - opened["before"][k]) / count for k in ("VmRSS", "RssAnon", "RssFile")}
            js = "(not run)"
            if count <= 1_000_000:
                parsed = run("json", folder, count)
                js = f"{(parsed['after']['VmRSS'] - parsed['before']['VmRSS']) / count:.0f}"
            print(f"| {count:,} | {built['seconds']:.2f} | {1e6 * built['seconds'] / count:.2f} | "
                  f"{opened['nbytes'] / count:.1f} | {grow['VmRSS']:.1f} ({grow['RssAnon']:.1f} / {grow['RssFile']:.1f}) "
                  f"| {js} |", flush=True)


if __name__ == "__main__":
    main()
