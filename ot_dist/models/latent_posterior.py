"""What a latent encoder's `encode` answers, as one (mean, std) pair: a diffusers VAE's Gaussian posterior
(`.latent_dist`), or a deterministic encoder's latents (`.latent`: the DC-AE's `EncoderOutput`) with std zero, so
that a drawn sample (mean + std x eps) and the latent cache treat both alike."""

from __future__ import annotations

import torch


def encode_posterior(encoder, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = encoder.encode(pixels)
    posterior = getattr(out, "latent_dist", None)
    if posterior is not None:
        return posterior.mean, posterior.std
    latents = out.latent
    return latents, torch.zeros_like(latents)
