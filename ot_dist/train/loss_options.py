"""The `loss` options, each a few lines: timestep range and distribution, offset noise, input
perturbation, min-SNR-gamma weighting.

Extra randomness comes from generators keyed by (seed, epoch, sample id, what it is for), like the
noise itself: a sample gets the same draws in any batch, on any rank. Options that are off draw
nothing and change nothing, so existing runs keep their exact draws.
"""

from __future__ import annotations

import torch

from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError
from ot_dist.randomness import generator


def timestep_bounds(options: LossConfig, num_timesteps: int) -> tuple[int, int]:
    """[low, high], inclusive, checked against the model's scheduler."""
    high = num_timesteps - 1 if options.max_timestep is None else options.max_timestep
    if high >= num_timesteps:
        raise ConfigError(f"loss.max_timestep: {high} is past the model's last timestep ({num_timesteps - 1})")
    if options.min_timestep > high:
        raise ConfigError(f"loss.min_timestep: {options.min_timestep} is past the largest timestep trained ({high})")
    return options.min_timestep, high


def draw_timestep(g: torch.Generator, num_timesteps: int, options: LossConfig | None) -> torch.Tensor:
    """One timestep (shape (1,)) from the sample's generator."""
    if options is None:
        return torch.randint(0, num_timesteps, (1,), generator=g)
    low, high = timestep_bounds(options, num_timesteps)
    if options.timestep_distribution in ("uniform", "auto"):
        return torch.randint(low, high + 1, (1,), generator=g)  # the defaults make the call above
    u = torch.sigmoid(torch.randn(1, generator=g) * options.logit_normal_std + options.logit_normal_mean)
    return (low + (u * (high - low + 1)).long()).clamp(max=high)


def per_sample_normal(sample_ids: list[int], shape: tuple[int, ...], seed: int, epoch: int, purpose: str) -> torch.Tensor:
    return torch.stack([torch.randn(shape, generator=generator(seed, epoch, i, purpose)) for i in sample_ids])


def offset_noise(noise: torch.Tensor, sample_ids: list[int], weight: float, seed: int, epoch: int) -> torch.Tensor:
    """noise + weight x one N(0,1) per sample and channel (shifts each channel's mean)."""
    if not weight:
        return noise
    offset = per_sample_normal(sample_ids, (noise.shape[1], 1, 1), seed, epoch, "offset_noise")
    return noise + weight * offset.to(noise)


def perturbed_input_noise(noise: torch.Tensor, sample_ids: list[int], gamma: float, seed: int, epoch: int) -> torch.Tensor:
    """The noise the UNet input is made with: noise + gamma x N(0,1); the target keeps `noise`."""
    if not gamma:
        return noise
    return noise + gamma * per_sample_normal(sample_ids, tuple(noise.shape[1:]), seed, epoch, "input_perturbation").to(noise)


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float,
                    prediction_type: str) -> torch.Tensor:
    """Per-sample loss weights min(SNR, gamma) / SNR (epsilon) or / (SNR + 1) (v-prediction)."""
    alpha_bar = alphas_cumprod.to(timesteps.device)[timesteps].double()
    snr = alpha_bar / (1 - alpha_bar)
    clipped = snr.clamp(max=gamma)
    return (clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr).float()
