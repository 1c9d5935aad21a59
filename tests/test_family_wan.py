"""Wan 2.1 on the family contract, images as one-frame videos: text encoding against WanPipeline.encode_prompt, the
objective against WanPipeline's conventions and SimpleTuner's flow-matching step written out (5-D latents normalised
with latents_mean / latents_std, x_t = (1 - s) x + s n with s shifted by the scheduler's flow_shift, the raw timestep
in, MSE against n - x), training (full: the transformer alone changes and reloads; LoRA: the file
WanPipeline.load_lora_weights reads gives the trained outputs) and samples equal to WanPipeline's one-frame output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

FAMILY = "wan"
SHIFT = 3.0  # the tiny model's scheduler: UniPCMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True), Wan 2.1 480p


def quiet(*_):
    pass


def trainer_for(model, data, out, method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family=FAMILY, method=method, **settings)), log=quiet)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The caption cleaned as the pipeline does (extra whitespace, HTML entities), padded with the mask, UMT5's states
    past each caption zeroed: equal to WanPipeline.encode_prompt at the same max_sequence_length."""
    model = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o").model
    captions = ["a  red &amp; circle ", "a big green square on a white background"]
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32  # the tiny tokenizer's length (512 with UMT5-XXL's)
    with torch.no_grad():
        tokens = model.family.tokenize(model.tokenizers, captions)
        ours = model.family.encode_text(model.text_encoders, tokens)
        hidden, _ = model.pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device="cpu",
                                                 max_sequence_length=options["max_sequence_length"])
    mask = tokens["text_encoder_mask"]
    assert 0 < mask.sum() < mask.numel() and mask[0].sum() < mask[1].sum()  # padded, the cleaned caption shorter
    assert ours["hidden"][0, mask[0].sum():].abs().max() == 0  # zeros past the caption, as the pipeline's
    torch.testing.assert_close(ours["hidden"], hidden)


