"""Per-component storage of frozen weights (`<part>.weight_dtype`, `vae_weight_dtype`, OneTrainer's per-part weight
dtypes): each component is stored as its own setting says, the rest as weight_dtype; training, samples and a full
export work with components of different dtypes; the settings are refused where they cannot apply."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory.float8 import FLOAT8
from ot_dist.train.trainer import Trainer

SAMPLE = {"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}


def quiet(*_):
    pass


def frozen_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if not p.requires_grad and p.is_floating_point()}


def test_each_component_is_stored_as_its_setting_says_and_the_run_trains_and_samples(tiny_models, shapes_data,
                                                                                      tmp_path):
    """SDXL LoRA: the UNet's base in float8, one text encoder in float8 too, the other in weight_dtype (bfloat16),
    the VAE in float32 (kohya's --no_half_vae); the run trains, samples (the pipeline meets float32 VAE weights and
    bfloat16 latents) and writes its LoRA. The VAE's weights are the loaded ones, bit for bit."""
    from diffusers import AutoencoderKL

    raw = base_config(tiny_models["sdxl"], shapes_data, tmp_path / "run", family="sdxl", method="lora", max_steps=2,
                      batch_size=2, train_dtype="bfloat16", weight_dtype="bfloat16", vae_weight_dtype="float32",
                      **{"unet.weight_dtype": "float8", "text_encoder.weight_dtype": "float8",
                         "sampling.prompts": [SAMPLE], "sampling.every_n_steps": 2})
    trainer = Trainer(validate(raw), log=quiet)
    model = trainer.model
    assert frozen_dtypes(model.denoiser) == {FLOAT8}
    assert frozen_dtypes(model.text_encoders["text_encoder"]) == {FLOAT8}
    assert frozen_dtypes(model.text_encoders["text_encoder_2"]) == {torch.bfloat16}
    assert frozen_dtypes(model.vae) == {torch.float32}
    loaded = AutoencoderKL.from_pretrained(tiny_models["sdxl"], subfolder="vae").state_dict()
    for name, value in model.vae.state_dict().items():
        assert torch.equal(value, loaded[name]), name
    result = trainer.train()
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    assert list((tmp_path / "run" / "samples" / "step-2").glob("*.png"))
    assert load_file(tmp_path / "run" / "lora.safetensors")


def test_a_full_export_writes_every_differently_stored_frozen_part_as_loaded(tiny_models, shapes_data, tmp_path):
    """A full finetune of the UNet with the text encoder in float16 and the VAE in bfloat16: the exported folder's
    frozen components are model.path's, not the rounded copies training held."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", max_steps=1, batch_size=2,
                      vae_weight_dtype="bfloat16", **{"text_encoder.weight_dtype": "float16"})
    trainer = Trainer(validate(raw), log=quiet)
    assert frozen_dtypes(trainer.model.vae) == {torch.bfloat16}
    assert frozen_dtypes(trainer.model.text_encoders["text_encoder"]) == {torch.float16}
    trainer.train()
    exported, original = tmp_path / "run" / "model", tiny_models["sd1"]
    for cls, sub in ((AutoencoderKL, "vae"), (CLIPTextModel, "text_encoder")):
        got = cls.from_pretrained(exported, subfolder=sub).state_dict()
        for name, value in cls.from_pretrained(original, subfolder=sub).state_dict().items():
            assert torch.equal(got[name], value), f"{sub}.{name}"


def test_storage_settings_are_refused_where_they_cannot_apply(tiny_models, shapes_data, tmp_path):
    def check(message, **overrides):
        with pytest.raises(ConfigError, match=message):
            validate(base_config(tiny_models["sd1"], shapes_data, tmp_path, method="lora", **overrides))

    check(r"text_encoder\.weight_dtype: float8 storage is supported with strategy single or ddp, not fsdp",
          strategy="fsdp", **{"text_encoder.weight_dtype": "float8"})
    check(r"vae_weight_dtype: float8 storage is supported with strategy single or ddp, not zero2",
          strategy="zero2", vae_weight_dtype="float8")
    check("text_encoder_2: model family sd1 has no text_encoder_2", **{"text_encoder_2.weight_dtype": "bfloat16"})
    check("vae_weight_dtype", vae_weight_dtype="float64")


@pytest.mark.parametrize("method, overrides, field", [
    ("lora", {"weight_dtype": "float16", "train_dtype": "bfloat16"}, "weight_dtype"),
    ("lora", {"weight_dtype": "bfloat16", "train_dtype": "float16"}, "weight_dtype"),
    ("full", {"weight_dtype": "bfloat16", "train_dtype": "bfloat16", "text_encoder.weight_dtype": "float16"},
     "text_encoder.weight_dtype"),
    ("full", {"weight_dtype": "bfloat16", "train_dtype": "bfloat16", "vae_weight_dtype": "float16"}, "vae_weight_dtype"),
])
def test_the_other_half_dtype_on_the_cpu_is_refused_before_loading(tiny_models, shapes_data, tmp_path, method,
                                                                    overrides, field):
    """CPU autocast runs LayerNorm / GroupNorm with their weights as stored, and its kernels take no float16 weight
    beside bfloat16 activations (nor the reverse): refused at the start, naming the field, on the CPU only."""
    from ot_dist.precision import check_storage_on_device

    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", method=method, max_steps=1,
                                  batch_size=2, **overrides))
    with pytest.raises(ConfigError, match=rf"^{field}: \w+ storage computing in train_dtype \w+ runs on CUDA only"):
        Trainer(config, log=lambda *_: None)
    check_storage_on_device(config, torch.device("cuda"))  # CUDA autocast computes the norms in float32
    matching = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "ok", method=method, max_steps=1,
                                    batch_size=2, weight_dtype="bfloat16", train_dtype="bfloat16"))
    check_storage_on_device(matching, torch.device("cpu"))


def test_what_the_cpu_storage_refusal_spares(tiny_models, shapes_data, tmp_path, monkeypatch):
    """Without the refusal the run fails in its first forward, after loading: the CPU's group norm refuses the
    float16 weight beside bfloat16 activations (should torch take it one day, this fails and the refusal can go)."""
    import ot_dist.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "check_storage_on_device", lambda *_: None)
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path, method="lora", max_steps=1, batch_size=2,
                                  weight_dtype="float16", train_dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="mixed dtype"):
        Trainer(config, log=lambda *_: None).train()
