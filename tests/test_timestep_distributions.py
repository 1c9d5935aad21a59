"""loss.timestep_distribution heavy_tail, sigmoid, cos_map, inverted_parabola (OneTrainer's TimestepDistribution,
shaped by noising_weight w and noising_bias b) beside uniform and logit_normal, on the DDPM draw (1000 steps),
Würstchen / Stable Cascade's (10000 steps of continuous time) and the flow-matching one (SD3 / Flux / Chroma).

The rules, as OneTrainer documents them in its draw (ModelSetupNoiseMixin._get_timestep_discrete):
- continuous: u from torch.rand (heavy_tail: f(u) = 1 - u - w (cos^2(pi u / 2) - 1 + u)), t = low + u (high + 1 -
  low), then the shift N k t / ((k - 1) t + N), floored;
- weighted: one step of [low, high] picked by torch.multinomial over x = linspace(0, 1, count) with weights
  shape(y) d, y = x / (k - k x + x) (the inverse shift), d = k / (k + x - x k)^2 (its derivative); shape: cos_map
  2 / (pi - 2 pi y + 2 pi y^2), inverted_parabola max(0, 2 - w (y - 0.5 - b)^2), sigmoid 1 / (1 + exp(-w (z - 0.5
  - b))) read at z = y / (k - k y + y) (OneTrainer inverts the shift once more for the sigmoid); not shifted after.
A flow family's step i is the noise level (i + 1) / N (OneTrainer's sigma table)."""

from __future__ import annotations

import math

import pytest
import torch

from ot_dist.config.load import validate
from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError
from ot_dist.models.objectives import DDPM, ContinuousCosine, FlowMatching
from ot_dist.train.loss_options import last_timestep_drawn

SEEDS = range(6)
FLUX_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}  # diffusers' 0.5 / 1.15
LATENT_1024, LATENT_512 = torch.Size((16, 128, 128)), torch.Size((16, 64, 64))


def ddpm() -> DDPM:
    return DDPM({"num_train_timesteps": 1000, "prediction_type": "epsilon"})


def options_for(distribution: str, weight: float, bias: float, window: tuple[float, float], shift, steps: int):
    """ot_dist's settings for OneTrainer's (min / max_noising_strength window, timestep_shift k)."""
    shape = {"heavy_tail": {"noising_weight": weight}, "cos_map": {}}.get(
        distribution, {"noising_weight": weight, "noising_bias": bias})
    return LossConfig(timestep_distribution=distribution, min_timestep=int(steps * window[0]),
                      max_timestep=int(steps * window[1]) - 1, timestep_shift=shift, **shape)


def draws(objective, options: LossConfig, shape=None, seeds=SEEDS) -> torch.Tensor:
    return torch.cat([objective.draw(torch.Generator().manual_seed(seed), options, shape) for seed in seeds])


# OneTrainer's own _get_timestep_discrete (commit 23df383, run in a scratch folder on a batch of 1 from
# torch.Generator().manual_seed(seed), seeds 0-5, a fresh setup per setting): (distribution, w, b,
# (min, max noising strength), timestep_shift) -> the steps it returns. Würstchen / Stable Cascade: its
# _get_timestep_continuous, as the step i of t = (i + 1) / 10000. Flow: the step i of its sigma (i + 1) / N, with the
# shift its Flux setup passes (flux1024 / flux512: calculate_timestep_shift's e^mu at 1024 / 512 px).
ONETRAINER_DDPM = {
    ("heavy_tail", 1.29, 0.0, (0.0, 1.0), 1.0): [500, 376, 464, 990, 483, 299],
    ("heavy_tail", -0.8, 0.0, (0.25, 0.5), 3.0): [644, 550, 600, 749, 621, 528],
    ("sigmoid", 8.0, 0.1, (0.0, 1.0), 1.0): [907, 510, 680, 748, 947, 898],
    ("sigmoid", -5.0, -0.2, (0.1, 0.9), 3.0): [536, 610, 780, 574, 386, 824],
    ("cos_map", 0.0, 0.0, (0.0, 1.0), 1.0): [436, 510, 680, 474, 286, 898],
    ("cos_map", 0.0, 0.0, (0.25, 0.5), 0.5): [308, 330, 357, 282, 263, 328],
    ("inverted_parabola", 2.0, 0.0, (0.0, 1.0), 1.0): [436, 510, 680, 246, 286, 898],
    ("inverted_parabola", 6.0, 0.2, (0.1, 0.9), 3.0): [536, 610, 780, 848, 844, 824]}
