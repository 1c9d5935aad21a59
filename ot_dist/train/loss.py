"""The diffusion training objective for one micro batch: encode, noise, predict, compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ot_dist.config.loss import LossConfig, MaskedTrainingConfig
from ot_dist.memory.float8 import compute_dtype
from ot_dist.models.loading import LoadedModel
from ot_dist.models.specs import TextConditioning
from ot_dist.randomness import generator
from ot_dist.train.inpainting import inpainting_masks, latent_mask, masked_pixels
from ot_dist.train.loss_options import (draw_timestep, min_snr_weights, offset_noise, per_sample_normal,
                                        perturbed_input_noise)
from ot_dist.train.masking import mask_weights


def draw_sample_noise(batch: dict, latent_shape: torch.Size, num_timesteps: int, seed: int, epoch: int,
                      options: LossConfig | None = None):
    """Per-sample draws from a generator keyed by (seed, epoch, sample id): the VAE posterior sample,
    the noise and the timestep (in `options`' range and distribution). A sample gets the same draws in
    any batch, on any rank."""
    vae_eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        vae_eps.append(torch.randn(latent_shape, generator=g))
        noise.append(torch.randn(latent_shape, generator=g))
        timesteps.append(draw_timestep(g, num_timesteps, options))
    return torch.stack(vae_eps), torch.stack(noise), torch.cat(timesteps)


def first_parameter(module: torch.nn.Module) -> torch.Tensor:
    # diffusers' `.device` / `.dtype` walk the whole module tree on every read (milliseconds per step
    # on a real UNet); the first parameter answers the same question at once.
    return next(module.parameters())


def encode_latents(vae: torch.nn.Module, batch: dict, eps: torch.Tensor) -> torch.Tensor:
    """A sample of each VAE posterior, scaled: encoded from `pixels`, or from the cached posterior
    (`latent_mean`, `latent_std`, data.cache_latents) with the same draw."""
    with torch.no_grad():
        device, dtype = first_parameter(vae).device, compute_dtype(vae)
        if "latent_mean" in batch:
            mean, std = (batch[k].to(device=device, dtype=dtype) for k in ("latent_mean", "latent_std"))
        else:
            posterior = vae.encode(batch["pixels"].to(device=device, dtype=dtype)).latent_dist
            mean, std = posterior.mean, posterior.std
        latents = mean + std * eps.to(mean)
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return ((latents - shift) * vae.config.scaling_factor).float()


def diffusion_loss(model: LoadedModel, batch: dict, seed: int, epoch: int, options: LossConfig | None = None,
                   masking: MaskedTrainingConfig | None = None) -> torch.Tensor:
    """Mean-squared error of the UNet's prediction (epsilon or v) for one micro batch, in float32,
    with the `loss` options and masked training applied when they are on.
    `batch["token_ids"]` holds the tokenized captions, one tensor per text encoder."""
    options = options or LossConfig()
    unet, scheduler = model.unet, model.noise_scheduler
    device, dtype = first_parameter(unet).device, compute_dtype(unet)
    if "latent_mean" in batch:
        latent_shape = batch["latent_mean"].shape[1:]
    else:
        pixels = batch["pixels"]
        factor = 2 ** (len(model.vae.config.block_out_channels) - 1)
        latent_shape = torch.Size((model.vae.config.latent_channels, pixels.shape[-2] // factor, pixels.shape[-1] // factor))
    sample_ids = batch["sample_id"].tolist()
    vae_eps, noise, timesteps = draw_sample_noise(batch, latent_shape, scheduler.config.num_train_timesteps, seed,
                                                  epoch, options)
    latents = encode_latents(model.vae, batch, vae_eps).to(device)  # the VAE may live elsewhere (offload)
    noise = offset_noise(noise, sample_ids, options.offset_noise_weight, seed, epoch)
    input_noise = perturbed_input_noise(noise, sample_ids, options.input_perturbation, seed, epoch)
    noise, input_noise, timesteps = noise.to(device), input_noise.to(device), timesteps.to(device)
    noisy = scheduler.add_noise(latents, input_noise, timesteps)
    if model.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise

    if "text_hidden" in batch:  # cached text-encoder outputs (data.cache_text)
        text = TextConditioning(batch["text_hidden"].to(device),
                                batch["text_pooled"].to(device) if "text_pooled" in batch else None)
    else:
        text_trains = any(p.requires_grad for enc in model.text_encoders.values() for p in enc.parameters())
        with torch.set_grad_enabled(text_trains and torch.is_grad_enabled()):
            text = model.spec.encode_text(model.text_encoders, batch["token_ids"])
    # Inputs in the UNet's storage dtype; autocast (if on) picks the compute dtype.
    text.hidden_states = text.hidden_states.to(dtype)
    if text.pooled is not None:
        text.pooled = text.pooled.to(dtype)
    conditioning = model.spec.unet_conditioning(text, batch)
    if model.inpainting:
        noisy = torch.cat([noisy, inpainting_condition(model.vae, batch, latent_shape, seed, epoch).to(noisy)], dim=1)
    prediction = unet(noisy.to(dtype), timesteps, **conditioning, return_dict=False)[0]
    weights = mask_weights(batch, latent_shape[-2:], masking, seed, epoch) if masking else None
    snr_weights = None
    if options.min_snr_gamma is not None:
        snr_weights = min_snr_weights(scheduler.alphas_cumprod, timesteps, options.min_snr_gamma, model.prediction_type)
    return weighted_mse(prediction.float(), target.float(), weights, snr_weights,
                        normalize=bool(masking and masking.normalize_masked_area_loss))


def inpainting_condition(vae: torch.nn.Module, batch: dict, latent_shape: torch.Size, seed: int,
                         epoch: int) -> torch.Tensor:
    """(B, 5, h, w): the latent-size repaint mask and the masked image's latent (ot_dist/train/inpainting.py),
    the masked image's VAE posterior sampled with a per-sample draw."""
    masks = inpainting_masks(batch, seed, epoch)
    eps = per_sample_normal(batch["sample_id"].tolist(), tuple(latent_shape), seed, epoch, "masked_image_latent")
    masked_latents = encode_latents(vae, {"pixels": masked_pixels(batch["pixels"], masks)}, eps)
    return torch.cat([latent_mask(masks, latent_shape[-2:]).to(masked_latents), masked_latents], dim=1)


def weighted_mse(prediction: torch.Tensor, target: torch.Tensor, element_weights: torch.Tensor | None = None,
                 sample_weights: torch.Tensor | None = None, normalize: bool = False) -> torch.Tensor:
    """The batch mean of each sample's mean of element_weights x squared error, times its sample weight.
    `normalize` divides a sample's loss by the mean of its element weights (the masked area).
    Without weights this is F.mse_loss itself, so runs without the options keep their exact loss."""
    if element_weights is None and sample_weights is None:
        return F.mse_loss(prediction, target)
    squared = (prediction - target) ** 2
    if element_weights is not None:
        element_weights = element_weights.to(squared)
        squared = squared * element_weights
    per_sample = squared.mean(dim=tuple(range(1, squared.dim())))
    if element_weights is not None and normalize:
        per_sample = per_sample / element_weights.mean(dim=tuple(range(1, element_weights.dim())))
    if sample_weights is not None:
        per_sample = per_sample * sample_weights.to(per_sample)
    return per_sample.mean()
