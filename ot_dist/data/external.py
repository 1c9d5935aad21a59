"""`ot-dist shard index`: train from existing webdataset tars (img2dataset's, webdataset.ShardWriter's) as they are.

The tars are read, never rewritten: their headers give each sample's key, members and offsets (tar_members.py),
and each image's size comes from the image's own header (Pillow reads the size, and the EXIF orientation, without
decoding the pixels). Not from img2dataset's json `width` / `height`: with `resize_mode no` (or
`resize_only_if_bigger`) and `skip_reencode` it keeps a photo's own bytes, EXIF orientation included, and records
the stored size (OpenCV's, orientation not applied), so a portrait phone photo would be bucketed landscape. Each
sample gets its aspect bucket from that size; the index (sample_index.py) and a manifest with `layout` go to the output
folder, which `data.shards` then names. The images are scaled to cover their bucket and cropped when loaded, on
the loader workers (reader.py), as ot_dist's own shards are cropped.

Member names follow webdataset: `<key>.<suffix>`, images `jpg|jpeg|png|webp`, captions `txt|caption|json` (the
first present, in that order; a json caption is its `caption` field); both lists and the field are configurable.
A sample whose image header does not open (or is over data.max_image_pixels), whose caption does not read (not
UTF-8, a json member without the caption field) or that holds a member twice is unreadable: counted and named, and
more than data.max_bad_fraction of them stops the indexing, before any training; a sample with no image or caption
member is not used, named with the reason. Compressed tars (.tar.gz) cannot be read by offset and are refused.
"""

from __future__ import annotations

import glob
import io
import json
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ot_dist.data.buckets import aspect_name, bucket_of, bucket_size
from ot_dist.data.images import (DEFAULT_MAX_PIXELS, HEIF_EXTENSIONS, UnreadableImage, heif_available, note_nclx,
                                 to_srgb_rgb)
from ot_dist.data.remote import DEFAULT_RETRIES, RemoteStore, expand_url, is_url, refuse_pipe
from ot_dist.data.sample_index import IndexWriter
from ot_dist.data.tar_members import Window, pread_of, samples_of
from ot_dist.data.unreadable import check_unreadable
from ot_dist.errors import InputFileError

LAYOUT = "webdataset"
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
CAPTION_SUFFIXES = ("txt", "caption", "json")
HEADER_BYTES = 1 << 16  # read to find an image's size: its header (with EXIF / ICC segments) fits, nearly always
_ORIENTATION = 0x0112  # EXIF orientation: 5-8 turn the image a quarter, so its upright width is its stored height


def expand_sources(patterns: list[str], storage_options: dict | None = None) -> list[Path | str]:
    """Tar paths from globs (`/data/*.tar`), webdataset's shard specs (brace ranges `shard-{000..099}.tar`, lists
    joined by `::`, expanded by webdataset's own expand_urls) or paths; URLs (`s3://b/{000..099}.tar`,
    `gs://b/*.tar`, `https://...`) the same way, listed by their store (remote.py), kept as given."""
    from webdataset.shardlists import expand_urls

    paths: list[Path | str] = []
    for pattern in patterns:
        refuse_pipe(pattern, "shard index")
        found: list = []
        for expanded in expand_urls(pattern):
            if is_url(expanded):
                found += expand_url(expanded, storage_options)
            else:
                found += [Path(p) for p in (sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded])]
        missing = [p for p in found if not is_url(p) and not p.is_file()]  # a URL's existence: when it is read
        if not found or missing:
            raise InputFileError(f"shard index: {pattern}: no tar file {missing[0] if missing else 'matches'}")
        for path in found:
            if str(path).endswith((".gz", ".tgz", ".bz2", ".xz", ".zst")):
                raise InputFileError(f"shard index: {path} is compressed: a compressed tar cannot be read by offset; "
                                     "decompress it (gunzip) and index the .tar")
        paths += found
    return paths


