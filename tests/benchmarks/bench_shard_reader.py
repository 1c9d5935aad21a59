"""Shard reader throughput, as ratios (not a pytest test).

1. Reader vs raw tar: samples/s of the shard reader over one epoch (plan order, `os.pread` of the
   indexed members) divided by samples/s of a raw sequential `tarfile` pass over the same shards that
   reads the same members. Measured twice: I/O only (members read, not decoded) and with decoding
   (both decode the PNG the same way). Target >= 0.8.
2. Cached latents vs images: batches/s of reading cached VAE posteriors divided by batches/s of
   reading + decoding the images and VAE-encoding them (tiny SD 1.x VAE, CPU).

    python tests/benchmarks/bench_shard_reader.py [--samples 2000] [--size 128]

Each figure is the best of 3 alternating rounds (A B A B ...), so background load hits both sides.
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def best_rate(fn, count: int, rounds: int = 3) -> float:
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = max(best, count / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()

    from ot_dist.config.load import validate
    from ot_dist.data.caches import attach_latent_cache
    from ot_dist.data.reader import ShardDataset, ShardReader
    from ot_dist.data.shards import build_shard_set
    from ot_dist.models.tiny import make_tiny_model
    from ot_dist.parallel.runtime import Runtime

    work = Path(tempfile.mkdtemp(prefix="bench_shards_"))
    rng = np.random.default_rng(0)
    folder = work / "imgs"
    folder.mkdir()
    for i in range(args.samples):
        Image.fromarray(rng.integers(0, 255, (args.size, args.size, 3), dtype=np.uint8)).save(folder / f"{i:05d}.png")
        (folder / f"{i:05d}.txt").write_text(f"img {i}")
    raw = {"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o", "seed": 0,
           "data": {"path": str(folder), "shard_size_mb": 16}, "resolution": args.size, "batch_size": 8}
    config = validate(raw)
    build_shard_set(config, work / "set", log=print)
    dataset = ShardDataset(work / "set", config)
    shards = [work / "set" / s["file"] for s in dataset.manifest["shards"]]
    image_member = f"{args.size}.png"
    plan_order = [i for gb in ShardReader(dataset, dataset.table(), 8, 1).plan(0) for i in gb.samples]

    def raw_tar(decode: bool):
        def run():
            for shard in shards:
                with tarfile.open(shard) as tar:
                    for info in tar:
                        if info.name.endswith(image_member) or info.name.endswith(".txt") or info.name.endswith(".json"):
                            data = tar.extractfile(info).read()
                            if decode and info.name.endswith(".png"):
                                Image.open(io.BytesIO(data)).convert("RGB").load()
        return run

    def reader(decode: bool):
        def run():
            for i in plan_order:
                sample = dataset.samples[i]
                path = work / "set" / dataset.manifest["shards"][sample["shard"]]["file"]
                for suffix in (image_member, "txt", "json"):
                    if decode:
                        dataset._read(sample, suffix)
                    else:
                        dataset.member_bytes(path, sample["key"], suffix, *sample["members"][suffix])
        return run

    for decode in (False, True):
        count = len(plan_order)
        tar_rate = best_rate(raw_tar(decode), args.samples)
        ours = best_rate(reader(decode), count)
        label = "with PNG decode" if decode else "I/O only       "
        print(f"reader vs sequential tarfile, {label}: {ours:9.0f} vs {tar_rate:9.0f} samples/s -> ratio {ours / tar_rate:.2f}")

    model_dir = make_tiny_model(work / "tiny-sd1", "sd1")
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae").eval()
    batches = [plan_order[i:i + 8] for i in range(0, 8 * 25, 8)]

    def images_and_encode():
        with torch.no_grad():
            for ids in batches:
                pixels = torch.stack([dataset.load(i, 0)["pixels"] for i in ids])
                vae.encode(pixels).latent_dist.sample()

    cached = ShardDataset(work / "set", config)
    attach_latent_cache(cached, vae, Runtime(), log=print)

    def latents():
        for ids in batches:
            torch.stack([cached.load(i, 0)["latent_mean"] for i in ids])

    encode_rate, cache_rate = best_rate(images_and_encode, len(batches)), best_rate(latents, len(batches))
    print(f"cached latents vs decode + VAE encode: {cache_rate:.1f} vs {encode_rate:.1f} batches/s (batch 8, "
          f"{args.size}px) -> ratio {cache_rate / encode_rate:.1f}")


if __name__ == "__main__":
    main()
