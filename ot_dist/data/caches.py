"""Cached VAE latents (`data.cache_latents`) and text-encoder outputs (`data.cache_text`): computed
once, read instead of the images / captions.

A cache sits in the shard set, `latents-<key>/` or `text-<key>/`: fixed chunks of samples, each a webdataset tar
committed by its name, and a compact memory-mapped index (cache_index.py). Chunk c holds samples [c*K, (c+1)*K)
and is computed by rank c mod world size; a run that finds committed chunks (an interrupted caching run, on any
number of processes) computes only the others. Members are safetensors (never pickle):
- `<id>.<res>.latent.safetensors`: the VAE posterior's mean and std. The posterior, not one sample of
  it, is stored: training still draws the VAE sample per (seed, epoch, sample id), so a cached run
  trains exactly like an uncached one, minus the decoding and the encoder. A video clip's (data.video_frames) is
  the posterior of its frames as the reader takes them, (C, F', h, w); the key then holds the frame choice.
- `<id>.<res>.reference_latent.safetensors`: the same for its reference image (edit models), cropped and augmented
  as the image; with several references (FLUX.2, Qwen-Image-Edit-2509: docs/data.md) the second, third ... as
  `<id>.<res>.reference2_latent.safetensors`, `reference3_latent`, ... A cache belongs to one shard set's fingerprint,
  which follows the reference files: another reference (or another count) is another set, and its cache another.
- `<id>.text.safetensors`: `<key>_<j>` for each key of the family's conditioning dict (`hidden`, `pooled`,
  masks, ...) and caption line j.
- With a concept's image_variations / text_variations N > 1 (variations.py), its samples also have version v of those
  members, `<id>.<res>.latent.v<v>.safetensors` / `<id>.text.v<v>.safetensors` (v = 1 .. N-1); version 0 keeps the
  name above. The samples of concepts with fewer versions have fewer members.
Encoding is batched: the samples of a chunk that share a bucket go through the VAE together (up to
BATCH_PIXELS pixels a batch), TEXT_BATCH_SAMPLES samples' captions at a time.

The key is a hash of the model parts that produced the cache (config and weights in their stored
dtype; tokenizer vocabularies for text; for latents of clips the data.video_* frame choice), and with variations of what they depend on (the seed, the concepts'
augmentation / caption options, their numbers of versions). The manifest records it with the resolutions, crop and
the shard set's fingerprint; a cache that does not match is refused (rebuilding a shard set deletes them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ot_dist.data import cache_index
from ot_dist.data.buckets import bucket_size
from ot_dist.data.cache_index import MANIFEST, CacheIndex, ChunkWriter
from ot_dist.data.sample_encoder import reference_kind, reference_latent_member
from ot_dist.data.variations import keyed, member_name
from ot_dist.errors import InputFileError
from ot_dist.memory.float8 import compute_dtype
from ot_dist.memory.stored import kept_entries, stored_layers
from ot_dist.models.latent_posterior import encode_posterior

FORMAT = "ot_dist.cache/2"  # chunks + columnar index (format 1: one part per rank, a JSON dict per sample)
CHUNK_SAMPLES = 1024  # samples a chunk: the unit of work a resumed run skips or computes
CACHE_WAIT_S = 48 * 3600  # how long a rank done with its chunks waits for the others' and the index
BATCH_PIXELS = 4 * 1024 * 1024  # pixels a VAE batch (at the largest resolution): 4 images at 1024, 16 at 512
TEXT_BATCH_SAMPLES = 32  # samples (all their caption lines) a text-encoder batch


def module_key(digest, module: torch.nn.Module) -> None:
    config = getattr(module, "config", None) or {}
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # transformers / diffusers
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in state_in_key_order(module):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        del tensor  # a dequantized copy is gone before the next layer's are made


def state_in_key_order(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The entries of `module.state_dict()` sorted by key, without holding that state dict: a frozen encoder stored in
    float8 / nf4 / int8 (memory/stored.py) gives each stored weight dequantized to float32 in CPU memory, all at once in
    one state dict (a T5-XXL in float8: ~19 GB of RAM to compute a cache key). Here the stored layers are dequantized
    one at a time, each freed before the next; every other entry is the module's own tensor. The same entries and
    bytes as the state dict, so the keys of existing caches hold."""
    with kept_entries(lambda key: False):  # every key; the stored entries as the layers hold them (no copies)
        held = module.state_dict()
    # each stored entry's key -> (its layer, its name in the layer's own state dict)
    stored = {f"{name}.{entry}" if name else entry: (layer, entry)
              for name, layer, parts in stored_layers(module) for entry in parts.entries}
    current, dequantized = None, {}
    for key in sorted(held):  # a layer's keys share its prefix, so they are adjacent in this order
        if key not in stored:
            yield key, held[key]
            continue
        layer, entry = stored[key]
        if layer is not current:
            dequantized = {}  # the previous layer's copies freed before this one's are made
            current, dequantized = layer, layer.state_dict()
        yield key, dequantized[entry]