def first_of(members: dict, suffixes: tuple[str, ...]) -> str | None:
    """The member suffix of the first kind present (case-insensitive: img2dataset writes `jpg`, cameras `JPG`)."""
    lower = {suffix.lower(): suffix for suffix in members}
    return next((lower[s] for s in suffixes if s in lower), None)


def header_size(read, offset: int, size: int, where: str) -> tuple[int, int]:
    """(width, height) of an image member as displayed (EXIF orientation applied), from its header."""
    data = read(offset, min(size, HEADER_BYTES))
    for attempt in (0, 1):
        limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # checked against data.max_image_pixels
        try:
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
                if upright_orientation(img) in (5, 6, 7, 8):
                    width, height = height, width
            return width, height
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
            if attempt or len(data) == size:
                why = "not an image Pillow reads" if isinstance(err, UnidentifiedImageError) else str(err)
                raise UnreadableImage(f"data: image {where} could not be read: {why}") from None
            data = read(offset, size)  # a header longer than HEADER_BYTES: the whole member
        finally:
            Image.MAX_IMAGE_PIXELS = limit
    raise AssertionError("unreachable")


def upright_orientation(img: Image.Image) -> int | None:
    """The EXIF orientation (1-8) still to apply to `img`'s reported size, read from the header alone."""
    if img.format == "TIFF":
        return None  # Pillow's TIFF opener reports the upright size already (it turns the pixels as it loads them)
    if img.format == "PNG":
        # PngImageFile.getexif decodes the whole image first, to find an eXIf chunk after the pixels; the PNG
        # extension spec puts it before them, where the header (img.info) has it
        return Image.Image.getexif(img).get(_ORIENTATION)
    return img.getexif().get(_ORIENTATION)


def register_openers(image_suffixes) -> None:
    """pillow-heif's opener, where the image suffixes name HEIC / HEIF (it registers when first asked)."""
    if any(f".{suffix.lower()}" in HEIF_EXTENSIONS for suffix in image_suffixes):
        heif_available()


def within_limit(width: int, height: int, where: str, max_pixels: int | None) -> tuple[int, int]:
    if max_pixels is not None and width * height > max_pixels:
        raise UnreadableImage(f"data: image {where} is {width}x{height} = {width * height} pixels, over "
                              f"data.max_image_pixels {max_pixels} (a decompression bomb, or raise the limit)")
    return width, height


