"""`ot-dist shard build`: concepts -> webdataset tar shards grouped by aspect bucket, plus a manifest.

Each sample is written once with one image per training resolution, resized to cover its bucket
(`<key>.<res>.<format>`, data.image_format; `auto` keeps a source's own bytes where nothing changes), the same
for its mask (`<key>.<res>.mask.png`) and its reference image (`<key>.<res>.reference.<format>`, edit models; a second
one `<key>.<res>.reference2.<format>`, ...), its
caption(s) (`<key>.txt`)
and metadata (`<key>.json`). Samples are written bucket by bucket, so a bucket's samples sit in
neighbouring shards. The manifest (`manifest.json`, written last: a set without one is incomplete)
holds per-shard and per-bucket counts, what built the set, a fingerprint of the source files and
settings (to detect a stale set) and the sample count; where each sample sits in its shard (the reader's
index) is the compact columnar index `index/*.npy` beside it (sample_index.py), written just before it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from array import array
from collections import Counter
from pathlib import Path

from PIL import Image

from ot_dist.config.schema import ConceptConfig, TrainConfig
from ot_dist.data.augment import AUGMENTATION_FIELDS
from ot_dist.data.buckets import aspect_name, bucket_size, config_bucket_of
from ot_dist.data.concepts import classify_files, concept_name, mask_of, reference_partners, scan_folders
from ot_dist.data.images import open_mask
from ot_dist.data.sample_index import (COLUMNS, INDEX_DIR, IndexWriter, SampleIndex, SampleRecords, ShardFiles,
                                      bytes_per_sample)
from ot_dist.data.sample_encoder import encoded_samples
from ot_dist.data.tar_members import samples_of
from ot_dist.errors import InputFileError

FORMAT = "ot_dist.shards/2"  # /1 held every sample as a JSON dict in the manifest (refused: rebuild)
MANIFEST = "manifest.json"
SAVE_FORMATS = {"png": "PNG", "webp": "WEBP", "jpg": "JPEG"}


def default_shard_dir(config: TrainConfig) -> Path:
    """<cache folder>/shards/<first concept's name>-<hash of the concept folders and build settings> (shard_cache.py);
    a set an earlier ot_dist built under ./data_shards/ with that name is used where it is."""
    from ot_dist.data.shard_cache import cache_root, sets_dir

    concepts = [c for _, c in config.data.concept_list()]
    key = json.dumps([build_settings(config), [str(Path(c.path).resolve()) for c in concepts]], sort_keys=True)
    name = f"{concept_name(concepts[0])}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    legacy = Path("data_shards") / name
    return legacy if (legacy / MANIFEST).is_file() else sets_dir(cache_root(config)) / name


# Concept options applied as samples are read (reader.py: caption processing, augmentation, loss weight): no shard
# depends on them. The first ones enter the settings at their defaults, so that sets built with the defaults keep their
# fingerprint and folder name, and a change of them neither rebuilds a set nor writes a new copy of it; the ones added
# later (SETTINGS_WITHOUT) are left out of the settings, so that adding them kept every existing set's fingerprint too.
READ_TIME_AT_DEFAULTS = ("loss_weight", "tag_shuffling", "tag_delimiter", "keep_tags_count", "tag_dropout_probability",
                         "tag_dropout_mode", "caption_dropout_probability", *AUGMENTATION_FIELDS)
SETTINGS_WITHOUT = ("tag_dropout_special_tags_mode", "tag_dropout_special_tags", "tag_dropout_special_tags_regex",
                    "caps_randomize_probability", "caps_randomize_mode", "lowercase_caption", "keep_tags_separator",
                    "secondary_separator", "caption_dropout_every_n_epochs", "image_variations", "text_variations")
READ_TIME_CONCEPT_FIELDS = READ_TIME_AT_DEFAULTS + SETTINGS_WITHOUT
# Options stored in the shards (they change the caption a shard holds) that were added later: in the settings only when
# set (not empty), so that sets built before they existed keep their fingerprint.
STORED_ADDED_LATER = {"caption_suffix", "reference_path"}


def build_settings(config: TrainConfig) -> dict:
    """What the shard content depends on besides the source files (balancing and the concept type do not: they are
    read-time, as READ_TIME_CONCEPT_FIELDS; data.small_buckets neither: it is a plan of the epoch)."""
    data = config.data
    defaults = {name: ConceptConfig.model_fields[name].default for name in READ_TIME_AT_DEFAULTS}
    concepts = [c.model_dump(exclude={"balancing", "balancing_strategy", "type", *SETTINGS_WITHOUT,
                                      *(n for n in STORED_ADDED_LATER if not getattr(c, n))}) | defaults
                for _, c in data.concept_list()]
    return {"resolutions": config.resolutions(), "bucket_step": data.bucket_step,
            "bucket_assignment": data.bucket_assignment, "image_format": data.image_format,
            "max_image_pixels": data.max_image_pixels, "image_background": data.image_background,
            "skip_small_images": data.skip_small_images, "concepts": concepts,
            **clip_settings(data)}


def clip_settings(data) -> dict:
    """The video settings a set with clips was built with (which clips are samples, which are too short); {} without
    data.video_frames, so sets built before clips keep their fingerprint."""
    if data.video_frames is None:
        return {}
    settings = {"video_frames": data.video_frames, "video_fps": data.video_fps,
                "video_source_fps": data.video_source_fps, "video_frame_extraction": data.video_frame_extraction}
    # the windows' spacing, where the extraction uses it (so that head sets keep their fingerprint)
    if data.video_frame_extraction == "slide":
        settings["video_frame_stride"] = data.video_frame_stride
    if data.video_frame_extraction == "uniform":
        settings["video_frame_sample"] = data.video_frame_sample
    return settings


def source_fingerprint(config: TrainConfig) -> str:
    """A hash of the build settings and of every source file's path, size and mtime: cheap (stat only),
    and it changes when an image, caption or mask is added, removed or edited."""
    return fingerprint_of(build_settings(config), config.data.concept_list())


def fingerprint_of(settings: dict, concepts: list) -> str:
    """source_fingerprint from the build settings and the (label, ConceptConfig) list; `ot-dist shard list` calls it
    with a manifest's own, to tell whether a set's sources changed since it was built."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for label, concept in concepts:
        images, unused = classify_files(label, concept, clips="video_frames" in settings)  # (clip_settings)
        others = [Path(concept.path) / path for path, _ in unused]  # a HEIC that becomes readable changes the set
        partners = reference_partners(label, concept, images)
        for image in images + others:
            for path in (image, image.with_suffix(concept.caption_extension), mask_of(image), *partners.get(image, [])):
                if path is not None and path.is_file():
                    stat = path.stat()
                    digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_manifest(shard_dir: Path, remote=None) -> dict:
    """The manifest of a set, its "samples" the index shown as a list of sample dicts (sample_index.py); `remote`
    (a RemoteStore: storage options, retries) reads the shards the manifest names by URL."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise InputFileError(f"data.shards: {shard_dir} has no {MANIFEST} (build it: ot-dist shard build CONFIG)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputFileError(f"data.shards: {path} is not readable JSON: {err}") from None
    if manifest.get("format") == "ot_dist.shards/1":
        raise InputFileError(
            f"data.shards: {path} was written by an earlier ot_dist (format ot_dist.shards/1, every sample in the JSON; "
            f"this version reads the compact index {FORMAT}); rebuild the set: ot-dist shard build CONFIG --out "
            f"{shard_dir} (a run with data.path / data.concepts rebuilds it by itself)")
    if manifest.get("format") != FORMAT:
        raise InputFileError(f"data.shards: {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    manifest["samples"] = SampleRecords(Path(shard_dir), manifest["shards"],
                                        SampleIndex(Path(shard_dir), manifest["sample_count"]), ShardFiles(remote))
    return manifest


def is_current(shard_dir: Path, fingerprint: str) -> bool:
    try:
        return read_manifest(shard_dir)["fingerprint"] == fingerprint
    except InputFileError:
        return False


def encode_image(img: Image.Image, image_format: str) -> bytes:
    out = io.BytesIO()
    img.save(out, format=SAVE_FORMATS[image_format], **({"quality": 95} if image_format != "png" else {}))
    return out.getvalue()


def build_shard_set(config: TrainConfig, out_dir: str | Path, log=print, config_path: str | None = None,
                    workers: int = 1) -> dict:
    """Scan the concepts (errors name the file), write the shards with webdataset's ShardWriter (the samples
    encoded over `workers` processes, written in order by this one), then index member offsets and write the
    manifest. Returns the manifest. (`--part i/n` builds one part of this: shard_parts.py.)"""
    scan, sources = scan_sources(config, log, workers=workers)
    out_dir = Path(out_dir)
    clear_set(out_dir)
    fingerprint = source_fingerprint(config)
    start = time.perf_counter()
    records = write_shards(config, out_dir, sources, workers, log)
    unused = [{"file": str(path), "reason": reason} for path, reason in scan.unused]
    bad = [{"file": str(path), "error": error} for path, error in scan.bad]
    manifest = write_manifest(config, out_dir, records, fingerprint, config_path, unused, bad)
    log(f"shard set {out_dir}: {len(records)} samples in {len(manifest['shards'])} shards "
        f"({sum(s['bytes'] for s in manifest['shards']) / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s; "
        f"{len(unused)} file{'s' if len(unused) != 1 else ''} not used, {len(bad)} unreadable")
    for line in unused_report(manifest):  # also when the build happens at train start
        log(line)
    return manifest


def scan_sources(config: TrainConfig, log=print, part: tuple[int, int] | None = None, workers: int = 1) -> tuple:
    """(the scan, the samples to build): the concepts scanned (`part`: one range of their images), the small
    images left out with data.skip_small_images or warned about."""
    from ot_dist.data.video import check_clip_settings
    from ot_dist.models.families.registry import get_family

    data = config.data
    check_clip_settings(data, get_family(config.model.family))  # before any clip is decoded
    scan = scan_folders(data, log, part, workers)
    sources, small = small_images(config, scan.samples)
    if data.skip_small_images:
        scan.unused += [(image, f"too small: {reason}; data.skip_small_images") for image, reason in small]
    elif small:
        log(f"warning: data: {len(small)} image{'s' if len(small) != 1 else ''} with a side below a quarter of the "
            f"bucket side it is scaled to (blurry when upscaled; data.skip_small_images leaves them out): "
            + ", ".join(f"{image} ({reason})" for image, reason in small))
    if not sources and part is None:
        raise InputFileError("data: no image is left to build the shard set from"
                             + (f"; {scan.unused_line()}" if scan.unused else ""))
    return scan, sources


def clear_set(out_dir: Path, keep_parts: int | None = None) -> None:
    """Remove what an earlier build left in `out_dir`: the manifest first (an interrupted rebuild leaves a set that is
    visibly incomplete), the shards, the latent / text caches (derived from the old shards) and the part folders
    (`--part`) except those of a build in `keep_parts` parts."""
    from ot_dist.data.shard_parts import part_folders

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [out_dir / MANIFEST, *out_dir.glob("shard-*.tar")]:
        old.unlink(missing_ok=True)
    for cache in [*out_dir.glob("latents-*"), *out_dir.glob("text-*")]:
        shutil.rmtree(cache, ignore_errors=True)  # parts of one build clear side by side
    for folder, (_, parts) in part_folders(out_dir).items():
        if parts != keep_parts:
            shutil.rmtree(folder, ignore_errors=True)


def build_order(config: TrainConfig, sources: list) -> list:
    """The order samples are written and indexed in: bucket by bucket, then by image number."""
    return sorted(sources, key=lambda s: (config_bucket_of(config, *s.size), s.number))


def write_shards(config: TrainConfig, out_dir: Path, sources: list, workers: int, log=print) -> list[dict]:
    """Encode `sources` into out_dir/shard-NNNNNN.tar, bucket by bucket (then in source order); the records of the
    samples written, in that order, each with its shard's number."""
    import webdataset as wds

    ordered = build_order(config, sources)
    records = []
    # mtime fixed: the same sources give byte-identical shards (with any number of workers).
    with wds.ShardWriter(str(out_dir / "shard-%06d.tar"), maxsize=config.data.shard_size_mb * 1e6, maxcount=10**9,
                         verbose=0, mtime=0, encoder=False) as writer:
        for sample, record, warnings in encoded_samples(config, ordered, workers):
            for line in warnings:
                log(line)
            writer.write(sample)
            records.append({"key": record["key"], "shard": writer.shard - 1, **record})
    return records


