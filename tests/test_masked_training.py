"""Masked training: the weighted loss against a hand computation, normalisation, the per-sample
unmasked draws, zero error signal outside the mask, real runs from a concept folder with masks
(images and cached latents alike, 2 fsdp ranks like 1 process) and the missing-mask error."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config
from PIL import Image
from test_strategies import assert_matches, exported_weights, exported_weights_of_base, write_config

from ot_dist.config.load import validate
from ot_dist.config.loss import MaskedTrainingConfig
from ot_dist.config.schema import ModelConfig
from ot_dist.errors import InputFileError
from ot_dist.models.loading import load_model
from ot_dist.train.loss import diffusion_loss, weighted_mse
from ot_dist.train.masking import mask_weights, trains_unmasked
from ot_dist.train.trainer import Trainer

# Sample 0: a 4x4 mask whose 2x2 blocks (the latent elements at factor 2) are 1, 0, 1/4 and 0 white.
MASK_0 = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


def hand_batch():
    mask = torch.tensor([MASK_0, [[0] * 4] * 4], dtype=torch.float32)[:, None]  # sample 1: all black
    target = torch.empty(2, 2, 2, 2)
    target[0, 0], target[0, 1], target[1] = 1.0, 3.0, 2.0  # squared errors 1 and 9 (sample 0), 4 (sample 1)
    return {"mask": mask, "sample_id": torch.tensor([0, 1])}, torch.zeros_like(target), target


def test_masked_loss_is_the_hand_computation():
    batch, prediction, target = hand_batch()
    options = MaskedTrainingConfig(enabled=True, unmasked_probability=0, unmasked_weight=0.2)
    weights = mask_weights(batch, (2, 2), options, seed=0, epoch=0)
    # area scaling: 1, 0, 1/4, 0; weight = the mask clamped to [0.2, 1], as OneTrainer's masked_losses
    # (modules/util/loss/masked_loss.py: torch.clamp(mask, unmasked_weight, 1)); the soft 1/4 stays 1/4
    torch.testing.assert_close(weights[0, 0], torch.tensor([[1.0, 0.2], [0.25, 0.2]]))
    torch.testing.assert_close(weights[1, 0], torch.full((2, 2), 0.2))
    # sample 0: mean over channels and positions of weight x error = (1 + 9) / 2 x mean(1, .2, .25, .2) = 5 x 0.4125
    # sample 1: 4 x 0.2; the batch: their mean
    loss = weighted_mse(prediction, target, weights)
    torch.testing.assert_close(loss, torch.tensor((5 * 0.4125 + 4 * 0.2) / 2))
    # normalize_masked_area_loss: each sample divided by the mean of its weights (0.4125 and 0.2)
    normalized = weighted_mse(prediction, target, weights, normalize=True)
    torch.testing.assert_close(normalized, torch.tensor((5.0 + 4.0) / 2))
    # with unmasked_weight 0 a black sample contributes nothing (and normalisation cannot divide by 0 then
    # only if it has some white): sample 0 alone is 5 x mean(1, 0, 1/4, 0)
    zero = mask_weights(batch, (2, 2), options.model_copy(update={"unmasked_weight": 0.0}), 0, 0)
    torch.testing.assert_close(weighted_mse(prediction, target, zero), torch.tensor((5 * 1.25 / 4 + 0) / 2))


def test_a_black_mask_with_unmasked_weight_0_adds_nothing_when_normalized():
    """A sample with nothing to learn (a black mask, or its white part cropped away by the bucket) and unmasked_weight
    0: normalize_masked_area_loss divides its 0 by an area of 0. OneTrainer's quotient is NaN, which stopped the run;
    the sample adds 0 and the others keep their normalized loss, with finite gradients."""
    batch, prediction, target = hand_batch()
    options = MaskedTrainingConfig(enabled=True, unmasked_probability=0, unmasked_weight=0.0)
    zero = mask_weights(batch, (2, 2), options, seed=0, epoch=0)
    assert zero[1].sum() == 0  # sample 1's mask is black
    prediction = prediction.clone().requires_grad_()
    loss = weighted_mse(prediction, target, zero, normalize=True)
    torch.testing.assert_close(loss, torch.tensor((5.0 + 0) / 2))  # sample 0: 5 x 0.3125 / 0.3125
    loss.backward()
    assert torch.isfinite(prediction.grad).all() and prediction.grad[1].abs().sum() == 0


def test_unmasked_draws_are_per_sample_deterministic_and_at_the_rate():
    draws = [trains_unmasked(i, 0.1, seed=3, epoch=2) for i in range(4000)]
    assert 0.085 < sum(draws) / len(draws) < 0.115
    assert draws == [trains_unmasked(i, 0.1, seed=3, epoch=2) for i in range(4000)]
    assert draws != [trains_unmasked(i, 0.1, seed=3, epoch=3) for i in range(4000)]  # redrawn per epoch
    assert not any(trains_unmasked(i, 0.0, 3, 2) for i in range(500)) and all(trains_unmasked(i, 1.0, 3, 2) for i in range(500))
    # A sample's draw does not depend on its batch: find an unmasked sample and put it in two batches.
    unmasked = draws.index(True)
    options = MaskedTrainingConfig(enabled=True, unmasked_probability=0.1, unmasked_weight=0.0)
    mask = torch.zeros(3, 1, 8, 8)
    in_batch = mask_weights({"mask": mask, "sample_id": torch.tensor([draws.index(False), unmasked, 4001])}, (4, 4),
                            options, 3, 2)
    alone = mask_weights({"mask": mask[:1], "sample_id": torch.tensor([unmasked])}, (4, 4), options, 3, 2)
    assert torch.equal(in_batch[1], alone[0]) and torch.equal(alone[0], torch.ones(1, 4, 4))
    assert torch.equal(in_batch[0], torch.zeros(1, 4, 4))  # a sample that keeps its (black) mask


def test_outside_the_mask_the_prediction_gets_no_gradient(tiny_models):
    model = load_model(ModelConfig(family="sd1", path=str(tiny_models["sd1"])))
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, 1, 64, 64)
    mask[0, :, :, :32] = 1  # left half of sample 0 (latent columns 0-3)
    mask[1, :, 16:40, 8:56] = 1  # a box aligned to the 8 px latent grid
    batch = {"pixels": torch.rand(2, 3, 64, 64, generator=g) * 2 - 1, "sample_id": torch.tensor([1, 2]), "mask": mask,
             "token_ids": model.family.tokenize(model.tokenizers, ["a", "b"])}
    predictions = []
    original = model.denoiser.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out[0].retain_grad()
        predictions.append(out[0])
        return out
    model.denoiser.forward = forward
    options = MaskedTrainingConfig(enabled=True, unmasked_probability=0, unmasked_weight=0)
    diffusion_loss(model, batch, seed=1, epoch=0, masking=options).backward()
    grad = predictions[0].grad
    latent_mask = torch.nn.functional.interpolate(mask, size=(8, 8), mode="area").expand_as(grad)
    assert torch.equal(grad[latent_mask == 0], torch.zeros_like(grad[latent_mask == 0]))  # exactly zero
    assert (grad[latent_mask == 1] != 0).float().mean() > 0.99
    assert (latent_mask == 0).float().mean() > 0.4  # a large part of the batch is masked out


def masked_folder(shapes_data, folder):
    """The shapes with masks: the left half white for even images, a centred box for odd ones."""
    shutil.copytree(shapes_data, folder)
    for i, image in enumerate(sorted(folder.glob("*.png"))):
        mask = np.zeros((64, 64), dtype=np.uint8)
        if i % 2:
            mask[16:48, 16:48] = 255
        else:
            mask[:, :32] = 255
        Image.fromarray(mask).save(folder / f"{image.stem}-masklabel.png")
    return folder


MASKED = {"masked_training.enabled": True, "masked_training.unmasked_probability": 0.25,
          "masked_training.unmasked_weight": 0.1, "masked_training.normalize_masked_area_loss": True}
SETTINGS = {"max_steps": 2, "learning_rate": 1e-5}


@pytest.fixture(scope="module")
def masked_data(shapes_data, tmp_path_factory):
    return masked_folder(shapes_data, tmp_path_factory.mktemp("masked") / "shapes")


@pytest.fixture(scope="module")
def masked_reference(small_sd1, masked_data, tmp_path_factory):
    """One process, batch 4, masked training: the run every other masked run must reproduce (on the 2-level SD 1.x
    UNet, small_sd1: the 2 fsdp ranks' cost grows with the module count, what is compared does not)."""
    out = tmp_path_factory.mktemp("masked-ref") / "out"
    trainer = Trainer(validate(base_config(small_sd1, masked_data, out, **SETTINGS, **MASKED)), log=print)
    batch = next(iter(trainer.epoch_batches(0)))
    assert batch["mask"].shape == (4, 1, 64, 64) and 0.2 < batch["mask"].mean() < 0.55  # the real masks arrive
    with torch.no_grad():  # the objective the run trains differs from the unmasked one on its first batch
        masked = trainer.loss(batch, 0)
        unmasked = diffusion_loss(trainer.model, batch, trainer.config.seed, 0)
    assert abs(masked - unmasked) > 1e-3 * unmasked
    result = trainer.train()
    return result, exported_weights(out, "full")


def test_masked_run_with_cached_latents_trains_like_one_with_images(small_sd1, masked_data, masked_reference,
                                                                    tmp_path):
    reference, weights = masked_reference
    cached = validate(base_config(small_sd1, masked_data, tmp_path / "cached", **SETTINGS, **MASKED,
                                  **{"data.cache_latents": True}))
    trainer = Trainer(cached, log=print)
    batch = next(iter(trainer.epoch_batches(0)))
    assert "pixels" not in batch and batch["mask"].shape == (4, 1, 64, 64)  # masks come from the shards
    result = trainer.train()
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-7)
    assert_matches(weights, exported_weights(tmp_path / "cached", "full"))


