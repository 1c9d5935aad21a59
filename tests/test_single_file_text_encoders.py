"""A full finetune that trains text encoders writes them into the single file of the transformer families, as the
full checkpoint ComfyUI's Load Checkpoint reads (docs/checkpoints.md, "What the single file holds"), and ot_dist reads
them back from it with the base model's folder as `model.config`, the way a user loads the file.

The key rules, from ComfyUI (github.com/Comfy-Org/ComfyUI @ a125cd84b054a57729b5eecab930ca9408719832, comfy/supported_models.py: each model's `text_encoder_key_prefix` / `vae_key_prefix`, the
text-encoder model its `clip_target` builds: SD3ClipModel clip_l / clip_g / t5xxl, FluxClipModel clip_l / t5xxl,
Chroma's PixArt-style t5xxl, Stable Cascade's clip_g; comfy/model_detection.py: a checkpoint's denoiser sits under
`model.diffusion_model.`), and diffusers 0.42 (loaders/single_file_utils.py: `text_encoders.clip_l.transformer.`,
`text_encoders.clip_g.transformer.`, `text_encoders.t5xxl.transformer.`, LDM VAE under `first_stage_model.` / `vae.`):

* SD3: `text_encoders.{clip_l,clip_g,t5xxl}.transformer.`, VAE `first_stage_model.`;
* Flux: `text_encoders.{clip_l,t5xxl}.transformer.`, VAE `vae.`;
* Chroma: `cond_stage_model.t5xxl.transformer.`, VAE `first_stage_model.`;
* Stable Cascade stage C: `text_encoder.clip_g.transformer.`, no VAE;
* under its prefix a CLIP keeps transformers' names with the `text_model.` level (ComfyUI detects a CLIP by
  `<prefix>text_model.final_layer_norm.weight`), a T5 its names (ComfyUI detects a T5 by
  `<prefix>encoder.final_layer_norm.weight`, diffusers by `<prefix>shared.weight`), the tied copy
  `encoder.embed_tokens.weight` included: diffusers' single-file T5 reader does not tie it again.
"""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file, save_file

from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.errors import InputFileError
from ot_dist.models.loading import load_model
from ot_dist.train.trainer import Trainer

DENOISER = "model.diffusion_model."
# family -> ({text encoder: prefix}, VAE prefix or None)
LAYOUTS = {
    "sd3": ({"text_encoder": "text_encoders.clip_l.transformer.", "text_encoder_2": "text_encoders.clip_g.transformer.",
             "text_encoder_3": "text_encoders.t5xxl.transformer."}, "first_stage_model."),
    "flux": ({"text_encoder": "text_encoders.clip_l.transformer.", "text_encoder_2": "text_encoders.t5xxl.transformer."},
             "vae."),
    "chroma": ({"text_encoder": "cond_stage_model.t5xxl.transformer."}, "first_stage_model."),
    "stable_cascade": ({"text_encoder": "text_encoder.clip_g.transformer."}, None),
}
RESOLUTION = {"stable_cascade": 128}
_RUNS = {}


def is_clip(module) -> bool:
    return module.config.model_type.startswith("clip")


def file_name(module, key: str) -> str:
    """The documented name of a text encoder's tensor in the file (without the prefix)."""
    if is_clip(module) and not key.startswith(("text_model.", "text_projection.")):
        return "text_model." + key
    return key


@pytest.fixture
def trained(family_models, shapes_data, tmp_path_factory):
    """family -> (trainer, the single file) of a 1-step full finetune of the denoiser and every text encoder."""

    def run(family):
        if family not in _RUNS:
            out = tmp_path_factory.mktemp(f"te-single-{family}") / "out"
            parts = {f"{name}.train": True for name in LAYOUTS[family][0]}
            raw = base_config(family_models[family], shapes_data, out, family=family, batch_size=2, max_steps=1,
                              resolution=RESOLUTION.get(family, 64), learning_rate=1e-3, output_dtype="float32",
                              **parts)
            trainer = Trainer(validate(raw), log=lambda *_: None)
            trainer.train()
            _RUNS[family] = trainer, out / "model.safetensors"
        return _RUNS[family]

    return run


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_trained_text_encoders_are_in_the_file_under_comfyuis_names(trained, family):
    trainer, path = trained(family)
    tensors = load_file(path)
    encoders, vae = LAYOUTS[family]
    prefixes = (DENOISER, *encoders.values(), *([vae] if vae else []))
    assert all(k.startswith(prefixes) for k in tensors), sorted(k for k in tensors if not k.startswith(prefixes))[:5]
    assert any(k.startswith(DENOISER) for k in tensors)
    if vae:
        assert f"{vae}decoder.conv_in.weight" in tensors  # ComfyUI's VAE detection key, LDM layout
    for name, prefix in encoders.items():
        module = trainer.model.text_encoders[name]
        if is_clip(module):
            assert f"{prefix}text_model.final_layer_norm.weight" in tensors
        else:
            assert {f"{prefix}encoder.final_layer_norm.weight", f"{prefix}shared.weight",
                    f"{prefix}encoder.embed_tokens.weight"} <= set(tensors)
        state = {file_name(module, k): v for k, v in module.state_dict().items() if not k.endswith("position_ids")}
        written = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        assert written.keys() == state.keys(), f"{name}: {sorted(set(written) ^ set(state))[:5]}"
        for key, value in state.items():
            assert torch.equal(written[key], value.float()), f"{name}: {key}"


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_the_file_loads_back_with_the_base_folder_as_model_config(trained, family_models, family):
    """What a user does: model.path = the single file, model.config = the base model's folder (whose text encoders
    are the untrained ones). Every text encoder comes from the file, trained."""
    trainer, path = trained(family)
    base = load_model(ModelConfig(family=family, path=str(family_models[family])))
    again = load_model(ModelConfig(family=family, path=str(path), config=str(family_models[family])))
    for name, module in trainer.model.text_encoders.items():
        loaded, original = again.text_encoders[name].state_dict(), base.text_encoders[name].state_dict()
        assert any(not torch.equal(v, original[k]) for k, v in module.state_dict().items()), f"{name} did not train"
        for key, value in module.state_dict().items():
            assert torch.equal(loaded[key], value), f"{name}.{key}"
    for key, value in trainer.model.denoiser.state_dict().items():
        assert torch.equal(again.denoiser.state_dict()[key], value), key