def unused_report(manifest: dict) -> list[str]:
    """The build report's lines on files not used: `3 files not used: a.heic (install ot-dist[heic]), ...`."""
    unused = manifest.get("unused_files", [])
    if not unused:
        return []
    return [f"{len(unused)} file{'s' if len(unused) != 1 else ''} not used: "
            + ", ".join(f"{u['file']} ({u['reason']})" for u in unused)]


def small_images(config: TrainConfig, sources: list) -> tuple[list, list[tuple[Path, str]]]:
    """(the samples to build, [(image, reason)] of those with a side below a quarter of the side of the bucket
    they are scaled to at the largest resolution). Without data.skip_small_images every sample is built."""
    keep, small, named = [], [], set()
    res = max(config.resolutions())
    roots = [Path(concept.path) for _, concept in config.data.concept_list()]
    for source in sources:
        width, height = source.size
        bucket_height, bucket_width = bucket_size(config_bucket_of(config, width, height), res, config.data.bucket_step)
        if 4 * width < bucket_width or 4 * height < bucket_height:
            if source.image not in named:  # a clip's windows: named once
                named.add(source.image)
                small.append((source.image.relative_to(roots[source.concept]),
                              f"{width}x{height} for a {bucket_width}x{bucket_height} bucket"))
            if config.data.skip_small_images:
                continue
        keep.append(source)
    return keep, small


