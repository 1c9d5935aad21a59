"""Timestep loss weighting (loss.weight_fn) and generalized offset noise equal OneTrainer's: values computed by
OneTrainer's own methods, tabulated here."""

from __future__ import annotations

import pytest
import torch

from ot_dist.config.load import validate
from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError
from ot_dist.models.objectives import DDPM, FlowMatching
from ot_dist.train.loss_options import generalized_offset_psi, offset_noise

# SD 1.x's scheduler (scaled_linear 0.00085 .. 0.012, 1000 steps) at these timesteps.
SD_SCHEDULER = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}
TIMESTEPS = [0, 10, 100, 250, 500, 750, 999]
# (weight_fn, weight_strength, prediction type, weights at TIMESTEPS), computed by ModelSetupDiffusionLossMixin's
# __min_snr_weight, __p2_loss_weight and __debiased_estimation_weight (modules/modelSetup/mixin/
# ModelSetupDiffusionLossMixin.py, Nerogar/OneTrainer 23df3832e8f213d64c337e39f9365ba46e99fed0), SNR from
# alphas_cumprod, in OneTrainer's float32.
ONETRAINER = [
    ('MIN_SNR_GAMMA', 5.0, 'epsilon', [0.004253725055605173, 0.048305679112672806, 0.5914454460144043, 1.0, 1.0, 1.0, 1.0]),
    ('P2', 1.0, 'epsilon', [0.0008500218973495066, 0.00956869125366211, 0.105776846408844, 0.32620769739151, 0.723667562007904, 0.9438301920890808, 0.9953398704528809]),
    ('P2', 5.0, 'epsilon', [4.4376241395110007e-16, 8.021631275889618e-11, 1.3241982742329128e-05, 0.003693780628964305, 0.19847027957439423, 0.7489784955978394, 0.9769155383110046]),
    ('DEBIASED_ESTIMATION', None, 'epsilon', [0.03162277862429619, 0.0982910767197609, 0.34393179416656494, 0.6957994699478149, 1.6182798147201538, 4.099165916442871, 14.614646911621094]),
    ('MIN_SNR_GAMMA', 5.0, 'v_prediction', [0.0042501091957092285, 0.04784345626831055, 0.52888423204422, 0.67379230260849, 0.27633246779441833, 0.05616980418562889, 0.00466009508818388]),
    ('P2', 1.0, 'v_prediction', [0.0008492999477311969, 0.009477999061346054, 0.09565839916467667, 0.24597027897834778, 0.4198417067527771, 0.48555177450180054, 0.49883222579956055]),
    ('P2', 5.0, 'v_prediction', [4.4188118024502787e-16, 7.648624789080571e-11, 8.009687007870525e-06, 0.0009003538289107382, 0.013044515624642372, 0.026988435536623, 0.03088676929473877]),
    ('DEBIASED_ESTIMATION', None, 'v_prediction', [0.03160697594285011, 0.09781968593597412, 0.325233519077301, 0.5711459517478943, 0.8506865501403809, 0.9715092182159424, 0.9976671934127808]),
]
# psi_t of generalized offset noise at TIMESTEPS: ModelSetupNoiseMixin._compute_and_cache_offset_noise_psi_schedule
# (modules/modelSetup/mixin/ModelSetupNoiseMixin.py, same commit) on the same betas.
ONETRAINER_PSI = {0: 0.00013629762495611237, 10: 0.00046132970483907856, 100: 0.0016988619708886161, 250: 0.0039594070566477185, 500: 0.014379597585058976, 750: 0.08078916724157027, 999: 0.9999999999999993}


@pytest.mark.parametrize("name,strength,prediction_type,expected", ONETRAINER)
def test_ddpm_weights_are_onetrainers(name, strength, prediction_type, expected):
    objective = DDPM(SD_SCHEDULER, prediction_type)
    options = LossConfig(weight_fn=name, weight_strength=strength)
    weights = objective.sample_weights(torch.tensor(TIMESTEPS), options)
    assert weights.tolist() == pytest.approx(expected, rel=1e-5)


