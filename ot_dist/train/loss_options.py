"""The `loss` options, each a few lines: timestep range and distribution (its shapes: timestep_distributions.py),
offset noise (plain and generalized), input perturbation, timestep weighting (min-SNR-gamma, P2, debiased
estimation).

Extra randomness comes from generators keyed by (seed, epoch, sample id, what it is for), like the
noise itself: a sample gets the same draws in any batch, on any rank. Options that are off draw
nothing and change nothing, so existing runs keep their exact draws.
"""

from __future__ import annotations

import torch

from ot_dist.config.loss import WEIGHTED_DISTRIBUTIONS, LossConfig
from ot_dist.errors import ConfigError
from ot_dist.randomness import generator
from ot_dist.train.timestep_distributions import shape_values, timestep_weights, unit_draw, weighted_index


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
    distribution = drawn_distribution(options)
    if distribution in WEIGHTED_DISTRIBUTIONS:  # the shift is in the weights: the pick stays in [low, high]
        return low + weighted_index(g, options, high + 1 - low, discrete_shift(options))
    if distribution == "heavy_tail" or discrete_shift(options) != 1.0:
        return shifted_timestep(g, num_timesteps, options, low, high, discrete_shift(options))
    if distribution == "uniform":
        return torch.randint(low, high + 1, (1,), generator=g)  # the defaults make the call above
    u = unit_draw(g, distribution, options, torch.float32)
    return (low + (u * (high - low + 1)).long()).clamp(max=high)


def drawn_distribution(options: LossConfig) -> str:
    """The distribution of a DDPM draw: auto is uniform."""
    return "uniform" if options.timestep_distribution == "auto" else options.timestep_distribution


def discrete_shift(options: LossConfig) -> float:
    """The shift k of a DDPM / Würstchen draw: loss.timestep_shift, auto = 1.0 (none), as OneTrainer's default."""
    return 1.0 if options.timestep_shift == "auto" else options.timestep_shift


def last_timestep_drawn(options: LossConfig, num_timesteps: int) -> bool:
    """Whether the draw can reach the schedule's last timestep: a weighted distribution's when it is in the range
    with a weight above 0; a continuous one's when the bounds' top one is, or, with a timestep_shift (which moves
    the bounds), when any t in [low, high + 1) shifts onto it."""
    low, high = timestep_bounds(options, num_timesteps)
    shift = discrete_shift(options)
    if drawn_distribution(options) in WEIGHTED_DISTRIBUTIONS:
        weight, bias = shape_values(options)
        weights = timestep_weights(options.timestep_distribution, weight, bias, high + 1 - low, shift)
        return high == num_timesteps - 1 and bool(weights[-1] > 0)
    if shift == 1.0:
        return high == num_timesteps - 1
    top = high + 1  # the draw's exclusive upper end; the shift is increasing in t
    return shifted_time(top, shift, num_timesteps) > num_timesteps - 1


def shifted_time(t, shift: float, num_timesteps: int):
    """t in [0, N) shifted as a share of the whole schedule, N k t / ((k - 1) t + N): OneTrainer's expression, in
    the dtype of t (float32 for a draw, so the same u floors to the same timestep)."""
    return num_timesteps * shift * t / ((shift - 1) * t + num_timesteps)


def shifted_timestep(g: torch.Generator, num_timesteps: int, options: LossConfig, low: int, high: int,
                     shift: float) -> torch.Tensor:
    """OneTrainer's continuous discrete draw: t = low + u (high + 1 - low) of a continuous unit draw u (uniform,
    logit_normal, heavy_tail), shifted as a share of the whole schedule, t' = N k t / ((k - 1) t + N) (k = 1: t),
    then floored. The bounds hold for t, not t': a shift moves them as OneTrainer's min / max_noising_strength move.
    float32 as OneTrainer's draw, so the same u floors to the same timestep."""
    unit = unit_draw(g, drawn_distribution(options), options, torch.float32)
    t = low + (high + 1 - low) * unit
    # t stays below high + 1: u can be 1 itself (heavy_tail at u = 0, a sigmoid that rounds up), and float32 can
    # round t up to it, where OneTrainer draws one step past its range
    t = t.clamp(max=torch.nextafter(torch.tensor(high + 1.0), torch.tensor(0.0)).item())
    t = shifted_time(t, shift, num_timesteps)
    # float32 can round t' of a u just below 1 up to N itself, one past the schedule's last timestep
    return t.long().clamp(max=num_timesteps - 1)