def load_mask(path: Path, image: Path, size: tuple[int, int], log=print) -> Image.Image:
    """The mask of an image at the image's size. A mask of the same shape at another size (a half-size mask) is
    scaled, with a warning; one of another shape would be stretched out of place over the image: refused."""
    mask = open_mask(path)  # drawn on the image as displayed: compared with the upright size
    if mask.size == size:
        return mask
    sizes = f"mask {Path(path).resolve()} is {mask.width}x{mask.height}, its image {Path(image).resolve()} is " \
            f"{size[0]}x{size[1]}"
    if abs(mask.width / mask.height - size[0] / size[1]) > 0.01 * size[0] / size[1]:
        raise InputFileError(f"data: {sizes}: another shape, so it cannot be laid over the image; make the mask "
                             "the image's size")
    log(f"warning: data: {sizes}; the mask is scaled to the image")
    return mask.resize(size, Image.Resampling.BILINEAR)


def load_reference(path: Path, image: Path, size: tuple[int, int], max_pixels: int, background, log=print) -> Image.Image:
    """The reference image of an image at the image's (upright) size, so one bucket, crop and flip fit both. One of
    the same shape at another size is scaled, with a warning; one of another shape is refused (scaled, it would be
    stretched; cropped, it would lose what the edit refers to): crop it to the image's shape."""
    from ot_dist.data.images import UnreadableImage, open_image

    try:
        reference = open_image(path, max_pixels, background)
    except UnreadableImage as err:
        raise InputFileError(f"data: reference image of {Path(image).resolve()}: {err}") from None
    if reference.size == size:
        return reference
    sizes = f"reference {Path(path).resolve()} is {reference.width}x{reference.height}, its image " \
            f"{Path(image).resolve()} is {size[0]}x{size[1]}"
    if abs(reference.width / reference.height - size[0] / size[1]) > 0.01 * size[0] / size[1]:
        raise InputFileError(f"data: {sizes}: another shape; the pair shares one bucket and crop, so crop the "
                             "reference to the image's shape")
    log(f"warning: data: {sizes}; the reference is scaled to the image")
    return reference.resize(size, Image.Resampling.LANCZOS)


