"""loss.timestep_shift / loss.dynamic_timestep_shifting (OneTrainer's timestep_shift / dynamic_timestep_shifting):
an explicit shift k draws sigma = k u / (1 + (k - 1) u) from the uniform-scale draw u, the dynamic one diffusers'
FlowMatchEulerDiscreteScheduler time_shift with calculate_shift's mu; auto keeps the family scheduler's shift.
DDPM families and Würstchen / Stable Cascade take the fixed shift on their discrete draw, as OneTrainer."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from ot_dist.config.load import validate
from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError
from ot_dist.models.objectives import DDPM, ContinuousCosine, FlowMatching

SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
# Flux.1 dev's scheduler, its base / max shift moved off diffusers' defaults so that the test sees them used
FLUX_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.6,
                  "max_shift": 1.3, "base_image_seq_len": 256, "max_image_seq_len": 4096}
LATENTS = [torch.Size((16, 128, 128)), torch.Size((16, 64, 96)), torch.Size((16, 32, 32))]  # 1024, 512x768, 256 px
SEEDS = range(8)


def sigmas(objective: FlowMatching, options: LossConfig, shape: torch.Size) -> torch.Tensor:
    draws = [objective.draw(torch.Generator().manual_seed(seed), options, shape) for seed in SEEDS]
    return torch.cat(draws).double() / objective.num_timesteps


def unit_draws() -> torch.Tensor:
    """The uniform draws u that timestep_distribution: uniform takes from the same generators (full range)."""
    return torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
                      for seed in SEEDS])


@pytest.mark.parametrize("shift", [1.0, 0.5, 2.0, 3.0, 6.0])
@pytest.mark.parametrize("scheduler", [SD3_SCHEDULER, FLUX_SCHEDULER])
def test_an_explicit_shift_is_the_published_formula(shift, scheduler):
    """OneTrainer's shift of the drawn t, whatever the scheduler's own (SD3's fixed 3.0, Flux's dynamic one)."""
    objective = FlowMatching.from_scheduler_config(scheduler, patch_size=2)
    u = unit_draws()
    got = sigmas(objective, LossConfig(timestep_distribution="uniform", timestep_shift=shift), LATENTS[0])
    torch.testing.assert_close(got, shift * u / (1 + (shift - 1) * u), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", LATENTS)
@pytest.mark.parametrize("scheduler", [SD3_SCHEDULER, FLUX_SCHEDULER])
def test_dynamic_shifting_is_diffusers_time_shift(shape, scheduler):
    """mu from the packed image tokens (2x2 latent patches) between the scheduler config's base / max shift
    (diffusers' defaults where SD3's config has none), then exp(mu) / (exp(mu) + 1 / u - 1)."""
    objective = FlowMatching.from_scheduler_config(scheduler, patch_size=2)
    reference = FlowMatchEulerDiscreteScheduler.from_config({**scheduler, "use_dynamic_shifting": True})
    c = reference.config
    mu = calculate_shift((shape[-2] // 2) * (shape[-1] // 2), c.base_image_seq_len, c.max_image_seq_len,
                         c.base_shift, c.max_shift)
    got = sigmas(objective, LossConfig(timestep_distribution="uniform", dynamic_timestep_shifting=True), shape)
    torch.testing.assert_close(got, reference.time_shift(mu, 1.0, unit_draws()), rtol=1e-6, atol=0)


def test_auto_is_the_schedulers_shift():
    """auto (the default) draws as before the options existed: SD3 by its `shift`, Flux dev by the resolution;
    dynamic_timestep_shifting: false gives Flux its config's fixed `shift`."""
    uniform, u = LossConfig(timestep_distribution="uniform"), unit_draws()
    sd3 = FlowMatching.from_scheduler_config(SD3_SCHEDULER, patch_size=2)
    torch.testing.assert_close(sigmas(sd3, uniform, LATENTS[0]), 3 * u / (1 + 2 * u), rtol=1e-6, atol=0)
    flux = FlowMatching.from_scheduler_config(FLUX_SCHEDULER, patch_size=2)
    dynamic = LossConfig(timestep_distribution="uniform", dynamic_timestep_shifting=True)
    for shape in LATENTS:
        assert torch.equal(sigmas(flux, uniform, shape), sigmas(flux, dynamic, shape))
    fixed = LossConfig(timestep_distribution="uniform", dynamic_timestep_shifting=False)
    torch.testing.assert_close(sigmas(flux, fixed, LATENTS[0]), 3 * u / (1 + 2 * u), rtol=1e-6, atol=0)
    # no options at all (a caller without a loss section) is auto too
    assert torch.equal(torch.cat([sd3.draw(torch.Generator().manual_seed(s), None, LATENTS[0]) for s in SEEDS]),
                       torch.cat([sd3.draw(torch.Generator().manual_seed(s), LossConfig(), LATENTS[0]) for s in SEEDS]))


