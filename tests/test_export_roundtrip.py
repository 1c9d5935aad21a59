"""A full finetune's exported folder is a model ot_dist loads again (`model.path` = the export), for every family:
what the loader reads equals the in-memory trained model, component by component (the denoiser, the text encoders
and the latent encoder: a VAE, or Stable Cascade's / Würstchen v2's EfficientNet, which lives beside diffusers'
files); so does the single file of a family that has one, read with the export folder as `model.config`. For the two stage C families also the EMA export, training on from the export and `ot-dist lora extract`
from it (the ways a user continues from a finetune)."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config, with_reference_images
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.models.families.registry import FAMILY_NAMES
from ot_dist.models.loading import load_model
from ot_dist.train.trainer import Trainer

CASCADE = ("stable_cascade", "wuerstchen_v2")
# Each family's smallest bucket: stage C's latents need 128 px sides (pixel_multiple), the others train at 64.
RESOLUTION = {"stable_cascade": 128, "wuerstchen_v2": 128}


def quiet(*_):
    pass


def finetune(family, model_dir, data, out, steps=1, **overrides):
    raw = with_reference_images(base_config(model_dir, data, out, family=family, resolution=RESOLUTION.get(family, 64),
                                            batch_size=2, max_steps=steps, learning_rate=1e-3, output_dtype="float32",
                                            **overrides))
    trainer = Trainer(validate(raw), log=quiet)
    return trainer, trainer.train()


def components(model) -> dict[str, torch.nn.Module]:
    """Everything with weights that the loader gives: the trainable parts and the latent encoder."""
    return {**model.parts(), model.family.latent_encoder: model.vae}


def assert_same_weights(loaded: dict[str, torch.nn.Module], expected: dict[str, dict[str, torch.Tensor]]):
    assert loaded.keys() == expected.keys()
    for name, module in loaded.items():
        state = module.state_dict()
        assert state.keys() == expected[name].keys(), f"{name}: {set(state) ^ set(expected[name])}"
        for key, value in state.items():
            assert torch.equal(value.cpu(), expected[name][key].cpu()), f"{name}.{key}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_full_export_loads_back_into_ot_dist_as_the_trained_model(family, family_models, shapes_data, tmp_path):
    trainer, result = finetune(family, family_models[family], shapes_data, tmp_path / "o")
    folder = tmp_path / "o" / "model"
    assert folder in result.exported
    trained = {name: module.state_dict() for name, module in components(trainer.model).items()}
    base = load_model(ModelConfig(family=family, path=str(family_models[family])))
    denoiser = trainer.model.family.denoiser
    assert any(not torch.equal(v, trained[denoiser][k]) for k, v in base.denoiser.state_dict().items())  # it trained
    again = load_model(ModelConfig(family=family, path=str(folder)))  # what a user's model.path = the export does
    assert_same_weights(components(again), trained)
    single = tmp_path / "o" / "model.safetensors"
    assert (single in result.exported) == trainer.model.family.single_file
    if trainer.model.family.single_file:  # the original layout, read with the export folder as model.config
        again = load_model(ModelConfig(family=family, path=str(single), config=str(folder)))
        assert_same_weights(components(again), trained)
        # only the denoiser trained: the transformer families' file stays the denoiser's own (no full checkpoint)
        layout = trainer.model.family.full_checkpoint
        if layout is not None:
            assert not any(k.startswith(tuple(layout.text_encoders.values())) for k in load_file(single))


@pytest.mark.parametrize("family", CASCADE)
def test_stage_c_exports_continue_training_and_extract_a_lora(family, family_models, shapes_data, tmp_path):
    """The folder (and the EMA one) holds the EfficientNet the loader needs: training goes on from the export, and
    `ot-dist lora extract BASE EXPORT` reads it."""

    from ot_dist.lora_tools.extract import extract_command

    base_dir = family_models[family]
    trainer, result = finetune(family, base_dir, shapes_data, tmp_path / "o", steps=2,
                               **{"ema.enabled": True, "ema.decay": 0.5, "ema.update_step_interval": 1})
    ema_folder = tmp_path / "o" / "model_ema"
    assert ema_folder in result.exported
    ema = trainer.ema.full_weights()
    loaded = load_model(ModelConfig(family=family, path=str(ema_folder)))
    expected = {k: ema.get(f"prior.{k}", v) for k, v in trainer.model.denoiser.state_dict().items()}
    assert_same_weights({"prior": loaded.denoiser, "effnet": loaded.vae},
                        {"prior": expected, "effnet": trainer.model.vae.state_dict()})
    assert any(not torch.equal(v, trainer.model.denoiser.state_dict()[k]) for k, v in expected.items())  # the EMA

    # The encoder file in Stability's layout: ComfyUI's VAE loader (comfy/sd.py) takes a state dict holding
    # `backbone.1.0.block.0.1.num_batches_tracked` for stage C's EfficientNet.
    effnet = load_file(tmp_path / "o" / "model" / "effnet_encoder.safetensors")
    assert "backbone.1.0.block.0.1.num_batches_tracked" in effnet
    assert all(k.startswith(("backbone.", "mapper.")) and v.dtype in (torch.float32, torch.int64)
               for k, v in effnet.items())
    if trainer.model.family.single_file:  # stage C alone, as ComfyUI reads it; the EfficientNet from model.config
        single = tmp_path / "o" / "model.safetensors"
        assert not any(k.startswith(("backbone.", "mapper.")) for k in load_file(single))
        loaded = load_model(ModelConfig(family=family, path=str(single), config=str(tmp_path / "o" / "model")))
        assert_same_weights({"prior": loaded.denoiser, "effnet": loaded.vae},
                            {"prior": trainer.model.denoiser.state_dict(), "effnet": trainer.model.vae.state_dict()})

    again, _ = finetune(family, tmp_path / "o" / "model", shapes_data, tmp_path / "again", steps=1)
    assert again.model.vae.state_dict().keys() == trainer.model.vae.state_dict().keys()
    lora = tmp_path / "x.safetensors"
    kept = extract_command(str(base_dir), str(tmp_path / "o" / "model"), family, 2, str(lora), 0.0, "float32",
                           log=quiet)
    assert kept and load_file(lora)
