"""The diffusion training objective for one micro batch: encode, noise, predict, compare."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from ot_dist.config.loss import LossConfig, MaskedTrainingConfig
from ot_dist.memory.float8 import compute_dtype
from ot_dist.models.families.base import Family
from ot_dist.models.loading import LoadedModel
from ot_dist.models.objectives import Objective
from ot_dist.randomness import generator
from ot_dist.train.inpainting import inpainting_masks, masked_pixels
from ot_dist.train.loss_functions import elementwise_loss
from ot_dist.train.loss_options import offset_noise, per_sample_normal, perturbed_input_noise
from ot_dist.train.masking import mask_weights
from ot_dist.train.references import reference_conditioning
from ot_dist.train.transfer import to_device


def draw_sample_noise(batch: dict, latent_shape: torch.Size, objective: Objective, seed: int, epoch: int,
                      options: LossConfig | None = None):
    """Per-sample draws from a generator keyed by (seed, epoch, sample id): the VAE posterior sample,
    the noise and the time (the objective's, in `options`' range and distribution). A sample gets the same
    draws in any batch, on any rank."""
    vae_eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        vae_eps.append(torch.randn(latent_shape, generator=g))
        noise.append(torch.randn(latent_shape, generator=g))
        timesteps.append(objective.draw(g, options, latent_shape))
    return torch.stack(vae_eps), torch.stack(noise), torch.cat(timesteps)


def first_parameter(module: torch.nn.Module) -> torch.Tensor:
    # diffusers' `.device` / `.dtype` walk the whole module tree on every read (milliseconds per step
    # on a real UNet); the first parameter answers the same question at once.
    return next(module.parameters())


def encode_latents(family: Family, vae: torch.nn.Module, batch: dict, eps: torch.Tensor) -> torch.Tensor:
    """A sample of each VAE posterior in the denoiser's latent space: encoded from `pixels`, or from the cached
    posterior (`latent_mean`, `latent_std`, data.cache_latents) with the same draw."""
    with torch.no_grad():
        device, dtype = first_parameter(vae).device, compute_dtype(vae)
        if "latent_mean" in batch:
            mean, std = (to_device(batch[k], device, dtype) for k in ("latent_mean", "latent_std"))
        else:
            mean, std = family.encode_posterior(vae, to_device(batch["pixels"], device, dtype))
        latents = mean + std * to_device(eps, mean.device, mean.dtype)
        return family.normalize_latents(vae, latents).float()


def latent_shape_of(model: LoadedModel, batch: dict) -> torch.Size:
    if "latent_mean" in batch:
        return batch["latent_mean"].shape[1:]
    pixels = batch["pixels"]
    if pixels.dim() == 5:  # video clips (B, 3, F, H, W): a video family's (C, F', h, w)
        return model.family.clip_latent_shape(model.vae, *pixels.shape[-3:])
    return model.family.latent_shape(model.vae, *pixels.shape[-2:])


def text_conditioning(model: LoadedModel, batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The family's conditioning dict: from the text cache (`text_<key>` in the batch) or the text encoders.
    Floating tensors come in the denoiser's storage dtype (autocast, if on, picks the compute dtype)."""
    cached = {k[len("text_"):]: to_device(v, device) for k, v in batch.items() if k.startswith("text_")}
    if cached:  # data.cache_text
        conditioning = cached
    else:
        text_trains = any(p.requires_grad for enc in model.text_encoders.values() for p in enc.parameters())
        with torch.set_grad_enabled(text_trains and torch.is_grad_enabled()):
            conditioning = model.family.encode_text(model.text_encoders, batch["token_ids"])
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in conditioning.items()}