RAW = {"method": "full", "output_dir": "o", "data": {"path": "d"}}


NON_FLOW = ["sd1", "sdxl", "pixart_alpha", "stable_cascade", "wuerstchen_v2"]


@pytest.mark.parametrize("family", NON_FLOW)
@pytest.mark.parametrize("dynamic", [True, False])
def test_a_non_flow_family_refuses_dynamic_shifting_by_name(family, dynamic):
    """OneTrainer's SD / SDXL / PixArt / Würstchen setups shift by timestep_shift alone."""
    loss = {"dynamic_timestep_shifting": dynamic}
    with pytest.raises(ConfigError, match=f"loss.dynamic_timestep_shifting: shifts flow-matching timesteps by the "
                                          f"resolution; {family} is not"):
        validate({**RAW, "model": {"family": family, "path": "m"}, "loss": loss})
    assert validate({**RAW, "model": {"family": "sd3", "path": "m"}, "loss": loss}).loss == LossConfig(**loss)


@pytest.mark.parametrize("family", NON_FLOW)
def test_a_non_flow_family_takes_a_fixed_shift(family):
    config = validate({**RAW, "model": {"family": family, "path": "m"}, "loss": {"timestep_shift": 2.0}})
    assert config.loss.timestep_shift == 2.0


# OneTrainer's own _get_timestep_discrete (ModelSetupNoiseMixin, run on a batch of 1 from
# torch.Generator().manual_seed(seed), seeds 0, 1, 2; min / max_noising_strength 0 / 1 and 0.25 / 0.5, i.e.
# ot_dist's bounds [0, 999] and [250, 499]): the timesteps it returns for SD-style 1000-step schedules.
ONETRAINER_SHIFTED = {
    (3.0, "uniform", 0, 999): [747, 903, 827], (3.0, "uniform", 250, 499): [641, 701, 670],
    (0.5, "uniform", 0, 999): [330, 609, 443], (6.0, "logit_normal", 0, 999): [965, 920, 898],
    (2.0, "logit_normal", 250, 499): [626, 586, 570]}


def ddpm() -> DDPM:
    return DDPM({"num_train_timesteps": 1000, "prediction_type": "epsilon"})


def ddpm_draws(objective, options: LossConfig, seeds=SEEDS) -> torch.Tensor:
    return torch.cat([objective.draw(torch.Generator().manual_seed(seed), options, None) for seed in seeds])


@pytest.mark.parametrize("case,expected", ONETRAINER_SHIFTED.items())
def test_a_ddpm_shift_draws_onetrainers_timesteps(case, expected):
    shift, distribution, low, high = case
    options = LossConfig(timestep_shift=shift, timestep_distribution=distribution, min_timestep=low,
                         max_timestep=high)
    assert ddpm_draws(ddpm(), options, range(3)).tolist() == expected


