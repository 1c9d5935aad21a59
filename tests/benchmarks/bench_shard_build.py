"""Shard build and image format figures at resolution 1024 (issue 25; not a pytest test).

    python tests/benchmarks/bench_shard_build.py formats [--images 12]
    python tests/benchmarks/bench_shard_build.py workers [--images 24] [--format jpg] [--workers 1,2,4]
    python tests/benchmarks/bench_shard_build.py loader  [--images 24] [--format jpg]
    python tests/benchmarks/bench_shard_build.py cached  [--images 24]
    python tests/benchmarks/bench_shard_build.py encode  [--images 24] [--batch-pixels 1,4194304] [--resolution 1024]

The sources are camera-like 1600x1200 JPEG photos (quality 92, ~500 KB, as the issue's 40 photos of 26 MB):
crops and flips of the two photographs that ship with scikit-learn (china.jpg, flower.jpg), scaled up and
given sensor-like noise (sigma 5), so that they compress like photos rather than like smooth upscales.

- formats: per shard image format at 1024 (the 4:3 photos go to the 1152x896 bucket, stored as 1195x896 to cover
  it): bytes per image, build images/s (decode the source + resize + encode, one process) and decode images/s
  (what a loader worker does with the member: decode to RGB). "source kept" is a source JPEG that needs no resize
  (already 1195x896): its bytes are stored as they are, so building it is reading it and checking its header.
- workers: `ot-dist shard build` (build_shard_set) images/s with 1, 2, ... encoder processes.
- loader: images/s of ShardDataset.load (read, decode, crop to the bucket, normalise to a float tensor) in one
  process = one loader worker, and the loader workers a GPU rank needs for 22 images/s.
- cached: the same with `data.cache_latents` and `data.cache_text` caches of SDXL's shapes (the posterior's mean
  and std, float32, 4 x h/8 x w/8 of the bucket: 4x144x112 for the photos' 1152x896 bucket; the text encoders'
  hidden 77x2048 and pooled 1280, float32), written by the cache writer (caches.py) from synthetic tensors (no
  model): the loader reads the posterior and text members through the cache index, the caption and json from the
  shards, and decodes no image.
- encode: `data.cache_latents` caching throughput (attach_latent_cache: read, crop, VAE-encode, write the chunks)
  with an SDXL-architecture VAE (diffusers AutoencoderKL, SDXL's config, random weights: the speed is the
  architecture's), on CUDA in bfloat16 when there is a GPU, else on the CPU in float32; images/s per --batch-pixels
  (1: one image a batch, as before batching; 4194304: the default, 4 images at 1024).

Each rate is the best of --rounds rounds. Print the machine's load with the figures: on a shared machine they
are lower bounds.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

RESOLUTION = 1024
TARGET_IMAGES_PER_S = 22.0  # SDXL LoRA at 1024 on one H100 rank (the GPU issue's target)


def photos(count: int, size=(1600, 1200), seed: int = 0) -> list[Image.Image]:
    """Camera-like RGB photos (see the module docstring)."""
    import sklearn.datasets

    folder = Path(sklearn.datasets.__file__).parent / "images"
    bases = [Image.open(folder / name).convert("RGB") for name in ("china.jpg", "flower.jpg")]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        base = bases[i % len(bases)]
        scale = 1.0 + 0.6 * rng.random()
        big = base.resize((int(size[0] * scale), int(size[0] * scale * base.height / base.width)),
                          Image.Resampling.LANCZOS)
        big = big.resize((max(big.width, size[0]), max(big.height, size[1])), Image.Resampling.LANCZOS)
        left, top = rng.integers(0, big.width - size[0] + 1), rng.integers(0, big.height - size[1] + 1)
        crop = big.crop((left, top, left + size[0], top + size[1]))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        noisy = np.asarray(crop, dtype=np.float32) + rng.normal(0, 5, (size[1], size[0], 3))
        out.append(Image.fromarray(noisy.clip(0, 255).astype(np.uint8)))
    return out


def jpeg_bytes(img: Image.Image, quality: int = 92) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


FORMATS = {  # name -> (PIL format, save options)
    "png": ("PNG", {}),
    "webp lossless": ("WEBP", {"lossless": True}),
    "webp q95": ("WEBP", {"quality": 95}),
    "jpeg q95": ("JPEG", {"quality": 95}),
}


def best_rate(fn, count: int, rounds: int) -> float:
    return best_rates(fn, count, rounds)[0]


def best_rates(fn, count: int, rounds: int) -> tuple[float, float]:
    """(best wall-clock rate, best rate per CPU second of this process: what an idle core would do)."""
    wall = cpu = 0.0
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = max(wall, count / (time.perf_counter() - start))
        cpu = max(cpu, count / max(1e-9, time.process_time() - start_cpu))
    return wall, cpu


def cover_size(width: int, height: int) -> tuple[int, int]:
    """(bucket (h, w), resized (w, h)) of a width x height image at RESOLUTION, bucket step 64 (SDXL)."""
    from ot_dist.data.buckets import bucket_of, bucket_size

    bucket_h, bucket_w = bucket_size(bucket_of(width, height, RESOLUTION, 64), RESOLUTION, 64)
    scale = max(bucket_w / width, bucket_h / height)
    return (bucket_h, bucket_w), (max(bucket_w, round(width * scale)), max(bucket_h, round(height * scale)))


def decode(data: bytes) -> Image.Image:
    from ot_dist.data.decode import decode_member

    suffix = {b"\x89P": "png", b"RI": "webp", b"\xff\xd8": "jpg"}[data[:2]]
    return decode_member(f"k.1024.{suffix}", data, "bench")  # the reader's own decoder (RGB)


def formats(args) -> None:
    from ot_dist.data.buckets import resize_to_cover

    images = photos(args.images)
    sources = [jpeg_bytes(img) for img in images]
    bucket, resized = cover_size(*images[0].size)
    print(f"{args.images} photos 1600x1200, JPEG q92 sources of {np.mean([len(s) for s in sources]) / 1e3:.0f} KB; "
          f"bucket {bucket[1]}x{bucket[0]}, stored at {resized[0]}x{resized[1]}; load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    rows = []
    for name, (fmt, options) in FORMATS.items():
        encoded: list[bytes] = []

        def build():
            encoded.clear()
            for source in sources:
                img = resize_to_cover(Image.open(io.BytesIO(source)).convert("RGB"), bucket)
                buf = io.BytesIO()
                img.save(buf, format=fmt, **options)
                encoded.append(buf.getvalue())

        build_rate = best_rates(build, len(sources), args.rounds)
        decode_rate = best_rates(lambda: [decode(data) for data in encoded], len(encoded), args.rounds)
        rows.append((name, np.mean([len(e) for e in encoded]), build_rate, decode_rate))
    # source kept: the photos already at the stored size (as a downloader that resized them would write them)
    kept = [jpeg_bytes(resize_to_cover(img, bucket)) for img in images]

    def keep():
        for data in kept:
            with Image.open(io.BytesIO(data)) as img:  # the header: size, mode, orientation
                assert img.size == resized and img.mode == "RGB"

    rows.append(("source kept (JPEG q92)", np.mean([len(k) for k in kept]), best_rates(keep, len(kept), args.rounds),
                 best_rates(lambda: [decode(data) for data in kept], len(kept), args.rounds)))
    print("images/s measured (wall clock, this machine's load) / per CPU second (an idle core)")
    print(f"{'format':24} {'KB/image':>9} {'build img/s':>16} {'decode img/s':>16}")
    for name, size, build_rate, decode_rate in rows:
        print(f"{name:24} {size / 1e3:9.0f} {build_rate[0]:7.1f} / {build_rate[1]:6.1f} "
              f"{decode_rate[0]:7.1f} / {decode_rate[1]:6.1f}")


def source_folder(work: Path, count: int) -> Path:
    folder = work / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(photos(count)):
        (folder / f"{i:05d}.jpg").write_bytes(jpeg_bytes(img))
        (folder / f"{i:05d}.txt").write_text(f"photo {i}")
    return folder


def build_config(folder: Path, image_format: str):
    from ot_dist.config.load import validate

    return validate({"model": {"family": "sdxl", "path": "m"}, "method": "lora", "output_dir": "o", "seed": 0,
                     "data": {"path": str(folder), "image_format": image_format, "shard_size_mb": 64},
                     "resolution": RESOLUTION, "batch_size": 1})


def cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, its finished child processes' CPU seconds)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def workers(args) -> None:
    from ot_dist.data.shards import build_shard_set

    work = Path(tempfile.mkdtemp(prefix="bench_build_"))
    config = build_config(source_folder(work, args.images), args.format)
    print(f"shard build of {args.images} 1600x1200 JPEG photos at {RESOLUTION}, image_format {args.format}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    base = None
    for count in [int(n) for n in args.workers.split(",")]:
        best, cpu = 0.0, (0.0, 0.0)
        for _ in range(args.rounds):
            before = cpu_seconds()
            start = time.perf_counter()
            build_shard_set(config, work / f"set-{count}", log=lambda *_: None, workers=count)
            rate = args.images / (time.perf_counter() - start)
            if rate > best:
                best, cpu = rate, tuple(b - a for a, b in zip(before, cpu_seconds()))
        base = base or best
        main_cpu, worker_cpu = (c / args.images for c in cpu)
        # on idle cores the build takes the longer of the main process's serial work and the workers' share
        projected = 1 / max(main_cpu, worker_cpu / count) if count > 1 else 1 / main_cpu
        print(f"workers {count}: {best:6.2f} images/s measured (x{best / base:.2f}; load {os.getloadavg()[0]:.1f}); "
              f"CPU per image: main process {1e3 * main_cpu:.0f} ms, workers {1e3 * worker_cpu:.0f} ms -> "
              f"{projected:.1f} images/s on {count} idle cores")


def loader(args) -> None:
    from ot_dist.data.reader import ShardDataset
    from ot_dist.data.shards import build_shard_set

    work = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    config = build_config(source_folder(work, args.images), args.format)
    build_shard_set(config, work / "set", log=lambda *_: None, workers=1)
    dataset = ShardDataset(work / "set", config)
    cpu = time.process_time()
    rate = best_rate(lambda: [dataset.load(i, epoch=0) for i in range(len(dataset))], len(dataset), args.rounds)
    idle = len(dataset) * args.rounds / (time.process_time() - cpu)  # images per CPU second: an idle core's rate
    print(f"loader worker at {RESOLUTION} ({args.format} shards; read, decode, crop, normalise): {rate:.1f} images/s "
          f"measured (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores), {idle:.1f} images/s per CPU second; "
          f"{TARGET_IMAGES_PER_S:.0f} images/s per rank needs {int(np.ceil(TARGET_IMAGES_PER_S / rate))} loader "
          f"workers at the measured rate, {int(np.ceil(TARGET_IMAGES_PER_S / idle))} on idle cores")


class SyntheticSDXL:
    """Cache members of SDXL's shapes for a shard set, from seeded random tensors (the encoder interface of caches.py)."""

    def __init__(self, dataset, kind: str):
        self.dataset, self.kind = dataset, kind
        self.members = ([f"{r}.latent.safetensors" for r in dataset.resolutions] if kind == "latents"
                        else ["text.safetensors"])

    def batches(self, ids):
        return [[i] for i in ids]

    def inputs(self, batches):
        return (None for _ in batches)

    def encode(self, ids, _inputs):
        import torch
        from safetensors.torch import save

        from ot_dist.data.buckets import bucket_size

        out = []
        for i in ids:
            g = torch.Generator().manual_seed(i)
            if self.kind == "latents":
                members = {}
                for resolution in self.dataset.resolutions:
                    h, w = bucket_size(int(self.dataset.index.bucket[i]), resolution, self.dataset.step)
                    shape = (4, h // 8, w // 8)
                    members[f"{resolution}.latent.safetensors"] = save(
                        {"mean": torch.randn(shape, generator=g), "std": torch.rand(shape, generator=g)})
                out.append(members)
            else:
                lines = self.dataset.captions(i)
                out.append({"text.safetensors": save(
                    {**{f"hidden_{j}": torch.randn(77, 2048, generator=g) for j in range(len(lines))},
                     **{f"pooled_{j}": torch.randn(1280, generator=g) for j in range(len(lines))}})})
        return out


def cached(args) -> None:
    from ot_dist.data.caches import attach_cache
    from ot_dist.data.reader import ShardDataset
    from ot_dist.data.shards import build_shard_set
    from ot_dist.parallel.runtime import Runtime

    work = Path(tempfile.mkdtemp(prefix="bench_cached_"))
    config = build_config(source_folder(work, args.images), args.format)
    build_shard_set(config, work / "set", log=lambda *_: None, workers=1)
    images = ShardDataset(work / "set", config)
    dataset = ShardDataset(work / "set", config)
    for kind in ("latents", "text"):
        attach_cache(dataset, kind, f"synthetic-sdxl-{kind}", SyntheticSDXL(dataset, kind), Runtime(),
                     log=lambda *_: None)
    sample = dataset.load(0, epoch=0)
    index_bytes = sum(cache.nbytes() for cache in dataset.caches.values()) / len(dataset)
    member_bytes = sum(cache.place(0, m)[2] for cache in dataset.caches.values() for m in cache.members)
    rows = []
    for name, source in (("images (decode, crop, normalise)", images), ("cached latents + text", dataset)):
        cpu = time.process_time()
        rate = best_rate(lambda: [source.load(i, epoch=0) for i in range(len(source))], len(source), args.rounds)
        rows.append((name, rate, len(source) * args.rounds / (time.process_time() - cpu)))
    print(f"{len(dataset)} samples at {RESOLUTION}, latent {tuple(sample['latent_mean'].shape)} (mean + std float32), "
          f"text hidden {tuple(sample['text_hidden'].shape)} + pooled {tuple(sample['text_pooled'].shape)}; "
          f"{member_bytes / 1e6:.2f} MB of cache members a sample, index {index_bytes:.0f} B/sample; "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, rate, idle in rows:
        print(f"loader worker, {name}: {rate:.1f} images/s measured, {idle:.1f} images/s per CPU second; "
              f"{TARGET_IMAGES_PER_S:.0f} images/s per rank needs {int(np.ceil(TARGET_IMAGES_PER_S / rate))} "
              f"worker(s) at the measured rate, {int(np.ceil(TARGET_IMAGES_PER_S / idle))} on idle cores")


def encode(args) -> None:
    import shutil

    import torch
    from diffusers import AutoencoderKL

    from ot_dist.data import caches
    from ot_dist.data.reader import ShardDataset
    from ot_dist.data.shards import build_shard_set
    from ot_dist.parallel.runtime import Runtime

    global RESOLUTION
    RESOLUTION = args.resolution
    work = Path(tempfile.mkdtemp(prefix="bench_encode_"))
    config = build_config(source_folder(work, args.images), args.format)
    build_shard_set(config, work / "set", log=lambda *_: None, workers=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=2, sample_size=1024).to(device=device, dtype=dtype).eval()
    print(f"{args.images} photos at {RESOLUTION} on {device} ({dtype}); load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    key = caches.vae_key(vae)  # hashing the weights: once, not timed
    for batch_pixels in map(int, args.batch_pixels.split(",")):
        dataset = ShardDataset(work / "set", config)
        for old in (work / "set").glob("latents-*"):
            shutil.rmtree(old)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        caches.attach_cache(dataset, "latents", key, caches.LatentEncoder(
            dataset, vae, batch_pixels=batch_pixels, workers=args.loader_workers), Runtime(device=device), lambda *_: None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"batch_pixels {batch_pixels} ({max(1, batch_pixels // (RESOLUTION * RESOLUTION))} at "
              f"{RESOLUTION}x{RESOLUTION}), loader workers {args.loader_workers}: {args.images / wall:.2f} images/s, "
              f"{args.images / (time.process_time() - cpu):.2f} per CPU second of the main process")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["formats", "workers", "loader", "cached", "encode"])
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--format", default="jpg")
    parser.add_argument("--workers", default=f"1,2,{os.cpu_count()}")
    parser.add_argument("--batch-pixels", default=f"1,{4 * 1024 * 1024}")
    parser.add_argument("--resolution", type=int, default=RESOLUTION)
    parser.add_argument("--loader-workers", type=int, default=0)
    args = parser.parse_args()
    {"formats": formats, "workers": workers, "loader": loader, "cached": cached, "encode": encode}[args.what](args)


if __name__ == "__main__":
    main()
