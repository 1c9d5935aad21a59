"""The diffusion training objective for one micro batch: encode, noise, predict, compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ot_dist.models.loading import LoadedModel
from ot_dist.models.specs import TextConditioning
from ot_dist.randomness import generator


def draw_sample_noise(batch: dict, latent_shape: torch.Size, num_timesteps: int, seed: int, epoch: int):
    """Per-sample draws from a generator keyed by (seed, epoch, sample id): the VAE posterior sample,
    the noise and the timestep. A sample gets the same draws in any batch, on any rank."""
    vae_eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        vae_eps.append(torch.randn(latent_shape, generator=g))
        noise.append(torch.randn(latent_shape, generator=g))
        timesteps.append(torch.randint(0, num_timesteps, (1,), generator=g))
    return torch.stack(vae_eps), torch.stack(noise), torch.cat(timesteps)


def first_parameter(module: torch.nn.Module) -> torch.Tensor:
    # diffusers' `.device` / `.dtype` walk the whole module tree on every read (milliseconds per step
    # on a real UNet); the first parameter answers the same question at once.
    return next(module.parameters())


def encode_latents(vae: torch.nn.Module, batch: dict, eps: torch.Tensor) -> torch.Tensor:
    """A sample of each VAE posterior, scaled: encoded from `pixels`, or from the cached posterior
    (`latent_mean`, `latent_std`, data.cache_latents) with the same draw."""
    with torch.no_grad():
        reference = first_parameter(vae)
        if "latent_mean" in batch:
            mean, std = (batch[k].to(device=reference.device, dtype=reference.dtype) for k in ("latent_mean", "latent_std"))
        else:
            posterior = vae.encode(batch["pixels"].to(device=reference.device, dtype=reference.dtype)).latent_dist
            mean, std = posterior.mean, posterior.std
        latents = mean + std * eps.to(mean)
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return ((latents - shift) * vae.config.scaling_factor).float()


def diffusion_loss(model: LoadedModel, batch: dict, seed: int, epoch: int) -> torch.Tensor:
    """Mean-squared error of the UNet's prediction (epsilon or v) for one micro batch, in float32.
    `batch["token_ids"]` holds the tokenized captions, one tensor per text encoder."""
    unet, scheduler = model.unet, model.noise_scheduler
    reference = first_parameter(unet)
    device, dtype = reference.device, reference.dtype
    if "latent_mean" in batch:
        latent_shape = batch["latent_mean"].shape[1:]
    else:
        pixels = batch["pixels"]
        factor = 2 ** (len(model.vae.config.block_out_channels) - 1)
        latent_shape = torch.Size((model.vae.config.latent_channels, pixels.shape[-2] // factor, pixels.shape[-1] // factor))
    vae_eps, noise, timesteps = draw_sample_noise(batch, latent_shape, scheduler.config.num_train_timesteps, seed, epoch)
    latents = encode_latents(model.vae, batch, vae_eps)
    noise, timesteps = noise.to(device), timesteps.to(device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
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
    prediction = unet(noisy.to(dtype), timesteps, **conditioning, return_dict=False)[0]
    return F.mse_loss(prediction.float(), target.float())