ONETRAINER_CASCADE = {
    ("heavy_tail", 1.75, 0.0, (0.0, 1.0), 3.0): [7500, 6890, 7447, 9960, 7492, 6127],
    ("sigmoid", 8.0, 0.1, (0.25, 0.5), 0.5): [4363, 3664, 4671, 4740, 4823, 4371],
    ("cos_map", 0.0, 0.0, (0.1, 0.9), 3.0): [2863, 6002, 3171, 7395, 5865, 2871],
    ("inverted_parabola", 1.0, -0.4, (0.0, 1.0), 1.0): [1863, 9247, 2171, 6395, 2323, 1871]}
ONETRAINER_FLOW = {
    ("cos_map", 0.0, 0.0, (0.0, 1.0), "flux1024"): [907, 510, 680, 748, 947, 898],
    ("sigmoid", 8.0, 0.1, (0.0, 1.0), 3.0): [907, 990, 977, 971, 947, 898],
    ("inverted_parabola", 6.0, 0.2, (0.1, 0.9), "flux512"): [536, 610, 780, 848, 633, 824],
    ("heavy_tail", 1.29, 0.0, (0.0, 1.0), 3.0): [750, 644, 722, 996, 737, 561]}


@pytest.mark.parametrize("case,expected", ONETRAINER_DDPM.items())
def test_ddpm_draws_onetrainers_timesteps(case, expected):
    assert draws(ddpm(), options_for(*case, steps=1000)).tolist() == expected


@pytest.mark.parametrize("case,expected", ONETRAINER_CASCADE.items())
def test_stable_cascade_draws_onetrainers_continuous_time(case, expected):
    """t = (i + 1) / 10000 (scale 1, no offset here: OneTrainer applies Stable Cascade's after the draw too)."""
    got = draws(ContinuousCosine(scale=1.0, offset=0.0), options_for(*case, steps=10000))
    assert ((got.double() * 10000).round().long() - 1).tolist() == expected


@pytest.mark.parametrize("case,expected", ONETRAINER_FLOW.items())
def test_flow_matching_draws_onetrainers_noise_levels(case, expected):
    """A weighted distribution gives OneTrainer's sigma = (i + 1) / N itself; a continuous one is ot_dist's
    continuous sigma, whose floor is OneTrainer's step i (sigma x N in [i, i + 1))."""
    distribution, weight, bias, window, shift = case
    if shift in ("flux1024", "flux512"):  # loss.dynamic_timestep_shifting: OneTrainer's Flux passes e^mu as k
        objective, shape = FlowMatching.from_scheduler_config(FLUX_SCHEDULER, patch_size=2), {
            "flux1024": LATENT_1024, "flux512": LATENT_512}[shift]
        options = options_for(distribution, weight, bias, window, "auto", 1000).model_copy(
            update={"dynamic_timestep_shifting": True})
    else:
        objective, shape = FlowMatching(shift=1.0), LATENT_1024
        options = options_for(distribution, weight, bias, window, shift, 1000)
    got = draws(objective, options, shape).double()
    if distribution == "heavy_tail":
        got = got.floor() + 1
    assert got.tolist() == [i + 1.0 for i in expected]


# --- the documented formulas, on more seeds and settings than the table ---

def heavy_tail(u: torch.Tensor, w: float) -> torch.Tensor:
    return 1 - u - w * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


@pytest.mark.parametrize("w,shift,low,high", [(0.0, 1.0, 0, 999), (1.5, 1.0, 100, 899), (-1.0, 2.0, 0, 999),
                                              (0.7, 0.5, 250, 499)])