def diffusion_loss(model: LoadedModel, batch: dict, seed: int, epoch: int, options: LossConfig | None = None,
                   masking: MaskedTrainingConfig | None = None) -> torch.Tensor:
    """The loss (loss.*_strength: the mean-squared error unless told) of the denoiser's prediction against the objective's target (epsilon, v or flow) for
    one micro batch, in float32, with the `loss` options and masked training applied when they are on.
    `batch["token_ids"]` holds the tokenized captions, one tensor per text encoder."""
    options = options or LossConfig()
    family, objective, denoiser = model.family, model.objective, model.denoiser
    device, dtype = first_parameter(denoiser).device, compute_dtype(denoiser)
    latent_shape = latent_shape_of(model, batch)
    sample_ids = batch["sample_id"].tolist()
    vae_eps, noise, timesteps = draw_sample_noise(batch, latent_shape, objective, seed, epoch, options)
    latents = to_device(encode_latents(family, model.vae, batch, vae_eps), device)  # the VAE may live elsewhere
    noise = offset_noise(noise, sample_ids, options.offset_noise_weight, seed, epoch,
                         objective.offset_noise_psi(timesteps, options))
    input_noise = perturbed_input_noise(noise, sample_ids, options.input_perturbation, seed, epoch)
    noise, input_noise, timesteps = (to_device(t, device) for t in (noise, input_noise, timesteps))
    noisy = objective.noisy(latents, input_noise, timesteps)
    target = objective.target(latents, noise, timesteps)
    conditioning = text_conditioning(model, batch, device, dtype) | reference_conditioning(model, batch, device, dtype)
    if model.inpainting:
        noisy = torch.cat([noisy, inpainting_condition(model, batch, latent_shape, seed, epoch).to(noisy)], dim=1)
    if model.depth_conditioned:  # the image's depth map (SD 2.0 depth)
        depth = family.depth_condition(model.pipeline, batch["pixels"], tuple(latent_shape[-2:]))
        noisy = torch.cat([noisy, depth.to(noisy)], dim=1)
    prediction, extra = family.training_prediction(denoiser, noisy.to(dtype), timesteps, conditioning, batch, latents,
                                                   objective, options)
    weights = mask_weights(batch, latent_shape[-2:], masking, seed, epoch) if masking else None
    prior = None
    prior_targets = batch.get("prior_prediction")  # per sample: a prior_prediction concept's
    if prior_targets is not None or (weights is not None and masking.prior_preservation_weight):
        with torch.no_grad(), adapters_disabled(model):  # OneTrainer's prior model: the same inputs, no LoRA
            prior_conditioning = text_conditioning(model, batch, device, dtype) | {
                k: v for k, v in conditioning.items() if k in ("reference_latents", "more_reference_latents")}
            prior = family.predict(denoiser, noisy.to(dtype), timesteps, prior_conditioning, batch).float()
    if prior_targets is not None:  # OneTrainer's PRIOR_PREDICTION: those samples learn the prior's prediction
        chosen = to_device(prior_targets, device).view(-1, *([1] * (target.dim() - 1)))
        target = torch.where(chosen, prior, target.float())
    sample_weights = objective.sample_weights(timesteps, options)
    if "loss_weight" in batch:  # the samples' concepts' loss_weight
        concept_weights = to_device(batch["loss_weight"], device)
        sample_weights = concept_weights if sample_weights is None else sample_weights * concept_weights
    normalize = bool(masking and masking.normalize_masked_area_loss)
    thresholds = objective.pseudo_huber_thresholds(timesteps, options)
    loss = weighted_loss(prediction.float(), target.float(), weights, sample_weights, normalize=normalize, prior=prior,
                         prior_weight=masking.prior_preservation_weight if masking else 0.0,
                         element_loss=None if options.plain_mse() else partial(elementwise_loss, options=options,
                                                                               thresholds=thresholds))
    if extra is None:
        return loss
    # The family's extra term (PixArt's learned-variance VB loss), weighted like the squared error.
    return loss + weighted_mean(extra.float(), weights, sample_weights, normalize=normalize)


