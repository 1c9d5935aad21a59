"""Flux.1 Fill [dev] (Flux dev's transformer with 384 input channels, OneTrainer's FLUX_FILL_DEV_1) on the inpainting
mechanism: the condition equals FluxFillPipeline.prepare_mask_latents, the step equals the pipeline's conventions
written out for one batch, the export loads in FluxFillPipeline and its samples equal that pipeline's with the same
seed, LoRA files load through its load_lora_weights, and model.inpainting checks the transformer."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from conftest import base_config
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError
from ot_dist.models.families.flux import pack
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import LoadedModel, load_model
from ot_dist.models.tiny import make_tiny_model
from ot_dist.randomness import generator
from ot_dist.train.inpainting import inpainting_masks, random_mask
from ot_dist.train.loss import diffusion_loss, inpainting_condition
from ot_dist.train.loss_options import per_sample_normal
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def fill_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("flux-fill") / "fill", "flux", inpainting=True)


@pytest.fixture(scope="module")
def partly_masked_data(shapes_data, tmp_path_factory):
    """The shapes; even images have a mask (a box), odd ones none (they get random masks)."""
    folder = tmp_path_factory.mktemp("fill-data") / "shapes"
    shutil.copytree(shapes_data, folder)
    for i, image in enumerate(sorted(folder.glob("*.png"))):
        if i % 2 == 0:
            mask = np.zeros((64, 64), dtype=np.uint8)
            mask[8:40, 16:56] = 255
            Image.fromarray(mask).save(folder / f"{image.stem}-masklabel.png")
    return folder


def fill_trainer(model, data, out, method="full", **overrides):
    raw = base_config(model, data, out, family="flux", method=method, **{"batch_size": 2, **overrides})
    return Trainer(validate(raw), log=quiet)


def test_the_condition_equals_the_fill_pipelines_prepare_mask_latents(fill_model):
    from diffusers import FluxFillPipeline

    pipe = FluxFillPipeline.from_pretrained(fill_model, local_files_only=True)
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 64, 48, generator=g) * 2 - 1
    soft = torch.zeros(2, 1, 64, 48)
    soft[0, :, 8:40, 5:30] = 0.7  # repainted after binarisation
    soft[0, :, 44:50, :] = 0.3  # kept
    batch = {"pixels": pixels, "mask": soft, "mask_given": torch.tensor([True, False]), "sample_id": torch.tensor([4, 9])}
    latent_shape = torch.Size((16, 8, 6))
    condition = inpainting_condition(LoadedModel(get_family("flux"), pipe, None), batch, latent_shape, seed=1, epoch=2)
    assert condition.shape == (2, 16 + 64, 8, 6)

    masks = inpainting_masks(batch, seed=1, epoch=2)
    assert torch.equal(masks[1], random_mask(64, 48, generator(1, 2, 9, "inpainting_mask")))
    # The pipeline's own preprocessing of sample 0's mask and the masked image it builds from it.
    mask_image = Image.fromarray((soft[0, 0].numpy() * 255).round().astype(np.uint8))
    assert torch.equal(masks[:1], pipe.mask_processor.preprocess(mask_image, height=64, width=48))
    masked_image = pixels * (1 - masks)
    # The posterior sample the condition drew (ours: keyed per sample), handed to the pipeline as its latents.
    eps = per_sample_normal([4, 9], tuple(latent_shape), 1, 2, "masked_image_latent")
    with torch.no_grad():
        posterior = pipe.vae.encode(masked_image).latent_dist
    raw = posterior.mean + posterior.std * eps
    mask, masked_latents = pipe.prepare_mask_latents(masks, raw, 2, 16, 1, 64, 48, torch.float32,
                                                     torch.device("cpu"), None)
    expected = torch.cat([masked_latents, mask], dim=-1)  # what FluxFillPipeline appends to the noisy tokens
    assert expected.shape == (2, 4 * 3, 320)
    torch.testing.assert_close(pack(condition), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(pack(condition)[..., 64:], mask)  # the mask's 256 channels exactly


def test_the_step_equals_the_fill_pipelines_conventions_written_out(fill_model, partly_masked_data, tmp_path):
    """Flux's flow step (noise - x, shifted logit-normal time, timestep / 1000, guidance 1) with the transformer input
    FluxFillPipeline builds: the packed noisy latents, then prepare_mask_latents' masked-image latents and mask."""
    from diffusers import FluxFillPipeline

    trainer = fill_trainer(fill_model, partly_masked_data, tmp_path / "o")
    model = trainer.model
    assert model.inpainting and type(model.pipeline) is FluxFillPipeline
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    assert batch["mask_given"].tolist() == [True, False]  # one drawn mask, one given
    seed, epoch = 1, 0
    loss = diffusion_loss(model, batch, seed, epoch)

    vae, transformer = model.vae, model.denoiser
    height, width = batch["pixels"].shape[-2:]
    shape = (16, height // 8, width // 8)
    tokens = (shape[1] // 2) * (shape[2] // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    eps, noise = torch.stack(eps), torch.stack(noise)
    masks = inpainting_masks(batch, seed, epoch)
    masked_eps = per_sample_normal(batch["sample_id"].tolist(), shape, seed, epoch, "masked_image_latent")
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    pipe = FluxFillPipeline(**model.pipeline.components)
    with torch.no_grad():
        posterior = vae.encode(batch["pixels"]).latent_dist
        x = ((posterior.mean + posterior.std * eps) - shift) * scale
        masked = vae.encode(batch["pixels"] * (1 - masks)).latent_dist
        mask, masked_latents = pipe.prepare_mask_latents(masks, masked.mean + masked.std * masked_eps, 2, 16, 1,
                                                         height, width, torch.float32, torch.device("cpu"), None)
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        noisy = (1 - sigma) * x + sigma * noise
        text = model.family.encode_text(model.text_encoders, batch["token_ids"])
        h, w = shape[1:]
        packed = FluxFillPipeline._pack_latents(noisy, 2, 16, h, w)
        hidden = torch.cat([packed, torch.cat([masked_latents, mask], dim=-1)], dim=2)
        ids = FluxFillPipeline._prepare_latent_image_ids(2, h // 2, w // 2, "cpu", torch.float32)
        out = transformer(hidden_states=hidden, timestep=sigma.flatten(), guidance=torch.ones(2),
                          pooled_projections=text["pooled"], encoder_hidden_states=text["hidden"],
                          txt_ids=torch.zeros(text["hidden"].shape[1], 3), img_ids=ids, return_dict=False)[0]
        prediction = FluxFillPipeline._unpack_latents(out, height, width, 8)
        expected = torch.nn.functional.mse_loss(prediction, noise - x)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_a_full_finetune_trains_exports_a_fill_pipeline_and_samples_as_it_does(fill_model, partly_masked_data,
                                                                              tmp_path):
    from diffusers import FluxFillPipeline
    from safetensors.torch import load_file

    sample = {"prompt": "a red circle", "seed": 3, "steps": 3, "width": 64, "height": 48}
    out = tmp_path / "o"
    trainer = fill_trainer(fill_model, partly_masked_data, out, epochs=4, **{"model.inpainting": True,
                                                                             "sampling.prompts": [sample]})
    per_epoch = np.array(trainer.train().losses).reshape(4, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"

    trained = load_file(out / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
    base = load_file(fill_model / "transformer" / "diffusion_pytorch_model.safetensors")
    assert trained["x_embedder.weight"].shape == (32, 384)
    # the masked-image and mask input channels learn too
    assert (trained["x_embedder.weight"][:, 64:] - base["x_embedder.weight"][:, 64:]).abs().max() > 1e-6

    pipe = FluxFillPipeline.from_pretrained(out / "model", local_files_only=True)
    assert type(pipe) is FluxFillPipeline
    # The sample repaints the whole image from pure noise (a full mask, so a blank masked image), as OneTrainer
    # samples a Fill model without a sample image; Flux's sample guidance 3.5.
    blank, full = Image.new("RGB", (64, 48), (40, 200, 90)), Image.new("L", (64, 48), 255)
    expected = pipe("a red circle", image=blank, mask_image=full, strength=1.0, height=48, width=64,
                    num_inference_steps=3, guidance_scale=3.5, generator=torch.Generator().manual_seed(3),
                    max_sequence_length=32).images[0]
    (written,) = sorted((out / "samples").glob("step-*/*.png"))[-1:]
    ours = np.asarray(Image.open(written).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - np.asarray(expected).astype(int)).max() <= 1
    kept = pipe("a red circle", image=blank, mask_image=Image.new("L", (64, 48), 0), strength=1.0, height=48,
                width=64, num_inference_steps=3, guidance_scale=3.5, generator=torch.Generator().manual_seed(3),
                max_sequence_length=32).images[0]
    assert np.abs(ours - np.asarray(kept).astype(int)).max() > 1  # the condition reached the sample


def test_the_lora_loads_in_the_fill_pipeline(fill_model, partly_masked_data, tmp_path):
    from diffusers import FluxFillPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file
    from test_family_flux import comfyui_transformer_keys

    trainer = fill_trainer(fill_model, partly_masked_data, tmp_path / "o", method="lora", max_steps=3,
                           learning_rate=3e-3)
    assert np.isfinite(trainer.train().losses).all()
    model = trainer.model
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert modules and modules <= comfyui_transformer_keys(fill_model)  # Flux's rule: ComfyUI runs Fill as Flux
    with safe_open(tmp_path / "o" / "lora.safetensors", "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "flux.1-dev/inpaint/lora"  # SwarmUI's Fill class

    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16 + 16 + 64, 8, 8), torch.tensor([500.0])  # noisy latent + the condition
    conditioning = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, ["a dot"]))
    with torch.no_grad():
        trained = model.family.predict(model.denoiser, noisy, t, conditioning, {})
        loaded = FluxFillPipeline.from_pretrained(fill_model, local_files_only=True)
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
        again = model.family.predict(loaded.transformer, noisy, t, conditioning, {})
        plain = model.family.predict(FluxFillPipeline.from_pretrained(fill_model, local_files_only=True).transformer,
                                     noisy, t, conditioning, {})
    assert trained.shape == (1, 16, 8, 8)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)
    assert (plain - trained).abs().max() > 1e-4  # the LoRA changed the prediction: the comparison can fail


def test_the_inpainting_option_checks_the_transformer(fill_model, family_models):
    with pytest.raises(ConfigError, match=r"model.inpainting: true, but the transformer of model.path has 64 input "
                                          r"channels; an inpainting transformer has 384 \(packed noisy latent 64"):
        load_model(ModelConfig(family="flux", path=str(family_models["flux"]), inpainting=True))
    with pytest.raises(ConfigError, match=r"model.inpainting: false, but model.path is an inpainting model \(384"):
        load_model(ModelConfig(family="flux", path=str(fill_model), inpainting=False))
    loaded = load_model(ModelConfig(family="flux", path=str(fill_model)))  # null: detected
    assert loaded.inpainting and type(loaded.pipeline).__name__ == "FluxFillPipeline"
    with pytest.raises(ConfigError, match="model.inpainting: model family flux_kontext has no inpainting models"):
        validate(base_config(fill_model, fill_model, fill_model / "o", family="flux_kontext",
                             **{"model.inpainting": True}))


def test_black_forest_labs_single_file_loads_as_the_folder(fill_model, tmp_path):
    """flux1-fill-dev.safetensors is Flux's layout with a wider img_in: Flux's key map reads it with a Fill config."""
    import json

    from safetensors.torch import load_file, save_file

    from ot_dist.models.families.flux_single_file import FLUX

    state = load_file(fill_model / "transformer" / "diffusion_pytorch_model.safetensors")
    config = json.loads((fill_model / "transformer" / "config.json").read_text())
    single = tmp_path / "flux1-fill-tiny.safetensors"
    original = FLUX.to_original(state, config)
    assert original["img_in.weight"].shape[1] == 384
    save_file({k: v.contiguous() for k, v in original.items()}, single)
    loaded = load_model(ModelConfig(family="flux", path=str(single), config=str(fill_model)))
    assert loaded.inpainting and type(loaded.pipeline).__name__ == "FluxFillPipeline"
    got = loaded.denoiser.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