def test_heavy_tail_is_the_published_map(w, shift, low, high):
    """floor(shift(low + f(u) (high + 1 - low))) of u = torch.rand(1) (float32, as OneTrainer), 1000 steps; on
    Stable Cascade the same over 10000."""
    options = LossConfig(timestep_distribution="heavy_tail", noising_weight=w, timestep_shift=shift,
                         min_timestep=low, max_timestep=high)
    seeds = range(32)
    u = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(s)) for s in seeds])
    for n, objective in ((1000, ddpm()), (10000, ContinuousCosine(scale=1.0, offset=0.0))):
        scaled = options.model_copy(update={"min_timestep": low * n // 1000, "max_timestep": (high + 1) * n // 1000 - 1})
        t = scaled.min_timestep + heavy_tail(u, w) * (scaled.max_timestep + 1 - scaled.min_timestep)
        expected = (n * shift * t / ((shift - 1) * t + n)).long()
        got = draws(objective, scaled, seeds=seeds)
        if n == 10000:
            got = (got.double() * n).round().long() - 1
        assert torch.equal(got, expected)


def formula_weights(distribution: str, w: float, b: float, count: int, k: float) -> torch.Tensor:
    """The weights of the module docstring, in float64."""
    x = torch.linspace(0, 1, count, dtype=torch.float64)
    y = x / (k - k * x + x)
    derivative = k / (k + x - x * k) ** 2
    if distribution == "cos_map":
        shape = 2 / (math.pi * (1 - 2 * y + 2 * y ** 2))
    elif distribution == "inverted_parabola":
        shape = (2 - w * (y - 0.5 - b) ** 2).clamp(min=0)
    else:
        shape = torch.sigmoid(w * (y / (k - k * y + y) - 0.5 - b))
    return shape * derivative


WEIGHTED_CASES = [("cos_map", 0.0, 0.0, 1.0), ("cos_map", 0.0, 0.0, 3.0), ("sigmoid", 6.0, 0.2, 1.0),
                  ("sigmoid", -4.0, 0.0, 2.0), ("inverted_parabola", 3.0, -0.1, 1.0),
                  ("inverted_parabola", 8.0, 0.3, 0.5)]


@pytest.mark.parametrize("distribution,w,b,shift", WEIGHTED_CASES)
def test_a_weighted_draw_is_multinomial_over_the_formula(distribution, w, b, shift):
    """low + torch.multinomial(weights, 1) from the sample's generator, for DDPM (shift: loss.timestep_shift) and a
    flow family (its shift; sigma = (i + 1) / N)."""
    low, high, seeds = 100, 899, range(32)
    options = LossConfig(timestep_distribution=distribution, min_timestep=low, max_timestep=high,
                         timestep_shift=shift, **({} if distribution == "cos_map" else
                                                  {"noising_weight": w, "noising_bias": b}))
    weights = formula_weights(distribution, w, b, high + 1 - low, shift).float()
    expected = torch.cat([low + torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(s))
                          for s in seeds])
    assert torch.equal(draws(ddpm(), options, seeds=seeds), expected)
    assert torch.equal(draws(FlowMatching(shift=1.0), options, LATENT_1024, seeds=seeds), (expected + 1).float())


# --- the empirical distribution of a large seeded draw against the analytic CDF ---

DRAWS = 4000
KS_LIMIT = 1.95 / math.sqrt(DRAWS)  # the Kolmogorov-Smirnov 0.1% critical value


def many(objective, options: LossConfig, shape=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.cat([objective.draw(g, options, shape) for _ in range(DRAWS)]).double()


def ks_distance(samples: torch.Tensor, cdf, points: torch.Tensor) -> float:
    """max over `points` of |share of samples <= point - cdf(point)|."""
    empirical = torch.searchsorted(samples.sort().values, points, right=True).double() / samples.numel()
    return float((empirical - cdf(points)).abs().max())


def normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def inverse_heavy_tail(x: torch.Tensor, w: float) -> torch.Tensor:
    """u with f(u) = x (f decreases from 1 to 0 for w in [-1, 2 / (pi - 2)]), by bisection."""
    lo, hi = torch.zeros_like(x), torch.ones_like(x)
    for _ in range(60):
        mid = (lo + hi) / 2
        above = heavy_tail(mid, w) > x
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return (lo + hi) / 2


def unshift(x: torch.Tensor, k: float) -> torch.Tensor:
    """The inverse of the shift s(u) = k u / (1 + (k - 1) u) on [0, 1]."""
    return x / (k - (k - 1) * x)


UNIT_CDFS = {  # P(u < x) of a continuous distribution's unit draw
    "uniform": lambda x, w: x,
    "logit_normal": lambda x, w: normal_cdf((torch.log(x) - torch.log1p(-x) - 0.3) / 1.4),  # mean 0.3, std 1.4
    "heavy_tail": lambda x, w: 1 - inverse_heavy_tail(x, w),
}


@pytest.mark.parametrize("distribution,w,shift", [("uniform", 0.0, 3.0), ("logit_normal", 0.0, 1.0),
                                                  ("logit_normal", 0.0, 0.5), ("heavy_tail", 1.2, 1.0),
                                                  ("heavy_tail", -0.8, 3.0)])
def test_a_continuous_draw_follows_its_cdf(distribution, w, shift):
    """DDPM step j = floor(N s(u)) over the whole range: P(step <= j) = P(u < s^-1((j + 1) / N)); flow sigma
    = s(u): P(sigma <= x) = P(u < s^-1(x))."""
    options = LossConfig(timestep_distribution=distribution, timestep_shift=shift, logit_normal_mean=0.3,
                         logit_normal_std=1.4, **({"noising_weight": w} if distribution == "heavy_tail" else {}))
    cdf = UNIT_CDFS[distribution]
    steps = torch.arange(0, 1000, 7, dtype=torch.float64)
    distance = ks_distance(many(ddpm(), options), lambda j: cdf(unshift((j + 1) / 1000, shift), w), steps)
    assert distance < KS_LIMIT
    levels = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    sigmas = many(FlowMatching(shift=1.0), options, LATENT_1024) / 1000
    assert ks_distance(sigmas, lambda x: cdf(unshift(x, shift), w), levels) < KS_LIMIT


def weighted_cdf(distribution: str, w: float, b: float, k: float):
    """P(X <= x) of the continuous density the weights sample, X = the position in the range: cos_map's CosMap
    density 2 / (pi (1 - 2 y + 2 y^2)) has the CDF (2 / pi) atan(y / (1 - y)) at y = s^-1(x); the others integrate
    their density shape(y) d (trapezoids on a fine grid)."""
    if distribution == "cos_map":
        return lambda x: (2 / math.pi) * torch.atan2(unshift(x, k), 1 - unshift(x, k))
    grid = torch.linspace(0, 1, 200001, dtype=torch.float64)
    density = formula_weights(distribution, w, b, grid.numel(), k)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64),
                            torch.cumsum((density[1:] + density[:-1]) / 2, 0)])
    cumulative = cumulative / cumulative[-1]
    return lambda x: cumulative[(x * (grid.numel() - 1)).round().long()]


