"""The training loop's promises: same result from a single file as from a folder, accumulation equals
a bigger batch, checkpointing changes nothing, per-sample randomness, dtype paths, part stopping."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.models.families.sd_single_file import export_single_file
from ot_dist.train.loss import diffusion_loss, draw_sample_noise
from ot_dist.models.objectives import DDPM
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


def run(tiny_models, shapes_data, tmp_path, name="out", family="sd1", method="full", **overrides):
    raw = base_config(tiny_models[family], shapes_data, tmp_path / name, family=family, method=method, **overrides)
    trainer = Trainer(validate(raw), log=quiet)
    result = trainer.train()
    return trainer, result


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_equal(a, b, exact=True, atol=0.0):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def test_single_file_and_folder_train_to_identical_weights(tiny_models, shapes_data, tmp_path):
    from diffusers import DiffusionPipeline

    base = DiffusionPipeline.from_pretrained(tiny_models["sd1"])
    single = export_single_file(base.components, "sd1", tmp_path / "base.safetensors")
    folder_trainer, _ = run(tiny_models, shapes_data, tmp_path, "folder", max_steps=3, **{"text_encoder.train": True})
    raw = base_config(single, shapes_data, tmp_path / "single", max_steps=3, **{"text_encoder.train": True})
    raw["model"]["config"] = str(tiny_models["sd1"])
    single_trainer = Trainer(validate(raw), log=quiet)
    single_trainer.train()
    assert_states_equal(state(folder_trainer.model.denoiser), state(single_trainer.model.denoiser))
    assert_states_equal(state(folder_trainer.model.text_encoders["text_encoder"]),
                        state(single_trainer.model.text_encoders["text_encoder"]))
    assert not torch.equal(base.unet.conv_in.weight, folder_trainer.model.denoiser.conv_in.weight)


def test_accumulation_equals_the_larger_batch(tiny_models, shapes_data, tmp_path):
    # The gradient of one batch of 4 equals the accumulated gradient of 2 micro batches of 2.
    raw = base_config(tiny_models["sdxl"], shapes_data, tmp_path / "o", family="sdxl", **{"text_encoder.train": True})
    trainer = Trainer(validate(raw), log=quiet)
    samples = [trainer.dataset.load(i, 0) for i in range(4)]
    trainer.micro_step(trainer.tokenize(collate(samples)), epoch=0, accumulation=1)
    # (SDXL conditions on the penultimate text-encoder layer, so the last layer gets no gradient)
    whole = [None if p.grad is None else p.grad.clone() for p in trainer.params]
    assert sum(g is not None for g in whole) > len(whole) // 2
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.micro_step(trainer.tokenize(collate(samples[:2])), epoch=0, accumulation=2)
    trainer.micro_step(trainer.tokenize(collate(samples[2:])), epoch=0, accumulation=2)
    for a, p in zip(whole, trainer.params):
        if a is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-7)
    # And end to end: the same optimizer-step losses from either layout.
    _, big = run(tiny_models, shapes_data, tmp_path, "big", max_steps=2, batch_size=4)
    _, acc = run(tiny_models, shapes_data, tmp_path, "acc", max_steps=2, batch_size=2, gradient_accumulation_steps=2)
    assert big.losses[0] == pytest.approx(acc.losses[0], rel=1e-5)


def test_gradient_checkpointing_gives_the_same_training(tiny_models, shapes_data, tmp_path):
    plain, r1 = run(tiny_models, shapes_data, tmp_path, "plain", family="sdxl", max_steps=2,
                    **{"text_encoder.train": True})
    ckpt, r2 = run(tiny_models, shapes_data, tmp_path, "ckpt", family="sdxl", max_steps=2, gradient_checkpointing=True,
                   **{"text_encoder.train": True})
    assert ckpt.model.denoiser.is_gradient_checkpointing
    encoder = ckpt.model.text_encoders["text_encoder"]
    name = "is_activation_checkpointing" if hasattr(encoder, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert getattr(encoder, name)
    assert r1.losses == pytest.approx(r2.losses, rel=1e-5)
    assert_states_equal(state(plain.model.denoiser), state(ckpt.model.denoiser), exact=False, atol=1e-5)


def test_noise_belongs_to_the_sample_not_the_batch():
    shape = torch.Size((4, 8, 8))
    alone = draw_sample_noise({"sample_id": torch.tensor([7])}, shape, DDPM({"num_train_timesteps": 1000}), seed=3, epoch=2)
    in_batch = draw_sample_noise({"sample_id": torch.tensor([5, 7, 9])}, shape, DDPM({"num_train_timesteps": 1000}), seed=3, epoch=2)
    for a, b in zip(alone, in_batch):
        assert torch.equal(a[0], b[1])
    other_epoch = draw_sample_noise({"sample_id": torch.tensor([7])}, shape, DDPM({"num_train_timesteps": 1000}), seed=3, epoch=3)
    assert not torch.equal(alone[1], other_epoch[1])


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_loss_target_follows_the_prediction_type(tiny_models, shapes_data, tmp_path, prediction_type):
    raw = base_config(tiny_models["sd2"], shapes_data, tmp_path / "o", family="sd2", **{"model.prediction_type": prediction_type})
    trainer = Trainer(validate(raw), log=quiet)
    assert trainer.model.objective.prediction_type == prediction_type
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    model = trainer.model
    # A UNet that predicts zeros makes the loss the mean square of the target, which we rebuild here.
    original_forward = model.denoiser.forward
    model.denoiser.forward = lambda sample, *a, **k: (torch.zeros_like(sample),)
    try:
        loss = diffusion_loss(model, batch, seed=1, epoch=0)
    finally:
        model.denoiser.forward = original_forward
    vae_eps, noise, timesteps = draw_sample_noise(batch, torch.Size((4, 8, 8)), model.objective, seed=1, epoch=0)
    with torch.no_grad():
        posterior = model.vae.encode(batch["pixels"]).latent_dist
        latents = (posterior.mean + posterior.std * vae_eps) * model.vae.config.scaling_factor
    scheduler = model.objective.scheduler
    target = scheduler.get_velocity(latents, noise, timesteps) if prediction_type == "v_prediction" else noise
    torch.testing.assert_close(loss, target.pow(2).mean(), rtol=1e-5, atol=1e-6)


def test_sd2_defaults_to_v_prediction(tiny_models, shapes_data, tmp_path):
    trainer, result = run(tiny_models, shapes_data, tmp_path, family="sd2", method="lora", max_steps=2)
    assert trainer.model.objective.prediction_type == "v_prediction"
    assert len(result.losses) == 2


def test_text_encoder_stops_training_after_n_steps(tiny_models, shapes_data, tmp_path):
    one, _ = run(tiny_models, shapes_data, tmp_path, "one", max_steps=1, **{"text_encoder.train": True})
    stopped, _ = run(
        tiny_models, shapes_data, tmp_path, "stopped", max_steps=3,
        **{"text_encoder.train": True, "text_encoder.stop_training_after": 1, "text_encoder.stop_training_after_unit": "step"},
    )
    # The text encoder got exactly the first step's update; the UNet kept training.
    assert_states_equal(state(one.model.text_encoders["text_encoder"]), state(stopped.model.text_encoders["text_encoder"]))
    assert not torch.equal(one.model.denoiser.conv_in.weight, stopped.model.denoiser.conv_in.weight)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_lora_trains_with_frozen_weights_in_that_dtype(tiny_models, shapes_data, tmp_path, dtype):
    trainer, result = run(
        tiny_models, shapes_data, tmp_path, family="sd1", method="lora", max_steps=3, train_dtype=dtype,
        weight_dtype=dtype, learning_rate=1e-3,
    )
    model = trainer.model
    assert model.vae.dtype == getattr(torch, dtype)
    lora_params = [p for p in model.denoiser.parameters() if p.requires_grad]
    base_params = [p for p in model.denoiser.parameters() if not p.requires_grad]
    assert lora_params and all(p.dtype == torch.float32 for p in lora_params)
    assert all(p.dtype == getattr(torch, dtype) for p in base_params)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    if dtype == "float16":
        assert trainer.precision.scaler is not None


def test_lora_targets_that_match_nothing_are_named(tiny_models, shapes_data, tmp_path):
    from ot_dist.errors import ConfigError

    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "o", method="lora", **{"lora.unet_targets": ["nope"]})
    with pytest.raises(ConfigError, match="lora.unet_targets"):
        Trainer(validate(raw), log=quiet)


def test_collections_after_the_trainer_is_built_skip_the_libraries_and_the_model(tiny_models, shapes_data, tmp_path,
                                                                                 monkeypatch):
    """A full garbage collection walks every tracked object (1-2 s for what torch / diffusers / a model leave);
    once a trainer is built those live in the permanent generation, so training's collections skip them."""
    import gc

    from ot_dist.memory import heap

    # As in a process of its own: nothing frozen yet (conftest.py freezes between test files, and an earlier trainer
    # of this test process froze already), so what is frozen below is this trainer's doing.
    gc.unfreeze()
    monkeypatch.setattr(heap, "_frozen", False)
    trainer = Trainer(validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1)), log=quiet)
    assert gc.get_freeze_count() > 100_000  # torch, diffusers, transformers alone leave several hundred thousand
    tracked_ids = {id(o) for o in gc.get_objects()}
    for long_lived in (torch.nn.Linear, torch.nn.Module.__call__, Trainer.train):
        assert id(long_lived) not in tracked_ids, long_lived
    trainer.close()
