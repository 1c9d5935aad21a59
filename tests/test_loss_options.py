"""The `loss` options, each against its formula on a hand-computed case, and the guarantee that with
every option off the objective is the unmodified one, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ot_dist.config.loss import LossConfig, MaskedTrainingConfig
from ot_dist.config.schema import ModelConfig
from ot_dist.errors import ConfigError
from ot_dist.models.loading import load_model
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss, draw_sample_noise, encode_latents
from ot_dist.models.objectives import DDPM

DDPM_1000 = DDPM({"num_train_timesteps": 1000})
from ot_dist.train.loss_options import timestep_bounds

SEED, EPOCH = 4, 1
SHAPE = torch.Size((4, 8, 8))  # tiny VAE: 4 channels, factor 8 on 64 px


@pytest.fixture(scope="module")
def models(tiny_models):
    return {family: load_model(ModelConfig(family=family, path=str(tiny_models[family]))) for family in ("sd1", "sd2")}


def make_batch(model, ids=(3, 8, 11), with_mask=False):
    g = torch.Generator().manual_seed(0)
    batch = {"pixels": torch.rand(len(ids), 3, 64, 64, generator=g) * 2 - 1, "sample_id": torch.tensor(ids),
             "token_ids": model.family.tokenize(model.tokenizers, [f"caption {i}" for i in ids])}
    if with_mask:
        batch["mask"] = (torch.rand(len(ids), 1, 64, 64, generator=g) > 0.5).float()
    return batch


class ZeroUNet:
    """Replaces the UNet's forward: predicts zeros (the loss is then the mean square of the target)
    and records the noisy input it was given."""

    def __init__(self, model):
        self.model, self.inputs = model, []

    def __enter__(self):
        self.original = self.model.denoiser.forward

        def forward(sample, *args, **kwargs):
            self.inputs.append(sample.detach().clone())
            return (torch.zeros_like(sample),)
        self.model.denoiser.forward = forward
        return self

    def __exit__(self, *exc):
        self.model.denoiser.forward = self.original


def unmodified_loss(model, batch, seed, epoch):
    """The objective as it was before the options existed (a copy of that code)."""
    scheduler = model.objective.scheduler
    vae_eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        vae_eps.append(torch.randn(SHAPE, generator=g))
        noise.append(torch.randn(SHAPE, generator=g))
        timesteps.append(torch.randint(0, scheduler.config.num_train_timesteps, (1,), generator=g))
    vae_eps, noise, timesteps = torch.stack(vae_eps), torch.stack(noise), torch.cat(timesteps)
    latents = encode_latents(model.family, model.vae, batch, vae_eps)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = scheduler.get_velocity(latents, noise, timesteps) if model.objective.prediction_type == "v_prediction" else noise
    text = model.family.encode_text(model.text_encoders, batch["token_ids"])
    prediction = model.denoiser(noisy, timesteps, **model.family.unet_inputs(text, batch), return_dict=False)[0]
    return F.mse_loss(prediction.float(), target.float())


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_every_option_off_is_the_unmodified_objective_bit_for_bit(models, family):
    model = models[family]
    batch = make_batch(model, with_mask=True)  # masks in the batch do nothing while masked training is off
    with torch.no_grad():
        before = unmodified_loss(model, batch, SEED, EPOCH)
        now = diffusion_loss(model, batch, SEED, EPOCH, LossConfig(), MaskedTrainingConfig())
        default = diffusion_loss(model, batch, SEED, EPOCH)
    assert torch.equal(before, now) and torch.equal(before, default)
    # An explicit full range is the default range, draw for draw.
    full = LossConfig(min_timestep=0, max_timestep=999)
    assert torch.equal(draw_sample_noise(batch, SHAPE, DDPM_1000, SEED, EPOCH, full)[2],
                       draw_sample_noise(batch, SHAPE, DDPM_1000, SEED, EPOCH)[2])


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_min_snr_gamma_weights_each_sample_by_its_timestep(models, family):
    model = models[family]
    batch = make_batch(model)
    timesteps = draw_sample_noise(batch, SHAPE, DDPM_1000, SEED, EPOCH)[2]
    alpha_bar = model.objective.scheduler.alphas_cumprod[timesteps].double()
    snr = alpha_bar / (1 - alpha_bar)
    gamma = float(snr.median())  # clips one sample, not another: the case can tell the weights apart
    with torch.no_grad():
        weighted = diffusion_loss(model, batch, SEED, EPOCH, LossConfig(min_snr_gamma=gamma))
        alone = torch.stack([diffusion_loss(model, {**batch, "sample_id": batch["sample_id"][i:i + 1],
                                                    "pixels": batch["pixels"][i:i + 1],
                                                    "token_ids": {k: v[i:i + 1] for k, v in batch["token_ids"].items()}},
                                            SEED, EPOCH) for i in range(3)])
    if family == "sd2":  # v-prediction
        assert model.objective.prediction_type == "v_prediction"
        expected_weights = torch.minimum(snr, torch.full_like(snr, gamma)) / (snr + 1)
    else:
        assert model.objective.prediction_type == "epsilon"
        expected_weights = torch.minimum(snr, torch.full_like(snr, gamma)) / snr
    assert expected_weights.max() / expected_weights.min() > 1.1  # not one common factor
    torch.testing.assert_close(weighted, (alone * expected_weights.float()).mean(), rtol=1e-5, atol=0)


def test_timestep_range_and_logit_normal_distribution():
    batch = {"sample_id": torch.arange(3000)}
    shape = torch.Size((1, 1, 1))
    ranged = draw_sample_noise(batch, shape, DDPM_1000, SEED, EPOCH, LossConfig(min_timestep=200, max_timestep=299))[2]
    assert ranged.min() == 200 and ranged.max() == 299  # inclusive at both ends, nothing outside
    uniform = draw_sample_noise(batch, shape, DDPM_1000, SEED, EPOCH, LossConfig())[2].float()
    logit = draw_sample_noise(batch, shape, DDPM_1000, SEED, EPOCH, LossConfig(timestep_distribution="logit_normal"))[2]
    middle = lambda t: ((t >= 333) & (t < 666)).float().mean().item()  # noqa: E731
    assert 0.30 < middle(uniform) < 0.37
    assert middle(logit.float()) > 0.45  # sigmoid(N(0, 1)) in the middle third: P(|z| < 0.69) = 0.51
    assert logit.min() >= 0 and logit.max() <= 999
    shifted = draw_sample_noise(batch, shape, DDPM_1000, SEED, EPOCH,
                                LossConfig(timestep_distribution="logit_normal", logit_normal_mean=1.5))[2]
    assert shifted.float().mean() > logit.float().mean() + 150
    narrow = draw_sample_noise(batch, shape, DDPM_1000, SEED, EPOCH, LossConfig(timestep_distribution="logit_normal",
                                                                          min_timestep=100, max_timestep=199))[2]
    assert narrow.min() >= 100 and narrow.max() <= 199
    # Per sample: the same draw alone or in another batch.
    alone = draw_sample_noise({"sample_id": torch.tensor([1234])}, shape, DDPM_1000, SEED, EPOCH,
                              LossConfig(timestep_distribution="logit_normal"))[2]
    assert alone.item() == logit[1234].item()
    with pytest.raises(ConfigError, match="loss.max_timestep: 1000 is past"):
        timestep_bounds(LossConfig(max_timestep=1000), 1000)


def test_offset_noise_shifts_each_channel_of_the_noise_and_the_target(models):
    model = models["sd1"]
    batch = make_batch(model)
    weight = 0.3
    with torch.no_grad(), ZeroUNet(model) as unet:
        loss = diffusion_loss(model, batch, SEED, EPOCH, LossConfig(offset_noise_weight=weight))
    vae_eps, noise, timesteps = draw_sample_noise(batch, SHAPE, DDPM_1000, SEED, EPOCH)
    offsets = torch.stack([torch.randn(4, 1, 1, generator=generator(SEED, EPOCH, i, "offset_noise")) for i in (3, 8, 11)])
    target = noise + weight * offsets
    torch.testing.assert_close(loss, target.pow(2).mean(), rtol=1e-6, atol=0)
    latents = encode_latents(model.family, model.vae, batch, vae_eps)
    torch.testing.assert_close(unet.inputs[0], model.objective.scheduler.add_noise(latents, target, timesteps))
    shift = (target - noise).mean(dim=(2, 3))  # per sample and channel: weight x its own N(0,1) value
    assert shift.std() > 0.1 and torch.allclose(shift, weight * offsets[..., 0, 0])


def test_input_perturbation_changes_the_unet_input_not_the_target(models):
    model = models["sd1"]
    batch = make_batch(model)
    gamma = 0.1
    with torch.no_grad(), ZeroUNet(model) as unet:
        plain = diffusion_loss(model, batch, SEED, EPOCH)
        perturbed = diffusion_loss(model, batch, SEED, EPOCH, LossConfig(input_perturbation=gamma))
    assert torch.equal(plain, perturbed)  # a zero prediction: the loss is the target's, which did not change
    vae_eps, noise, timesteps = draw_sample_noise(batch, SHAPE, DDPM_1000, SEED, EPOCH)
    extra = torch.stack([torch.randn(SHAPE, generator=generator(SEED, EPOCH, i, "input_perturbation")) for i in (3, 8, 11)])
    latents = encode_latents(model.family, model.vae, batch, vae_eps)
    scheduler = model.objective.scheduler
    torch.testing.assert_close(unet.inputs[0], scheduler.add_noise(latents, noise, timesteps))
    torch.testing.assert_close(unet.inputs[1], scheduler.add_noise(latents, noise + gamma * extra, timesteps))
    assert not torch.allclose(unet.inputs[0], unet.inputs[1])


def test_config_errors_name_the_key():
    from ot_dist.config.load import validate

    raw = {"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o", "data": {"path": "d"}}
    with pytest.raises(ConfigError, match=r"loss.max_timestep \(100\) is below loss.min_timestep \(200\)"):
        validate({**raw, "loss": {"min_timestep": 200, "max_timestep": 100}})
    with pytest.raises(ConfigError, match="masked_training.unmasked_probability"):
        validate({**raw, "masked_training": {"enabled": True, "unmasked_probability": 1.5}})
    with pytest.raises(ConfigError, match="loss.min_snr"):
        validate({**raw, "loss": {"min_snr": 5}})  # a typo is an error, not a silent default


def test_concept_loss_weight_weights_each_sample(models):
    """Per-concept loss_weight (issue 18): the batch loss is the mean of each sample's loss times its concept's
    weight, checked against each sample's loss computed alone (its noise and timestep are its own)."""
    model = models["sd1"]
    batch = make_batch(model)
    weights = torch.tensor([1.0, 3.0, 0.5])
    alone = []
    with torch.no_grad():
        for i in range(3):
            single = {k: (v[i:i + 1] if torch.is_tensor(v) else v) for k, v in batch.items() if k != "token_ids"}
            single["token_ids"] = {k: v[i:i + 1] for k, v in batch["token_ids"].items()}
            alone.append(diffusion_loss(model, single, SEED, EPOCH))
        weighted = diffusion_loss(model, {**batch, "loss_weight": weights}, SEED, EPOCH)
        plain = diffusion_loss(model, batch, SEED, EPOCH)
    assert plain.item() == pytest.approx(torch.stack(alone).mean().item(), rel=1e-5)
    assert weighted.item() == pytest.approx((weights * torch.stack(alone)).mean().item(), rel=1e-5)
    assert weighted.item() != pytest.approx(plain.item(), rel=1e-3)