def test_min_snr_gamma_is_weight_fn_min_snr_gamma():
    objective, t = DDPM(SD_SCHEDULER, "epsilon"), torch.tensor(TIMESTEPS)
    assert torch.equal(objective.sample_weights(t, LossConfig(min_snr_gamma=5.0)),
                       objective.sample_weights(t, LossConfig(weight_fn="MIN_SNR_GAMMA")))  # default strength 5
    assert objective.sample_weights(t, LossConfig()) is None  # CONSTANT: the loss stays F.mse_loss


def test_sigma_weight_is_the_flow_noise_level():
    objective = FlowMatching(num_timesteps=1000)
    timesteps = torch.tensor([1.0, 250.0, 999.0])
    weights = objective.sample_weights(timesteps, LossConfig(weight_fn="SIGMA"))
    assert weights.tolist() == pytest.approx([0.001, 0.25, 0.999])
    assert objective.sample_weights(timesteps, LossConfig()) is None


def test_generalized_offset_noise_psi_is_onetrainers():
    betas = DDPM(SD_SCHEDULER).scheduler.betas
    psi = generalized_offset_psi(betas)
    assert {t: float(psi[t]) for t in TIMESTEPS} == pytest.approx(ONETRAINER_PSI, rel=1e-9)
    objective = DDPM(SD_SCHEDULER)
    options = LossConfig(offset_noise_weight=0.1, generalized_offset_noise=True)
    t = torch.tensor([10, 999])
    assert objective.offset_noise_psi(t, options).tolist() == pytest.approx([ONETRAINER_PSI[10], ONETRAINER_PSI[999]])
    # the offset is scaled per sample by psi_t: at t = 999 (psi 1) it is the plain offset noise
    noise = torch.zeros(2, 4, 2, 2)
    plain = offset_noise(noise, [3, 4], 0.1, seed=0, epoch=0)
    scaled = offset_noise(noise, [3, 4], 0.1, seed=0, epoch=0, psi=objective.offset_noise_psi(t, options))
    torch.testing.assert_close(scaled[1], plain[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(scaled[0], plain[0] * ONETRAINER_PSI[10], rtol=1e-5, atol=0)


@pytest.mark.parametrize("family,loss,expected", [
    ("sd1", {"weight_fn": "SIGMA"}, "loss.weight_fn: SIGMA weights by the flow-matching noise level"),
    ("flux", {"weight_fn": "P2"}, "loss.weight_fn: P2 is defined for DDPM objectives"),
    ("flux", {"offset_noise_weight": 0.1, "generalized_offset_noise": True}, "loss.generalized_offset_noise: needs DDPM"),
    ("sd1", {"generalized_offset_noise": True}, "set loss.offset_noise_weight > 0"),
    ("sd1", {"weight_fn": "DEBIASED_ESTIMATION", "weight_strength": 2}, "loss.weight_strength: weight_fn DEBIASED"),
    ("sd1", {"weight_fn": "P2", "min_snr_gamma": 5}, "loss.min_snr_gamma: is weight_fn MIN_SNR_GAMMA"),
])
def test_bad_weighting_names_the_key(family, loss, expected):
    with pytest.raises(ConfigError) as err:
        validate({"model": {"family": family, "path": "m"}, "method": "lora", "output_dir": "o",
                  "data": {"path": "d"}, "loss": loss})
    assert expected in str(err.value)


# A zero-terminal-SNR schedule (diffusers' rescale_betas_zero_snr, SD 2.x v-prediction finetunes): SNR 0 at t = 999.
ZERO_TERMINAL_SNR = {**SD_SCHEDULER, "rescale_betas_zero_snr": True}


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_on_a_zero_terminal_snr_schedule_is_finite_and_diffusers_elsewhere(prediction_type):
    """min(SNR, gamma) / SNR (epsilon) or / (SNR + 1) (v) with SNR from diffusers' compute_snr, as
    train_text_to_image.py weights; at SNR 0 the epsilon quotient is 0 / 0 there, and its limit 1 here (every SNR
    below gamma weighs 1), so the run's loss stays finite when t = 999 is drawn."""
    from diffusers.training_utils import compute_snr

    objective = DDPM(ZERO_TERMINAL_SNR, prediction_type)
    t = torch.tensor([0, 10, 500, 990, 998, 999])
    snr = compute_snr(objective.scheduler, t)
    clipped = torch.minimum(snr, torch.full_like(snr, 3.0))
    expected = clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr
    assert snr[-1] == 0
    weights = objective.sample_weights(t, LossConfig(min_snr_gamma=3.0))
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights[:-1], expected[:-1], rtol=1e-5, atol=0)
    assert weights[-1].item() == (0.0 if prediction_type == "v_prediction" else 1.0)


def test_zero_terminal_snr_refuses_what_it_cannot_compute_by_name():
    """Generalized offset noise's psi_t needs alpha_T > 0 (Algorithm 1 divides by it): refused, where it came out
    0 at every timestep but NaN at the last. DEBIASED_ESTIMATION's 1 / sqrt(SNR) is infinite there for epsilon."""
    epsilon, v = DDPM(ZERO_TERMINAL_SNR, "epsilon"), DDPM(ZERO_TERMINAL_SNR, "v_prediction")
    t = torch.tensor([10, 999])
    with pytest.raises(ConfigError, match="loss.generalized_offset_noise: this model's noise schedule has zero"):
        v.offset_noise_psi(t, LossConfig(offset_noise_weight=0.1, generalized_offset_noise=True))
    with pytest.raises(ConfigError, match="loss.weight_fn: DEBIASED_ESTIMATION .* timestep 999 is never drawn .998"):
        epsilon.sample_weights(t, LossConfig(weight_fn="DEBIASED_ESTIMATION"))
    # The way out the message gives works: with the last timestep out of reach the weights are finite ...
    kept_away = LossConfig(weight_fn="DEBIASED_ESTIMATION", max_timestep=998)
    assert torch.isfinite(epsilon.sample_weights(torch.tensor([10, 998]), kept_away)).all()
    # ... but a timestep_shift moves the bound back onto it (998 + 1 shifted by 2 is past 999), so it is refused again
    with pytest.raises(ConfigError, match="DEBIASED_ESTIMATION"):
        epsilon.sample_weights(t, kept_away.model_copy(update={"timestep_shift": 2.0}))
    assert torch.isfinite(epsilon.sample_weights(
        torch.tensor([10, 990]), LossConfig(weight_fn="DEBIASED_ESTIMATION", max_timestep=600, timestep_shift=2.0))).all()
    assert torch.isfinite(v.sample_weights(t, LossConfig(weight_fn="DEBIASED_ESTIMATION"))).all()
    assert v.offset_noise_psi(t, LossConfig(offset_noise_weight=0.1)) is None  # plain offset noise stays


def test_a_prediction_type_ot_dist_does_not_train_is_refused_by_name():
    """A scheduler config saying `sample` (x0 prediction) trained the epsilon target before."""
    with pytest.raises(ConfigError, match="model.prediction_type: the model's scheduler config says 'sample'"):
        DDPM({**SD_SCHEDULER, "prediction_type": "sample"})
    assert DDPM({**SD_SCHEDULER, "prediction_type": "sample"}, "v_prediction").prediction_type == "v_prediction"


# OneTrainer's LossScaler.get_scale(batch_size=2, accumulation_steps=5) with multi_gpu_util.world_size() = 3, run from
# its modules/util/enum/LossScaler.py in a scratch folder (OneTrainer 23df383): its batch_size is the per-process one.
ONETRAINER_LOSS_SCALES = {"NONE": 1, "BATCH": 2, "GLOBAL_BATCH": 6, "GRADIENT_ACCUMULATION": 5, "BOTH": 10,
                          "GLOBAL_BOTH": 30}


def test_loss_scaler_factors_are_onetrainers():
    from ot_dist.early_checks import setup_warnings

    assert {name: LossConfig(scaler=name).scale(batch_size=2, accumulation=5, processes=3)
            for name in ONETRAINER_LOSS_SCALES} == ONETRAINER_LOSS_SCALES
    # the per-process ones train another step when the same global batch is split otherwise: said at the start
    config = validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                       "data": {"path": "d"}, "loss": {"scaler": "BOTH"}})
    assert any(line.startswith("loss.scaler: BOTH") for line in setup_warnings(config, 2))
    assert not any(line.startswith("loss.scaler") for line in setup_warnings(config, 1))