@pytest.mark.parametrize("distribution,w,b,shift", WEIGHTED_CASES)
def test_a_weighted_draw_follows_its_density(distribution, w, b, shift):
    """Steps 0 .. 999 are x = j / 999; the share of draws at or below x against the density's CDF (the draw is
    discrete, the CDF continuous: they differ by less than one step's mass, ~0.1%)."""
    options = LossConfig(timestep_distribution=distribution, timestep_shift=shift, **(
        {} if distribution == "cos_map" else {"noising_weight": w, "noising_bias": b}))
    positions = many(ddpm(), options) / 999
    points = torch.linspace(0, 1, 101, dtype=torch.float64)
    assert ks_distance(positions, weighted_cdf(distribution, w, b, shift), points) < KS_LIMIT + 0.002


# --- settings ---

RAW = {"method": "full", "output_dir": "o", "data": {"path": "d"}, "model": {"family": "sd1", "path": "m"}}


@pytest.mark.parametrize("loss,message", [
    ({"timestep_distribution": "uniform", "noising_weight": 2.0},
     "loss.noising_weight: timestep_distribution uniform does not use it; sigmoid, heavy_tail, inverted_parabola do"),
    ({"timestep_distribution": "logit_normal", "noising_bias": 0.5},
     "loss.noising_bias: timestep_distribution logit_normal does not use it \\(its mean is logit_normal_mean"),
    ({"timestep_distribution": "heavy_tail", "noising_bias": 0.5},
     "loss.noising_bias: timestep_distribution heavy_tail does not use it"),
    ({"timestep_distribution": "cos_map", "noising_weight": 1.0}, "loss.noising_weight: timestep_distribution cos_map"),
    ({"timestep_distribution": "heavy_tail", "noising_weight": 1.8}, "loss.noising_weight: 1.8 is outside \\[-1, 1.7519\\]"),
    ({"timestep_distribution": "heavy_tail", "noising_weight": -1.01}, "loss.noising_weight: -1.01 is outside"),
    ({"timestep_distribution": "inverted_parabola", "noising_weight": 8.0, "noising_bias": 1.0},
     "loss.noising_bias: 1.0 puts inverted_parabola's centre"),
    ({"timestep_distribution": "sigmoid", "noising_weight": float("nan")}, "loss.noising_weight"),
    ({"timestep_distribution": "beta"}, "loss.timestep_distribution")])
