"""SD 2.0 depth (sd2 with a 5-channel UNet, OneTrainer's STABLE_DIFFUSION_20_DEPTH): the depth map equals
StableDiffusionDepth2ImgPipeline.prepare_depth_map for the same images, the step equals the pipeline's UNet input
written out for one batch, the export loads in that pipeline, LoRA files load through its load_lora_weights, and what
it refuses (cached latents, samples) is refused before training."""

from __future__ import annotations

import json
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
from ot_dist.models.depth import depth_map, images_of
from ot_dist.models.loading import load_model
from ot_dist.models.tiny import make_tiny_model
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def depth_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sd2-depth") / "depth", "sd2", depth=True)


def depth_trainer(model, data, out, method="full", **overrides):
    raw = base_config(model, data, out, family="sd2", method=method, **{"batch_size": 2, **overrides})
    return Trainer(validate(raw), log=quiet)


def test_the_depth_map_equals_the_pipelines_prepare_depth_map(depth_model):
    from diffusers import StableDiffusionDepth2ImgPipeline

    pipe = StableDiffusionDepth2ImgPipeline.from_pretrained(depth_model, local_files_only=True)
    g = torch.Generator().manual_seed(0)
    images = [Image.fromarray(np.asarray(torch.randint(0, 256, (64, 48, 3), generator=g), dtype=np.uint8))
              for _ in range(2)]
    pixels = torch.stack([torch.from_numpy(np.asarray(i, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
                          for i in images])  # as the data path makes them
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images_of(pixels), images))
    ours = depth_map(pipe.depth_estimator, pipe.feature_extractor, pixels, (8, 6))
    with torch.no_grad():
        expected = pipe.prepare_depth_map(images, None, 2, False, torch.float32, torch.device("cpu"))
    assert ours.shape == expected.shape == (2, 1, 8, 6)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert ours.amin() == -1 and ours.amax() == 1 and ours.std() > 0.1  # a map with depth in it


def test_the_step_equals_the_pipelines_unet_input_written_out(depth_model, shapes_data, tmp_path):
    """SD's epsilon step (add_noise at the drawn timestep, target the noise) with the UNet input the pipeline builds:
    the noisy latent, then prepare_depth_map of the same images."""
    from diffusers import StableDiffusionDepth2ImgPipeline

    trainer = depth_trainer(depth_model, shapes_data, tmp_path / "o")
    model = trainer.model
    assert model.depth_conditioned and not model.inpainting
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    seed, epoch = 1, 0
    loss = diffusion_loss(model, batch, seed, epoch)

    pipe, scheduler = model.pipeline, model.pipeline.scheduler
    assert type(pipe) is StableDiffusionDepth2ImgPipeline and scheduler.config.prediction_type == "epsilon"
    height, width = batch["pixels"].shape[-2:]
    shape = (4, height // 8, width // 8)
    eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        timesteps.append(model.objective.draw(g, None, shape))
    eps, noise, timesteps = torch.stack(eps), torch.stack(noise), torch.cat(timesteps)
    images = [Image.fromarray(((p.permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy())
              for p in batch["pixels"]]
    with torch.no_grad():
        posterior = pipe.vae.encode(batch["pixels"]).latent_dist
        x = (posterior.mean + posterior.std * eps) * pipe.vae.config.scaling_factor
        noisy = scheduler.add_noise(x, noise, timesteps)
        depth = pipe.prepare_depth_map(images, None, 2, False, torch.float32, torch.device("cpu"))
        hidden = pipe.text_encoder(batch["token_ids"]["text_encoder"])[0]
        prediction = pipe.unet(torch.cat([noisy, depth], dim=1), timesteps, hidden).sample
        expected = torch.nn.functional.mse_loss(prediction, noise)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_a_full_finetune_trains_and_exports_a_depth_pipeline(depth_model, shapes_data, tmp_path):
    from diffusers import StableDiffusionDepth2ImgPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "o"
    trainer = depth_trainer(depth_model, shapes_data, out, epochs=4, learning_rate=1e-3)
    per_epoch = np.array(trainer.train().losses).reshape(4, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.01, f"loss did not fall: {per_epoch}"
    trained = load_file(out / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    base = load_file(depth_model / "unet" / "diffusion_pytorch_model.safetensors")
    assert trained["conv_in.weight"].shape[1] == 5
    assert (trained["conv_in.weight"][:, 4:] - base["conv_in.weight"][:, 4:]).abs().max() > 1e-6  # the depth input
    pipe = StableDiffusionDepth2ImgPipeline.from_pretrained(out / "model", local_files_only=True)
    image = Image.fromarray(np.asarray(torch.randint(0, 256, (64, 64, 3)), dtype=np.uint8))
    output = pipe("a red circle", image=image, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert output.shape == (1, 64, 64, 3) and np.isfinite(output).all()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-v2-depth"  # the spec's id


def test_the_lora_loads_in_the_depth_pipeline(depth_model, shapes_data, tmp_path):
    from diffusers import StableDiffusionDepth2ImgPipeline

    trainer = depth_trainer(depth_model, shapes_data, tmp_path / "o", method="lora", max_steps=3,
                            learning_rate=3e-2)
    assert np.isfinite(trainer.train().losses).all()
    model = trainer.model
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 5, 8, 8), torch.tensor([500])  # noisy latent + depth
    conditioning = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, ["a dot"]))
    with torch.no_grad():
        trained = model.family.predict(model.denoiser, noisy, t, conditioning, {})
        loaded = StableDiffusionDepth2ImgPipeline.from_pretrained(depth_model, local_files_only=True)
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
        again = model.family.predict(loaded.unet, noisy, t, conditioning, {})
        plain = model.family.predict(StableDiffusionDepth2ImgPipeline.from_pretrained(
            depth_model, local_files_only=True).unet, noisy, t, conditioning, {})
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)
    assert (plain - trained).abs().max() > 1e-4  # the LoRA changed the prediction: the comparison can fail


def test_the_published_folders_processor_name_and_the_refusals(depth_model, shapes_data, tmp_path):
    """stabilityai/stable-diffusion-2-depth's model_index.json names DPTFeatureExtractor (gone in transformers 5)."""
    folder = shutil.copytree(depth_model, tmp_path / "published")
    index = json.loads((folder / "model_index.json").read_text())
    index["feature_extractor"] = ["transformers", "DPTFeatureExtractor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    loaded = load_model(ModelConfig(family="sd2", path=str(folder)))
    assert loaded.depth_conditioned and type(loaded.pipeline.feature_extractor).__name__.startswith("DPTImageProcessor")
    from safetensors.torch import load_file

    for name in ("unet", "depth_estimator"):
        (weights,) = (folder / name).glob("*.safetensors")
        state, got = load_file(weights), getattr(loaded.pipeline, name).state_dict()
        assert all(torch.equal(got[k], v) for k, v in state.items())

    with pytest.raises(ConfigError, match="data.cache_latents: model.path is a depth-conditioned model"):
        depth_trainer(depth_model, shapes_data, tmp_path / "c", **{"data.cache_latents": True})
    with pytest.raises(ConfigError, match=r"sampling.prompts: a depth-conditioned model \(SD 2.0 depth\)"):
        depth_trainer(depth_model, shapes_data, tmp_path / "s", **{"sampling.prompts": [{"prompt": "a dot"}]})
