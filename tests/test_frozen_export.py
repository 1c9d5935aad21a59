"""A full finetune's exports hold every component the run did not train exactly as the user loaded it, whatever
low-memory storage (`weight_dtype: float8 / nf4 / bfloat16`) held it during training: bit for bit at the original's
dtype, or the original cast once to output_dtype; the trained parts come from the trained weights. For the folder, the
single file, the EMA copies and `ot-dist export CHECKPOINT`."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config, with_reference_images
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file

from ot_dist.checkpoint.export_command import export_checkpoint
from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.models.families.registry import FAMILY_NAMES
from ot_dist.models.loading import load_model
from ot_dist.train.trainer import Trainer

FROZEN_FILES = {"vae": "vae/diffusion_pytorch_model.safetensors", "text_encoder": "text_encoder/model.safetensors"}
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def quiet(*_):
    pass


def assert_frozen_as_loaded(folder, original, dtype):
    for name, file in FROZEN_FILES.items():
        exported, source = load_file(folder / file), load_file(original / file)
        assert exported.keys() == source.keys(), name
        for key, value in source.items():
            assert exported[key].dtype == dtype, f"{name}.{key}"
            assert torch.equal(exported[key], value.to(dtype)), f"{folder.name}/{name}.{key} is not the original"


# nf4 with the CPU's float32 train_dtype: every floating parameter stays float32, only the packed uint8 Linear weights
# tell that the VAE and text encoder hold rounded copies (checkpoint/frozen_source.py held_as_loaded)
# files "bfloat16": a model published in bfloat16, which training reads in bfloat16 (models/load_dtype.py), and the
# export reads again in bfloat16: cast once to output_dtype, as from float32
@pytest.mark.parametrize("weight_dtype,output_dtype,files", [("float8", "float32", "float32"),
                                                             ("bfloat16", "float16", "float32"),
                                                             ("nf4", "float32", "float32"),
                                                             ("float8", "float32", "bfloat16")])
def test_frozen_components_are_exported_as_loaded_not_as_stored(weight_dtype, output_dtype, files, tiny_models,
                                                                shapes_data, tmp_path, monkeypatch):
    original = tiny_models["sd1"]
    if files == "bfloat16":
        from ot_dist.models.tiny import make_tiny_model

        original = make_tiny_model(tmp_path / "bf16", "sd1", dtype=torch.bfloat16)
    raw = base_config(original, shapes_data, tmp_path / "o", batch_size=2, max_steps=1, learning_rate=1e-3,
                      weight_dtype=weight_dtype, output_dtype=output_dtype,
                      **{"ema.enabled": True, "ema.decay": 0.5, "ema.update_step_interval": 1})
    trainer = Trainer(validate(raw), log=quiet)
    loads, load = [], UNet2DConditionModel.from_pretrained.__func__
    monkeypatch.setattr(UNet2DConditionModel, "from_pretrained",
                        classmethod(lambda cls, *args, **kwargs: loads.append(args) or load(cls, *args, **kwargs)))
    result = trainer.train()
    assert loads == []  # the exports read the frozen components again, not the trained UNet (a second copy)
    dtype = DTYPES[output_dtype]
    # The run did hold rounded copies: exporting them would differ from the original.
    stored = trainer.model.vae.state_dict()
    source = load_file(original / FROZEN_FILES["vae"])
    assert any(not torch.equal(stored[k].cpu().to(dtype), v.to(dtype)) for k, v in source.items())
    for name in ("model", "model_ema"):
        assert tmp_path / "o" / name in result.exported
        assert_frozen_as_loaded(tmp_path / "o" / name, original, dtype)
    # The trained UNet is the trained weights, not the original.
    trained = {k: v.to(dtype) for k, v in trainer.trained_state_dict_of()(trainer.model.denoiser).items()}
    unet = load_file(tmp_path / "o" / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(unet[k], v.cpu()) for k, v in trained.items())
    assert any(not torch.equal(unet[k], v.to(dtype)) for k, v in
               load_file(original / "unet" / "diffusion_pytorch_model.safetensors").items())
    # The single file, read back with the folder as its config: the original VAE and text encoder.
    base = load_model(ModelConfig(family="sd1", path=str(original)))
    for name in ("model.safetensors", "model_ema.safetensors"):
        again = load_model(ModelConfig(family="sd1", path=str(tmp_path / "o" / name), config=str(original)))
        for part in ("vae", "text_encoder"):
            got, want = getattr(again.pipeline, part).state_dict(), getattr(base.pipeline, part).state_dict()
            assert all(torch.equal(got[k].to(dtype), v.to(dtype)) for k, v in want.items()), f"{name}: {part}"
    # `ot-dist export CHECKPOINT`, the plain and the EMA export: the files training wrote, bit for bit.
    for ema, name in ((False, "model"), (True, "model_ema")):
        folder, single = export_checkpoint(str(result.checkpoint), None, ema, str(tmp_path / f"x{ema}"), log=quiet)
        assert_frozen_as_loaded(folder, original, dtype)
        assert single.read_bytes() == (tmp_path / "o" / f"{name}.safetensors").read_bytes()
        for file in folder.rglob("*.safetensors"):
            assert file.read_bytes() == (tmp_path / "o" / name / file.relative_to(folder)).read_bytes(), file


def test_a_bfloat16_model_stored_in_bfloat16_is_exported_from_memory(shapes_data, tmp_path, monkeypatch):
    """Read in its files' bfloat16 and stored in bfloat16, a frozen component holds the files' values: the export
    writes it from memory, without reading model.path again, and it is the original bit for bit."""
    from ot_dist.checkpoint import frozen_source
    from ot_dist.models.tiny import make_tiny_model

    original = make_tiny_model(tmp_path / "bf16", "sd1", dtype=torch.bfloat16)
    raw = base_config(original, shapes_data, tmp_path / "o", batch_size=2, max_steps=1, learning_rate=1e-3,
                      weight_dtype="bfloat16", train_dtype="bfloat16", output_dtype="bfloat16")
    reads = []
    monkeypatch.setattr(frozen_source, "load_model", lambda *args, **kwargs: reads.append(args) or load_model(
        *args, **kwargs))
    trainer = Trainer(validate(raw), log=quiet)
    assert frozen_source.held_as_loaded(trainer.model.vae)
    trainer.train()
    assert reads == []
    assert_frozen_as_loaded(tmp_path / "o" / "model", original, torch.bfloat16)
    # a float32 model stored in bfloat16 holds rounded copies: read again
    trainer = Trainer(validate({**raw, "model": {"family": "sd1", "path": str(make_tiny_model(tmp_path / "f32"))},
                                "output_dir": str(tmp_path / "o32")}), log=quiet)
    assert not frozen_source.held_as_loaded(trainer.model.vae)


def test_a_single_file_model_path_gives_its_frozen_tensors_back_bit_for_bit(tiny_models, shapes_data, tmp_path):
    """Trained from a single file under float8 storage: the exported single file's VAE and text encoder tensors are
    the input file's, key for key (the UNet's are the trained ones)."""
    folder = tiny_models["sd1"]
    base = load_model(ModelConfig(family="sd1", path=str(folder)))
    original = tmp_path / "base.safetensors"
    base.family.export_single_file({**base.parts(), "vae": base.vae},
                                   {n: m.state_dict() for n, m in {**base.parts(), "vae": base.vae}.items()},
                                   original, torch.float32)
    raw = base_config(original, shapes_data, tmp_path / "o", batch_size=2, max_steps=1, learning_rate=1e-3,
                      weight_dtype="float8", **{"model.config": str(folder)})
    Trainer(validate(raw), log=quiet).train()
    source, exported = load_file(original), load_file(tmp_path / "o" / "model.safetensors")
    assert exported.keys() == source.keys()
    frozen = [k for k in source if k.startswith(("first_stage_model.", "cond_stage_model."))]
    assert frozen and all(torch.equal(exported[k], source[k]) for k in frozen)
    assert any(not torch.equal(exported[k], v) for k, v in source.items() if k.startswith("model.diffusion_model."))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_exports_its_untrained_components_as_loaded(family, family_models, shapes_data, tmp_path):
    """weight_dtype float8, the denoiser trains: what ot_dist loads from the export folder (and the single file, with
    the folder as model.config) is the base model's text encoders and latent encoder (a VAE, or the EfficientNet
    that lives beside diffusers' files) bit for bit, and the trained denoiser."""
    from test_export_roundtrip import RESOLUTION, assert_same_weights, components

    raw = with_reference_images(base_config(family_models[family], shapes_data, tmp_path / "o", family=family,
                                            batch_size=2, max_steps=1, resolution=RESOLUTION.get(family, 64),
                                            learning_rate=1e-3, weight_dtype="float8"))
    trainer = Trainer(validate(raw), log=quiet)
    trainer.train()
    base = load_model(ModelConfig(family=family, path=str(family_models[family])))
    expected = {name: module.state_dict() for name, module in components(base).items()}
    denoiser = trainer.model.family.denoiser
    expected[denoiser] = trainer.trained_state_dict_of()(trainer.model.denoiser)
    folder = tmp_path / "o" / "model"
    assert_same_weights(components(load_model(ModelConfig(family=family, path=str(folder)))), expected)
    if trainer.model.family.single_file:
        again = load_model(ModelConfig(family=family, path=str(tmp_path / "o" / "model.safetensors"), config=str(folder)))
        assert_same_weights(components(again), expected)


def test_given_modules_stand_in_for_a_folders_components_under_the_folders_class_names(tiny_models):
    """load_model(given=...): the module given is used, not read from the folder, and model_index.json (the
    pipeline's config, which exports save) still names the folder's class, not the given module's (a strategy's
    wrapper subclass, as FSDP2's fully_shard makes)."""
    folder = tiny_models["sd1"]

    class WrappedUNet(UNet2DConditionModel):
        pass

    unet = WrappedUNet.from_config(UNet2DConditionModel.load_config(folder / "unet"))
    loaded = load_model(ModelConfig(family="sd1", path=str(folder)), given={"unet": unet})
    assert loaded.denoiser is unet
    assert tuple(loaded.pipeline.config["unet"]) == ("diffusers", "UNet2DConditionModel")
