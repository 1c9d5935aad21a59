"""Cached VAE latents (`data.cache_latents`): encoded once, read instead of the images.

The cache sits in the shard set, `latents-<model key>/`: one webdataset tar per rank of the launch
that computed it (each rank encodes every world-size-th sample), whose members
`KEY.<res>.latent.safetensors` hold the posterior's mean and std, and a manifest indexing them. The
posterior, not one sample of it, is stored: training still draws the VAE sample per (seed, epoch,
sample id), so a cached run trains exactly like an uncached one, minus the decoding and the encoder.

The folder name is a hash of the VAE (config and weights, in their stored dtype); its manifest
records that key, the resolutions, the crop and the shard set's fingerprint, and a cache that does
not match them is refused (rebuilding a shard set deletes its caches).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import torch

from ot_dist.errors import InputFileError

MANIFEST = "manifest.json"


def vae_key(vae: torch.nn.Module) -> str:
    digest = hashlib.sha256(json.dumps(dict(vae.config), sort_keys=True, default=str).encode())
    for name, tensor in sorted(vae.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def expected_record(dataset, key: str) -> dict:
    return {"model_key": key, "resolutions": dataset.resolutions, "crop": dataset.crop,
            "shard_fingerprint": dataset.manifest["fingerprint"]}


@torch.no_grad()
def encode_part(dataset, vae, path: Path, indices) -> None:
    """Encode the given samples at every resolution into one tar (written aside, then renamed)."""
    import webdataset as wds
    from safetensors.torch import save

    reference = next(vae.parameters())
    tmp = path.with_suffix(".tmp")
    with wds.TarWriter(str(tmp), encoder=False, mtime=0) as writer:
        for index in indices:
            sample = {"__key__": dataset.samples[index]["key"]}
            for resolution in dataset.resolutions:
                pixels = dataset.load(index, 0, resolution, use_cache=False)["pixels"][None]
                posterior = vae.encode(pixels.to(device=reference.device, dtype=reference.dtype)).latent_dist
                sample[f"{resolution}.latent.safetensors"] = save(
                    {"mean": posterior.mean[0].float().cpu().contiguous(), "std": posterior.std[0].float().cpu().contiguous()})
            writer.write(sample)
    os.replace(tmp, path)


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


def attach_latent_cache(dataset, vae, runtime, log=print) -> Path:
    """Compute the cache if it is missing (split over the ranks), check it matches, and make the
    dataset read latents from it."""
    key = vae_key(vae)
    cache_dir = dataset.dir / f"latents-{key[:16]}"
    record = expected_record(dataset, key)
    error = None
    # The main process decides whether to compute; every rank learns it from one collective (a rank
    # checking the folder itself could see a cache finished meanwhile and skip the collectives below).
    missing = runtime.is_main and not (cache_dir / MANIFEST).is_file()
    if runtime.mean(torch.tensor([float(missing)], device=runtime.device)).item() > 0:
        if runtime.is_main:
            log(f"data: caching VAE latents in {cache_dir} ({len(dataset)} samples x {len(dataset.resolutions)} "
                f"resolutions over {runtime.world_size} process(es))")
        try:
            cache_dir.mkdir(exist_ok=True)
            part = cache_dir / f"part-{runtime.rank:05d}-of-{runtime.world_size:05d}.tar"
            encode_part(dataset, vae, part, range(runtime.rank, len(dataset), runtime.world_size))
        except Exception as err:  # noqa: BLE001  (reported to all ranks below, then raised)
            error = err
        check_all(runtime, error, "encoding latents")
        if runtime.is_main:
            try:
                index_parts(cache_dir, record)
            except Exception as err:  # noqa: BLE001
                error = err
        check_all(runtime, error, "indexing the latent cache")
    dataset.use_latents(cache_dir, record)
    return cache_dir


def check_all(runtime, error: Exception | None, what: str) -> None:
    """A collective every rank joins: a failure on any rank stops all of them instead of a hang."""
    failed = runtime.mean(torch.tensor([float(error is not None)], device=runtime.device)).item() > 0
    if error is not None:
        raise error
    if failed:
        raise InputFileError(f"data: {what} failed on another process (see its error)")


def read_cache_manifest(cache_dir: Path, expected: dict) -> dict:
    manifest = json.loads((cache_dir / MANIFEST).read_text())
    for field, value in expected.items():
        if manifest.get(field) != value:
            raise InputFileError(
                f"data.cache_latents: the cache {cache_dir} is stale: its {field} is {str(manifest.get(field))[:40]!r}, "
                f"this run needs {str(value)[:40]!r}; delete the folder to recompute it"
            )
    return manifest
