"""The variational-bound (VB) loss of a denoiser that learns its reverse-process variance (Nichol & Dhariwal 2021,
"Improved DDPM"; PixArt-α / Σ output epsilon and these variance values side by side), as OneTrainer trains it
(its modules/util/loss/vb_loss.py, after OpenAI's improved-diffusion).

The denoiser's variance output v in [-1, 1] interpolates the log variance of p(x_{t-1} | x_t) between the
posterior's (clipped) log variance (v = -1) and log beta_t (v = 1). The loss is KL(q(x_{t-1} | x_t, x_0) ||
p(x_{t-1} | x_t)) in bits per element, and at t = 0 the discretized Gaussian negative log likelihood of x_0. The
mean of p comes from the epsilon prediction with its gradient stopped: the VB term trains the variance only,
the MSE trains epsilon.
"""

from __future__ import annotations

import math

import torch


class VarianceSchedule:
    """The per-timestep coefficients of a discrete DDPM schedule that the VB loss needs (float64 on the CPU,
    gathered per sample and cast to float32)."""

    def __init__(self, betas: torch.Tensor):
        betas = betas.double().cpu()
        alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        previous = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        posterior_variance = betas * (1 - previous) / (1 - alphas_cumprod)
        self.log_betas = torch.log(betas)
        # The posterior variance is 0 at t = 0: its log is clipped to the value at t = 1, as improved-diffusion does.
        self.posterior_log_variance = torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]]))
        self.mean_coef_x0 = betas * previous.sqrt() / (1 - alphas_cumprod)
        self.mean_coef_xt = (1 - previous) * (1 - betas).sqrt() / (1 - alphas_cumprod)
        self.recip_sqrt_alphas_cumprod = alphas_cumprod.rsqrt()
        self.sqrt_recip_minus_one = (1 / alphas_cumprod - 1).sqrt()

    def at(self, name: str, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        values = getattr(self, name)[timesteps.long().cpu()]
        return values.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.dim() - 1)))


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x, means, log_scales) -> torch.Tensor:
    """log P(x) of a Gaussian discretized to 256 bins over [-1, 1] (the edge bins open), elementwise, in nats."""
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def vb_loss(schedule: VarianceSchedule, x0: torch.Tensor, xt: torch.Tensor, timesteps: torch.Tensor,
            predicted_eps: torch.Tensor, variance_values: torch.Tensor) -> torch.Tensor:
    """The elementwise VB term (bits) for clean latents x0, noisy latents xt at integer `timesteps`, the epsilon
    prediction (detached here) and the denoiser's variance output; float32 throughout."""
    x0, xt = x0.float(), xt.float()
    eps, values = predicted_eps.detach().float(), variance_values.float()

    def posterior_mean(start):
        return schedule.at("mean_coef_x0", timesteps, xt) * start + schedule.at("mean_coef_xt", timesteps, xt) * xt

    true_log_variance = schedule.at("posterior_log_variance", timesteps, xt)
    min_log, max_log = true_log_variance, schedule.at("log_betas", timesteps, xt)
    fraction = (values + 1) / 2
    predicted_log_variance = fraction * max_log + (1 - fraction) * min_log
    predicted_x0 = (schedule.at("recip_sqrt_alphas_cumprod", timesteps, xt) * xt
                    - schedule.at("sqrt_recip_minus_one", timesteps, xt) * eps)
    predicted_mean = posterior_mean(predicted_x0)
    kl = normal_kl(posterior_mean(x0), true_log_variance, predicted_mean, predicted_log_variance) / math.log(2.0)
    nll = -discretized_gaussian_log_likelihood(x0, predicted_mean, 0.5 * predicted_log_variance) / math.log(2.0)
    first = (timesteps.to(xt.device) == 0).view(-1, *([1] * (xt.dim() - 1)))
    return torch.where(first, nll, kl)
