"""loss.timestep_shift / loss.dynamic_timestep_shifting (OneTrainer's timestep_shift / dynamic_timestep_shifting):
an explicit shift k draws sigma = k u / (1 + (k - 1) u) from the uniform-scale draw u, the dynamic one diffusers'
FlowMatchEulerDiscreteScheduler time_shift with calculate_shift's mu; auto keeps the family scheduler's shift."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from ot_dist.config.load import validate
from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError
from ot_dist.models.objectives import FlowMatching

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


@pytest.mark.parametrize("loss,key", [({"timestep_shift": 2.0}, "loss.timestep_shift"),
                                      ({"dynamic_timestep_shifting": False}, "loss.dynamic_timestep_shifting")])
def test_a_ddpm_family_refuses_the_shift_by_name(loss, key):
    with pytest.raises(ConfigError, match=f"{key}: shifts flow-matching timesteps; sd1 is not"):
        validate({**RAW, "model": {"family": "sd1", "path": "m"}, "loss": loss})
    assert validate({**RAW, "model": {"family": "sd3", "path": "m"}, "loss": loss}).loss == LossConfig(**loss)


@pytest.mark.parametrize("loss,message", [
    ({"timestep_shift": 0}, "loss.timestep_shift: 0.0 must be a finite number > 0"),
    ({"timestep_shift": float("inf")}, "loss.timestep_shift: inf must be a finite number > 0"),
    ({"timestep_shift": 2.0, "dynamic_timestep_shifting": True}, "loss.timestep_shift: 2.0 is a fixed shift")])
def test_shift_values_that_cannot_train_are_refused(loss, message):
    with pytest.raises(ConfigError, match=message):
        validate({**RAW, "model": {"family": "flux", "path": "m"}, "loss": loss})
