"""Reading a shard set: samples by index (ShardDataset) and this rank's micro batches (ShardReader).

How samples are read: by seeking to the member offsets the index holds (sample_index.py), not by streaming
shards. The epoch plan (plan.py) decides which samples make each global batch; random access is
what lets every rank read exactly its slice of that plan, lets loader workers split the micro
batches, and makes a resume (on any world size) start at the exact global batch without replaying
the epoch. A sample's members are contiguous in its tar, so each read is one seek and a few
sequential reads of an open file; the shards of a rank are split by the plan, not by file, which is
what keeps the per-rank step count exactly equal. Shards in object storage (named by URL, remote.py) are read
the same way, by byte range: each sample's span in one request, the spans of the next micro batches fetched ahead
by a few threads on each loader worker (data.remote_read_ahead, data.remote_concurrency), so that the store's
latency overlaps the decoding instead of adding to it.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ot_dist.data.buckets import bucket_size, cover_size, merged_buckets, resize_to_cover
from ot_dist.data.augment import augment_mask, augment_with_references
from ot_dist.data.cache_index import CacheIndex
from ot_dist.data.captions import vary_caption
from ot_dist.data.concepts import clip_selection
from ot_dist.data.decode import decode_member
from ot_dist.data import external
from ot_dist.data.images import parse_colour
from ot_dist.data.plan import EpochPlan, GlobalBatch, SampleTable, plan_epoch, steps_per_epoch
from ot_dist.data.remote import RemoteStore, filesystem, is_url
from ot_dist.data.sample_encoder import reference_kind, reference_latent_member
from ot_dist.data.sample_index import MASK, REFERENCE, reference_counts, shard_label
from ot_dist.data.small_buckets import move_small_buckets
from ot_dist.data.shards import clip_settings, read_manifest
from ot_dist.data.variations import Variations, member_name
from ot_dist.data.video import clip_frames
from ot_dist.errors import InputFileError
from ot_dist.randomness import generator


class ShardDataset:
    """The samples of one shard set; `load(index, epoch)` decodes, crops to the bucket and normalises."""

    def __init__(self, shard_dir: str | Path, config):
        self.dir = Path(shard_dir)
        data = config.data
        self.manifest = read_manifest(self.dir, RemoteStore(data.storage_options, data.remote_retries, log=_warn))
        self.samples = self.manifest["samples"]  # the index as sample dicts, read on access (sample_index.py)
        self.index = self.samples.index  # its memory-mapped columns
        self.seed, self.crop, self.step = config.seed, config.data.crop, self.manifest["bucket_step"]
        self.resolutions = config.resolutions()
        # concept index -> its config (caption variation); a set trained from data.shards alone has none
        self.concepts = {i: c for i, (_, c) in enumerate(config.data.concept_list())}
        # per-sample loss weights travel in the batch only when some concept has one: without, the loss stays MSE
        self.weighted = any(c.loss_weight != 1.0 for c in self.concepts.values())
        # per-sample prior-prediction flags travel in every batch of a run with such a concept (all ranks alike: the
        # loss then runs the model without its LoRA on every micro batch, the same forwards on every rank)
        self.prior_prediction = any(c.type == "prior_prediction" for c in self.concepts.values())
        # None: ot_dist's own shards (an image per resolution); else tars indexed as they are (external.py): their
        # images are scaled to cover the bucket when loaded, at any resolution
        self.layout = self.manifest.get("layout")
        if self.layout:
            external.register_openers(self.layout["image"])
        self.background = parse_colour(config.data.image_background)
        self.clip_selection = clip_selection(config.data)  # how video clips' frames are chosen (video.py)
        check_clip_set(self.manifest, config.data, self.dir)
        missing = sorted(set(self.resolutions) - set(self.manifest["resolutions"]))
        if missing and not self.layout:
            raise InputFileError(
                f"data.shards: {self.dir} was built for resolutions {self.manifest['resolutions']}, not "
                f"{missing}; rebuild it (ot-dist shard build CONFIG)"
            )
        self.has_masks = bool(np.any(self.index.flags & MASK))
        self.has_references = bool(np.any(self.index.flags & REFERENCE))  # an edit model's conditioning images
        # with cached latents, also the references' pixels (the family's text encoder reads them: Qwen-Image-Edit)
        self.reference_pixels_with_latents = False
        # (parallel reads, micro batches ahead) on each loader worker when some shard is a URL; None: all local
        urls = {s["file"].split("://", 1)[0]: s["file"] for s in self.manifest["shards"] if is_url(s["file"])}
        for url in urls.values():  # a store whose package is missing (s3fs, gcsfs) is named now, not per sample
            filesystem(url, data.storage_options)
        self.fetch_ahead = (data.remote_concurrency, data.remote_read_ahead) if urls else None
        self._last = None  # the sample record load() read last: its tar headers are read once per load
        self.caches: dict[str, CacheIndex] = {}  # latents / text -> the cache's index (cache_index.py)
        # latents / text -> each sample's cached versions and which one an epoch reads (variations.py)
        self.variations = {kind: Variations(kind, self.concepts, self.index.concept, self.seed)
                           for kind in ("latents", "text")}

    def __len__(self) -> int:
        return len(self.samples)

    def table(self, data_config=None) -> SampleTable:
        """Buckets and concepts of the samples; balancing from the config's concepts when it has them."""
        concepts = self.manifest["concepts"]
        balancing = [(c["balancing"], c["balancing_strategy"]) for c in concepts]
        kinds: tuple[str, ...] = ()
        if data_config is not None and data_config.concept_list():
            balancing = [(c.balancing, c.balancing_strategy) for _, c in data_config.concept_list()]
            kinds = tuple(c.type for _, c in data_config.concept_list())
        merged = merged_buckets(self.resolutions, self.step)
        lookup = np.array([merged[b] for b in range(len(merged))], dtype=np.int16)  # bucket numbers: < 100
        return SampleTable(lookup[self.index.bucket], np.asarray(self.index.concept),
                           tuple(balancing), tuple(c["name"] for c in concepts), kinds)

    def without_masks(self) -> list[int]:
        """Indices of the samples that have no mask."""
        return np.flatnonzero((self.index.flags & MASK) == 0).tolist()

    def with_references(self, present: bool = True) -> list[int]:
        """Indices of the samples that have a reference image (`present` false: that have none)."""
        return np.flatnonzero(((self.index.flags & REFERENCE) != 0) == present).tolist()

    def reference_counts(self) -> dict[int, list[int]]:
        """How many reference images -> the indices of the samples with that many (0: without)."""
        counts = reference_counts(self.index.flags)
        return {int(n): np.flatnonzero(counts == n).tolist() for n in np.unique(counts)}

    def _sample(self, sample_id: int):
        """The record of a sample (its tar headers read once, on first use, and kept for the next call)."""
        index = sample_id % len(self.samples)
        if self._last is None or self._last.index != index:
            self._last = self.samples[index]
        return self._last

    def _read(self, sample: dict, suffix: str):
        path = self.samples.shard_path(sample["shard"])
        if suffix not in sample["members"]:
            raise InputFileError(f"shard {self.manifest['shards'][sample['shard']]['file']} sample {sample['key']}: "
                                 f"no member {suffix}")
        return self._read_member(path, sample["key"], suffix, *sample["members"][suffix])

    def _read_member(self, path: Path, key: str, suffix: str, offset: int, size: int):
        return decode_member(f"{key}.{suffix}", self.member_bytes(path, key, suffix, offset, size),
                             f"shard {shard_label(path)} sample {key}")

    def member_bytes(self, path: Path | str, key: str, suffix: str, offset: int, size: int) -> bytes:
        # a local shard by pread (no shared file position, so forked loader workers can use descriptors they
        # inherited); a URL's from the sample's span, fetched when its headers were read (or ahead, by the loader)
        where = f"shard {shard_label(path)} sample {key}"
        data = self.samples.files.read(path, offset, size, where)
        if len(data) != size:
            raise InputFileError(f"{where}: member {suffix} is truncated ({len(data)} of {size} bytes)")
        return data

    def use_cache(self, kind: str, index: CacheIndex) -> None:
        """Read `kind` (latents | text) from a cache (caches.py), through its index: sample id -> member places."""
        if len(index) != len(self.samples):
            raise InputFileError(f"data.cache_{kind}: the cache {index.dir} holds {len(index)} samples, the shard set "
                                 f"{len(self.samples)}; delete the folder to recompute it")
        self.caches[kind] = index

    def _read_cached(self, kind: str, sample_id: int, key: str, suffix: str):
        path, offset, size = self.caches[kind].place(sample_id % len(self.samples), suffix)
        return self._read_member(path, key, suffix, offset, size)

    def metadata(self, sample_id: int) -> dict:
        """The sample's json member: source file, mask file, sizes, bucket (shards.py); for tars indexed as they
        are, the same fields from the index (the source: `<tar>:<key>`)."""
        sample = self._sample(sample_id)
        if not self.layout:
            return self._read(sample, "json")
        index = sample_id % len(self.samples)
        width, height = int(self.index.width[index]), int(self.index.height[index])
        resized = {}
        for resolution in self.resolutions:
            size = bucket_size(sample["bucket"], resolution, self.step)
            resized[str(resolution)] = {"bucket_size": list(size), "resized_size": list(cover_size(width, height, size))[::-1]}
        return {"source": f"{self.samples.shard_path(sample['shard'])}:{sample['key']}", "mask": None,
                "concept": sample["concept"], "original_size": [height, width], "bucket": sample["bucket"],
                "resolutions": resized}

    def captions(self, sample_id: int) -> list[str]:
        sample = self._sample(sample_id)
        if not self.layout:
            return self._read(sample, "txt").split("\n")
        suffix = external.first_of(sample["members"], tuple(self.layout["caption"]))
        path = self.samples.shard_path(sample["shard"])
        text = external.caption_text(self.member_bytes(path, sample["key"], suffix, *sample["members"][suffix]),
                                     suffix, self.layout["caption_field"], f"shard {shard_label(path)} sample {sample['key']}")
        return [line.strip() for line in text.split("\n") if line.strip()] or [""]

    def _image(self, sample, resolution: int) -> Image.Image:
        """The stored image of a sample at a resolution; for tars indexed as they are, the image as it is."""
        if not self.layout:
            return self._read(sample, self._image_suffix(sample, resolution))
        suffix = external.first_of(sample["members"], tuple(self.layout["image"]))
        if suffix is None:
            raise InputFileError(f"data.shards: sample {sample['key']} has no image member ({'|'.join(self.layout['image'])})")
        path = self.samples.shard_path(sample["shard"])
        return external.decode_image(self.member_bytes(path, sample["key"], suffix, *sample["members"][suffix]),
                                     f"shard {shard_label(path)} sample {sample['key']} member {suffix}", self.background)

    def moved(self, sample_id: int, bucket: int | None, resolution: int) -> bool:
        """Whether the sample trains in a bucket of another size than its own (data.small_buckets move)."""
        own = int(self.index.bucket[sample_id % len(self.samples)])
        return bucket is not None and bucket_size(bucket, resolution, self.step) != bucket_size(own, resolution, self.step)

    def load(self, sample_id: int, epoch: int, resolution: int | None = None, use_cache: bool = True,
             bucket: int | None = None, latents: bool = True) -> dict:
        """The sample cropped to its bucket, or to `bucket` (scaled to cover it first when its size differs).
        `latents` false: pixels even with a latent cache (a micro batch with a moved sample is all pixels)."""
        resolution = resolution or self.resolutions[0]
        sample = self._sample(sample_id)
        moved = self.moved(sample_id, bucket, resolution)
        height, width = bucket_size(bucket if moved else sample["bucket"], resolution, self.step)
        meta = self.metadata(sample_id)
        mask_image = None
        if "latents" in self.caches and use_cache and latents and not moved:
            # the cache holds the centre crop (the one `data.crop: center` takes), augmented as in epoch image_version
            image_version = self.variations["latents"].of(sample_id, sample["concept"], epoch)
            posterior = self._read_cached("latents", sample_id, sample["key"],
                                          member_name(f"{resolution}.latent.safetensors", image_version))
            resized = meta["resolutions"][str(resolution)]["resized_size"]
            top, left = (resized[0] - height) // 2, (resized[1] - width) // 2
            out = {"latent_mean": posterior["mean"], "latent_std": posterior["std"]}
            if sample["reference"]:  # its references' posteriors, cropped and augmented as the image (caches.py)
                out |= self._cached_references(sample, sample_id, resolution, image_version)
                if self.reference_pixels_with_latents:  # the pixels the cache was encoded from: centre, version v
                    pixels = self._pixel_sample(sample, sample_id % len(self.samples), image_version, resolution,
                                                False, (height, width))[2]
                    out |= {k: v for k, v in pixels.items() if k in ("reference_pixels", "more_reference_pixels")}
        elif self._clip_member(sample):
            top, left, out = self._clip(sample, sample_id, epoch, resolution, (height, width))
        else:
            top, left, out, mask_image = self._pixel_sample(sample, sample_id, epoch, resolution, moved,
                                                            (height, width))
        box = (left, top, left + width, top + height)
        captions = self.captions(sample_id)
        line = int(torch.randint(len(captions), (1,), generator=generator(self.seed, epoch, sample_id, "caption")))
        if "text" in self.caches and use_cache:
            # the line drawn in this epoch, in the cached version of its variation (what the text tensors encode)
            version = self.variations["text"].of(sample_id, sample["concept"], epoch)
            caption = self.caption_version(sample_id % len(self.samples), captions[line], version)
            text = self._read_cached("text", sample_id, sample["key"], member_name("text.safetensors", version))
            # The family's conditioning dict for this caption line, keys as `text_<key>` (ot_dist/data/caches.py).
            out |= {f"text_{k.rsplit('_', 1)[0]}": v for k, v in text.items() if _line_of(k) == line}
        else:
            caption = vary_caption(captions[line], self.concepts.get(sample["concept"]),
                                   generator(self.seed, epoch, sample_id, "caption variation"), epoch)
        if self.weighted:
            out["loss_weight"] = torch.tensor(self.concepts[sample["concept"]].loss_weight, dtype=torch.float32)
        if self.prior_prediction:
            out["prior_prediction"] = torch.tensor(self.concepts[sample["concept"]].type == "prior_prediction")
        out |= {
            "caption": caption,
            "sample_id": sample_id,
            "original_size": torch.tensor(meta["original_size"], dtype=torch.float32),
            "crop_top_left": torch.tensor((top, left), dtype=torch.float32),
            "target_size": torch.tensor((height, width), dtype=torch.float32),
        }
        if self.has_masks:  # a sample without a mask trains everywhere
            mask = torch.ones(1, height, width)
            if "latent_mean" in out:  # cached latents: the mask of the centre crop, augmented as the cached version
                if sample["mask"]:
                    mask_image = self._read(sample, f"{resolution}.mask.png").convert("L").crop(box)
                mask_image = augment_mask(mask_image, (width, height), self.concepts.get(sample["concept"]),
                                          generator(self.seed, image_version, sample_id % len(self.samples), "augment"))
            if mask_image is not None:  # (a rotation gives an unmasked sample a mask of its image's area)
                mask = torch.from_numpy(np.asarray(mask_image, dtype=np.float32) / 255.0)[None]
            out["mask"] = mask
            out["mask_given"] = torch.tensor(bool(sample["mask"]))  # inpainting draws a mask for the others
        return out

    def frames_of(self, sample_id: int) -> int:
        """The frames a sample trains on: 0 for an image, a clip window's count."""
        if self.clip_selection is None or not self._clip_member(self._sample(sample_id)):
            return 0
        return self._clip_window(sample_id)[1]

    def _clip_window(self, sample_id: int) -> tuple[int, int]:
        """(start, frames) of a clip sample on its timeline (video.py); a set built before windows: its head."""
        return tuple(self.metadata(sample_id).get("clip_window", (0, self.clip_selection["frames"])))

    def _pixel_sample(self, sample: dict, sample_id: int, epoch: int, resolution: int, moved: bool,
                      size: tuple[int, int]):
        """(top, left, {"pixels", "reference_pixels", "more_reference_pixels"}, mask image) of an image sample: its
        crop in epoch `epoch`, the mask and every reference with the image's box and augmentation draws."""
        height, width = size
        image = self._image(sample, resolution)
        if moved or self.layout:  # stored to cover its own bucket (or as it was): scaled to cover this one
            image = resize_to_cover(image, (height, width))
        top, left = self._crop_offset(image.height - height, image.width - width, sample_id, epoch)
        box = (left, top, left + width, top + height)
        mask_image = None
        if sample["mask"]:
            mask_image = self._read(sample, f"{resolution}.mask.png").convert("L")
            if moved:
                mask_image = resize_to_cover(mask_image, (height, width), Image.Resampling.BILINEAR)
            mask_image = mask_image.crop(box)
        references = []
        for index in range(sample["reference"]):  # how many; stored at the image's size: the same box and augmentation
            reference = self._read(sample, self._image_suffix(sample, resolution, reference_kind(index)))
            if moved:
                reference = resize_to_cover(reference, (height, width))
            references.append(reference.crop(box))
        cropped, mask_image, references = augment_with_references(
            image.crop(box), mask_image, references, self.concepts.get(sample["concept"]),
            generator(self.seed, epoch, sample_id, "augment"))
        out = {"pixels": _pixels(cropped)}
        if references:  # the first as before; FLUX.2's / Qwen-Image-Edit-2509's further ones (N - 1, 3, H, W)
            out["reference_pixels"] = _pixels(references[0])
        if len(references) > 1:
            out["more_reference_pixels"] = torch.stack([_pixels(r) for r in references[1:]])
        return top, left, out, mask_image

    def _cached_references(self, sample: dict, sample_id: int, resolution: int, version: int) -> dict:
        """The cached posteriors of a sample's references: the first as `reference_latent_mean` / `_std`, the others
        (several references) stacked as `more_reference_latent_mean` / `_std` (N - 1, C, h, w), as the pixels are."""
        posteriors = [self._read_cached("latents", sample_id, sample["key"],
                                        member_name(reference_latent_member(resolution, index), version))
                      for index in range(sample["reference"])]
        out = {"reference_latent_mean": posteriors[0]["mean"], "reference_latent_std": posteriors[0]["std"]}
        if len(posteriors) > 1:
            out |= {f"more_reference_latent_{part}": torch.stack([p[part] for p in posteriors[1:]])
                    for part in ("mean", "std")}
        return out

    def _clip_member(self, sample: dict) -> str | None:
        """The member holding a video clip's own bytes (`clip.mp4`, ...), None for an image sample."""
        return next((suffix for suffix in sample["members"] if suffix.startswith("clip.")), None)

    def _clip(self, sample: dict, sample_id: int, epoch: int, resolution: int, size: tuple[int, int]):
        """(top, left, {"pixels": (3, F, H, W)}) of a video clip: its frames (data.video_*) each through the image
        path's geometry: scaled to cover the bucket, one crop box and one augmentation draw for every frame."""
        if self.clip_selection is None:
            raise InputFileError(f"data.video_frames: sample {sample['key']} is a video clip; set data.video_frames "
                                 "(the shard set was built with clips)")
        suffix = self._clip_member(sample)
        path = self.samples.shard_path(sample["shard"])
        where = f"shard {shard_label(path)} sample {sample['key']} member {suffix}"
        start, count = self._clip_window(sample_id)
        selection = self.clip_selection
        frames = clip_frames(self.member_bytes(path, sample["key"], suffix, *sample["members"][suffix]), count,
                             selection["fps"], selection["source_fps"], where, start)
        height, width = size
        frames = [resize_to_cover(frame, size) for frame in frames]
        top, left = self._crop_offset(frames[0].height - height, frames[0].width - width, sample_id, epoch)
        box = (left, top, left + width, top + height)
        concept = self.concepts.get(sample["concept"])
        # the same generator key for each frame: the same flip / rotation / colour draws, so the clip moves as one
        pixels = [_pixels(augment_with_references(frame.crop(box), None, [], concept,
                                                 generator(self.seed, epoch, sample_id, "augment"))[0])
                  for frame in frames]
        return top, left, {"pixels": torch.stack(pixels, dim=1)}

    def caption_version(self, index: int, caption: str, version: int) -> str:
        """A caption line of sample `index` varied as the uncached epoch `version` varies it: text version `version`."""
        return vary_caption(caption, self.concepts.get(int(self.index.concept[index])),
                            generator(self.seed, version, index, "caption variation"), version)

    def _image_suffix(self, sample: dict, resolution: int, kind: str = "image") -> str:
        """The member of the sample's image (kind image: `<res>.<format>`) or reference image (kind reference:
        `<res>.reference.<format>`) at a resolution."""
        wanted = [str(resolution)] if kind == "image" else [str(resolution), kind]
        for suffix in sample["members"]:
            if suffix.split(".")[:-1] == wanted:  # the name before the format's extension
                return suffix
        raise InputFileError(f"data.shards: sample {sample['key']} has no {kind} at resolution {resolution}")

    def _crop_offset(self, spare_height: int, spare_width: int, sample_id: int, epoch: int) -> tuple[int, int]:
        if self.crop == "random":
            g = generator(self.seed, epoch, sample_id, "crop")
            return int(torch.randint(0, spare_height + 1, (1,), generator=g)), int(torch.randint(0, spare_width + 1, (1,), generator=g))
        return spare_height // 2, spare_width // 2

    def __getstate__(self):  # the index pickles as its folder, the shard files as none open (sample_index.py)
        return {**self.__dict__, "_last": None}