@dataclass
class TarIndex:
    """What indexing one tar found (picklable: tars are indexed over worker processes)."""
    size: int = 0  # the tar's bytes
    rows: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (offset, span, bucket, width, height)
    bad: list[dict] = field(default_factory=list)
    unused: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class TarIndexer:
    """Indexes one tar: its samples' spans, sizes and buckets (callable on a path or URL, for a process pool)."""
    largest: int
    bucket_step: int
    bucket_assignment: str
    image_suffixes: tuple[str, ...]
    caption_suffixes: tuple[str, ...]
    max_image_pixels: int | None
    caption_field: str = "caption"
    storage_options: dict | None = None  # for URLs: data.storage_options
    retries: int = DEFAULT_RETRIES

    def __call__(self, path: Path | str) -> TarIndex:
        register_openers(self.image_suffixes)
        if is_url(path):  # ranged reads: the headers' 64 KB windows, each image's header, its caption
            store = RemoteStore(self.storage_options, self.retries, log=print)
            out = TarIndex(store.size(path, f"tar {path}"))
            self._index(store.reader(path, f"tar {path}"), Window(store.reader(path, f"tar {path}")), path, out)
            return out
        fd = os.open(path, os.O_RDONLY)
        try:
            out = TarIndex(os.fstat(fd).st_size)
            self._index(fd, pread_of(fd), path, out)
        finally:
            os.close(fd)
        return out

    def _index(self, source, read, path, out: TarIndex) -> None:
        """Into `out`: the samples of the tar `source` (a descriptor or a read function); `read` reads members."""
        for span in samples_of(source, f"tar {path}"):
            where = f"{path}:{span.key}"
            image = first_of(span.members, self.image_suffixes)
            caption = first_of(span.members, self.caption_suffixes)
            if span.repeated:  # which of the two would train? webdataset stops on such a tar; here it is named
                twins = sorted({f"{span.key}.{s}" for s in span.members if s.lower() in span.repeated})
                out.bad.append({"file": where, "error": f"data: sample {where} has a member more than once: "
                                f"{', '.join(twins)} (suffixes compared lower-case, as webdataset does); keep one"})
                continue
            if image is None or caption is None:
                kind, wanted = ("image", self.image_suffixes) if image is None else ("caption", self.caption_suffixes)
                out.unused.append({"file": where, "reason": f"no {kind} member ({'|'.join(wanted)}); it has "
                                                            f"{', '.join(sorted(span.members))}"})
                continue
            try:
                width, height = within_limit(*header_size(read, *span.members[image], where), where,
                                             self.max_image_pixels)
                # read as the loader will: a json without the caption field (a wrong --caption-field) or text
                # that is not UTF-8 is found here, not in every sample once training has started
                caption_text(read(*span.members[caption]), caption, self.caption_field, where)
            except InputFileError as err:  # UnreadableImage is one
                out.bad.append({"file": where, "error": str(err)})
                continue
            bucket = bucket_of(width, height, self.largest, self.bucket_step, self.bucket_assignment)
            out.rows.append((span.start, span.end - span.start, bucket, width, height))


