"""SD3 / SD3.5 on the family contract: the objective against a hand computation, text encoding against the
pipeline's own, training (full, LoRA) with exports diffusers loads, Stability's single-file layout, samples."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.models.tiny import make_tiny_model
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def sd35_model(tmp_path_factory):
    """SD3.5's layout: qk RMS norms and a dual-attention layer."""
    return make_tiny_model(tmp_path_factory.mktemp("sd35") / "sd35", "sd3", variant="sd35")


def trainer_for(model, data, out, method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family="sd3", method=method, **settings)), log=quiet)


def test_sd3_objective_equals_a_hand_computation(family_models, shapes_data, tmp_path):
    """sigma = 3u / (1 + 2u) from the sample's logit-normal u, x_t = (1 - sigma) x + sigma n, target n - x, the
    raw timestep sigma x 1000 in."""
    trainer = trainer_for(family_models["sd3"], shapes_data, tmp_path / "o")
    model = trainer.model
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    loss = diffusion_loss(model, batch, 1, 0)
    vae, shape = model.vae, (16, batch["pixels"].shape[-2] // 8, batch["pixels"].shape[-1] // 8)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(3 * u / (1 + 2 * u))
    eps, noise = torch.stack(eps), torch.stack(noise)
    with torch.no_grad():
        posterior = vae.encode(batch["pixels"]).latent_dist
        x = ((posterior.mean + posterior.std * eps) - 0.0609) * 1.5305
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        hidden, _, pooled, _ = model.pipeline.encode_prompt(batch["caption"], batch["caption"], batch["caption"],
                                                            do_classifier_free_guidance=False, max_sequence_length=32)
        out = model.denoiser(hidden_states=(1 - sigma) * x + sigma * noise, timestep=sigma.flatten() * 1000,
                             encoder_hidden_states=hidden, pooled_projections=pooled, return_dict=False)[0]
    torch.testing.assert_close(loss.detach(), torch.nn.functional.mse_loss(out, noise - x), rtol=1e-5, atol=1e-6)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    model = trainer_for(family_models["sd3"], shapes_data, tmp_path / "o").model
    captions = ["a red circle", "a big green square on a white background"]
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        hidden, _, pooled, _ = model.pipeline.encode_prompt(captions, captions, captions,
                                                            do_classifier_free_guidance=False, max_sequence_length=32)
    torch.testing.assert_close(ours["hidden"], hidden)
    torch.testing.assert_close(ours["pooled"], pooled)


@pytest.mark.parametrize("variant,method", [("sd3", "full"), ("sd3", "lora"), ("sd35", "lora")])
def test_training_lowers_the_loss_and_the_exports_load_in_diffusers(variant, method, family_models, sd35_model,
                                                                  shapes_data, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    base = family_models["sd3"] if variant == "sd3" else sd35_model
    extra = {"text_encoder.train": True} if method == "lora" else {}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method=method, epochs=6,
                          learning_rate=3e-4 if method == "full" else 2e-2, **extra)
    per_epoch = np.array(trainer.train().losses).reshape(6, -1).mean(axis=1)
    assert per_epoch[-2:].mean() < per_epoch[0] - 0.05, f"loss did not fall: {per_epoch}"
    model = trainer.model
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 8, 8), torch.tensor([500.0])

    def prediction(pipe):
        encoders = {n: getattr(pipe, n) for n in model.family.text_encoders}
        tokenizers = {n: getattr(pipe, n) for n in model.family.tokenizers}
        with torch.no_grad():
            conditioning = model.family.encode_text(encoders, model.family.tokenize(tokenizers, ["a dot"]))
            return model.family.predict(pipe.transformer, noisy, t, conditioning, {})

    if method == "full":
        loaded = StableDiffusion3Pipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    else:
        loaded = StableDiffusion3Pipeline.from_pretrained(base, local_files_only=True)
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(prediction(loaded), prediction(model.pipeline), rtol=1e-4, atol=1e-5)


def test_stability_single_file_loads_in_diffusers_and_trains_like_the_folder(family_models, shapes_data, tmp_path):
    """The export's single file (Stability's layout: model.diffusion_model.* and first_stage_model.*) is what
    diffusers' from_single_file reads as the trained transformer, and loads back with the folder's other components
    and trains exactly like the folder."""
    from diffusers import SD3Transformer2DModel

    folder = family_models["sd3"]
    first = trainer_for(folder, shapes_data, tmp_path / "first", max_steps=1)
    first.train()
    single = tmp_path / "first" / "model.safetensors"
    header = load_file(single)
    assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in header
    assert any(k.startswith("first_stage_model.") for k in header)
    loaded = SD3Transformer2DModel.from_single_file(single, config=str(tmp_path / "first" / "model"),
                                                     subfolder="transformer").state_dict()
    for key, value in first.model.denoiser.state_dict().items():
        assert torch.equal(loaded[key], value), key
    weights = []
    for name, path, extra in (("folder", tmp_path / "first" / "model", {}),
                              ("single", single, {"model.config": str(tmp_path / "first" / "model")})):
        trainer_for(path, shapes_data, tmp_path / name, max_steps=2, **extra).train()
        weights.append(load_file(tmp_path / name / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_samples_equal_the_pipeline_on_the_export(family_models, shapes_data, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 64, "height": 64}
    trainer_for(family_models["sd3"], shapes_data, tmp_path / "o", max_steps=2, **{"sampling.prompts": [prompt]}).train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    image = pipe(prompt="a red circle", width=64, height=64, num_inference_steps=3, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, output_type="pil").images[0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1


def test_min_snr_is_refused_by_name_for_flow_matching(family_models, shapes_data, tmp_path):
    from ot_dist.errors import ConfigError

    with pytest.raises(ConfigError, match="loss.min_snr_gamma"):
        trainer_for(family_models["sd3"], shapes_data, tmp_path / "o", **{"loss.min_snr_gamma": 5.0})


def test_bfloat16_transformer_sees_the_timestep_as_the_pipeline_passes_it():
    """StableDiffusion3Pipeline (and diffusers' SD3 training scripts) hand the transformer the scheduler's float32
    timesteps, whatever the transformer's dtype; rounding them to bfloat16 first moves t by up to 2 near 1000 and
    changes the prediction."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from ot_dist.models.families.sd3 import SD3

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64, out_channels=16,
        pos_embed_max_size=32).to(torch.bfloat16)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(28)
    timesteps = scheduler.timesteps[[1, 6]]  # what the pipeline's denoising loop passes, float32
    assert not torch.equal(timesteps.bfloat16().float(), timesteps)  # bfloat16 would move them
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 8, 8, generator=g).bfloat16()
    conditioning = {"hidden": torch.randn(2, 5, 64, generator=g).bfloat16(),
                    "pooled": torch.randn(2, 64, generator=g).bfloat16()}
    with torch.no_grad():
        ours = SD3().predict(transformer, noisy, timesteps, conditioning, {})
        pipeline = transformer(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=conditioning["hidden"],
                               pooled_projections=conditioning["pooled"], return_dict=False)[0]
    assert torch.equal(ours, pipeline)