def vae_key(vae: torch.nn.Module) -> str:
    digest = hashlib.sha256(b"latents")
    module_key(digest, vae)
    return digest.hexdigest()


def text_key(model) -> str:
    digest = hashlib.sha256(f"text {model.family.name}".encode())
    if model.family.layer_skip:  # another layer is another cache (runs without a skip keep their key)
        digest.update(json.dumps(sorted(model.family.layer_skip.items())).encode())
    if getattr(model.family, "t5_tokens", None):  # another caption length is another cache
        digest.update(f"t5 {model.family.t5_tokens}".encode())
    for name in model.family.text_encoders:
        module_key(digest, model.text_encoders[name])
    for name in model.family.tokenizers:
        digest.update(json.dumps(sorted(model.tokenizers[name].get_vocab().items())).encode())
    return digest.hexdigest()


def expected_record(dataset, key: str, variations: dict | None = None) -> dict:
    """`variations`: the signature of the cached versions (variations.py); None records none, as before them."""
    record = {"format": FORMAT, "model_key": key, "resolutions": dataset.resolutions, "crop": dataset.crop,
              "shard_fingerprint": dataset.manifest["fingerprint"]}
    return record if variations is None else {**record, "variations": variations}


def variation_members(members: list[str], versions: int) -> list[str]:
    """The members of a cache with `versions` versions: version-major, version 0 the members without variations."""
    return [member_name(m, v) for v in range(versions) for m in members]