def index_members(shard: Path) -> dict[str, dict[str, list[int]]]:
    """key -> member suffix -> [data offset, size]: read from the tar headers, so the reader can seek."""
    return {span.key: span.members for span in shard_samples(shard)}


def shard_samples(shard: Path):
    """The samples of one tar in order (tar_members.SampleSpan: key, first header offset, end, members)."""
    fd = os.open(shard, os.O_RDONLY)
    try:
        yield from samples_of(fd, f"shard {shard.name}")
    finally:
        os.close(fd)


def index_records(out_dir: Path, shard_files: list[Path], records: list[dict]) -> tuple[IndexWriter, list[dict]]:
    """The columnar index of `records` (in their order) from one read of each shard's tar headers: linear in
    samples. Each record gets its "members" (suffix -> [data offset, size]); returns (index, per-shard stats)."""
    by_shard: dict[int, list[int]] = {}
    for position, record in enumerate(records):  # one pass: a scan of all records per shard is quadratic
        by_shard.setdefault(record["shard"], []).append(position)
    unknown = sorted(set(by_shard) - set(range(len(shard_files))))
    if unknown:
        raise InputFileError(f"shard set {out_dir}: records name shard {unknown[0]}, the folder holds "
                             f"{len(shard_files)} shard-*.tar")
    starts, spans_of = array("Q", [0]) * len(records), array("Q", [0]) * len(records)  # 16 bytes a sample
    shards = []
    for number, path in enumerate(shard_files):
        spans = {span.key: span for span in shard_samples(path)}
        in_shard = by_shard.get(number, [])
        for position in in_shard:
            record = records[position]
            span = spans.get(record["key"])
            if span is None:
                raise InputFileError(f"shard {path}: no members of sample {record['key']}")
            record["members"] = span.members
            starts[position], spans_of[position] = span.start, span.end - span.start
        shards.append({"file": path.relative_to(out_dir).as_posix(), "samples": len(in_shard), "bytes": path.stat().st_size,
                       "buckets": dict(Counter(str(records[p]["bucket"]) for p in in_shard))})
    index = IndexWriter()
    for record, offset, span in zip(records, starts, spans_of):
        index.add(record["shard"], offset, span, record["bucket"], record["concept"], record.get("mask", False),
                  record.get("width", 0), record.get("height", 0), record.get("reference", False))
    return index, shards


