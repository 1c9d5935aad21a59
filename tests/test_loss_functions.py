"""The loss.*_strength loss functions against their formulas and against values computed by OneTrainer's
ModelSetupDiffusionLossMixin and kohya's conditional_loss / get_huber_threshold_if_needed (run on these inputs,
recorded here), the pseudo-Huber threshold schedules at several timesteps, and their composition with masks,
prior preservation and sample weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ot_dist.config.load import validate
from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError
from ot_dist.models.objectives import DDPM, ContinuousCosine, FlowMatching, cosine_alpha_cumprod
from ot_dist.train.loss import weighted_loss, weighted_mse
from ot_dist.train.loss_functions import elementwise_loss, pseudo_huber

SD_SCHEDULER = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}
PREDICTION = torch.tensor([[[[0.0, 0.5, -2.0, 3.0]]]])
TARGET = torch.zeros_like(PREDICTION)


def per_element(**options) -> list[float]:
    return elementwise_loss(PREDICTION, TARGET, LossConfig(**options)).flatten().tolist()


def test_onetrainers_loss_functions():
    d = PREDICTION.flatten()
    assert per_element() == (d ** 2).tolist()
    assert per_element(mse_strength=0, mae_strength=1) == d.abs().tolist()
    # OneTrainer's __log_cosh_loss on these values; log(cosh(d)) itself
    assert per_element(mse_strength=0, log_cosh_strength=1) == pytest.approx(
        [0.0, 0.12011450529098511, 1.325002670288086, 2.309328556060791], abs=1e-7)
    assert per_element(mse_strength=0, log_cosh_strength=1) == pytest.approx(torch.log(torch.cosh(d)).tolist(), abs=1e-6)
    # log-cosh does not overflow where cosh does
    assert elementwise_loss(torch.tensor([100.0]), torch.tensor([0.0]), LossConfig(mse_strength=0, log_cosh_strength=1)
                            ).item() == pytest.approx(100 - math.log(2))
    # Huber: d^2 / 2 inside delta, delta (|d| - delta / 2) beyond; torch's huber_loss = delta x smooth_l1_loss(beta delta)
    huber = per_element(mse_strength=0, huber_strength=1, huber_delta=0.5)
    assert huber == [0.0, 0.125, 0.5 * (2 - 0.25), 0.5 * (3 - 0.25)]
    assert huber == pytest.approx((0.5 * F.smooth_l1_loss(PREDICTION, TARGET, reduction="none", beta=0.5)).flatten().tolist())
    # OneTrainer's unmasked per-sample losses: huber_strength 1 (delta 1), huber_strength 2 with delta 0.5, and the sum
    # mse 0.5 + mae 0.25 + log_cosh 1 + huber 0.5 (delta 0.5)
    assert sum(per_element(mse_strength=0, huber_strength=1)) / 4 == pytest.approx(1.03125)
    assert sum(per_element(mse_strength=0, huber_strength=2, huber_delta=0.5)) / 4 == pytest.approx(1.1875)
    assert sum(per_element(mse_strength=0.5, mae_strength=0.25, log_cosh_strength=1, huber_strength=0.5,
                           huber_delta=0.5)) / 4 == pytest.approx(3.2354865074157715, rel=1e-6)


def test_kohyas_pseudo_huber_and_smooth_l1():
    c = torch.tensor([0.3])
    d = PREDICTION.flatten()
    huber = pseudo_huber(PREDICTION, c, "huber").flatten()
    smooth = pseudo_huber(PREDICTION, c, "smooth_l1").flatten()
    # kohya's conditional_loss on the same values
    assert huber.tolist() == pytest.approx([0.0, 0.16985711455345154, 1.033424973487854, 1.628977656364441], rel=1e-6)
    assert smooth.tolist() == pytest.approx([0.0, 0.5661903619766235, 3.4447498321533203, 5.429925441741943], rel=1e-6)
    # the documented 2 c (sqrt(d^2 + c^2) - c); smooth_l1 is that divided by c
    torch.testing.assert_close(huber, 2 * 0.3 * (torch.sqrt(d ** 2 + 0.09) - 0.3))
    torch.testing.assert_close(smooth, huber / 0.3)
    # about d^2 for small d, 2 c |d| for large (float64: float32 cancels in sqrt(d^2 + c^2) - c at d = 1e-3)
    assert pseudo_huber(torch.tensor([1e-3], dtype=torch.float64), c, "huber").item() == pytest.approx(1e-6, rel=1e-4)
    assert pseudo_huber(torch.tensor([1e3], dtype=torch.float64), c, "huber").item() == pytest.approx(600, rel=1e-3)
    # per sample: each row of a batch takes its own threshold
    batch = PREDICTION.expand(2, 1, 1, 4)
    rows = elementwise_loss(batch, torch.zeros_like(batch), LossConfig(mse_strength=0, pseudo_huber_strength=1),
                            torch.tensor([0.3, 1.0]))
    torch.testing.assert_close(rows[0].flatten(), huber)
    torch.testing.assert_close(rows[1].flatten(), pseudo_huber(PREDICTION, torch.tensor([1.0]), "huber").flatten())


def pseudo(schedule, **options):
    return LossConfig(mse_strength=0, pseudo_huber_strength=1, pseudo_huber_schedule=schedule, **options)


def test_threshold_schedules_are_kohyas():
    """kohya's get_huber_threshold_if_needed with huber_c 0.1, huber_scale 2 on SD's scheduler at t = 0, 250, 500,
    999, and on its flow scheduler (num_train_timesteps 1000) at sigma 0, 0.25, 0.5, 1 (timesteps sigma x 1000)."""
    ddpm, t = DDPM(SD_SCHEDULER), torch.tensor([0, 250, 500, 999])
    assert ddpm.pseudo_huber_thresholds(t, pseudo("constant", pseudo_huber_c=0.1, pseudo_huber_scale=2)).tolist() == \
        pytest.approx([0.2] * 4)
    assert ddpm.pseudo_huber_thresholds(t, pseudo("exponential", pseudo_huber_c=0.1, pseudo_huber_scale=2)).tolist() == \
        pytest.approx([2.0, 1.1246826648712158, 0.6324555277824402, 0.20046105980873108], rel=1e-6)
    assert ddpm.pseudo_huber_thresholds(t, pseudo("snr", pseudo_huber_c=0.1)).tolist() == \
        pytest.approx([0.9497092366218567, 0.4129633903503418, 0.23128357529640198, 0.10369129478931427], rel=1e-6)
    assert ddpm.pseudo_huber_thresholds(t, pseudo(None)).tolist() == \
        ddpm.pseudo_huber_thresholds(t, pseudo("snr", pseudo_huber_c=0.1)).tolist()  # kohya's defaults
    assert ddpm.pseudo_huber_thresholds(t, LossConfig()) is None  # off: nothing computed
    # exponential is S C^(t / N): S at t = 0, C S at t = N
    flow = FlowMatching(shift=3.0)
    sigmas = torch.tensor([0.0, 0.25, 0.5, 1.0])
    thresholds = flow.pseudo_huber_thresholds(sigmas * 1000, pseudo("exponential", pseudo_huber_c=0.1, pseudo_huber_scale=2))
    assert thresholds.tolist() == pytest.approx([2.0, 1.1246826648712158, 0.6324555277824402, 0.2], rel=1e-6)
    torch.testing.assert_close(thresholds, 2 * 0.1 ** sigmas)
    # Würstchen's continuous t in (0, 1] is its own share of the schedule; its alpha-bar is the cosine one
    cosine, times = ContinuousCosine(), torch.tensor([0.1, 0.5, 1.0])
    torch.testing.assert_close(cosine.pseudo_huber_thresholds(times, pseudo("exponential", pseudo_huber_c=0.1)),
                               0.1 ** times)
    alpha_bar = cosine_alpha_cumprod(times)
    torch.testing.assert_close(cosine.pseudo_huber_thresholds(times, pseudo("snr")),
                               (0.9 / (1 + ((1 - alpha_bar) / alpha_bar).sqrt()) ** 2 + 0.1).float())


def test_masks_prior_and_sample_weights_compose_with_any_loss_function():
    """OneTrainer's masked_losses_with_prior with huber_strength 1, huber_delta 0.5, the mask [1, 0, 1, 0.5] clamped
    at unmasked_weight 0.1, normalize_masked_area_loss and masked_prior_preservation_weight 0.5 (prior 0.25)."""
    options = LossConfig(mse_strength=0, huber_strength=1, huber_delta=0.5)
    weights = torch.tensor([[[[1.0, 0.1, 1.0, 0.5]]]])
    prior = torch.full_like(PREDICTION, 0.25)

    def huber(p, t):
        return elementwise_loss(p, t, options)
    loss = weighted_loss(PREDICTION, TARGET, weights, normalize=True, prior=prior, prior_weight=0.5, element_loss=huber)
    assert loss.item() == pytest.approx(0.8390281200408936, rel=1e-6)
    # sample weights (min-SNR, concept loss weights) multiply each sample's mean, as for the squared error
    batch, target = torch.cat([PREDICTION, 2 * PREDICTION]), torch.zeros(2, 1, 1, 4)
    per_sample = huber(batch, target).mean(dim=(1, 2, 3))
    sample_weights = torch.tensor([0.5, 3.0])
    assert weighted_loss(batch, target, sample_weights=sample_weights, element_loss=huber).item() == \
        pytest.approx((per_sample * sample_weights).mean().item())
    # the default is the squared error, weighted_mse's
    assert weighted_loss(batch, target, weights.expand(2, 1, 1, 4)).item() == \
        weighted_mse(batch, target, weights.expand(2, 1, 1, 4)).item()


def check(loss: dict, family: str = "sd1") -> None:
    validate({"model": {"family": family, "path": "m"}, "method": "lora", "output_dir": "o", "data": {"path": "d"},
              "loss": loss})


@pytest.mark.parametrize("family,loss,expected", [
    ("sd1", {"mse_strength": 0}, "are all 0: nothing would train"),
    ("sd1", {"huber_delta": 0.5}, "loss.huber_delta: shapes the loss that loss.huber_strength weighs"),
    ("sd1", {"pseudo_huber_c": 0.2}, "loss.pseudo_huber_c: shapes the loss that loss.pseudo_huber_strength weighs"),
    ("sd1", {"pseudo_huber_strength": 1, "pseudo_huber_scale": 2}, "loss.pseudo_huber_scale: the snr schedule"),
    ("flux", {"pseudo_huber_strength": 1}, "loss.pseudo_huber_schedule: snr (the default) reads the DDPM"),
    ("sd1", {"pseudo_huber_strength": 1, "pseudo_huber_c": 0}, "greater than 0"),
])
def test_bad_loss_functions_name_the_key(family, loss, expected):
    with pytest.raises(ConfigError) as err:
        check(loss, family)
    assert expected in str(err.value)


def test_flow_families_take_the_exponential_and_constant_schedules():
    check({"mse_strength": 0, "pseudo_huber_strength": 1, "pseudo_huber_schedule": "exponential"}, "flux")
    check({"pseudo_huber_strength": 0.5, "pseudo_huber_schedule": "constant", "pseudo_huber_scale": 2}, "sd3")