def test_pseudo_huber_composes_with_masks_and_min_snr_in_the_objective(models):
    """diffusion_loss with kohya's scheduled pseudo-Huber, masked training (normalized) and min-SNR-gamma: each
    sample's mean of mask x 2 c_t (sqrt(d^2 + c_t^2) - c_t), divided by its mask's mean, times min(SNR, gamma) / SNR,
    with c_t = 0.9 / (1 + sqrt((1 - alpha-bar_t) / alpha-bar_t))^2 + 0.1 (epsilon: the target is the noise)."""
    from ot_dist.train.masking import mask_weights

    model = models["sd1"]
    batch = make_batch(model, with_mask=True)
    options = LossConfig(mse_strength=0, pseudo_huber_strength=1, min_snr_gamma=2.0)
    masking = MaskedTrainingConfig(enabled=True, unmasked_probability=0, unmasked_weight=0.1,
                                   normalize_masked_area_loss=True)
    with torch.no_grad(), ZeroUNet(model):
        loss = diffusion_loss(model, batch, SEED, EPOCH, options, masking)
        doubled = diffusion_loss(model, batch, SEED, EPOCH, LossConfig(mse_strength=2.0))
        plain = diffusion_loss(model, batch, SEED, EPOCH)
    _, noise, timesteps = draw_sample_noise(batch, SHAPE, model.objective, SEED, EPOCH, options)
    alpha_bar = model.objective.scheduler.alphas_cumprod[timesteps]
    c = (0.9 / (1 + ((1 - alpha_bar) / alpha_bar).sqrt()) ** 2 + 0.1).view(-1, 1, 1, 1)
    weights = mask_weights(batch, SHAPE[-2:], masking, SEED, EPOCH)
    assert 0.1 < float(weights.mean()) < 1  # the masks weigh
    per_sample = (weights * 2 * c * (torch.sqrt(noise ** 2 + c ** 2) - c)).mean(dim=(1, 2, 3)) / weights.mean(dim=(1, 2, 3))
    snr = alpha_bar.double() / (1 - alpha_bar.double())
    expected = (per_sample * (snr.clamp(max=2.0) / snr).float()).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(doubled, 2 * plain, rtol=1e-6, atol=0)  # a strength weighs the squared error too