def check_clip_set(manifest: dict, data, shard_dir: Path) -> None:
    """A set holding clips read with the video settings it was built with: its windows (start, frames) are on the
    timeline those settings make (a run from data.shards alone does not rebuild it as a run from concepts does)."""
    if not manifest.get("clip_samples"):
        return
    built = {k: v for k, v in manifest.get("built_from", {}).items() if k.startswith("video_")}
    wanted = clip_settings(data)
    if built and built != wanted:
        changed = sorted((k for k in set(built) | set(wanted) if built.get(k) != wanted.get(k)),
                         key=lambda k: (k != "video_frames", k))
        raise InputFileError(f"data.{changed[0]}: the shard set {shard_dir} was built with "
                             + ", ".join(f"{k} {built.get(k)}" for k in changed) + ", this run asks for "
                             + ", ".join(f"{k} {wanted.get(k)}" for k in changed)
                             + "; rebuild it (ot-dist shard build CONFIG) or train with the settings it was built with")


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _FetchAhead:
    """The spans of a loader worker's next micro batches, read from the store by a few threads while the current
    one decodes: at most `concurrency` requests at once, `read_ahead` micro batches beyond the one loading held."""

    def __init__(self, dataset: ShardDataset, batches: list[list[int]], concurrency: int, read_ahead: int):
        self.files, self.samples, self.batches = dataset.samples.files, dataset.samples, batches
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ot-dist-fetch")
        self.read_ahead, self.submitted, self.futures = read_ahead, 0, {}

    def _submit(self, upto: int) -> None:
        while self.submitted < min(upto, len(self.batches)):
            spans = []
            for i in self.batches[self.submitted]:
                url, start, span = self.samples.span(i % len(self.samples))
                where = f"shard {url} sample #{i % len(self.samples)}"
                spans.append((url, start, self.pool.submit(self.files.remote.read, url, start, span, where)))
            self.futures[self.submitted] = spans
            self.submitted += 1

    def take(self, n: int) -> dict[int, str]:
        """Hold micro batch n's spans (waiting for them) and start the next ones; sample id -> why it is unreadable
        for those that failed (a 401 / 403 is raised: RemoteAccessDenied stops the run)."""
        self._submit(n + 1 + self.read_ahead)
        failed = {}
        for i, (url, start, future) in zip(self.batches[n], self.futures[n]):
            try:
                self.files.hold(url, start, future.result())
            except InputFileError as err:
                failed[i] = str(err)
        return failed

    def release(self, n: int) -> None:
        for url, start, _ in self.futures.pop(n):
            self.files.release(url, start)

    def close(self) -> None:
        """Stop fetching (an epoch ended or its consumer stopped early) and let go of the spans held."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        for n in list(self.futures):
            self.release(n)


def _line_of(member_key: str) -> int:
    """The caption line of a text-cache tensor named `<key>_<line>`."""
    return int(member_key.rsplit("_", 1)[1])


def _pixels(image: Image.Image) -> torch.Tensor:
    """(3, H, W) float32 in [-1, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()


def collate(samples: list[dict]) -> dict:
    keys = [k for k in ("pixels", "latent_mean", "latent_std", "mask", "mask_given", "reference_pixels",
                        "more_reference_pixels", "reference_latent_mean", "reference_latent_std",
                        "more_reference_latent_mean", "more_reference_latent_std") if k in samples[0]]
    keys += sorted(k for k in samples[0] if k.startswith("text_"))  # cached text conditioning
    keys += ["original_size", "crop_top_left", "target_size"]
    keys += [key for key in ("loss_weight", "prior_prediction") if key in samples[0]]
    if len({s["pixels"].dim() for s in samples if "pixels" in s}) > 1:
        raise InputFileError("data: a micro batch mixes video clips and images, which cannot stack into one tensor; "
                             "train clips with batch_size 1 or put images and clips in separate runs")
    batch = {key: torch.stack([s[key] for s in samples]) for key in keys}
    batch["caption"] = [s["caption"] for s in samples]
    batch["sample_id"] = torch.tensor([s["sample_id"] for s in samples])
    return batch


def _return_freed_memory() -> None:
    """Hand memory freed by the epoch plan back to the system (glibc keeps freed heap blocks of up to 32 MB for reuse:
    several bytes a sample at 10M samples). A no-op where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _RankMicroBatches(torch.utils.data.IterableDataset):
    """This rank's micro batches of an epoch plan (its sample ids kept as one numpy array, steps x accumulation x
    batch); loader worker w of W loads those with index % W == w. torch's DataLoader takes items from its workers
    round-robin, so the order is the plan's."""

    def __init__(self, dataset: ShardDataset, epoch: int, plan: EpochPlan, rank: int, world_size: int,
                 batch_size: int, accumulation: int):
        self.ids = plan.rank_ids(rank, world_size, batch_size, accumulation).reshape(-1, batch_size)
        self.dataset, self.epoch, self.plan = dataset, epoch, plan.without_ids()  # the other ranks' ids are let go
        self.accumulation = accumulation

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, mine = self.epoch, range(worker, len(self.ids), workers)
        ahead = None
        if self.dataset.fetch_ahead is not None:  # shards in a store: their spans read ahead, a few at a time
            ahead = _FetchAhead(self.dataset, [self.ids[k].tolist() for k in mine], *self.dataset.fetch_ahead)
        try:
            for n, k in enumerate(mine):
                yield self._micro_batch(k, epoch, ahead.take(n) if ahead else {})
                if ahead:
                    ahead.release(n)
        finally:
            if ahead:
                ahead.close()

    def _micro_batch(self, k: int, epoch: int, failed: dict[int, str]) -> dict:
        """Micro batch k of this rank, its unreadable samples skipped (`failed`: those the store did not give)."""
        step = k // self.accumulation
        resolution, bucket, ids = self.plan.resolution(step), int(self.plan.buckets[step]), self.ids[k].tolist()
        samples, skipped = [], []
        # one moved sample (no cached latent of this size): the whole micro batch is read as pixels
        latents = not any(self.dataset.moved(i, bucket, resolution) for i in ids)
        for i in ids:
            if i in failed:  # its span could not be read from the store (named, with the URL)
                skipped.append(failed[i])
                continue
            try:
                samples.append(self.dataset.load(i, epoch, resolution, bucket=bucket, latents=latents))
            except InputFileError as err:  # a corrupt member or truncated shard: skipped and counted
                skipped.append(str(err))
        if not samples:
            raise InputFileError("data: every sample of a micro batch is unreadable:\n  " + "\n  ".join(skipped))
        return {**collate(samples), "skipped": skipped}


