"""Flux.1 Kontext (an edit model on Flux dev's transformer) on the family contract: the objective against diffusers'
Kontext DreamBooth LoRA script's step written out for one batch, samples against FluxKontextPipeline with the same
reference image and seed, LoRA files FluxKontextPipeline loads and ComfyUI's Flux rule reads, cached latents (the
reference's too) training as uncached, and the refusals of data without references (or with them for Flux)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from conftest import base_config
from PIL import Image
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def edit_pairs(shapes_data, tmp_path_factory):
    """The shapes demo as edited images, each with a reference image of its own (another drawing, same size) in
    references/ under the same file name."""
    from ot_dist.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("edit_pairs")
    images = shutil.copytree(shapes_data, root / "images")
    references = make_demo_dataset(root / "references", count=len(list(images.glob("*.png"))), seed=7)
    for caption in references.glob("*.txt"):
        caption.unlink()
    return images, references


def kontext_config(model, pairs, out, method="full", concept=None, **overrides):
    images, references = pairs
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    raw = base_config(model, images, out, family="flux_kontext", method=method, **settings)
    raw["data"].pop("path")
    raw["data"]["concepts"] = [{"path": str(images), "reference_path": str(references), **(concept or {})}]
    return raw


def trainer_for(model, pairs, out, method="full", concept=None, **overrides):
    return Trainer(validate(kontext_config(model, pairs, out, method, concept, **overrides)), log=quiet)


def test_kontext_objective_equals_the_diffusers_scripts_step(family_models, edit_pairs, tmp_path):
    """train_dreambooth_lora_flux_kontext.py for one batch: the reference latent is the posterior's mode
    (--vae_encode_mode mode), shifted and scaled; the noisy target's packed tokens, then the reference's, with ids
    (0, row, col) and (1, row, col); the prediction is the first tokens, unpacked; target noise - x."""
    from diffusers import FluxKontextPipeline

    trainer = trainer_for(family_models["flux_kontext"], edit_pairs, tmp_path / "o")
    model = trainer.model
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    assert "reference_pixels" in batch
    seed, epoch = 1, 0
    loss = diffusion_loss(model, batch, seed, epoch)

    vae, transformer = model.vae, model.denoiser
    shape = (16, batch["pixels"].shape[-2] // 8, batch["pixels"].shape[-1] // 8)
    tokens = (shape[1] // 2) * (shape[2] // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)  # the shift of the target's token count
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    eps, noise = torch.stack(eps), torch.stack(noise)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    with torch.no_grad():
        posterior = vae.encode(batch["pixels"]).latent_dist
        x = ((posterior.mean + posterior.std * eps) - shift) * scale
        cond = (vae.encode(batch["reference_pixels"]).latent_dist.mode() - shift) * scale
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        noisy = (1 - sigma) * x + sigma * noise
        text = model.family.encode_text(model.text_encoders, batch["token_ids"])
        h, w = shape[1:]
        ids = FluxKontextPipeline._prepare_latent_image_ids(2, h // 2, w // 2, "cpu", torch.float32)
        cond_ids = FluxKontextPipeline._prepare_latent_image_ids(2, h // 2, w // 2, "cpu", torch.float32)
        cond_ids[..., 0] = 1
        packed = FluxKontextPipeline._pack_latents(noisy, 2, 16, h, w)
        hidden = torch.cat([packed, FluxKontextPipeline._pack_latents(cond, 2, 16, h, w)], dim=1)
        out = transformer(hidden_states=hidden, timestep=sigma.flatten(), guidance=torch.ones(2),
                          pooled_projections=text["pooled"], encoder_hidden_states=text["hidden"],
                          txt_ids=torch.zeros(text["hidden"].shape[1], 3), img_ids=torch.cat([ids, cond_ids]),
                          return_dict=False)[0]
        prediction = FluxKontextPipeline._unpack_latents(out[:, :packed.shape[1]], h * 8, w * 8, 8)
        expected = torch.nn.functional.mse_loss(prediction, noise - x)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_the_lora_trains_and_loads_in_the_kontext_pipeline_and_by_comfyuis_flux_rule(family_models, edit_pairs,
                                                                                        tmp_path):
    from diffusers import FluxKontextPipeline
    from test_family_flux import comfyui_transformer_keys

    trainer = trainer_for(family_models["flux_kontext"], edit_pairs, tmp_path / "o", method="lora", epochs=4,
                          learning_rate=3e-3)
    result = trainer.train()
    per_epoch = np.array(result.losses).reshape(4, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"

    model = trainer.model
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert modules and modules <= comfyui_transformer_keys(family_models["flux_kontext"])  # Flux's rule

    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 8, 8), torch.tensor([500.0])
    conditioning = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, ["a dot"]))
    conditioning["reference_latents"] = torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        trained = model.family.predict(model.denoiser, noisy, t, conditioning, {})
        loaded = FluxKontextPipeline.from_pretrained(family_models["flux_kontext"], local_files_only=True)
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
        again = model.family.predict(loaded.transformer, noisy, t, conditioning, {})
        plain = model.family.predict(FluxKontextPipeline.from_pretrained(
            family_models["flux_kontext"], local_files_only=True).transformer, noisy, t, conditioning, {})
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)
    assert (plain - trained).abs().max() > 1e-4  # the LoRA changed the prediction: the comparison can fail


def test_a_full_finetune_lowers_the_loss(family_models, edit_pairs, tmp_path):
    trainer = trainer_for(family_models["flux_kontext"], edit_pairs, tmp_path / "o", epochs=4)
    per_epoch = np.array(trainer.train().losses).reshape(4, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"


def test_black_forest_labs_single_file_loads_as_the_folder(family_models, tmp_path):
    """flux1-kontext-dev.safetensors is Flux's layout (ComfyUI loads it as a Flux model): Flux's key map reads it."""
    import json

    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.families.flux_single_file import FLUX
    from ot_dist.models.loading import load_model

    folder = family_models["flux_kontext"]
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    single = tmp_path / "flux1-kontext-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in FLUX.to_original(state, config).items()}, single)
    loaded = load_model(ModelConfig(family="flux_kontext", path=str(single), config=str(folder)))
    assert type(loaded.pipeline).__name__ == "FluxKontextPipeline"
    got = loaded.denoiser.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_samples_equal_the_kontext_pipeline_with_the_same_reference_and_seed(family_models, edit_pairs, tmp_path):
    from diffusers import FluxKontextPipeline

    images, references = edit_pairs
    reference = references / "0003.png"
    prompt = {"prompt": "make it red", "seed": 3, "steps": 3, "width": 64, "height": 48,
              "reference_image": str(reference)}
    trainer = trainer_for(family_models["flux_kontext"], edit_pairs, tmp_path / "o", max_steps=2,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = FluxKontextPipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    given = Image.open(reference).convert("RGB").resize((64, 64), Image.Resampling.BICUBIC).crop((0, 8, 64, 56))
    image = pipe(image=given, prompt="make it red", width=64, height=48, num_inference_steps=3, guidance_scale=2.5,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, max_area=64 * 48,
                 _auto_resize=False, output_type="pil").images[0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1
    blank = pipe(image=Image.new("RGB", (64, 48)), prompt="make it red", width=64, height=48, num_inference_steps=3,
                 guidance_scale=2.5, generator=torch.Generator().manual_seed(3), max_sequence_length=32,
                 max_area=64 * 48, _auto_resize=False, output_type="pil").images[0]
    assert np.abs(ours - np.asarray(blank).astype(int)).max() > 1  # the reference reached the sample


def test_cached_latents_train_like_encoding_each_step(family_models, edit_pairs, tmp_path):
    """The latent cache holds the reference's posterior beside the image's, each flipped with its image in the
    cached versions (image_variations): the same losses either way (epoch 0 reads version 0, its augmentation)."""
    losses = []
    for cached in (False, True):
        trainer = trainer_for(family_models["flux_kontext"], edit_pairs, tmp_path / str(cached), method="lora",
                              concept={"flip_probability": 0.5, "image_variations": 2}, max_steps=3,
                              **{"data.cache_latents": cached})
        losses.append(trainer.train().losses)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_data_without_references_is_refused_before_the_model_loads(family_models, edit_pairs, tmp_path, monkeypatch):
    import ot_dist.train.trainer as trainer_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_module, "load_model", no_loading)
    images, references = edit_pairs
    plain = base_config(family_models["flux_kontext"], images, tmp_path / "o", family="flux_kontext")
    with pytest.raises(ConfigError, match=r"16 of 16 samples have no reference image: sample .*0000.png.*reference_path"):
        Trainer(validate(plain), log=quiet)
    flux = kontext_config(family_models["flux"], edit_pairs, tmp_path / "f")
    flux["model"]["family"] = "flux"
    with pytest.raises(ConfigError, match="flux takes no reference images, and 16 samples have one"):
        Trainer(validate(flux), log=quiet)


def test_a_sample_prompt_reference_is_refused_for_flux(family_models, shapes_data, edit_pairs, tmp_path):
    from test_family_flux import trainer_for as flux_trainer

    prompt = {"prompt": "a dot", "reference_image": str(edit_pairs[1] / "0000.png")}
    with pytest.raises(ConfigError, match=r"sampling.prompts\[0\].reference_image: model.family flux takes no"):
        flux_trainer(family_models["flux"], shapes_data, tmp_path / "o", **{"sampling.prompts": [prompt]})
