"""Reference images (edit models): the check that a run's samples and its family agree on them, and the latents the
denoiser sees them as.

The data layer carries `batch["reference_pixels"]` (B, 3, H, W, cropped and augmented as `pixels`; concepts'
`reference_path`, ot_dist/data/concepts.py) or, with data.cache_latents, their posterior `reference_latent_mean` /
`reference_latent_std`. The reference is encoded to the posterior's mean (no draw): what FluxKontextPipeline encodes
at inference (retrieve_latents sample_mode argmax) and diffusers' Kontext script's default (--vae_encode_mode mode).
"""

from __future__ import annotations

import torch

from ot_dist.errors import ConfigError
from ot_dist.memory.float8 import compute_dtype
from ot_dist.train.transfer import to_device


def check_references(dataset, family) -> None:
    """Before the model loads: an edit family needs a reference image for every sample; any other family refuses
    samples that have one (they would be dropped without a word)."""
    if family.reference_images:
        missing = dataset.with_references(present=False)
        if not missing:
            return
        shown = [f"sample {dataset.samples[i]['key']} (image {dataset.metadata(i).get('source') or '?'})"
                 for i in missing[:5]]
        more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
        raise ConfigError(
            f"model.family {family.name}: an edit model trains on (reference image, edited image) pairs, and "
            f"{len(missing)} of {len(dataset)} samples have no reference image: {'; '.join(shown)}{more}. Give each "
            "concept a reference_path (a folder of the reference images, paired by file name)")
    if dataset.has_references:
        raise ConfigError(
            f"model.family {family.name} takes no reference images, and {len(dataset.with_references())} samples have "
            "one (data.concepts[].reference_path): train an edit model (flux_kontext) or remove reference_path")


def check_caches(data_config, family) -> None:
    """The data caches the family refuses (`cache_refusals`), with its reason."""
    for option, reason in family.cache_refusals.items():
        if getattr(data_config, option, False):
            raise ConfigError(f"data.{option}: {reason}; turn {option} off for model.family {family.name}")


def reference_conditioning(model, batch: dict, device, dtype) -> dict:
    """{"reference_latents": (B, C, h, w)} in the denoiser's latent space and storage dtype, or {} for a batch
    without reference images."""
    if "reference_latent_mean" in batch:
        mean = batch["reference_latent_mean"]
    elif "reference_pixels" in batch:
        vae = model.vae
        first = next(vae.parameters())
        with torch.no_grad():
            mean, _ = model.family.encode_posterior(vae, to_device(batch["reference_pixels"], first.device,
                                                                   compute_dtype(vae)))
    else:
        return {}
    with torch.no_grad():
        latents = model.family.normalize_latents(model.vae, mean.float())
    return {"reference_latents": to_device(latents, device, dtype)}