def indexed_tars(indexer: TarIndexer, tars: list[Path], workers: int):
    """TarIndex of each tar, in order; over `workers` processes when above 1 (tars are independent)."""
    if workers <= 1 or len(tars) < 2:
        yield from map(indexer, tars)
        return
    with ProcessPoolExecutor(min(workers, len(tars)), mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            yield from pool.map(indexer, tars)
        except BrokenProcessPool:
            raise RuntimeError("shard index: a worker process died (killed or out of memory); no manifest was "
                               "written; run it again") from None


def index_webdataset(patterns: list[str], out_dir: str | Path, *, resolutions: list[int], bucket_step: int,
                     bucket_assignment: str = "rounded_aspect", image_suffixes=IMAGE_SUFFIXES,
                     caption_suffixes=CAPTION_SUFFIXES, caption_field: str = "caption", max_bad_fraction: float = 0.01,
                     max_image_pixels: int | None = DEFAULT_MAX_PIXELS, name: str | None = None, workers: int = 1,
                     storage_options: dict | None = None, retries: int = DEFAULT_RETRIES, log=print) -> dict:
    """Index the tars into `out_dir` (index/*.npy + manifest.json, sample_index.py), the tars split over `workers`
    processes (the index is the same with any number). Returns the manifest. Local tars are stored by their path
    relative to `out_dir` (the set moves with its tars), URLs as given (the index moves alone)."""
    from ot_dist.data.shards import FORMAT, MANIFEST, index_description, write_index_and_manifest

    tars = expand_sources(patterns, storage_options)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # an interrupted index leaves a set that is visibly incomplete
    image_suffixes, caption_suffixes = tuple(s.lower() for s in image_suffixes), tuple(s.lower() for s in caption_suffixes)
    indexer = TarIndexer(max(resolutions), bucket_step, bucket_assignment, image_suffixes, caption_suffixes,
                         max_image_pixels, caption_field, storage_options, retries)
    writer, shards, bad, unused, start = IndexWriter(), [], [], [], time.perf_counter()
    for number, (path, found) in enumerate(zip(tars, indexed_tars(indexer, tars, workers))):
        per_bucket: Counter = Counter()
        for offset, span, bucket, width, height in found.rows:
            writer.add(number, offset, span, bucket, 0, False, width, height)
            per_bucket[bucket] += 1
        bad += found.bad
        unused += found.unused
        file = path if is_url(path) else os.path.relpath(path.resolve(), out_dir.resolve())
        shards.append({"file": file, "samples": len(found.rows), "bytes": found.size,
                       "buckets": {str(b): n for b, n in sorted(per_bucket.items())}})
    total = len(writer) + len(bad)
    check_unreadable([b["error"] for b in bad], total, max_bad_fraction, "samples", log)
    if not len(writer):
        raise InputFileError(f"shard index: no sample with an image ({'|'.join(image_suffixes)}) and a caption "
                             f"({'|'.join(caption_suffixes)}) in {len(tars)} tar(s)"
                             + (f"; not used: {unused[0]['file']} ({unused[0]['reason']}) ..." if unused else ""))
    folder = tars[0].rsplit("/", 1)[0] if is_url(tars[0]) else str(tars[0].parent)
    counts: Counter = Counter()
    for shard in shards:
        counts.update({int(b): n for b, n in shard["buckets"].items()})
    manifest = {
        "format": FORMAT,
        "fingerprint": None,  # not built from concept folders: nothing to compare, never rebuilt by training
        "layout": {"kind": LAYOUT, "image": list(image_suffixes), "caption": list(caption_suffixes),
                   "caption_field": caption_field},
        "built_from": {"config": None, "tars": patterns, "resolutions": resolutions, "bucket_step": bucket_step,
                       "bucket_assignment": bucket_assignment},
        "resolutions": resolutions,
        "bucket_step": bucket_step,
        "concepts": [{"name": name or out_dir.name, "path": folder, "images": len(writer), "balancing": 1.0,
                      "balancing_strategy": "repeats"}],
        "buckets": [{"bucket": b, "aspect": aspect_name(b), "samples": counts[b],
                     "sizes": {str(r): list(bucket_size(b, r, bucket_step)) for r in resolutions}} for b in sorted(counts)],
        "shards": shards,
        "sample_count": len(writer),
        "index": index_description(),
        "unused_files": unused,
        "unreadable_images": bad,
    }
    write_index_and_manifest(out_dir, writer, manifest)
    log(f"indexed {len(tars)} tar(s) into {out_dir}: {len(writer)} samples in {len(counts)} buckets in "
        f"{time.perf_counter() - start:.1f}s; {len(unused)} not used, {len(bad)} unreadable"
        + (f"; not used: {', '.join(u['file'] + ' (' + u['reason'] + ')' for u in unused[:5])}"
           + (" ..." if len(unused) > 5 else "") if unused else ""))
    return manifest


def decode_image(data: bytes, where: str, background: tuple[int, int, int]) -> Image.Image:
    """An image member as ot_dist's own builder opens files: upright, sRGB, 8-bit RGB, alpha on the background."""
    from PIL import ImageOps

    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # `shard index` checked data.max_image_pixels
    try:
        with Image.open(io.BytesIO(data)) as img:
            note_nclx(img)
            return to_srgb_rgb(ImageOps.exif_transpose(img), background)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, EOFError) as err:
        raise InputFileError(f"{where}: image could not be decoded: {err}") from None
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def caption_text(data: bytes, suffix: str, field: str, where: str) -> str:
    """The caption lines of a `txt` / `caption` member, or the `field` of a json member."""
    try:
        if suffix.lower() == "json":
            value = json.loads(data).get(field)  # bytes, as webdataset decodes json: a UTF-8 BOM (Windows) is fine
            if not isinstance(value, str):
                raise InputFileError(f"{where}: its json member has no {field!r} text (the caption field; "
                                     "ot-dist shard index --caption-field)")
            text = value
        else:
            text = data.decode("utf-8-sig")  # a byte order mark is no part of the caption (concepts.read_caption)
    except (UnicodeDecodeError, ValueError, AttributeError) as err:
        raise InputFileError(f"{where}: caption member {suffix} is not readable: {err}") from None
    return text.strip()