def test_a_text_encoder_that_does_not_fit_the_folder_is_named(trained, family_models, tmp_path):
    _, path = trained("flux")
    tensors = load_file(path)
    prefix = LAYOUTS["flux"][0]["text_encoder_2"]
    del tensors[f"{prefix}encoder.final_layer_norm.weight"]
    tensors[f"{prefix}shared.weight"] = tensors[f"{prefix}shared.weight"][:-1].contiguous()
    save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError) as err:
        load_model(ModelConfig(family="flux", path=str(tmp_path / "bad.safetensors"), config=str(family_models["flux"])))
    text = str(err.value)
    assert f"missing {prefix}encoder.final_layer_norm.weight" in text and f"{prefix}shared.weight is [" in text


def test_diffusers_from_single_file_reads_the_trained_sd3_text_encoders(trained, family_models):
    from diffusers import StableDiffusion3Pipeline
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModelWithProjection

    trainer, path = trained("sd3")
    folder = str(family_models["sd3"])
    encoders = trainer.model.text_encoders
    # diffusers picks the CLIP-L or CLIP-G keys for a CLIP by its width (768 / 1280); the tiny ones share one width,
    # so CLIP-G is read by the same diffusers reader from its own keys.
    clip_g = create_diffusers_clip_model_from_ldm(
        CLIPTextModelWithProjection, {k: v for k, v in load_file(path).items() if k.startswith("text_encoders.clip_g.")},
        config=folder, subfolder="text_encoder_2", local_files_only=True)
    pipe = StableDiffusion3Pipeline.from_single_file(str(path), config=folder, text_encoder_2=clip_g,
                                                     local_files_only=True)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        loaded = getattr(pipe, name).state_dict()
        for key, value in encoders[name].state_dict().items():
            if name == "text_encoder" and key == "text_projection.weight":
                continue  # diffusers sets SD3's CLIP-L projection to the identity (ComfyUI does not use it either)
            assert torch.equal(loaded[key], value), f"{name}.{key}"


def test_diffusers_from_single_file_reads_the_trained_flux_text_encoders(trained, family_models):
    from diffusers import FluxPipeline

    trainer, path = trained("flux")
    # diffusers' Flux transformer converter assumes the real width (3072): the tiny transformer is given
    pipe = FluxPipeline.from_single_file(str(path), config=str(family_models["flux"]),
                                         transformer=trainer.model.denoiser, local_files_only=True)
    for name, module in trainer.model.text_encoders.items():
        loaded = getattr(pipe, name).state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(loaded[key], value), f"{name}.{key}"
    for key, value in trainer.model.vae.state_dict().items():
        assert torch.equal(pipe.vae.state_dict()[key], value), f"vae.{key}"


def test_an_sd3_file_without_clip_ls_projection_keeps_the_folders(trained, family_models, tmp_path):
    """SD3's CLIP-L projection is not applied by the SD3 reference; a file may leave it out (ComfyUI does not warn)."""
    trainer, path = trained("sd3")
    tensors = load_file(path)
    del tensors["text_encoders.clip_l.transformer.text_projection.weight"]
    save_file(tensors, tmp_path / "no_projection.safetensors")
    folder = str(family_models["sd3"])
    again = load_model(ModelConfig(family="sd3", path=str(tmp_path / "no_projection.safetensors"), config=folder))
    base = load_model(ModelConfig(family="sd3", path=folder))
    loaded = again.text_encoders["text_encoder"].state_dict()
    assert torch.equal(loaded["text_projection.weight"], base.text_encoders["text_encoder"].text_projection.weight)
    for key, value in trainer.model.text_encoders["text_encoder"].state_dict().items():
        assert key == "text_projection.weight" or torch.equal(loaded[key], value), key


def test_a_t5_without_its_tied_copy_loads_as_comfyui_saves_it(trained, family_models, tmp_path):
    """ComfyUI's Save Checkpoint writes its T5 as it holds it: `shared.weight` without `encoder.embed_tokens.weight`."""
    trainer, path = trained("chroma")
    prefix = LAYOUTS["chroma"][0]["text_encoder"]
    tensors = load_file(path)
    del tensors[f"{prefix}encoder.embed_tokens.weight"]
    save_file(tensors, tmp_path / "comfy.safetensors")
    again = load_model(ModelConfig(family="chroma", path=str(tmp_path / "comfy.safetensors"),
                                   config=str(family_models["chroma"])))
    t5 = again.text_encoders["text_encoder"]
    assert t5.encoder.embed_tokens.weight is t5.shared.weight
    for key, value in trainer.model.text_encoders["text_encoder"].state_dict().items():
        assert torch.equal(t5.state_dict()[key], value), key
