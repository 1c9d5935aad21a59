"""Wan 2.2 A14B, one expert per run (model.wan_expert), on a tiny folder of the A14B layout (two random tiny
transformers, boundary_ratio 0.875 in model_index.json as WanPipeline.save_pretrained writes it): the option's
validation, only the chosen expert built, the draws on its side of the boundary (the usual draw conditioned on it),
the loss equal to the step WanPipeline's conventions give for that expert, the low-noise LoRA through
load_lora_weights(load_into_transformer_2=True), samples refused and the full export as an A14B folder again."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import load_model
from ot_dist.models.objectives import FlowMatching
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

SHIFT, BOUNDARY = 3.0, 875.0  # the tiny scheduler's flow_shift; boundary_ratio 0.875 x 1000 timesteps
EXPERT_SLOT = {"high_noise": "transformer", "low_noise": "transformer_2"}


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan22") / "a14b"
    get_family("wan").build_tiny(seed=0, a14b=True).save_pretrained(folder)
    return folder


def quiet(*_):
    pass


def trainer_for(model, data, out, expert, method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, "model.wan_expert": expert, **overrides}
    return Trainer(validate(base_config(model, data, out, family="wan", method=method, **settings)), log=quiet)


def test_the_a14b_layout_is_what_diffusers_saves(a14b):
    index = json.loads((a14b / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]


def test_wan_expert_is_required_for_a14b_and_refused_elsewhere(a14b, family_models):
    with pytest.raises(InputFileError, match="model.wan_expert"):
        load_model(ModelConfig(family="wan", path=str(a14b)))
    with pytest.raises(InputFileError, match="model.wan_expert: high_noise .* one transformer"):
        load_model(ModelConfig(family="wan", path=str(family_models["wan"]), wan_expert="high_noise"))
    with pytest.raises(ConfigError, match="model.wan_expert: model.family sd1 has no such setting"):
        get_family("sd1").configure(ModelConfig(family="sd1", path="x", wan_expert="low_noise"))
    with pytest.raises(ValueError, match="wan_expert"):
        ModelConfig(family="wan", path="x", wan_expert="middle")


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_only_the_chosen_expert_is_built_in_the_denoiser_slot(a14b, monkeypatch, expert):
    from diffusers import WanPipeline, WanTransformer3DModel

    reference = WanPipeline.from_pretrained(a14b, local_files_only=True)
    built = []
    original = WanTransformer3DModel.__init__

    @functools.wraps(original)
    def counting(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(WanTransformer3DModel, "__init__", counting)
    model = load_model(ModelConfig(family="wan", path=str(a14b), wan_expert=expert))
    assert len(built) == 1 and model.pipeline.transformer is built[0] and model.pipeline.transformer_2 is None
    assert model.denoiser is built[0]
    expected = getattr(reference, EXPERT_SLOT[expert]).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.denoiser.state_dict().items())
    # a full export's source: the trained expert given, nothing read for the denoiser, the other expert still absent
    source = load_model(ModelConfig(family="wan", path=str(a14b), wan_expert=expert),
                        given={"transformer": model.denoiser})
    assert len(built) == 1 and source.pipeline.transformer is model.denoiser and source.pipeline.transformer_2 is None


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_draws_are_the_usual_draws_kept_on_the_experts_side(a14b, expert):
    """Over many draws every t is on the expert's side (WanPipeline: transformer at t >= 875, transformer_2 below),
    and they are the unrestricted draws that land there, in order: the distribution's shape within the side kept."""
    model = load_model(ModelConfig(family="wan", path=str(a14b), wan_expert=expert))
    plain = FlowMatching(shift=SHIFT)
    shape = torch.Size((16, 8, 8))
    g = torch.Generator().manual_seed(1)
    ours = torch.cat([model.objective.draw(g, None, shape) for _ in range(2000)])
    g = torch.Generator().manual_seed(1)
    usual = torch.cat([plain.draw(g, None, shape) for _ in range(12000)])
    kept = usual[usual >= BOUNDARY] if expert == "high_noise" else usual[usual < BOUNDARY]
    assert len(kept) >= 2000 and 0.05 < (usual >= BOUNDARY).float().mean() < 0.5  # both sides reachable
    torch.testing.assert_close(ours, kept[:2000], rtol=0, atol=0)
    assert bool((ours >= BOUNDARY).all()) if expert == "high_noise" else bool((ours < BOUNDARY).all())


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_objective_equals_the_pipelines_expert_at_the_drawn_time(a14b, shapes_data, tmp_path, expert):
    """diffusion_loss against the step written out: the logit-normal u shifted by flow_shift, redrawn until on the
    expert's side, x_t = (1 - s) x + s n, the transformer WanPipeline uses at t = 1000 s (its own `transformer` /
    `transformer_2` from the folder), MSE against n - x."""
    from diffusers import WanPipeline

    trainer = trainer_for(a14b, shapes_data, tmp_path / "o", expert)
    model, options = trainer.model, trainer.config.loss
    pipe = WanPipeline.from_pretrained(a14b, local_files_only=True)
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    pixels, vae = batch["pixels"], model.vae
    shape = (16, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        while True:
            u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
            sigma = SHIFT * u / (1 + (SHIFT - 1) * u)
            if (sigma * 1000 >= BOUNDARY) == (expert == "high_noise"):
                break
        sigmas.append(sigma)
    eps, noise = torch.stack(eps)[:, :, None], torch.stack(noise)[:, :, None]
    t = torch.tensor(sigmas, dtype=torch.float32) * 1000
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    transformer = pipe.transformer if bool((t >= boundary).all()) else pipe.transformer_2  # WanPipeline's choice
    assert transformer is getattr(pipe, EXPERT_SLOT[expert])
    with torch.no_grad():
        posterior = vae.encode(pixels[:, :, None]).latent_dist
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        x = (posterior.mean + posterior.std * eps - mean) / std
        sigma = t.view(-1, 1, 1, 1, 1) / 1000
        hidden, _ = pipe.encode_prompt(list(batch["caption"]), do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=32)
        out = transformer(hidden_states=(1 - sigma) * x + sigma * noise, timestep=t, encoder_hidden_states=hidden,
                          return_dict=False)[0]
        expected = torch.nn.functional.mse_loss(out, noise - x)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def outputs(transformer, text_encoder, tokenizer, family):
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([500.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a red dot"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def test_low_noise_lora_loads_into_transformer_2(a14b, shapes_data, tmp_path):
    """The low-noise expert's LoRA file (the `transformer.` layout) through WanPipeline.load_lora_weights(...,
    load_into_transformer_2=True) on the full A14B pipeline gives the trained outputs, and leaves the high-noise
    expert as it was; the ComfyUI file names the same modules `diffusion_model.<original>` (each expert is its own
    diffusion model file there)."""
    from diffusers import WanPipeline

    trainer = trainer_for(a14b, shapes_data, tmp_path / "o", "low_noise", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    assert saved and all(k.startswith("transformer.blocks.") for k in saved)
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    assert comfy and all(k.startswith("diffusion_model.blocks.") for k in comfy)
    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], family)

    pipe = WanPipeline.from_pretrained(a14b, local_files_only=True)
    base_low = outputs(pipe.transformer_2, pipe.text_encoder, pipe.tokenizer, family)
    base_high = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    assert (base_low - trained).abs().max() > 1e-4
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors", load_into_transformer_2=True)
    torch.testing.assert_close(outputs(pipe.transformer_2, pipe.text_encoder, pipe.tokenizer, family), trained,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family), base_high)


def test_samples_are_refused_for_a_one_expert_run(a14b, shapes_data, tmp_path):
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 2, "width": 64, "height": 48}
    with pytest.raises(ConfigError, match="sampling.prompts: a Wan 2.2 A14B run trains one expert"):
        trainer_for(a14b, shapes_data, tmp_path / "o", "high_noise", method="lora", **{"sampling.prompts": [prompt]})


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_full_export_is_the_a14b_folder_with_the_trained_expert_in_its_slot(a14b, shapes_data, tmp_path, expert):
    from diffusers import WanPipeline

    trainer = trainer_for(a14b, shapes_data, tmp_path / "o", expert, max_steps=2, learning_rate=1e-3)
    trainer.train()
    export = tmp_path / "o" / "model"
    index = json.loads((export / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    trained_slot = EXPERT_SLOT[expert]
    name = "diffusion_pytorch_model.safetensors"
    for slot in ("transformer", "transformer_2"):
        before, after = load_file(a14b / slot / name), load_file(export / slot / name)
        changed = max((before[k].float() - after[k].float()).abs().max().item() for k in before)
        assert (changed > 1e-4) if slot == trained_slot else (changed == 0), (slot, changed)
    loaded = WanPipeline.from_pretrained(export, local_files_only=True)
    family = trainer.model.family
    ours = outputs(trainer.model.denoiser, trainer.model.text_encoders["text_encoder"],
                   trainer.model.tokenizers["tokenizer"], family)
    torch.testing.assert_close(outputs(getattr(loaded, trained_slot), loaded.text_encoder, loaded.tokenizer, family),
                               ours)
    # ot_dist trains the export again, as an A14B folder
    again = load_model(ModelConfig(family="wan", path=str(export), wan_expert=expert))
    assert again.pipeline.transformer_2 is None