def test_two_fsdp_ranks_train_masked_like_one_process(small_sd1, masked_data, masked_reference, tmp_path):
    out = tmp_path / "two"
    raw = base_config(small_sd1, masked_data, out, batch_size=2, strategy="fsdp", **SETTINGS, **MASKED)
    config = write_config(tmp_path / "two.yaml", raw)
    done = run_ranks("-m", "ot_dist", "train", str(config))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "strategy fsdp, global batch 4" in done.stdout
    got = exported_weights(out, "full")
    assert_matches(masked_reference[1], got)
    base = exported_weights_of_base(small_sd1, "full", got)
    assert max((base[k] - got[k]).abs().max().item() for k in base) > 2e-5  # it trained: the match can fail


def test_a_missing_mask_is_an_error_naming_the_image_or_trains_unmasked(tiny_models, masked_data, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(masked_data, folder)
    (folder / "0005-masklabel.png").unlink()
    raw = base_config(tiny_models["sd1"], folder, tmp_path / "o", **{"masked_training.enabled": True})
    with pytest.raises(InputFileError, match=r"1 of 16 samples have no mask.*0005\.png.*missing_mask: unmasked"):
        Trainer(validate(raw), log=print)
    lines = []
    trainer = Trainer(validate({**raw, "masked_training": {"enabled": True, "missing_mask": "unmasked"}}),
                      log=lines.append, overwrite=True)
    assert any("1 of 16 samples have no mask; they train on the whole image" in line for line in lines)
    without = next(i for i, s in enumerate(trainer.dataset.samples) if not s["mask"])
    assert trainer.dataset.metadata(without)["source"].endswith("0005.png")
    assert torch.equal(trainer.dataset.load(without, 0)["mask"], torch.ones(1, 64, 64))


def test_prior_preservation_adds_the_hand_computed_term():
    """OneTrainer's masked_losses_with_prior: + w x (1 - clamped mask) x (prediction - prior)^2, normalized by the
    mean of (1 - clamped mask) when normalize_masked_area_loss."""
    batch, prediction, target = hand_batch()
    options = MaskedTrainingConfig(enabled=True, unmasked_probability=0, unmasked_weight=0.2)
    weights = mask_weights(batch, (2, 2), options, seed=0, epoch=0)
    prior = torch.ones_like(prediction)  # (prediction - prior)^2 = 1 everywhere
    # outside the mask: sample 0 mean(0, .8, .75, .8) = 0.5875, sample 1 0.8; weight 0.5
    loss = weighted_mse(prediction, target, weights, prior=prior, prior_weight=0.5)
    torch.testing.assert_close(loss, torch.tensor((5 * 0.4125 + 0.5 * 0.5875 + 4 * 0.2 + 0.5 * 0.8) / 2))
    normalized = weighted_mse(prediction, target, weights, normalize=True, prior=prior, prior_weight=0.5)
    torch.testing.assert_close(normalized, torch.tensor((5.0 + 0.5 + 4.0 + 0.5) / 2))
    # nothing outside the mask (a sample drawn unmasked): no prior term, where OneTrainer would divide 0 by 0
    ones = torch.ones_like(weights)
    torch.testing.assert_close(weighted_mse(prediction, target, ones, normalize=True, prior=prior, prior_weight=0.5),
                               weighted_mse(prediction, target, ones, normalize=True))


def test_prior_preservation_pulls_towards_the_model_without_lora(tiny_models, masked_data, tmp_path):
    prior = {**MASKED, "masked_training.prior_preservation_weight": 1.0}
    raw = base_config(tiny_models["sd1"], masked_data, tmp_path / "out", method="lora", max_steps=3,
                      learning_rate=1e-2, **prior)
    trainer = Trainer(validate(raw), log=lambda *_: None)
    batch = next(iter(trainer.epoch_batches(0)))
    without = validate({**raw, "masked_training": {**raw.get("masked_training", {}),
                                                   "prior_preservation_weight": 0.0}}).masked_training
    trainable = [p.requires_grad for p in trainer.params]

    def losses():
        with torch.no_grad():
            return (trainer.loss(batch, 0),
                    diffusion_loss(trainer.model, batch, trainer.config.seed, 0, trainer.config.loss, without))

    with_prior, plain = losses()
    assert with_prior == plain  # LoRA starts at zero: the prediction is the prior's, the prior term is 0
    trainer.train()
    with_prior, plain = losses()
    assert with_prior > plain * (1 + 1e-6)  # trained, the LoRA moves the prediction away from the prior
    assert [p.requires_grad for p in trainer.params] == trainable  # the prior pass left the adapters as they were
    from peft.tuners.tuners_utils import BaseTunerLayer
    assert not any(m.disable_adapters for m in trainer.model.denoiser.modules() if isinstance(m, BaseTunerLayer))


def test_prior_preservation_needs_lora_and_masks():
    from ot_dist.errors import ConfigError

    with pytest.raises(ConfigError, match="masked_training.prior_preservation_weight: the prior is the model without"):
        validate(base_config("m", "d", "o", method="full", **MASKED, **{"masked_training.prior_preservation_weight": 1}))