def write_manifest(config: TrainConfig, out_dir: Path, records: list[dict], fingerprint: str,
                   config_path: str | None, unused: list[dict] = (), bad: list[dict] = (),
                   shard_files: list[Path] | None = None) -> dict:
    """Index the shards `shard_files` (default: out_dir/shard-*.tar; a merge of parts passes theirs, in out_dir's
    part folders), a record's "shard" being its shard's place in that list, into out_dir/index/*.npy, and write
    manifest.json (last, atomically). Returns the manifest with "samples": `records`, each given its "members"."""
    shard_files = sorted(out_dir.glob("shard-*.tar")) if shard_files is None else shard_files
    index, shards = index_records(out_dir, shard_files, records)
    counts = Counter(r["bucket"] for r in records)
    per_concept = Counter(r["concept"] for r in records)
    manifest = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "built_from": {"config": config_path, **build_settings(config)},
        "resolutions": config.resolutions(),
        "bucket_step": config.data.bucket_step,
        "concepts": [{"name": concept_name(c), "path": c.path, "images": per_concept[i], "balancing": c.balancing,
                      "balancing_strategy": c.balancing_strategy}
                     for i, (_, c) in enumerate(config.data.concept_list())],
        "buckets": [{"bucket": b, "aspect": aspect_name(b), "samples": counts[b],
                     "sizes": {str(r): list(bucket_size(b, r, config.data.bucket_step)) for r in config.resolutions()}}
                    for b in sorted(counts)],
        "shards": shards,
        "sample_count": len(records),
        "clip_samples": sum(1 for r in records if r.get("clip")),  # video clips among them (video.py)
        # their frame counts (data.video_frame_extraction full: several; a micro batch stacks one)
        "clip_frame_counts": sorted({r.pop("frames") for r in records if r.get("clip") and "frames" in r}),
        "index": index_description(),
        "unused_files": list(unused),  # files in the concept folders that are not samples, with the reason
        "unreadable_images": list(bad),  # skipped within data.max_bad_fraction
    }
    write_index_and_manifest(out_dir, index, manifest)
    return {**manifest, "samples": records}


def index_description() -> dict:
    return {"folder": INDEX_DIR, "columns": COLUMNS, "bytes_per_sample": bytes_per_sample()}


def write_index_and_manifest(out_dir: Path, index: IndexWriter, manifest: dict) -> None:
    """The index first, then the manifest (atomic): a reader sees the old set's absence or the whole new one."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    index.write(out_dir)
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, out_dir / MANIFEST)