def shifted_floor(u: torch.Tensor, shift: float, low: int, high: int, n: int) -> torch.Tensor:
    """The published rule: t = low + u (high + 1 - low), then floor(N k t / ((k - 1) t + N)), in float32 as
    OneTrainer draws."""
    t = low + (high + 1 - low) * u.float()
    return (n * shift * t / ((shift - 1) * t + n)).long()


def float32_units(distribution: str, options: LossConfig) -> torch.Tensor:
    if distribution == "uniform":
        return torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(seed)) for seed in SEEDS])
    normal = torch.cat([torch.randn(1, generator=torch.Generator().manual_seed(seed)) for seed in SEEDS])
    return torch.sigmoid(normal * options.logit_normal_std + options.logit_normal_mean)


@pytest.mark.parametrize("shift", [0.5, 2.0, 3.0])
@pytest.mark.parametrize("distribution", ["uniform", "logit_normal"])
@pytest.mark.parametrize("low,high", [(0, None), (100, 899)])
def test_a_ddpm_shift_is_the_published_formula(shift, distribution, low, high):
    """DDPM over its 1000 steps, Würstchen / Stable Cascade over OneTrainer's 10000 (t = (i + 1) / 10000, then
    its scale and offset)."""
    options = LossConfig(timestep_shift=shift, timestep_distribution=distribution, min_timestep=low,
                         max_timestep=high, logit_normal_mean=0.3, logit_normal_std=1.5)
    u = float32_units(distribution, options)
    expected = shifted_floor(u, shift, low, 999 if high is None else high, 1000)
    assert torch.equal(ddpm_draws(ddpm(), options), expected)
    cascade = ContinuousCosine(scale=1.0)
    options = options.model_copy(update={"max_timestep": None if high is None else 8999, "min_timestep": low * 10})
    steps = shifted_floor(u, shift, low * 10, 9999 if high is None else 8999, 10000)
    expected = ((steps.double() + 1) / 10000 + 0.001).clamp(0.001, 1.0).float()
    assert torch.equal(ddpm_draws(cascade, options), expected)


def test_a_ddpm_shift_never_draws_past_the_last_timestep():
    """A t just below N shifts to a value float32 rounds up to N itself, one past the schedule."""
    options = LossConfig(timestep_shift=1e6, timestep_distribution="uniform", min_timestep=999)
    assert ddpm_draws(ddpm(), options).max() == 999


@pytest.mark.parametrize("distribution", ["uniform", "logit_normal"])
def test_auto_and_1_leave_the_ddpm_draw_unchanged(distribution):
    """auto (and 1.0, OneTrainer's no-shift) draw the same timesteps as a config without the key, from the same
    generator calls as before the option existed."""
    unshifted = {"timestep_distribution": distribution, "min_timestep": 100, "max_timestep": 899}
    for objective in (ddpm(), ContinuousCosine(scale=1.08)):
        before = ddpm_draws(objective, LossConfig(**unshifted))
        for shift in ("auto", 1.0):
            assert torch.equal(ddpm_draws(objective, LossConfig(timestep_shift=shift, **unshifted)), before)
    expected = (torch.cat([torch.randint(100, 900, (1,), generator=torch.Generator().manual_seed(seed))
                           for seed in SEEDS]) if distribution == "uniform" else
                100 + (float32_units(distribution, LossConfig()) * 800).long())
    assert torch.equal(ddpm_draws(ddpm(), LossConfig(**unshifted)), expected)


@pytest.mark.parametrize("loss,message", [
    ({"timestep_shift": 0}, "loss.timestep_shift: 0.0 must be a finite number > 0"),
    ({"timestep_shift": float("inf")}, "loss.timestep_shift: inf must be a finite number > 0"),
    ({"timestep_shift": 2.0, "dynamic_timestep_shifting": True}, "loss.timestep_shift: 2.0 is a fixed shift")])
def test_shift_values_that_cannot_train_are_refused(loss, message):
    with pytest.raises(ConfigError, match=message):
        validate({**RAW, "model": {"family": "flux", "path": "m"}, "loss": loss})
