"""The shapes of loss.timestep_distribution, OneTrainer's TimestepDistribution with its formulas.

Two kinds, as OneTrainer draws them:
- continuous (uniform, logit_normal, heavy_tail): a unit draw u in [0, 1] that the caller spreads over the timestep
  window and then shifts (loss.timestep_shift, a flow family's shift);
- weighted (sigmoid, cos_map, inverted_parabola): one of the window's `count` timesteps picked with
  torch.multinomial by a weight per timestep; the shift k is already in the weights (the shape is read at the
  inverse-shifted point and multiplied by the inverse shift's derivative), so nothing shifts the result and it
  never leaves the window.
The weights are float32 and follow OneTrainer's order of operations, so that the same generator picks the same
timestep.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ot_dist.config.loss import WEIGHTED_DISTRIBUTIONS
from ot_dist.errors import ConfigError


def heavy_tail(u: torch.Tensor, scale: float) -> torch.Tensor:
    """f(u) = 1 - u - s (cos^2(pi u / 2) - 1 + u): s = 0 is uniform (reversed), s > 0 favours the middle of the
    range, s < 0 its ends."""
    return 1.0 - u - scale * (torch.cos(math.pi / 2.0 * u) ** 2.0 - 1.0 + u)


def unit_draw(g: torch.Generator, distribution: str, options, dtype: torch.dtype) -> torch.Tensor:
    """One continuous draw u in [0, 1] (shape (1,)) of a continuous distribution from the sample's generator, in
    `dtype` (a flow family's draw is float64). heavy_tail is drawn and mapped in float32 whatever `dtype`, as
    OneTrainer draws it, so that a seed gives OneTrainer's u there too."""
    if distribution == "logit_normal":
        return torch.sigmoid(torch.randn(1, generator=g, dtype=dtype) * options.logit_normal_std
                             + options.logit_normal_mean)
    if distribution == "heavy_tail":
        return heavy_tail(torch.rand(1, generator=g, dtype=torch.float32), shape_values(options)[0]).to(dtype)
    return torch.rand(1, generator=g, dtype=dtype)


def shape_values(options) -> tuple[float, float]:
    """(noising_weight, noising_bias), OneTrainer's defaults 0 where unset."""
    return (options.noising_weight or 0.0), (options.noising_bias or 0.0)


@lru_cache(maxsize=32)
def timestep_weights(distribution: str, weight: float, bias: float, count: int, shift: float) -> torch.Tensor:
    """float32 weights of the window's `count` timesteps, x = 0 .. 1 over them (torch.linspace), for a shift k:
    y = x / (k - k x + x) (the inverse of k u / (1 + (k - 1) u)), d = k / (k + x - x k)^2 (its derivative), then
      cos_map            2 / (pi - 2 pi y + 2 pi y^2) * d
      sigmoid            1 / (1 + exp(-w (z - (b + 0.5)))) * d, z = y / (k - k y + y): OneTrainer inverts the shift
                         once more for this shape (the sigmoid is read at the k^2 inverse), kept for parity
      inverted_parabola  max(0, -w (y - (b + 0.5))^2 + 2) * d
    w = noising_weight, b = noising_bias. Cached: the same settings give the same tensor (OneTrainer computes its
    weights once per run; ot_dist once per shift, which a resolution-dependent shift changes)."""
    x = torch.linspace(0, 1, count)
    y = x / (shift - shift * x + x)
    derivative = shift / (shift + x - (x * shift)).pow(2)
    if distribution == "cos_map":
        shape = 2.0 / (math.pi - 2.0 * math.pi * y + 2.0 * math.pi * y ** 2.0)
    elif distribution == "sigmoid":
        z = y / (shift - shift * y + y)
        shape = 1 / (1 + torch.exp(-weight * (z - (bias + 0.5))))
    elif distribution == "inverted_parabola":
        shape = torch.clamp(-weight * ((y - (bias + 0.5)) ** 2) + 2, min=0.0)
    else:
        raise ValueError(f"loss.timestep_distribution: {distribution} is not one of {WEIGHTED_DISTRIBUTIONS}")
    weights = shape * derivative
    total = weights.sum()
    if not (torch.isfinite(total) and total > 0):
        raise ConfigError(f"loss.noising_weight / loss.noising_bias: {weight} / {bias} give timestep_distribution "
                          f"{distribution} no weight on any of the {count} timesteps in the window (shift {shift}); "
                          "lower noising_weight or move noising_bias towards 0")
    return weights


def weighted_index(g: torch.Generator, options, count: int, shift: float) -> torch.Tensor:
    """An index in [0, count) (shape (1,), int64) drawn by the distribution's weights with the sample's generator."""
    weight, bias = shape_values(options)
    weights = timestep_weights(options.timestep_distribution, float(weight), float(bias), count, float(shift))
    return torch.multinomial(weights, 1, replacement=True, generator=g)