class LatentEncoder:
    """Each sample's VAE posterior at each training resolution; a chunk's samples of one bucket (one size at every
    resolution) are encoded together, up to `batch_pixels` pixels a batch at the largest resolution. With
    `workers`, that many loader processes read and crop the next batches' images while the VAE encodes. A sample
    with image variations is encoded once per version (its augmentation in epoch v), each version of a batch
    together."""

    kind = "latents"

    def __init__(self, dataset, vae, batch_pixels: int = BATCH_PIXELS, workers: int = 0, posterior=None):
        self.dataset, self.vae, self.batch_pixels, self.workers = dataset, vae, batch_pixels, workers
        self.posterior = posterior or encode_posterior  # the family's (mean, std) of pixels: Family.encode_posterior
        self.variations = dataset.variations["latents"]
        self.per_version = [f"{resolution}.latent.safetensors" for resolution in dataset.resolutions]
        # every sample has as many references then (ot_dist/train/references.py: check_references)
        self.references = max(dataset.reference_counts()) if dataset.has_references else 0
        self.per_version += [reference_latent_member(resolution, index)
                             for index in range(self.references) for resolution in dataset.resolutions]
        self.members = variation_members(self.per_version, self.variations.most)

    def batches(self, ids: range) -> list[list[int]]:
        """The chunk's samples in VAE batches of one bucket and one frame count (images 0, a clip its frames: their
        pixels stack only then), a clip counting its frames' pixels against batch_pixels."""
        buckets = np.asarray(self.dataset.index.bucket[ids.start:ids.stop])
        frames = np.asarray([self.dataset.frames_of(i) for i in ids]) if self.dataset.clip_selection else \
            np.zeros(len(ids), dtype=np.int64)
        largest = max(self.dataset.resolutions)
        out = []
        # in bucket then frame-count order, each group's samples in id order: deterministic
        for bucket, count in sorted(set(zip(buckets.tolist(), frames.tolist()))):
            group = (ids.start + np.flatnonzero((buckets == bucket) & (frames == count))).tolist()
            height, width = bucket_size(int(bucket), largest, self.dataset.step)
            size = max(1, self.batch_pixels // (height * width * max(1, count)))
            out += [group[i:i + size] for i in range(0, len(group), size)]
        return out

    def inputs(self, batches: list[list[int]]):
        """Each batch's pixels at each resolution, in the batches' order (read by `workers` processes, or here)."""
        counts = self.variations.counts(self.dataset.index.concept)
        source = _Pixels(self.dataset, batches, [counts[batch].tolist() for batch in batches])
        if not self.workers:
            return (source[n] for n in range(len(batches)))
        return iter(torch.utils.data.DataLoader(source, batch_size=None, num_workers=self.workers))

    @torch.no_grad()
    def encode(self, ids: list[int], pixels: dict[int, dict[int, torch.Tensor]]) -> list[dict[str, bytes]]:
        """`pixels`: version -> resolution -> the batch's samples that have the version (_Pixels)."""
        from safetensors.torch import save

        first = next(self.vae.parameters())
        out: list[dict[str, bytes]] = [{} for _ in ids]
        counts = self.variations.counts(self.dataset.index.concept[ids])
        for version, by_resolution in pixels.items():
            holders = [members for count, members in zip(counts, out) if count > version]
            for resolution in self.dataset.resolutions:
                images = {f"{resolution}.latent.safetensors": by_resolution[resolution]}
                images |= {reference_latent_member(resolution, index):
                           by_resolution[f"{resolution}.{reference_kind(index)}"] for index in range(self.references)}
                for name, stacked in images.items():
                    batch = stacked.to(device=first.device, dtype=compute_dtype(self.vae))
                    mean, std = (t.float().cpu() for t in self.posterior(self.vae, batch))
                    for n, members in enumerate(holders):
                        members[member_name(name, version)] = save({"mean": _own(mean[n]), "std": _own(std[n])})
        return out


class _Pixels(torch.utils.data.Dataset):
    """Batch n: version v -> resolution -> the batch's samples with a version v (`counts`: each sample's versions),
    cropped to their bucket (centre, as the cache holds them) and augmented as the uncached epoch v reads them."""

    def __init__(self, dataset, batches: list[list[int]], counts: list[list[int]]):
        self.dataset, self.batches, self.counts = dataset, batches, counts

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, n: int) -> dict[int, dict[int | str, torch.Tensor]]:
        """version -> resolution -> the images; with reference images also `<resolution>.reference` -> the first's,
        `<resolution>.reference2` -> the second's, ... (sample_encoder.reference_kind)."""
        batch, counts = self.batches[n], self.counts[n]
        out = {}
        for version in range(max(counts)):
            out[version] = {}
            for resolution in self.dataset.resolutions:
                loaded = [self.dataset.load(i, version, resolution, use_cache=False)
                          for i, count in zip(batch, counts) if count > version]
                out[version][resolution] = torch.stack([sample["pixels"] for sample in loaded])
                if "reference_pixels" in loaded[0]:
                    out[version][f"{resolution}.reference"] = torch.stack([s["reference_pixels"] for s in loaded])
                if "more_reference_pixels" in loaded[0]:  # (B, N - 1, 3, H, W): the second reference on
                    more = torch.stack([s["more_reference_pixels"] for s in loaded])
                    out[version] |= {f"{resolution}.{reference_kind(index + 1)}": pixels
                                     for index, pixels in enumerate(more.unbind(1))}
        return out


