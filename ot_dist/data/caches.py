"""Cached VAE latents (`data.cache_latents`) and text-encoder outputs (`data.cache_text`): computed
once, read instead of the images / captions.

A cache sits in the shard set, `latents-<key>/` or `text-<key>/`: one webdataset tar per rank of
the launch that computed it (each rank encodes every world-size-th sample) and a manifest indexing
them. Members are safetensors (never pickle):
- `KEY.<res>.latent.safetensors`: the VAE posterior's mean and std. The posterior, not one sample of
  it, is stored: training still draws the VAE sample per (seed, epoch, sample id), so a cached run
  trains exactly like an uncached one, minus the decoding and the encoder.
- `KEY.text.safetensors`: `<key>_<j>` for each key of the family's conditioning dict (`hidden`, `pooled`,
  masks, ...) and caption line j.

The key is a hash of the model parts that produced the cache (config and weights in their stored
dtype; tokenizer vocabularies for text). The manifest records it with the resolutions, crop and the
shard set's fingerprint; a cache that does not match is refused (rebuilding a shard set deletes them).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import torch

from ot_dist.errors import InputFileError
from ot_dist.memory.float8 import compute_dtype

MANIFEST = "manifest.json"


def module_key(digest, module: torch.nn.Module) -> None:
    config = getattr(module, "config", None) or {}
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # transformers / diffusers
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def vae_key(vae: torch.nn.Module) -> str:
    digest = hashlib.sha256(b"latents")
    module_key(digest, vae)
    return digest.hexdigest()


def text_key(model) -> str:
    digest = hashlib.sha256(f"text {model.family.name}".encode())
    if model.family.layer_skip:  # another layer is another cache (runs without a skip keep their key)
        digest.update(json.dumps(sorted(model.family.layer_skip.items())).encode())
    for name in model.family.text_encoders:
        module_key(digest, model.text_encoders[name])
    for name in model.family.tokenizers:
        digest.update(json.dumps(sorted(model.tokenizers[name].get_vocab().items())).encode())
    return digest.hexdigest()


def expected_record(dataset, key: str) -> dict:
    return {"model_key": key, "resolutions": dataset.resolutions, "crop": dataset.crop,
            "shard_fingerprint": dataset.manifest["fingerprint"]}


def latent_members(dataset, vae):
    from safetensors.torch import save

    reference = next(vae.parameters())

    @torch.no_grad()
    def encode(index: int) -> dict[str, bytes]:
        members = {}
        for resolution in dataset.resolutions:
            pixels = dataset.load(index, 0, resolution, use_cache=False)["pixels"][None]
            posterior = vae.encode(pixels.to(device=reference.device, dtype=compute_dtype(vae))).latent_dist
            members[f"{resolution}.latent.safetensors"] = save(
                {"mean": posterior.mean[0].float().cpu().contiguous(), "std": posterior.std[0].float().cpu().contiguous()})
        return members
    return encode


def text_members(dataset, model):
    from safetensors.torch import save

    @torch.no_grad()
    def encode(index: int) -> dict[str, bytes]:
        lines = dataset.captions(index)
        family = model.family
        conditioning = family.encode_text(model.text_encoders, family.tokenize(model.tokenizers, lines))
        # One tensor per key of the family's conditioning dict and caption line; masks keep their dtype.
        tensors = {f"{key}_{j}": (value[j].float() if value.is_floating_point() else value[j]).cpu().contiguous()
                   for key, value in conditioning.items() for j in range(len(lines))}
        return {"text.safetensors": save(tensors)}
    return encode


def attach_latent_cache(dataset, vae, runtime, log=print) -> Path:
    return attach_cache(dataset, "latents", vae_key(vae), latent_members(dataset, vae), runtime, log)


def attach_text_cache(dataset, model, runtime, log=print) -> Path:
    return attach_cache(dataset, "text", text_key(model), text_members(dataset, model), runtime, log)


def attach_cache(dataset, kind: str, key: str, encode, runtime, log) -> Path:
    """Compute the cache if it is missing (split over the ranks), check it matches, and make the
    dataset read from it."""
    import webdataset as wds

    cache_dir = dataset.dir / f"{kind}-{key[:16]}"
    record = expected_record(dataset, key)
    error = None
    # The main process decides whether to compute; every rank learns it from one collective (a rank
    # checking the folder itself could see a cache finished meanwhile and skip the collectives below).
    missing = runtime.is_main and not (cache_dir / MANIFEST).is_file()
    if runtime.mean(torch.tensor([float(missing)], device=runtime.device)).item() > 0:
        if runtime.is_main:
            log(f"data: caching {kind} in {cache_dir} ({len(dataset)} samples over {runtime.world_size} process(es))")
        try:
            cache_dir.mkdir(exist_ok=True)
            part = cache_dir / f"part-{runtime.rank:05d}-of-{runtime.world_size:05d}.tar"
            tmp = part.with_suffix(".tmp")
            with wds.TarWriter(str(tmp), encoder=False, mtime=0) as writer:
                for index in range(runtime.rank, len(dataset), runtime.world_size):
                    writer.write({"__key__": dataset.samples[index]["key"], **encode(index)})
            os.replace(tmp, part)
        except Exception as err:  # noqa: BLE001  (reported to all ranks below, then raised)
            error = err
        check_all(runtime, error, f"caching {kind}")
        if runtime.is_main:
            try:
                index_parts(cache_dir, record)
            except Exception as err:  # noqa: BLE001
                error = err
        check_all(runtime, error, f"indexing the {kind} cache")
    dataset.use_cache(kind, cache_dir, read_cache_manifest(cache_dir, record, kind)["samples"])
    return cache_dir


def index_parts(cache_dir: Path, record: dict) -> None:
    samples = {}
    for part in sorted(cache_dir.glob("part-*.tar")):
        with tarfile.open(part) as tar:
            for info in tar:
                key, suffix = info.name.split(".", 1)
                samples.setdefault(key, {})[suffix] = [part.name, info.offset_data, info.size]
    tmp = cache_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({**record, "samples": samples}))
    os.replace(tmp, cache_dir / MANIFEST)


def check_all(runtime, error: Exception | None, what: str) -> None:
    """A collective every rank joins: a failure on any rank stops all of them instead of a hang."""
    failed = runtime.mean(torch.tensor([float(error is not None)], device=runtime.device)).item() > 0
    if error is not None:
        raise error
    if failed:
        raise InputFileError(f"data: {what} failed on another process (see its error)")


def read_cache_manifest(cache_dir: Path, expected: dict, kind: str) -> dict:
    manifest = json.loads((cache_dir / MANIFEST).read_text())
    for field, value in expected.items():
        if manifest.get(field) != value:
            raise InputFileError(
                f"data.cache_{kind}: the cache {cache_dir} is stale: its {field} is {str(manifest.get(field))[:40]!r}, "
                f"this run needs {str(value)[:40]!r}; delete the folder to recompute it"
            )
    return manifest
