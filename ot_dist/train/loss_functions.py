"""The per-element loss of a prediction against its target: a weighted sum of OneTrainer's loss functions (MSE,
MAE, log-cosh, Huber) and kohya's / diffusers' scheduled pseudo-Huber, as the `loss.*_strength` options say.
Generic over what prediction and target are (epsilon, v, flow): the family's objective decides those, and
masks, timestep weights, concept weights and the loss scaler weigh the result as they weigh the squared error.

The pseudo-Huber threshold c depends on the sample's timestep (kohya's get_huber_threshold_if_needed): the
objective supplies the timestep's share of the schedule and, for DDPM schedules, its alpha-bar."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ot_dist.config.loss import LossConfig


def elementwise_loss(prediction: torch.Tensor, target: torch.Tensor, options: LossConfig,
                     thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """sum over the loss functions of strength x loss(prediction - target), per element. `thresholds` (B,): the
    pseudo-Huber c of each sample (pseudo_huber_thresholds), needed when pseudo_huber_strength is on."""
    diff = prediction - target
    total = None

    def add(strength: float, values: torch.Tensor) -> None:
        nonlocal total
        values = values if strength == 1.0 else strength * values
        total = values if total is None else total + values

    if options.mse_strength:
        add(options.mse_strength, diff ** 2)
    if options.mae_strength:
        add(options.mae_strength, diff.abs())
    if options.log_cosh_strength:
        add(options.log_cosh_strength, log_cosh(diff))
    if options.huber_strength:
        delta = 1.0 if options.huber_delta is None else options.huber_delta
        add(options.huber_strength, F.huber_loss(prediction, target, reduction="none", delta=delta))
    if options.pseudo_huber_strength:
        if thresholds is None:
            raise ValueError("loss.pseudo_huber_strength: the per-sample thresholds are missing")
        add(options.pseudo_huber_strength, pseudo_huber(diff, thresholds, options.pseudo_huber_form or "huber"))
    return total


def log_cosh(diff: torch.Tensor) -> torch.Tensor:
    """log(cosh(d)) as d + softplus(-2 d) - log 2 (OneTrainer's form), which does not overflow where cosh does."""
    return diff + F.softplus(-2.0 * diff) - math.log(2.0)


def pseudo_huber(diff: torch.Tensor, thresholds: torch.Tensor, form: str) -> torch.Tensor:
    """kohya's conditional_loss: huber 2 c (sqrt(d^2 + c^2) - c), smooth_l1 2 (sqrt(d^2 + c^2) - c), c per sample."""
    c = thresholds.to(diff).view(-1, *([1] * (diff.dim() - 1)))
    root = torch.sqrt(diff ** 2 + c ** 2) - c
    return 2 * c * root if form == "huber" else 2 * root


def pseudo_huber_thresholds(options: LossConfig, timesteps: torch.Tensor, num_timesteps: int,
                            alphas_cumprod: torch.Tensor | None) -> torch.Tensor:
    """Each sample's threshold c (kohya's get_huber_threshold_if_needed): constant C S; exponential
    exp(-alpha t) S, alpha = -ln(C) / N (t in the scheduler's units, N = its num_train_timesteps); snr
    (1 - C) / (1 + sigma)^2 + C, sigma = sqrt((1 - alpha-bar) / alpha-bar), `alphas_cumprod` being each sample's
    alpha-bar (None for flow matching, which has none: refused by the config check)."""
    schedule, c, scale = options.pseudo_huber_threshold()
    if schedule == "constant":
        return torch.full(timesteps.shape, c * scale, device=timesteps.device)
    if schedule == "exponential":
        alpha = -math.log(c) / num_timesteps
        return torch.exp(-alpha * timesteps.float()) * scale
    if alphas_cumprod is None:
        raise ValueError("loss.pseudo_huber_schedule: snr needs a DDPM schedule (alphas_cumprod)")
    sigmas = ((1.0 - alphas_cumprod) / alphas_cumprod) ** 0.5
    return ((1 - c) / (1 + sigmas) ** 2 + c).float().to(timesteps.device)