class TextEncoder:
    """Each sample's text-encoder outputs for each of its caption lines; `batch_samples` samples' lines at once. A
    sample with text variations has each version of its lines (as the uncached epoch v varies them) encoded."""

    kind = "text"

    def __init__(self, dataset, model, batch_samples: int = TEXT_BATCH_SAMPLES):
        self.dataset, self.model, self.batch_samples = dataset, model, batch_samples
        self.variations = dataset.variations["text"]
        self.members = variation_members(["text.safetensors"], self.variations.most)

    def batches(self, ids: range) -> list[list[int]]:
        return [list(ids[i:i + self.batch_samples]) for i in range(0, len(ids), self.batch_samples)]

    def inputs(self, batches: list[list[int]]):
        """Per batch, per sample, per version: its caption lines."""
        return ([self._versions(i) for i in batch] for batch in batches)

    def _versions(self, sample: int) -> list[list[str]]:
        lines, count = self.dataset.captions(sample), self.variations.count(int(self.dataset.index.concept[sample]))
        if count == 1:
            return [lines]  # as stored (the config refuses varying captions without variations)
        return [[self.dataset.caption_version(sample, line, v) for line in lines] for v in range(count)]

    @torch.no_grad()
    def encode(self, ids: list[int], lines: list[list[list[str]]]) -> list[dict[str, bytes]]:
        from safetensors.torch import save

        family = self.model.family
        every = [line for sample in lines for version in sample for line in version]
        conditioning = family.encode_text(self.model.text_encoders, family.tokenize(self.model.tokenizers, every))
        out, first = [], 0
        for sample in lines:
            members = {}
            for v, version in enumerate(sample):
                # One tensor per key of the family's conditioning dict and caption line; masks keep their dtype.
                tensors = {f"{key}_{j}": _own(value[first + j].float() if value.is_floating_point() else value[first + j])
                           for key, value in conditioning.items() for j in range(len(version))}
                members[member_name("text.safetensors", v)] = save(tensors)
                first += len(version)
            out.append(members)
        return out


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A sample's slice of a batch as a tensor of its own (contiguous, on the CPU): what safetensors saves."""
    return tensor.cpu().clone(memory_format=torch.contiguous_format)


def latent_key(vae, clip_selection: dict | None) -> str:
    """vae_key, and with video clips (data.video_*) the frames they are read with: another frame count, rate or
    extraction is another cache folder (a set without clips keeps its key)."""
    key = vae_key(vae)
    if clip_selection is None:
        return key
    return hashlib.sha256(f"{key} clips {json.dumps(clip_selection, sort_keys=True)}".encode()).hexdigest()


def attach_latent_cache(dataset, vae, runtime, log=print, workers: int = 0, posterior=None, **options) -> Path:
    """`workers`: loader processes reading the images while the VAE encodes (data.loader_workers); `posterior`: the
    family's `encode_posterior` (the default: a VAE of images; a video family's takes clips (B, 3, F, H, W) too)."""
    encoder = LatentEncoder(dataset, vae, workers=workers, posterior=posterior)
    return attach_cache(dataset, "latents", latent_key(vae, dataset.clip_selection), encoder, runtime, log, **options)


def attach_text_cache(dataset, model, runtime, log=print, **options) -> Path:
    return attach_cache(dataset, "text", text_key(model), TextEncoder(dataset, model), runtime, log, **options)


