"""Encoding one source image into its shard sample (the images per resolution, mask, reference image, caption,
metadata),
in this process or in a pool of worker processes (`ot-dist shard build --workers N`).

The pool only encodes: the samples come back in the build order (`imap`, not `imap_unordered`) and one
writer writes them, so a build with N workers is byte-identical to a build with one. Encoding (decode,
resize, re-encode) is nearly all of a build's time, so that is where the cores go.
"""

from __future__ import annotations

import io
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from PIL import Image

from ot_dist.data.buckets import aspect_name, bucket_size, config_bucket_of, cover_size, resize_to_cover
from ot_dist.data.images import open_image, parse_colour
from ot_dist.data.video import VIDEO_EXTENSIONS


class SampleEncoder:
    """Callable on (n, source) -> (sample dict for the writer, record, warnings); picklable for the pool.
    n (the source's place in the list of all concepts' images) names the sample, so a part of a build
    (`--part i/n`) names its samples as the whole build does."""

    def __init__(self, config):
        self.config = config

    def __call__(self, job):
        from ot_dist.data.shards import encode_image, load_mask, load_reference  # shards.py imports this module

        n, source = job
        config, data = self.config, self.config.data
        warnings: list[str] = []
        key = f"c{source.concept}_{n:08d}"
        if source.window is not None and data.video_frame_extraction != "head":  # a clip's windows: one sample each
            key += f"_{source.window[0]:05d}-{source.window[1]:03d}"  # (musubi-tuner's item key: start-frames)
        bucket = config_bucket_of(config, *source.size)
        sample = {"__key__": key, "txt": source.caption.encode("utf-8")}
        meta = {"source": str(source.image), "mask": str(source.mask) if source.mask else None,
                **({"reference": str(source.reference)} if source.reference else {}),
                **({"more_references": [str(p) for p in source.more_references]} if source.more_references else {}),
                "concept": source.concept, "original_size": [source.size[1], source.size[0]],
                "bucket": bucket, "aspect": aspect_name(bucket), "resolutions": {}}
        if source.image.suffix.lower() in VIDEO_EXTENSIONS:
            return encoded_clip(config, source, sample, meta, bucket)
        img = open_image(source.image, data.max_image_pixels, parse_colour(data.image_background))  # upright sRGB
        mask = load_mask(source.mask, source.image, img.size, warnings.append) if source.mask else None
        background = parse_colour(data.image_background)
        # member kind -> (image at the image's size, format): `reference`, then `reference2`, ... (Picture 1, 2, ...)
        references = {reference_kind(i): (load_reference(path, source.image, img.size, data.max_image_pixels,
                                                         background, warnings.append),
                                          reference_member_format(data.image_format, path))
                      for i, path in enumerate(references_of(source))}
        kept = KeptSource(source.image) if data.image_format == "auto" else None
        for res in config.resolutions():
            target = bucket_size(bucket, res, data.bucket_step)
            resized = resize_to_cover(img, target)
            suffix, encoded = kept.member(img, resized) if kept else (data.image_format, None)
            sample[f"{res}.{suffix}"] = encoded if encoded is not None else encode_image(resized, suffix)
            if mask is not None:  # the same geometry as the image, so they stay aligned
                sample[f"{res}.mask.png"] = encode_image(resize_to_cover(mask, target), "png")
            for kind, (reference, reference_format) in references.items():  # the image's geometry too: one box
                sample[f"{res}.{kind}.{reference_format}"] = encode_image(resize_to_cover(reference, target),
                                                                          reference_format)
            meta["resolutions"][str(res)] = {"bucket_size": list(target), "resized_size": [resized.height, resized.width]}
        sample["json"] = json.dumps(meta).encode()
        record = {"key": key, "bucket": bucket, "concept": source.concept, "mask": source.mask is not None,
                  "reference": len(references), "clip": False}  # how many (a bool before several were read)
        return sample, record, warnings


def references_of(source) -> list:
    """A source sample's reference images in order (none, or the first and any more)."""
    return [source.reference, *source.more_references] if source.reference else []


def reference_kind(index: int) -> str:
    """The member kind of a sample's `index`-th reference image: `reference`, then `reference2`, `reference3`, ..."""
    return "reference" if index == 0 else f"reference{index + 1}"