def test_shapes_that_cannot_draw_are_refused_by_name(loss, message):
    with pytest.raises(ConfigError, match=message):
        validate({**RAW, "loss": loss})


def test_weights_that_vanish_on_the_range_name_the_fields():
    """A sigmoid so steep that every weight underflows to 0 (float32) cannot be told from the settings alone: the
    first draw says which fields to change."""
    options = LossConfig(timestep_distribution="sigmoid", noising_weight=1000.0, noising_bias=0.6)
    with pytest.raises(ConfigError, match="loss.noising_weight / loss.noising_bias: 1000.0 / 0.6 give "
                                          "timestep_distribution sigmoid no weight on any of the 1000 timesteps"):
        draws(ddpm(), options)


def test_the_heavy_tail_edge_stays_in_the_range():
    """heavy_tail with w = -1 maps a u below ~1e-4 to 1.0 in float32, the range's exclusive top. OneTrainer then
    draws one step past its range: 500 for noising strengths 0.1 .. 0.5, and 1000 over the whole range, past a
    1000-step schedule's last step (it did so for these seeds, whose first torch.rand is below 1e-4). ot_dist keeps
    t below the top."""
    edge_seeds = [18881, 27866, 28429]
    options = LossConfig(timestep_distribution="heavy_tail", noising_weight=-1.0, min_timestep=100, max_timestep=499)
    assert draws(ddpm(), options, seeds=edge_seeds).tolist() == [499, 499, 499]
    whole = LossConfig(timestep_distribution="heavy_tail", noising_weight=-1.0)
    assert draws(ddpm(), whole, seeds=edge_seeds).tolist() == [999, 999, 999]
    sigmas = draws(FlowMatching(shift=1.0), whole, LATENT_1024, seeds=edge_seeds) / 1000
    assert ((0 < sigmas) & (sigmas < 1)).all()


def test_the_last_timestep_of_a_weighted_draw():
    """Whether a zero-terminal-SNR schedule's last step can be drawn (epsilon DEBIASED_ESTIMATION is refused then):
    a weighted distribution that gives it weight 0 never draws it, and a shift does not move the range."""
    assert last_timestep_drawn(LossConfig(timestep_distribution="cos_map", timestep_shift=3.0), 1000)
    assert not last_timestep_drawn(LossConfig(timestep_distribution="cos_map", max_timestep=998, timestep_shift=3.0),
                                   1000)
    # centre 0.3, w = 8: 2 - 8 (1 - 0.3)^2 < 0 at the last step
    parabola = LossConfig(timestep_distribution="inverted_parabola", noising_weight=8.0, noising_bias=-0.2)
    assert not last_timestep_drawn(parabola, 1000)