def attach_cache(dataset, kind: str, key: str, encoder, runtime, log, chunk_size: int = CHUNK_SAMPLES) -> Path:
    """Compute the chunks of the cache that are missing (chunk c on rank c mod world size), index them, check the
    cache matches, and make the dataset read from it."""
    variations = encoder.variations
    signature = variations.signature()
    key = keyed(key, signature)
    cache_dir = dataset.dir / f"{kind}-{key[:16]}"
    record = expected_record(dataset, key, signature)
    progress = {**record, "chunk_size": chunk_size, "members": encoder.members, "sample_count": len(dataset)}
    held = None
    if signature is not None:  # per sample its members: its versions x the members of one
        held = variations.counts(dataset.index.concept) * (len(encoder.members) // variations.most)
    if signature is not None and runtime.is_main:  # what the versions cost: the cache grows with them
        versions = int(held.sum()) // (len(encoder.members) // variations.most)
        log(f"data: the {kind} cache holds {versions} versions of {len(dataset)} samples "
            f"({versions / max(1, len(dataset)):.2f}x the size without variations; "
            f"data.concepts[].{'image' if kind == 'latents' else 'text'}_variations)")
    error = None
    # The main process decides whether to compute; every rank learns it from one collective (a rank
    # checking the folder itself could see a cache finished meanwhile and skip the collectives below).
    missing = runtime.is_main and not (cache_dir / MANIFEST).is_file()
    if missing:
        try:
            cache_index.prepare(cache_dir, progress)  # before the collective: the other ranks see a ready folder
        except Exception as err:  # noqa: BLE001  (reported to all ranks below, then raised)
            error = err
    if runtime.mean(torch.tensor([float(missing)], device=runtime.device)).item() > 0:
        check_all(runtime, error, f"preparing the {kind} cache")
        # The ranks that finish their chunks first wait for the slowest, then for the main process's index: on a large
        # set that is longer than the default group's distributed.timeout_minutes, so those waits get a group of their
        # own (made by every rank here, before the encoding starts).
        waiting = runtime.waiting_group(CACHE_WAIT_S)
        chunks = cache_index.chunk_count(len(dataset), chunk_size)
        if runtime.is_main:
            todo = sum(not cache_index.committed(cache_dir, c) for c in range(chunks))
            log(f"data: caching {kind} in {cache_dir}: {todo} of {chunks} chunks of {chunk_size} samples to compute"
                f"{f' ({chunks - todo} done earlier)' if todo < chunks else ''} over {runtime.world_size} process(es)")
        try:
            mine = [c for c in range(runtime.rank, chunks, runtime.world_size) if not cache_index.committed(cache_dir, c)]
            for done, chunk in enumerate(mine, start=1):
                write_chunk(cache_dir, chunk, cache_index.chunk_samples(chunk, len(dataset), chunk_size), encoder)
                if runtime.is_main and len(mine) >= 20 and done % (len(mine) // 10) == 0:
                    log(f"data: caching {kind}: {done} of this process's {len(mine)} chunks committed")
        except Exception as err:  # noqa: BLE001
            error = err
        check_all(runtime, error, f"caching {kind}", waiting)
        if runtime.is_main:
            try:
                cache_index.write_index(cache_dir, record, len(dataset), chunk_size, encoder.members, held)
            except Exception as err:  # noqa: BLE001
                error = err
        runtime.fail_together(error, waiting, f"data: indexing the {kind} cache")
    manifest = read_cache_manifest(cache_dir, record, kind)
    dataset.use_cache(kind, CacheIndex(cache_dir, manifest, f"data.cache_{kind}"))
    return cache_dir


def write_chunk(cache_dir: Path, chunk: int, ids: range, encoder) -> None:
    writer = ChunkWriter(cache_dir, chunk, encoder.members)
    try:
        batches = encoder.batches(ids)
        for batch, inputs in zip(batches, encoder.inputs(batches)):
            for sample_id, members in zip(batch, encoder.encode(batch, inputs)):
                writer.add(sample_id, members)
    except BaseException:
        writer.abandon()
        raise
    writer.commit()


def check_all(runtime, error: Exception | None, what: str, group=None) -> None:
    """A collective every rank joins (in `group`, a waiting_group, if given): a failure on any rank stops all of them
    instead of a hang."""
    if group is not None:
        failed = runtime.any_rank(error is not None, group)
    else:
        failed = runtime.mean(torch.tensor([float(error is not None)], device=runtime.device)).item() > 0
    if error is not None:
        raise error
    if failed:
        raise InputFileError(f"data: {what} failed on another process (see its error)")


def read_cache_manifest(cache_dir: Path, expected: dict, kind: str) -> dict:
    manifest = json.loads((cache_dir / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise InputFileError(
            f"data.cache_{kind}: the cache {cache_dir} was written by an earlier ot_dist (format "
            f"{manifest.get('format', 'ot_dist.cache/1')}), this one reads {FORMAT}; delete the folder to recompute it")
    for field, value in expected.items():
        if manifest.get(field) != value:
            raise InputFileError(
                f"data.cache_{kind}: the cache {cache_dir} is stale: its {field} is {str(manifest.get(field))[:40]!r}, "
                f"this run needs {str(value)[:40]!r}; delete the folder to recompute it"
            )
    return manifest