def reference_latent_member(resolution: int, index: int) -> str:
    """The latent cache's member of a sample's `index`-th reference at a resolution (version 0's name, caches.py):
    `<res>.reference_latent.safetensors` (one reference's name before several were cached), then
    `<res>.reference2_latent.safetensors`, ..."""
    return f"{resolution}.{reference_kind(index)}_latent.safetensors"


def encoded_clip(config, source, sample: dict, meta: dict, bucket: int):
    """A video clip's sample: the clip's own bytes (`clip.<extension>`, decoded and its frames chosen by the reader,
    video.py), never re-encoded; its metadata gives each resolution's bucket and the size its frames are scaled to.
    (The scan decoded its frames: it is long enough.)"""
    from ot_dist.errors import InputFileError

    if source.mask is not None or source.reference is not None:
        raise InputFileError(f"data: clip {source.image} has a mask or a reference image, which clips cannot have yet")
    sample[f"clip{source.image.suffix.lower()}"] = Path(source.image).read_bytes()
    for res in config.resolutions():
        target = bucket_size(bucket, res, config.data.bucket_step)
        width, height = cover_size(*source.size, target)
        meta["resolutions"][str(res)] = {"bucket_size": list(target), "resized_size": [height, width]}
    meta["clip"] = True
    meta["clip_window"] = list(source.window)  # (start, frames) on the clip's timeline: the reader decodes these
    sample["json"] = json.dumps(meta).encode()
    record = {"key": sample["__key__"], "bucket": bucket, "concept": source.concept, "mask": False, "reference": 0,
              "clip": True, "frames": source.window[1]}  # (into the manifest's clip_frame_counts, not the index)
    return sample, record, []


def reference_member_format(image_format: str, path) -> str:
    """The format a reference image is stored in: data.image_format, or for auto jpg for a JPEG source (lossless
    would only add bytes) and png for the others. (Its own bytes are never kept: it is always scaled or checked.)"""
    if image_format != "auto":
        return image_format
    with Image.open(path) as img:
        return "jpg" if img.format in ("JPEG", "MPO") else "png"


class KeptSource:
    """image_format auto for one source: its own bytes where they decode to exactly the pixels to store, else the
    format it is re-encoded in (jpg for a JPEG source: re-encoding a lossy source losslessly only adds bytes; png
    for the others)."""

    KEPT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}

    def __init__(self, path):
        self.data = Path(path).read_bytes()
        with Image.open(io.BytesIO(self.data)) as img:
            # MPO is a JPEG with more pictures after the first (camera previews, Android Ultra HDR gain maps): a JPEG
            # source, whose first picture is the photo; re-encoding it as PNG would add bytes for nothing.
            self.format = "JPEG" if img.format == "MPO" else img.format
        self.equal: bool | None = None  # decoded once, on the first resolution that needs no resize

    def member(self, upright, resized) -> tuple[str, bytes | None]:
        """(member suffix, the bytes to store or None: encode `resized` in that format)."""
        suffix = self.KEPT.get(self.format)
        if suffix is not None and resized.size == upright.size:
            if self.equal is None:
                self.equal = decodes_to(self.data, suffix, upright)
            if self.equal:
                return suffix, self.data
        return ("jpg" if self.format == "JPEG" else "png"), None


def decodes_to(data: bytes, suffix: str, pixels) -> bool:
    """Whether the reader's decoder (decode.py) gives exactly `pixels` (RGB) from `data`."""
    import numpy as np

    from ot_dist.data.decode import decode_member

    try:
        decoded = decode_member(f"source.{suffix}", data, "source")
    except Exception:  # noqa: BLE001  (not decodable as stored: re-encode)
        return False
    return decoded.mode == "RGB" and decoded.size == pixels.size and np.array_equal(np.asarray(decoded),
                                                                                    np.asarray(pixels))


def encoded_samples(config, sources: list, workers: int):
    """(sample, record, warnings) for each source, in order; over `workers` processes when above 1."""
    encode = SampleEncoder(config)
    jobs = [(source.number, source) for source in sources]
    if workers <= 1:
        yield from map(encode, jobs)
        return
    # fork: the workers start without re-importing torch. An executor, not multiprocessing.Pool: a worker that
    # dies (killed, out of memory) fails the build here instead of leaving Pool.imap waiting forever.
    chunk = max(1, min(16, len(jobs) // (4 * workers)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            yield from pool.map(encode, jobs, chunksize=chunk)
        except BrokenProcessPool:
            raise RuntimeError("shard build: a worker process died (killed or out of memory); no manifest was "
                               "written, so the set stays visibly incomplete; run the build again") from None