@contextmanager
def adapters_disabled(model: LoadedModel):
    """Every LoRA layer (and OFT layer) of the model bypassed (peft's flag, set directly: peft's enable_adapters would also change
    requires_grad, which strategies and stop_training_after own). The additional embeddings' rows stay: OneTrainer's
    prior model unhooks its LoRA adapters only (BaseModelSetup.prior_model), so the captions' tokens read the trained
    vectors there too."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from ot_dist.methods.oft import OrthogonalConv2d, OrthogonalLinear  # lora.variant oft: ot_dist's own layers

    modules = [model.denoiser, *model.text_encoders.values()]
    kinds = (BaseTunerLayer, OrthogonalLinear, OrthogonalConv2d)
    layers = [m for module in modules for m in module.modules() if isinstance(m, kinds)]
    before = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield
    finally:
        for layer, flag in zip(layers, before):
            layer._disable_adapters = flag


def inpainting_condition(model: LoadedModel, batch: dict, latent_shape: torch.Size, seed: int,
                         epoch: int) -> torch.Tensor:
    """(B, k, h, w): the repaint mask and the masked image's latent (ot_dist/train/inpainting.py) in the family's
    layout (SD: the latent-size mask, then the latent; 5 channels), the masked image's VAE posterior sampled with a
    per-sample draw."""
    masks = inpainting_masks(batch, seed, epoch)
    eps = per_sample_normal(batch["sample_id"].tolist(), tuple(latent_shape), seed, epoch, "masked_image_latent")
    masked_latents = encode_latents(model.family, model.vae, {"pixels": masked_pixels(batch["pixels"], masks)}, eps)
    return model.family.inpainting_condition(masks, masked_latents)


def per_sample_mean(values: torch.Tensor, element_weights: torch.Tensor | None = None,
                    normalize: bool = False) -> torch.Tensor:
    """Each sample's mean of element_weights x an elementwise loss (`normalize`: divided by the mean of its element
    weights, the masked area; a sample whose weights are all 0, a black mask with unmasked_weight 0, adds 0 where
    OneTrainer divides 0 by 0)."""
    if element_weights is not None:
        element_weights = element_weights.to(values)
        values = values * element_weights
    per_sample = values.mean(dim=tuple(range(1, values.dim())))
    if element_weights is not None and normalize:
        area = element_weights.mean(dim=tuple(range(1, element_weights.dim())))
        per_sample = torch.where(area > 0, per_sample / area.clamp(min=1e-12), torch.zeros_like(per_sample))
    return per_sample


def sample_weighted_mean(per_sample: torch.Tensor, sample_weights: torch.Tensor | None) -> torch.Tensor:
    if sample_weights is not None:
        per_sample = per_sample * sample_weights.to(per_sample)
    return per_sample.mean()


def weighted_mean(values: torch.Tensor, element_weights: torch.Tensor | None = None,
                  sample_weights: torch.Tensor | None = None, normalize: bool = False) -> torch.Tensor:
    """The batch mean of each sample's mean of element_weights x an elementwise loss, times its sample weight."""
    return sample_weighted_mean(per_sample_mean(values, element_weights, normalize), sample_weights)


def squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (prediction - target) ** 2


def weighted_mse(prediction: torch.Tensor, target: torch.Tensor, element_weights: torch.Tensor | None = None,
                 sample_weights: torch.Tensor | None = None, normalize: bool = False,
                 prior: torch.Tensor | None = None, prior_weight: float = 0.0) -> torch.Tensor:
    """weighted_loss of the squared error."""
    return weighted_loss(prediction, target, element_weights, sample_weights, normalize, prior, prior_weight)


def weighted_loss(prediction: torch.Tensor, target: torch.Tensor, element_weights: torch.Tensor | None = None,
                  sample_weights: torch.Tensor | None = None, normalize: bool = False,
                  prior: torch.Tensor | None = None, prior_weight: float = 0.0,
                  element_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The batch mean of each sample's mean of element_weights x element_loss (default: the squared error), times
    its sample weight. `normalize` divides a sample's loss by the mean of its element weights (the masked area).
    With `prior` (the prediction without LoRA), prior_weight x (1 - element_weights) x element_loss(prediction,
    prior) is added per element, normalized by the mean of (1 - element_weights) (OneTrainer's
    masked_losses_with_prior, which takes the same loss function for both; a sample with nothing outside its mask
    adds 0 there, where OneTrainer divides 0 by 0).
    The squared error without weights is F.mse_loss itself, so runs without the options keep their exact loss."""
    if element_loss is None:
        if element_weights is None and sample_weights is None:
            return F.mse_loss(prediction, target)
        element_loss = squared_error
    per_sample = per_sample_mean(element_loss(prediction, target), element_weights, normalize)
    if prior is not None and element_weights is not None and prior_weight:
        outside = 1 - element_weights.to(prediction)
        prior_sample = (element_loss(prediction, prior) * outside * prior_weight).mean(
            dim=tuple(range(1, prediction.dim())))
        if normalize:
            area = outside.mean(dim=tuple(range(1, outside.dim())))
            prior_sample = torch.where(area > 0, prior_sample / area.clamp(min=1e-12), torch.zeros_like(prior_sample))
        per_sample = per_sample + prior_sample
    return sample_weighted_mean(per_sample, sample_weights)