def per_sample_normal(sample_ids: list[int], shape: tuple[int, ...], seed: int, epoch: int, purpose: str) -> torch.Tensor:
    return torch.stack([torch.randn(shape, generator=generator(seed, epoch, i, purpose)) for i in sample_ids])


def offset_noise(noise: torch.Tensor, sample_ids: list[int], weight: float, seed: int, epoch: int,
                 psi: torch.Tensor | None = None) -> torch.Tensor:
    """noise + weight x one N(0,1) per sample and channel (shifts each channel's mean); with `psi` (B,), the
    generalized offset noise's per-sample factor psi_t, noise + psi_t x weight x offset."""
    if not weight:
        return noise
    offset = per_sample_normal(sample_ids, (noise.shape[1], 1, 1), seed, epoch, "offset_noise").to(noise)
    if psi is not None:
        offset = psi.to(noise).view(-1, *([1] * (noise.dim() - 1))) * offset
    return noise + weight * offset


def generalized_offset_psi(betas: torch.Tensor) -> torch.Tensor:
    """psi_t of every timestep for generalized offset noise ("Generalized Diffusion Model with Adjusted Offset
    Noise", Eq. 34 and Algorithm 1, balanced phi_t / psi_t strategy), computed in float64 as OneTrainer's
    ModelSetupNoiseMixin does."""
    betas = betas.double()
    alphas = 1.0 - betas
    alphas_cumprod = torch.cumprod(alphas, dim=0)
    previous = torch.cat([torch.ones(1, dtype=betas.dtype), alphas_cumprod[:-1]])  # alpha-bar_0 = 1
    gammas = torch.zeros_like(betas)
    gammas[0] = 1.0
    running = gammas[0] / torch.sqrt(previous[0])
    for t in range(1, betas.shape[0]):
        c_t = (1 - alphas[t]) * torch.sqrt(previous[t]) / (alphas[t] * (1 - previous[t]))
        gammas[t] = c_t * running
        running = running + gammas[t] / torch.sqrt(previous[t])
    psi_last = running / torch.sqrt(1 - alphas_cumprod[-1])
    terms = (gammas / psi_last) / torch.sqrt(previous)
    return torch.cumsum(terms, dim=0) / torch.sqrt(1 - alphas_cumprod)


def perturbed_input_noise(noise: torch.Tensor, sample_ids: list[int], gamma: float, seed: int, epoch: int) -> torch.Tensor:
    """The noise the UNet input is made with: noise + gamma x N(0,1); the target keeps `noise`."""
    if not gamma:
        return noise
    return noise + gamma * per_sample_normal(sample_ids, tuple(noise.shape[1:]), seed, epoch, "input_perturbation").to(noise)


def snr_of(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    alpha_bar = alphas_cumprod.to(timesteps.device)[timesteps].double()
    return alpha_bar / (1 - alpha_bar)


def ddpm_weights(name: str, strength: float, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor,
                 prediction_type: str) -> torch.Tensor | None:
    """Per-sample loss weights of OneTrainer's DDPM weight functions (ModelSetupDiffusionLossMixin), None for
    CONSTANT. v-prediction adds 1 to the SNR where OneTrainer does."""
    if name == "CONSTANT":
        return None
    if name == "MIN_SNR_GAMMA":
        return min_snr_weights(alphas_cumprod, timesteps, strength, prediction_type)
    v = 1.0 if prediction_type == "v_prediction" else 0.0
    snr = snr_of(alphas_cumprod, timesteps)
    if name == "P2":
        return ((1.0 + snr + v) ** -strength).float()
    if name == "DEBIASED_ESTIMATION":  # the clip at 1000 is kohya's and OneTrainer's, not the paper's
        return torch.rsqrt(snr.clamp(max=1.0e3) + v).float()
    raise ValueError(f"loss.weight_fn: {name} is not a DDPM weighting")


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float,
                    prediction_type: str) -> torch.Tensor:
    """Per-sample loss weights min(SNR, gamma) / SNR (epsilon) or / (SNR + 1) (v-prediction). For epsilon it is
    computed as min(1, gamma / SNR), the same value, which at SNR 0 (a zero-terminal-SNR schedule's last timestep)
    is its limit 1 where the quotient is 0 / 0 = NaN."""
    alpha_bar = alphas_cumprod.to(timesteps.device)[timesteps].double()
    snr = alpha_bar / (1 - alpha_bar)
    if prediction_type == "v_prediction":
        return (snr.clamp(max=gamma) / (snr + 1)).float()
    return (gamma / snr).clamp(max=1.0).float()
