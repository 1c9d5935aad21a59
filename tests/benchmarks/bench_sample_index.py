"""The compact sample index at 100k, 1M and 10M samples (issue 25; not a pytest test).

For each size, in a fresh process each (so the memory figures are that process's own):

1. build: synthetic index records (shard, offset, span, bucket, concept, mask; no images, no tars) streamed
   through `IndexWriter.add` and written as `index/*.npy`, with a manifest: seconds and microseconds a sample
   (constant per sample = linear time).
2. load: the set opened as training opens it (`ShardDataset`, then its `SampleTable`), and RSS after each step
   from /proc/self/status: VmRSS, of which RssAnon (this process's own memory) and RssFile (mapped file pages: the
   index columns, shared through the page cache by every rank and loader worker of a node). Bytes a sample =
   growth over the process before opening the set.
3. for comparison, the format-1 manifest (every sample a JSON dict, as before issue 25), parsed with `json.loads`
   (up to 1M samples: 10M would need ~10 GB).
4. tar header scan (`shard index` and `shard build`'s indexing pass): samples/s reading the headers of a synthetic
   tar of 2 small members a sample (100k samples); and `shard index` samples/s on tars of 3000 1024x768 JPEGs.

    python tests/benchmarks/bench_sample_index.py [--sizes 100000,1000000,10000000] [--plan]

`--plan` also measures the sample table and one epoch's plan as a rank holds them (numpy arrays, plan.py): the
table's anon growth, `plan_epoch` seconds and its arrays (every rank's ids, while the epoch starts), then what one
rank of 8 keeps (its own ids: `EpochPlan.rank_ids`, global batch 32 = 4 per rank; and its RSS growth over the table,
which includes the table's per-bucket sample groups, computed with the first plan), and the peak (VmHWM) while
planning, all in bytes a sample.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SAMPLES_PER_SHARD = 2000


def rss() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def config():
    from ot_dist.config.load import validate

    return validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                     "data": {"path": ".", "bucket_step": 64}, "resolution": 512, "batch_size": 4, "seed": 1})


def build(folder: Path, count: int) -> dict:
    """Synthetic records -> index/*.npy and manifest.json, as write_manifest writes them."""
    import numpy as np

    from ot_dist.data.sample_index import IndexWriter
    from ot_dist.data.shards import FORMAT, MANIFEST, index_description

    rng = np.random.default_rng(0)
    buckets = rng.choice([6, 8, 9, 10, 12], size=count, p=[0.1, 0.2, 0.4, 0.2, 0.1]).tolist()
    concepts = rng.integers(0, 3, size=count).tolist()
    sizes = rng.integers(200_000, 2_000_000, size=count).tolist()
    start = time.perf_counter()
    writer, offset = IndexWriter(), 0
    for i in range(count):
        if i % SAMPLES_PER_SHARD == 0:
            offset = 0
        writer.add(i // SAMPLES_PER_SHARD, offset, sizes[i], buckets[i], concepts[i], i % 7 == 0)
        offset += sizes[i] + 2048
    shards = [{"file": f"shard-{n:06d}.tar", "samples": SAMPLES_PER_SHARD} for n in range(-(-count // SAMPLES_PER_SHARD))]
    manifest = {"format": FORMAT, "fingerprint": "synthetic", "built_from": {}, "resolutions": [512], "bucket_step": 64,
                "concepts": [{"name": f"c{c}", "path": ".", "images": 0, "balancing": 1.0,
                              "balancing_strategy": "repeats"} for c in range(3)],
                "buckets": [], "shards": shards, "sample_count": count, "index": index_description(),
                "unused_files": [], "unreadable_images": []}
    from ot_dist.data.shards import write_index_and_manifest

    write_index_and_manifest(folder, writer, manifest)
    seconds = time.perf_counter() - start
    index_bytes = sum(f.stat().st_size for f in (folder / "index").iterdir())
    return {"build_s": seconds, "build_us_per_sample": 1e6 * seconds / count, "index_file_bytes": index_bytes,
            "manifest_bytes": (folder / MANIFEST).stat().st_size}


def load(folder: Path, count: int, plan: bool) -> dict:
    cfg = config()
    from ot_dist.data.reader import ShardDataset

    before = rss()
    start = time.perf_counter()
    dataset = ShardDataset(folder, cfg)
    opened = rss()
    table = dataset.table(None)
    tabled = rss()  # open_s below: opening and the table, together
    out = {"open_s": time.perf_counter() - start, "before": before, "opened": opened, "table": tabled,
           "samples": len(table)}
    if plan:
        from ot_dist.data.plan import plan_epoch

        out["table_anon"] = tabled["RssAnon"] - opened["RssAnon"]
        start = time.perf_counter()
        batches = plan_epoch(table, 32, [512], 1, 0)
        out["plan_s"], out["planned"], out["batches"] = time.perf_counter() - start, rss(), len(batches)
        out["plan_bytes"] = batches.ids.nbytes + batches.buckets.nbytes
        mine = batches.rank_ids(0, 8, 4, 1)  # rank 0 of 8, as ShardReader keeps it for the epoch
        out["plan_s"] = time.perf_counter() - start
        del batches
        from ot_dist.data.reader import _return_freed_memory

        _return_freed_memory()  # as ShardReader.epoch_batches does
        out["rank_bytes"], out["kept"] = mine.nbytes, rss()
    return out


def json_manifest(count: int) -> dict:
    """The format-1 manifest's samples (key, shard, bucket, concept, mask, members), parsed."""
    text = json.dumps({"samples": [{"key": f"c0_{i:08d}", "shard": i // SAMPLES_PER_SHARD, "bucket": 9, "concept": 0,
                                    "mask": False, "members": {"512.png": [1536 + i, 400000], "json": [512, 300],
                                                               "txt": [1024, 40]}} for i in range(count)]})
    before = rss()
    manifest = json.loads(text)
    after = rss()
    del text
    return {"before": before, "after": after, "samples": len(manifest["samples"])}


def scan(folder: Path, count: int) -> dict:
    from ot_dist.data.shards import shard_samples

    path = folder / "scan.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            for suffix, data in (("jpg", b"J" * 300), ("txt", b"a caption")):
                info = tarfile.TarInfo(f"{i:09d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    start = time.perf_counter()
    found = sum(1 for _ in shard_samples(path))
    seconds = time.perf_counter() - start
    path.unlink()
    return {"samples": found, "scan_s": seconds, "samples_per_s": found / seconds}


def external(folder: Path, count: int) -> dict:
    """`shard index` samples/s on webdataset tars of 1024x768 JPEGs (~700 KB): sizes from a json member
    (img2dataset's width / height) and from the image headers."""
    import numpy as np
    import webdataset as wds
    from PIL import Image

    from ot_dist.data.external import index_webdataset

    out = {}
    pixels = np.random.default_rng(0).integers(0, 255, (768, 1024, 3), dtype=np.uint8)
    jpg = io.BytesIO()
    Image.fromarray(pixels).save(jpg, "JPEG", quality=90)
    for kind in ("json", "header"):
        with wds.ShardWriter(str(folder / f"{kind}-%04d.tar"), maxcount=1000, verbose=0) as writer:
            for i in range(count):
                sample = {"__key__": f"{i:09d}", "jpg": jpg.getvalue(), "txt": b"a caption"}
                if kind == "json":
                    sample["json"] = json.dumps({"width": 1024, "height": 768}).encode()
                writer.write(sample)
        best = min(_timed(lambda: index_webdataset([str(folder / f"{kind}-*.tar")], folder / f"out-{kind}",
                                                   resolutions=[1024], bucket_step=64, log=lambda *_: None))
                   for _ in range(3))
        out[kind] = count / best
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def child(args) -> None:
    folder, count = Path(args.folder), args.count
    if args.step == "build":
        result = build(folder, count)
    elif args.step == "load":
        result = load(folder, count, args.plan)
    elif args.step == "json":
        result = json_manifest(count)
    elif args.step == "external":
        result = external(folder, count)
    else:
        result = scan(folder, count)
    print(json.dumps(result))


def run(step: str, folder: Path, count: int, plan: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", step, "--folder", str(folder), "--count", str(count)]
    done = subprocess.run(command + (["--plan"] if plan else []), capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_sample(after: dict, before: dict, field: str, count: int) -> float:
    return (after[field] - before[field]) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--child", dest="step", default=None)
    parser.add_argument("--folder")
    parser.add_argument("--count", type=int)
    args = parser.parse_args()
    if args.step:
        return child(args)
    print("| samples | build s | build us/sample | index file B/sample | RSS after open+table B/sample (anon / file) "
          "| open+table s | JSON manifest (format 1) RSS B/sample" + (" | sample table anon B/sample | epoch plan: s, all ranks' ids B/sample, one rank of 8 keeps B/sample (its ids; RSS with the table's "
                               "groups), "
                               "peak while planning B/sample" if args.plan else "")
          + " |")
    print("|---|---|---|---|---|---|---|" + ("---|---|" if args.plan else ""))
    for count in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            built = run("build", folder, count)
            loaded = run("load", folder, count, args.plan)
            before, after = loaded["before"], loaded["table"]
            row = [f"{count:,}", f"{built['build_s']:.2f}", f"{built['build_us_per_sample']:.2f}",
                   f"{built['index_file_bytes'] / count:.1f}",
                   f"{per_sample(after, before, 'VmRSS', count):.1f} ({per_sample(after, before, 'RssAnon', count):.1f}"
                   f" / {per_sample(after, before, 'RssFile', count):.1f})",
                   f"{loaded['open_s']:.2f}"]
            if count <= 1_000_000:
                old = run("json", folder, count)
                row.append(f"{per_sample(old['after'], old['before'], 'VmRSS', count):.0f}")
            else:
                row.append("(not run: ~10 GB)")
            if args.plan:
                row.append(f"{loaded['table_anon'] / count:.1f}")
                row.append(f"{loaded['plan_s']:.2f} s, {loaded['plan_bytes'] / count:.1f}, "
                           f"{loaded['rank_bytes'] / count:.2f} (RSS {per_sample(loaded['kept'], after, 'VmRSS', count):.1f}), "
                           f"{(loaded['kept']['VmHWM'] - loaded['table']['VmRSS']) / count:.0f}")
            print("| " + " | ".join(row) + " |", flush=True)
    scanned = run("scan", Path(tempfile.gettempdir()), 100_000)
    print(f"\ntar header scan: {scanned['samples']} samples (2 members each) in {scanned['scan_s']:.2f}s = "
          f"{scanned['samples_per_s']:,.0f} samples/s")
    with tempfile.TemporaryDirectory() as tmp:
        indexed = run("external", Path(tmp), 3000)
    print(f"shard index, 1024x768 JPEGs: {indexed['json']:,.0f} samples/s with json width/height, "
          f"{indexed['header']:,.0f} samples/s from image headers (one process)")


if __name__ == "__main__":
    main()
