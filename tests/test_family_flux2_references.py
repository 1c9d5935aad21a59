"""FLUX.2 [dev] / [klein] as edit models: with a reference_path on the concepts the objective is diffusers'
train_dreambooth_lora_flux2_img2img.py / _klein_img2img.py step (the reference's normalised, packed latents appended
with ids (10, row, column, 0), the prediction read from the target's tokens), samples with a prompt's reference_image
equal Flux2Pipeline / Flux2KleinPipeline with the same image and seed, and a run mixing samples with and without
references is refused. Without references they stay text-to-image (tests/test_family_flux2.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import test_family_flux_kontext as kontext_tests
import torch
from conftest import base_config
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError
from ot_dist.models.families.flux2 import patchify, reference_ids, unpatchify
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

FAMILIES = ("flux2", "flux2_klein")
edit_pairs = kontext_tests.edit_pairs  # the shapes demo, each image with a reference of its own (same file name)


def quiet(*_):
    pass


def edit_config(family, model, pairs, out, method="full", **overrides):
    images, references = pairs
    raw = base_config(model, images, out, family=family, method=method,
                      **{"batch_size": 2, "learning_rate": 3e-4, **overrides})
    raw["data"].pop("path")
    raw["data"]["concepts"] = [{"path": str(images), "reference_path": str(references)}]
    return raw


def trainer_for(family, model, pairs, out, method="full", **overrides):
    return Trainer(validate(edit_config(family, model, pairs, out, method, **overrides)), log=quiet)


def test_reference_ids_are_the_pipelines():
    from diffusers import Flux2Pipeline

    latents = [torch.zeros(1, 128, 3, 4), torch.zeros(1, 128, 2, 5)]
    expected = Flux2Pipeline._prepare_image_ids(latents)[0]
    assert torch.equal(torch.cat([reference_ids(3, 4, 0, "cpu"), reference_ids(2, 5, 1, "cpu")]), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_objective_equals_the_img2img_scripts_step(family, family_models, edit_pairs, tmp_path):
    """The script's step for one batch of two, with the same draws (the posterior sample where the script takes the
    target's mode): target and reference patchified and normalised by the VAE's batch norm, the reference from the
    posterior's mode; _prepare_latent_ids for the target; the reference's ids as each script builds them ([dev]:
    _prepare_image_ids over the batch's references, viewed per sample; [klein]: the first reference's, expanded);
    the packed target then the packed reference; t / 1000, guidance ([dev]); the prediction's first tokens,
    _unpack_latents_with_ids; MSE against n - x."""
    from diffusers import Flux2Pipeline

    trainer = trainer_for(family, family_models[family], edit_pairs, tmp_path / "o", **{"model.guidance_scale": 2.5})
    model = trainer.model
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    assert "reference_pixels" in batch
    vae, transformer = model.vae, model.denoiser
    shape = (32, batch["pixels"].shape[-2] // 8, batch["pixels"].shape[-1] // 8)
    tokens = (shape[1] // 2) * (shape[2] // 2)  # the shift follows the target's tokens, not the reference's
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    eps, noise = torch.stack(eps), Flux2Pipeline._patchify_latents(torch.stack(noise))
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    with torch.no_grad():
        posterior = vae.encode(batch["pixels"]).latent_dist
        x = (Flux2Pipeline._patchify_latents(posterior.mean + posterior.std * eps) - mean) / std
        cond = (Flux2Pipeline._patchify_latents(vae.encode(batch["reference_pixels"]).latent_dist.mode()) - mean) / std
        ids = Flux2Pipeline._prepare_latent_ids(x)
        if family == "flux2":
            cond_ids = Flux2Pipeline._prepare_image_ids([cond[i].unsqueeze(0) for i in range(2)]).view(2, -1, 4)
        else:
            cond_ids = Flux2Pipeline._prepare_image_ids([cond[0:1]]).expand(2, -1, -1)
        s = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        noisy = (1.0 - s) * x + s * noise
        packed = Flux2Pipeline._pack_latents(noisy)
        prompt_embeds, text_ids = model.pipeline.encode_prompt(
            list(batch["caption"]), device="cpu",
            max_sequence_length=model.family.pipeline_call_options(model.pipeline)["max_sequence_length"])
        guidance = torch.full((2,), 2.5) if transformer.config.guidance_embeds else None
        pred = transformer(hidden_states=torch.cat([packed, Flux2Pipeline._pack_latents(cond)], dim=1),
                           timestep=s.flatten(), guidance=guidance, encoder_hidden_states=prompt_embeds,
                           txt_ids=text_ids, img_ids=torch.cat([ids, cond_ids], dim=1), return_dict=False)[0]
        pred = Flux2Pipeline._unpack_latents_with_ids(pred[:, :packed.shape[1]], ids)
        expected = torch.mean((pred.float() - (noise - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, trainer.config.loss)
        # the loss averages a wrong reference position away (time 0 moves it by ~1e-6): the prediction is compared
        # too, the family's own call on the same inputs in ot_dist's 32-channel layout
        conditioning = {"hidden": prompt_embeds, "reference_latents": unpatchify(cond)}
        predicted = model.family.predict(transformer, unpatchify(noisy), s.flatten() * 1000, conditioning, batch)
        del conditioning["reference_latents"]
        without = model.family.predict(transformer, unpatchify(noisy), s.flatten() * 1000, conditioning, batch)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(patchify(predicted), pred, rtol=1e-5, atol=1e-5)
    assert (predicted - without).abs().max() > 1e-3  # the reference reached the prediction: the comparison can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_samples_equal_the_pipeline_with_the_same_reference_and_seed(family, family_models, edit_pairs, tmp_path):
    """A step trained on pairs; the sample with a reference_image against the pipeline on the exported folder, given
    the reference scaled to cover the sample and centre-cropped, and the same seed."""
    import diffusers

    reference = edit_pairs[1] / "0003.png"
    prompt = {"prompt": "make it red", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 80, "height": 64,
              "reference_image": str(reference)}
    trainer = trainer_for(family, family_models[family], edit_pairs, tmp_path / "o", max_steps=1,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = getattr(diffusers, trainer.model.family.pipeline_class).from_pretrained(tmp_path / "o" / "model",
                                                                                   local_files_only=True)
    options = {"max_sequence_length": trainer.model.family.pipeline_call_options(pipe)["max_sequence_length"]}

    def image(given):
        return np.asarray(pipe(image=given, prompt="make it red", width=80, height=64, num_inference_steps=3,
                               guidance_scale=4.0, generator=torch.Generator().manual_seed(3), output_type="pil",
                               **options).images[0]).astype(int)

    # the pipelines take no reference under 64 pixels a side (Flux2ImageProcessor.check_image_input)
    given = Image.open(reference).convert("RGB").resize((80, 80), Image.Resampling.BICUBIC).crop((0, 8, 80, 72))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (64, 80, 3)
    same = np.abs(ours - image(given))
    assert same.max() <= 1 and same.mean() < 0.01
    # the reference reached the sample: another reference (the same one flipped) gives another one; the tiny VAE
    # decodes both to nearly the same grey, so the differences are many single steps
    other = image(given.transpose(Image.Transpose.FLIP_TOP_BOTTOM))
    assert np.abs(ours - other).mean() > 0.02


def test_a_run_mixing_samples_with_and_without_references_is_refused(family_models, shapes_data, edit_pairs,
                                                                       tmp_path, monkeypatch):
    import ot_dist.train.trainer as trainer_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_module, "load_model", no_loading)
    raw = edit_config("flux2_klein", family_models["flux2_klein"], edit_pairs, tmp_path / "o")
    raw["data"]["concepts"].append({"path": str(shapes_data)})
    with pytest.raises(ConfigError, match=r"flux2_klein trains with reference images or without, not both in one "
                                          r"run: 16 samples have one and 16 of 32 have none: sample .*reference_path"):
        Trainer(validate(raw), log=quiet)
    flux = edit_config("flux", family_models["flux"], edit_pairs, tmp_path / "f")
    with pytest.raises(ConfigError, match=r"flux takes no reference images.*train an edit model \((.*)\)") as refused:
        Trainer(validate(flux), log=quiet)
    named = refused.value.args[0].split("train an edit model (")[1].split(")")[0].split(", ")
    assert {"flux2", "flux2_klein", "flux_kontext"} <= set(named) and "flux" not in named


def test_cached_reference_latents_train_as_the_images(family_models, edit_pairs, tmp_path):
    """data.cache_latents stores the reference's posterior beside the image's (32-channel layout, normalised when
    read): the denoiser sees the uncached reference latents and the first step's loss is the uncached one."""
    from ot_dist.train.references import reference_conditioning

    losses, references = {}, {}
    for cache in (False, True):
        trainer = trainer_for("flux2_klein", family_models["flux2_klein"], edit_pairs, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache})
        batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
        assert ("reference_latent_mean" in batch) == cache and ("reference_pixels" in batch) != cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
        references[cache] = reference_conditioning(trainer.model, batch, "cpu", torch.float32)["reference_latents"]
    torch.testing.assert_close(references[True], references[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