class ShardReader:
    """This rank's micro batches of each epoch, from the plan every rank computes alike.

    A global batch (batch_size x accumulation x world size samples of one bucket and resolution) is
    split into `accumulation` micro steps; rank r takes samples [r*b, (r+1)*b) of each micro step.
    `state_dict()` is (epoch, global batches done): independent of the world size, so a run may resume
    on another number of ranks as long as the global batch is the same.
    """

    def __init__(self, dataset: ShardDataset, table: SampleTable, batch_size: int, accumulation: int,
                 rank: int = 0, world_size: int = 1, workers: int = 0, max_bad_fraction: float = 0.01,
                 log=print, small_buckets: str = "drop", changed_plan: str = "refuse"):
        self.batch_size, self.accumulation, self.rank, self.world_size = batch_size, accumulation, rank, world_size
        self.global_batch = batch_size * accumulation * world_size
        self.pool = small_buckets == "move"  # data.small_buckets (small_buckets.py)
        self.dataset, self.table = dataset, move_small_buckets(table, self.global_batch) if self.pool else table
        self.workers = workers
        self.steps_per_epoch = steps_per_epoch(self.table, self.global_batch, self.pool)
        self.epoch, self.step = 0, 0  # the position: global batches of `epoch` already handed out in full
        self._resume: tuple[int, int] | None = None  # set by load_state_dict, used by the next epoch_batches
        self.max_bad_fraction, self.log = max_bad_fraction, log
        self.skipped = 0  # unreadable samples skipped this epoch on this rank
        self.changed_plan = changed_plan  # data.resume_with_changed_data
        self._digests: dict[int, str] = {}

    def plan(self, epoch: int) -> EpochPlan:
        return plan_epoch(self.table, self.global_batch, self.dataset.resolutions, self.dataset.seed, epoch, self.pool)

    def my_ids(self, batch: GlobalBatch) -> list[list[int]]:
        """This rank's sample ids of each micro step of a global batch."""
        micro = self.batch_size * self.world_size
        return [list(batch.samples[m * micro + self.rank * self.batch_size:][:self.batch_size])
                for m in range(self.accumulation)]

    def epoch_batches(self, epoch: int):
        """Yield this rank's micro batches of `epoch`, from the restored position if it is in this epoch."""
        start = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        self._resume = None
        self.epoch, self.step = epoch, start
        micro = _RankMicroBatches(self.dataset, epoch, self.plan(epoch)[start:], self.rank, self.world_size,
                                  self.batch_size, self.accumulation)
        source = micro
        _return_freed_memory()  # the plan's other ranks' ids and its shuffles' buffers
        if self.workers:
            # Its workers' base seed from a generator of its own: drawn from the global one, each epoch's loader
            # moved the global stream by one draw, and a resumed run (a new loader mid-epoch) was one draw off.
            source = torch.utils.data.DataLoader(source, batch_size=None, num_workers=self.workers,
                                                 generator=generator(self.dataset.seed, epoch, start, "loader"))
        self.skipped, allowed = 0, int(self.max_bad_fraction * len(micro.ids) * self.batch_size)
        for n, batch in enumerate(source, start=1):
            for message in batch.pop("skipped"):
                self.skipped += 1
                self.log(f"rank {self.rank}: skipped an unreadable sample ({self.skipped} this epoch): {message}")
            if self.skipped > allowed:
                raise InputFileError(
                    f"data: {self.skipped} unreadable samples on rank {self.rank} in epoch {epoch}, more than "
                    f"data.max_bad_fraction {self.max_bad_fraction} of its {len(micro.ids) * self.batch_size}; see the "
                    "log for their keys"
                )
            if n % self.accumulation == 0:
                self.step += 1  # before the yield: a state_dict taken now resumes after this global batch
            yield batch
        self.epoch, self.step = epoch + 1, 0

    def resume_position(self, epoch: int) -> int:
        """Global batches of `epoch` the next `epoch_batches(epoch)` skips (restored by load_state_dict)."""
        return self._resume[1] if self._resume and self._resume[0] == epoch else 0

    def plan_digest(self, epoch: int) -> str:
        """A digest of `epoch`'s plan (every global batch's samples and bucket, the seed that draws resolutions):
        what a resumed position is a position in. Kept per epoch: a checkpoint of a 10M-sample set costs one plan."""
        if epoch not in self._digests:
            plan = self.plan(epoch)
            digest = hashlib.blake2b(digest_size=16)
            for part in (np.ascontiguousarray(plan.ids), np.ascontiguousarray(plan.buckets),
                         np.asarray(plan.resolutions + [plan.seed], dtype=np.int64)):
                digest.update(str(part.shape).encode())
                digest.update(part.tobytes())
            self._digests = {epoch: digest.hexdigest()}
        return self._digests[epoch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "global_batch": self.global_batch,
                "plan": self.plan_digest(self.epoch), "samples": len(self.table),
                "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        if state["global_batch"] != self.global_batch:
            raise InputFileError(
                f"data: the saved position is for a global batch of {state['global_batch']}, this run has "
                f"{self.global_batch}; keep batch_size x gradient_accumulation_steps x processes equal to resume"
            )
        self.epoch, self.step = state["epoch"], state["step"]
        # a checkpoint from before plans were recorded has no digest: its position is taken as it is
        if self.step and "plan" in state and state["plan"] != self.plan_digest(self.epoch):
            then = f"{state['samples']} samples, {state['steps_per_epoch']} steps an epoch"
            now = f"{len(self.table)} samples, {self.steps_per_epoch} steps an epoch"
            changed = (f"data: the checkpoint stopped after global batch {self.step} of epoch {self.epoch}, planned "
                       f"from other data than this run's ({then} then, {now} now: images added, removed or re-bucketed, "
                       "or another seed or concept setting); resuming there would train some samples of that epoch "
                       "twice and skip others")
            if self.changed_plan != "next_epoch":
                raise InputFileError(f"{changed}. Resume with the data as it was, or set data.resume_with_changed_data: "
                                     "next_epoch to go on from the start of the next epoch with the new data")
            self.log(f"{changed}: going on from the start of epoch {self.epoch + 1} (data.resume_with_changed_data)")
            self.epoch, self.step = self.epoch + 1, 0
        self._resume = (self.epoch, self.step)
