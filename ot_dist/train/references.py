"""Reference images (edit models): the check that a run's samples and its family agree on them, and the latents the
denoiser sees them as.

The data layer carries `batch["reference_pixels"]` (B, 3, H, W, cropped and augmented as `pixels`; concepts'
`reference_path`, ot_dist/data/concepts.py) or, with data.cache_latents, their posterior `reference_latent_mean` /
`reference_latent_std`. The reference is encoded to the posterior's mean (no draw): what FluxKontextPipeline encodes
at inference (retrieve_latents sample_mode argmax) and diffusers' Kontext script's default (--vae_encode_mode mode);
FLUX.2's pipelines and img2img scripts take the mode too.
"""

from __future__ import annotations

import torch

from ot_dist.errors import ConfigError
from ot_dist.memory.float8 import compute_dtype
from ot_dist.train.transfer import to_device


def check_references(dataset, family) -> None:
    """Before the model loads: an edit family needs a reference image for every sample, one that also trains
    text-to-image (FLUX.2) takes them for every sample or for none; any other family refuses samples that have one
    (they would be dropped without a word)."""
    if family.reference_images or (family.reference_images_optional and dataset.has_references):
        missing = dataset.with_references(present=False)
        if not missing:
            return
        shown = [f"sample {dataset.samples[i]['key']} (image {dataset.metadata(i).get('source') or '?'})"
                 for i in missing[:5]]
        more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
        if family.reference_images:
            raise ConfigError(
                f"model.family {family.name}: an edit model trains on (reference image, edited image) pairs, and "
                f"{len(missing)} of {len(dataset)} samples have no reference image: {'; '.join(shown)}{more}. Give "
                "each concept a reference_path (a folder of the reference images, paired by file name)")
        # A batch is one token sequence per sample, all of one length: samples with and without a reference's tokens
        # cannot share it (neither the pipelines nor diffusers' scripts mask padded tokens): one kind per run.
        raise ConfigError(
            f"model.family {family.name} trains with reference images or without, not both in one run: "
            f"{len(dataset) - len(missing)} samples have one and {len(missing)} of {len(dataset)} have none: "
            f"{'; '.join(shown)}{more}. Give every concept a reference_path (image editing) or none (text-to-image)")
    if dataset.has_references and not family.takes_reference_images:
        raise ConfigError(
            f"model.family {family.name} takes no reference images, and {len(dataset.with_references())} samples have "
            f"one (data.concepts[].reference_path): train an edit model ({', '.join(edit_families())}) or remove "
            "reference_path")


def edit_families() -> list[str]:
    """The families whose denoiser sees reference images, for the messages that point to them."""
    from ot_dist.models.families.registry import FAMILY_NAMES, get_family

    return [name for name in FAMILY_NAMES if get_family(name).takes_reference_images]


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
