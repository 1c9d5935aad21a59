"""Reference images (edit models): the check that a run's samples and its family agree on them, and the latents the
denoiser sees them as.

The data layer carries `batch["reference_pixels"]` (B, 3, H, W, cropped and augmented as `pixels`; concepts'
`reference_path`, ot_dist/data/concepts.py) or, with data.cache_latents, their posterior `reference_latent_mean` /
`reference_latent_std` (and the pixels too where the family's text encoder reads them: Qwen-Image-Edit). The
reference is encoded to the posterior's mean (no draw): what FluxKontextPipeline encodes at inference
(retrieve_latents sample_mode argmax) and diffusers' Kontext script's default (--vae_encode_mode mode); FLUX.2's
pipelines and img2img scripts take the mode too.

Several references per sample (FLUX.2, Qwen-Image-Edit-2509: a reference folder's numbered partners `a_0`, `a_1`,
..., or a list of reference folders): the first stays `reference_pixels` / `reference_latents`, the others come as
`more_reference_pixels` (B, N - 1, 3, H, W) or cached `more_reference_latent_mean` / `_std` (B, N - 1, C, h, w), and
`more_reference_latents` (a list), so a one-reference run is the same as before.
"""

from __future__ import annotations

import torch

from ot_dist.errors import ConfigError
from ot_dist.memory.float8 import compute_dtype
from ot_dist.train.transfer import to_device


def check_references(dataset, family) -> None:
    """Before the model loads: an edit family needs a reference image for every sample, one that also trains
    text-to-image (FLUX.2) takes them for every sample or for none; any other family refuses samples that have one
    (they would be dropped without a word). Samples with several take as many each, no more than the family reads."""
    if family.reference_images or (family.reference_images_optional and dataset.has_references):
        missing = dataset.with_references(present=False)
        if missing:
            refuse_missing(dataset, family, missing)
    if dataset.has_references and family.takes_reference_images:
        check_reference_counts(dataset, family)
    if dataset.has_references and not family.takes_reference_images:
        raise ConfigError(
            f"model.family {family.name} takes no reference images, and {len(dataset.with_references())} samples have "
            f"one (data.concepts[].reference_path): train an edit model ({', '.join(edit_families())}) or remove "
            "reference_path")


def refuse_missing(dataset, family, missing: list[int]) -> None:
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


def check_reference_counts(dataset, family) -> None:
    """Every sample gives the same number of reference images (one token sequence length per batch, as for samples
    with and without one), and no more than the family's denoiser reads (`max_reference_images`)."""
    counts = {n: ids for n, ids in dataset.reference_counts().items() if n}
    if len(counts) > 1:
        shown = "; ".join(f"{len(ids)} with {n} (sample {dataset.samples[ids[0]]['key']}, image "
                          f"{dataset.metadata(ids[0]).get('source') or '?'})" for n, ids in sorted(counts.items()))
        raise ConfigError(f"data.concepts[].reference_path: samples give different numbers of reference images: {shown}. "
                          "Give every image of the run as many numbered partners (`a_0`, `a_1`, ...)")
    most = max(counts, default=0)
    if most > family.max_reference_images:
        ids = counts[most]
        raise ConfigError(
            f"data.concepts[].reference_path: {len(ids)} samples have {most} reference images (numbered partners, e.g. "
            f"sample {dataset.samples[ids[0]]['key']}, image {dataset.metadata(ids[0]).get('source') or '?'}), and "
            f"model.family {family.name} takes at most {family.max_reference_images} per sample; "
            f"{', '.join(several_reference_families()) or 'no family'} take more")


def several_reference_families() -> list[str]:
    """The families whose denoiser reads more than one reference image per sample."""
    from ot_dist.models.families.registry import FAMILY_NAMES, get_family

    return [name for name in FAMILY_NAMES if get_family(name).takes_reference_images
            and get_family(name).max_reference_images > 1]


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
    """{"reference_latents": (B, C, h, w)} in the denoiser's latent space and storage dtype, with
    "more_reference_latents" (a list of such) for a batch of several references a sample, or {} for a batch
    without reference images."""
    if "reference_latent_mean" in batch:  # data.cache_latents: the posteriors' means
        more = batch.get("more_reference_latent_mean")
        means = [batch["reference_latent_mean"], *(more.unbind(1) if more is not None else ())]
    elif "reference_pixels" in batch:
        more = batch.get("more_reference_pixels")
        pixels = [batch["reference_pixels"], *(more.unbind(1) if more is not None else ())]
        vae = model.vae
        first = next(vae.parameters())
        with torch.no_grad():
            means = [model.family.encode_posterior(vae, to_device(p, first.device, compute_dtype(vae)))[0]
                     for p in pixels]
    else:
        return {}
    with torch.no_grad():
        latents = [to_device(model.family.normalize_latents(model.vae, m.float()), device, dtype) for m in means]
    return {"reference_latents": latents[0], **({"more_reference_latents": latents[1:]} if len(latents) > 1 else {})}


def reference_latents(conditioning: dict) -> list:
    """The conditioning's reference latents in order (Picture 1, 2, ...), [] without."""
    first = conditioning.get("reference_latents")
    return [] if first is None else [first, *conditioning.get("more_reference_latents", ())]