def test_objective_equals_the_pipelines_conventions_and_simpletuners_step(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against the step written out with the same draws: the VAE's posterior of the images
    as (B, 3, 1, H, W) clips, (x - latents_mean) / latents_std (the inverse of WanPipeline's decode), sigma the
    logit-normal u shifted by flow_shift (SimpleTuner: shift u / (1 + (shift - 1) u)), x_t = (1 - s) x + s n, the
    transformer called as WanPipeline calls it (5-D latents, the timestep 1000 s in float32, the prompt embeddings,
    no mask), MSE against n - x."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    assert model.objective.shift == SHIFT
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    vae = model.vae
    pixels = batch["pixels"]
    shape = (16, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(SHIFT * u / (1 + (SHIFT - 1) * u))
    eps, noise = torch.stack(eps)[:, :, None], torch.stack(noise)[:, :, None]  # (B, C, 1, h, w)
    with torch.no_grad():
        posterior = vae.encode(pixels[:, :, None]).latent_dist
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        x = (posterior.mean + posterior.std * eps - mean) / std
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1, 1)
        hidden, _ = model.pipeline.encode_prompt(list(batch["caption"]), do_classifier_free_guidance=False,
                                                 device="cpu", max_sequence_length=32)
        out = model.denoiser(hidden_states=(1 - sigma) * x + sigma * noise, timestep=sigma.flatten() * 1000,
                             encoder_hidden_states=hidden, return_dict=False)[0]
        expected = torch.nn.functional.mse_loss(out, noise - x)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def outputs(transformer, text_encoder, tokenizer, family):
    """The transformer's prediction for fixed noisy latents and a caption, the text encoded by `text_encoder`."""
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([500.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a red dot"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def test_lora_file_loads_in_the_pipeline_and_samples_equal_its_one_frame(family_models, shapes_data, tmp_path):
    """One LoRA run (attention and the feed-forward): its file through WanPipeline.load_lora_weights gives the
    trained transformer's outputs, and its end-of-training sample equals WanPipeline's frame (num_frames=1) on the
    base model with that file, flow_euler at the model's flow_shift, the same seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 64, "height": 48}
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp",
                                                 "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    assert all(k.startswith("transformer.blocks.") for k in saved)
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert {m.split(".", 3)[-1] for m in modules} == {
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
        "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"}
    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], family)

    pipe = WanPipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    base = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    assert (base - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    again = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=SHIFT)
    frame = pipe(prompt="a red circle", width=64, height=48, num_frames=1, num_inference_steps=3, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, output_type="pil").frames[0][0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - np.asarray(frame).astype(int)).max() <= 1


def test_full_finetune_trains_the_transformer_and_the_export_reloads(family_models, shapes_data, tmp_path):
    from diffusers import WanPipeline

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-3)
    trainer.train()
    export = tmp_path / "o" / "model"
    for part, trained in (("transformer", True), ("vae", False), ("text_encoder", False)):
        name = "model.safetensors" if part == "text_encoder" else "diffusion_pytorch_model.safetensors"
        before, after = load_file(base / part / name), load_file(export / part / name)
        changed = max((before[k].float() - after[k].float()).abs().max().item() for k in before)
        assert (changed > 1e-4) if trained else (changed == 0), (part, changed)
    loaded = WanPipeline.from_pretrained(export, local_files_only=True)
    assert type(loaded.scheduler).__name__ == "UniPCMultistepScheduler"  # the model's own scheduler kept
    family = trainer.model.family
    ours = outputs(trainer.model.denoiser, trainer.model.text_encoders["text_encoder"],
                   trainer.model.tokenizers["tokenizer"], family)
    torch.testing.assert_close(outputs(loaded.transformer, loaded.text_encoder, loaded.tokenizer, family), ours)


@pytest.mark.parametrize("method,lr", [("lora", 1e-2), ("full", 1e-3)])
def test_loss_falls_on_the_demo_data(family_models, shapes_data, tmp_path, method, lr):
    """A few steps on one batch at fixed draws lower the loss (the gradient reaches the trained parameters)."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method=method,
                          **{"lora.rank": 8, "lora.alpha": 8})
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    model = trainer.model
    params = [p for p in model.denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(8):
        loss = diffusion_loss(model, batch, 1, 0, trainer.config.loss)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), losses


def test_unsupported_wan_variants_are_refused():
    """Wan 2.2 A14B (two experts) and TI2V-5B (per-token timesteps) would train wrongly as a single Wan 2.1
    transformer: refused when the folder loads."""
    from ot_dist.errors import ConfigError
    from ot_dist.models.families.registry import get_family
    from ot_dist.models.families.wan import refuse_unsupported_variant

    pipeline = get_family(FAMILY).build_tiny()
    refuse_unsupported_variant(pipeline)  # Wan 2.1: accepted
    pipeline.register_to_config(boundary_ratio=0.875)
    with pytest.raises(ConfigError, match="A14B"):
        refuse_unsupported_variant(pipeline)
    pipeline.register_to_config(boundary_ratio=None, expand_timesteps=True)
    with pytest.raises(ConfigError, match="TI2V-5B"):
        refuse_unsupported_variant(pipeline)
    # from model_index.json, before from_pretrained loads anything
    family = get_family(FAMILY)
    single = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
              "transformer_2": [None, None], "boundary_ratio": None}
    assert family.load_folder(None, single) is None
    with pytest.raises(ConfigError, match="A14B"):
        family.load_folder(None, {**single, "transformer_2": ["diffusers", "WanTransformer3DModel"],
                                  "boundary_ratio": 0.875})


def test_a_video_clip_in_a_concept_is_refused_not_skipped(family_models, shapes_data, tmp_path):
    """Without data.video_frames a video clip in the data folder stops the run with a message naming it (and pointing
    at data.video_frames), where an image family lists it among the unused files (clips as data: test_video_clips.py)."""
    import shutil

    from ot_dist.errors import InputFileError

    data = tmp_path / "data"
    shutil.copytree(shapes_data, data)
    (data / "clip.mp4").write_bytes(b"\0" * 16)
    with pytest.raises(InputFileError, match=r"1 video clip \(.*clip\.mp4\).*unless data.video_frames is set"):
        trainer_for(family_models[FAMILY], data, tmp_path / "o")


def test_comfyui_file_follows_comfyuis_generic_rule_and_loads_in_the_pipeline(family_models, shapes_data, tmp_path):
    """lora_comfyui.safetensors names every module `diffusion_model.<original key>` (ComfyUI's generic rule in
    comfy/lora.py model_lora_keys_unet: `diffusion_model.<key>` minus `.weight`, the only one that maps Wan), with
    `.lora_A/B.weight` and no `.alpha` (the scale inside the weights: strength 1 in both loaders); the original keys are the ones diffusers' single-file converter turns
    into the trained diffusers modules, and WanPipeline.load_lora_weights reads the file (its non-diffusers Wan
    converter) to the trained outputs."""
    from diffusers import WanPipeline
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "all_linear"})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    diffusers_file = load_file(tmp_path / "o" / "lora.safetensors")
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    trained_modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in diffusers_file}
    originals = {k.rsplit(".lora_", 1)[0] for k in comfy}
    assert all(k.startswith("diffusion_model.") for k in originals) and len(originals) == len(trained_modules)
    assert len(comfy) == 2 * len(originals)  # lora_A and lora_B of each module
    assert all(f"{m}.lora_A.weight" in comfy and f"{m}.lora_B.weight" in comfy for m in originals)
    # the original keys, through diffusers' own single-file renames, are the trained modules' paths
    fake = {m.removeprefix("diffusion_model.") + ".weight": torch.zeros(1) for m in originals}
    renamed = {k.removesuffix(".weight") for k in convert_wan_transformer_to_diffusers(fake)}
    assert renamed == trained_modules
    assert any(".self_attn.o" in m for m in originals) and any(m.endswith("head.head") for m in originals)

    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], family)
    pipe = WanPipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    pipe.load_lora_weights(tmp_path / "o" / "lora_comfyui.safetensors")
    again = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)
