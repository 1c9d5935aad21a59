"""ERNIE-Image on the family contract: the conditioning against ErnieImagePipeline.encode_prompt (plain tokens,
hidden_states[-2], one caption at a time without padding; ours padded and masked), the objective against OneTrainer's
BaseErnieSetup.predict written out for one batch (there is no diffusers training script: patchified latents
normalised by the VAE's batch norm with the pipeline's eps, x_t = (1 - s) x + s n, the transformer at t = 1000 s with
the padded caption states and their lengths, MSE against n - x), training (full: the transformer alone moves, the
export reloads through from_pretrained, its single file through from_single_file; LoRA: the file
ErnieImagePipeline.load_lora_weights reads, under ComfyUI's ERNIE-Image key rule), samples equal to the pipeline's.
The 2-rank fsdp and zero2 comparisons ride in Flux's launch (tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from safetensors.torch import load_file

from family_training import family_trainer, first_batch, losses_around_training
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "ernie_image"
trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The pipeline's per-caption hidden states are ours cut at each caption's length; the padding is zero; an empty
    caption is the BOS token alone in both."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, captions = trainer.model, ["a red circle on a blue background", "a big yellow square", ""]
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        theirs = model.pipeline.encode_prompt(captions, device="cpu")
    lengths = ours["mask"].sum(1).tolist()
    assert lengths == [len(t) for t in theirs] and lengths[0] != lengths[1] and lengths[2] == 1
    for hidden, mask, expected in zip(ours["hidden"], ours["mask"], theirs):
        torch.testing.assert_close(hidden[:len(expected)], expected)
        assert mask[:len(expected)].all() and not mask[len(expected):].any() and not hidden[len(expected):].any()


def test_objective_equals_onetrainers_step(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against OneTrainer's BaseErnieSetup.predict written out with the same draws, the
    text through the pipeline's own encode_prompt and _pad_text; the normalisation undoes the pipeline's decode."""
    from diffusers import ErnieImagePipeline

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer, pipe = model.vae, model.denoiser, model.pipeline
    pixels = batch["pixels"]
    shape = (32, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        timesteps.append(model.objective.draw(g, options, torch.Size(shape)))
    eps, noise, timesteps = torch.stack(eps), torch.stack(noise), torch.cat(timesteps)
    patchify = ErnieImagePipeline._patchify_latents
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)  # the pipeline's decode eps
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        x = (patchify(posterior.mean + posterior.std * eps) - mean) / std
        n = patchify(noise)
        sigmas = (timesteps / 1000).view(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * x + sigmas * n
        text, lengths = pipe._pad_text(pipe.encode_prompt(list(batch["caption"]), device="cpu"), device="cpu",
                                       dtype=torch.float32, text_in_dim=transformer.config.text_in_dim)
        pred = transformer(hidden_states=noisy, timestep=timesteps, text_bth=text, text_lens=lengths,
                           return_dict=False)[0]
        expected = torch.mean((pred.float() - (n - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
        # what the pipeline does before decoding, applied to ours, gives the VAE's own latents back
        latents = posterior.mean
        normalized = patchify(model.family.normalize_latents(vae, latents))
        torch.testing.assert_close(ErnieImagePipeline._unpatchify_latents(normalized * std + mean), latents)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # the scheduler config's fixed shift 3: s = 3u / (1 + 2u) lies above u
    u = torch.tensor([0.25], dtype=torch.float64)
    torch.testing.assert_close(model.objective.shifted(u, torch.Size(shape)), 3 * u / (1 + 2 * u))


def prediction(family, transformer, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 32, 8, 6), torch.tensor([300.0, 800.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot", "a big yellow circle"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def comfy_ernie_weight_keys(config: dict) -> set[str]:
    """The weight keys of ComfyUI's ERNIE-Image model for a transformer config, read from comfy/ldm/ernie/model.py
    (Comfy-Org/ComfyUI @ 7b30bf37b09aa4b59c58f69a392f20c97cf6c0a6, ErnieImageModel): x_embedder.proj (Conv2d),
    text_proj (no bias; only where text_in_dim != hidden_size), time_embedding.linear_1 / linear_2,
    adaLN_modulation.1, per block of `layers` adaLN_sa_ln and adaLN_mlp_ln (RMSNorm), self_attention.to_q / to_k /
    to_v / norm_q / norm_k / to_out.0, mlp.gate_proj / up_proj / linear_fc2; final_norm.linear (its LayerNorm has
    no weight) and final_linear."""
    block = ("adaLN_sa_ln", "adaLN_mlp_ln", "self_attention.to_q", "self_attention.to_k", "self_attention.to_v",
             "self_attention.norm_q", "self_attention.norm_k", "self_attention.to_out.0", "mlp.gate_proj",
             "mlp.up_proj", "mlp.linear_fc2")
    names = {f"layers.{i}.{m}" for i in range(config["num_layers"]) for m in block}
    names |= {"x_embedder.proj", "time_embedding.linear_1", "time_embedding.linear_2", "adaLN_modulation.1",
              "final_norm.linear", "final_linear"}
    if config["text_in_dim"] != config["hidden_size"]:
        names.add("text_proj")
    return {f"{n}.weight" for n in names}


def comfy_ernie_lora_names(config: dict) -> set[str]:
    """The LoRA module names ComfyUI maps for ERNIE-Image (comfy/lora.py model_lora_keys_unet @ 17358c8f, for a
    comfy.model_base.ErnieImage): `transformer.<k>` for each key `diffusion_model.<k>.weight` of the model."""
    return {"transformer." + k[:-len(".weight")] for k in comfy_ernie_weight_keys(config)}


def test_full_finetune_moves_the_transformer_only_and_reloads(family_models, shapes_data, tmp_path):
    """The folder reloads through ErnieImagePipeline.from_pretrained and equals the trained modules; beside it the
    single file holds ComfyUI's keys and diffusers' from_single_file reads the folder's transformer back from it."""
    from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-2)
    trainer.train()
    export = tmp_path / "o" / "model"
    single = load_file(tmp_path / "o" / "model.safetensors")
    config = dict(trainer.model.denoiser.config)
    assert {k for k in single if k.endswith(".weight")} == comfy_ernie_weight_keys(config)
    read = ErnieImageTransformer2DModel.from_single_file(str(tmp_path / "o" / "model.safetensors"),
                                                         config=str(export), subfolder="transformer",
                                                         local_files_only=True)
    folder_state = ErnieImageTransformer2DModel.from_pretrained(export / "transformer").state_dict()
    assert read.state_dict().keys() == folder_state.keys()
    assert all(torch.equal(v, folder_state[k]) for k, v in read.state_dict().items())
    original = ErnieImagePipeline.from_pretrained(base, local_files_only=True)
    loaded = ErnieImagePipeline.from_pretrained(export, local_files_only=True)
    for component, moves in (("transformer", True), ("vae", False), ("text_encoder", False)):
        before, after = (getattr(pipe, component).state_dict() for pipe in (original, loaded))
        assert before.keys() == after.keys(), component
        moved = max((before[k] - after[k]).abs().max().item() for k in before)
        assert (moved > 1e-4) == moves, (component, moved)
    model = trainer.model
    assert all(torch.equal(v, model.denoiser.state_dict()[k]) for k, v in loaded.transformer.state_dict().items())
    torch.testing.assert_close(
        prediction(model.family, loaded.transformer, loaded.text_encoder, loaded.tokenizer),
        prediction(model.family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"]),
        rtol=1e-5, atol=1e-6)


def test_lora_file_follows_comfyuis_rule_and_loads_in_the_pipeline_and_samples_equal_it(family_models, shapes_data,
                                                                                        tmp_path):
    """LoRA on every linear layer: each module of the file is one ComfyUI maps for ERNIE-Image;
    ErnieImagePipeline.load_lora_weights gives the trained outputs; the end-of-training sample equals the pipeline's
    with the same seed and guidance."""
    from diffusers import ErnieImagePipeline
    from PIL import Image

    base = family_models[FAMILY]
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 20.0, "width": 64, "height": 48}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "lora.preset": "all_linear",
                                                     "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved if ".lora_" in k}
    comfy = comfy_ernie_lora_names(dict(model.denoiser.config))
    assert modules <= comfy, sorted(modules - comfy)[:3]
    assert {"transformer.layers.1.self_attention.to_q", "transformer.layers.0.mlp.linear_fc2",
            "transformer.time_embedding.linear_1", "transformer.final_linear"} <= modules
    trained = prediction(family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"])
    pipe = ErnieImagePipeline.from_pretrained(base, local_files_only=True)
    before = prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer), trained,
                               rtol=1e-5, atol=1e-6)

    def image(guidance_scale):
        return np.asarray(pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3,
                               guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(3),
                               use_pe=False, output_type="pil").images[0]).astype(int)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - image(20.0)).max() <= 1
    assert np.abs(ours - image(1.0)).max() > 4  # unguided differs: the comparison above can fail


def test_lora_and_full_lower_the_loss_on_the_demo_data(family_models, shapes_data, tmp_path):
    """The same batch's loss with the same draws, before and after an epoch of the demo data, for each method."""
    for method, rate in (("lora", 5e-2), ("full", 2e-3)):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / method, method=method, max_steps=8,
                              learning_rate=rate, **({"lora.rank": 8, "lora.alpha": 8} if method == "lora" else {}))
        before, after = losses_around_training(trainer)
        assert after < before - 0.1, (method, before, after)


def test_cached_latents_and_text_train_as_the_images_and_captions_do(family_models, shapes_data, tmp_path):
    """data.cache_text stores the padded hidden states and the mask; each step cuts the captions from the cached
    mask: the first step's loss is the uncached one."""
    losses = {}
    for cache in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache, "data.cache_text": cache})
        batch = first_batch(trainer)
        assert ("text_mask" in batch) == cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_text_encoder_lora_carries_comfyuis_ministral_names(family_models, shapes_data, tmp_path):
    """text_encoder.train with LoRA: Ministral-3's language-model projections (not the vision tower's) are written
    under ComfyUI's names for ERNIE-Image's text encoder (comfy/lora.py model_lora_keys_clip @ 17358c8f:
    `text_encoders.<k>` for each weight key k of its ErnieTEModel, comfy/text_encoders/ernie.py: the Ministral-3 3B
    named `ministral3_3b`, llama.py's model under `transformer.model.` with transformers' layer names), and load back
    through peft to the trained conditioning."""
    from diffusers import ErnieImagePipeline

    from ot_dist.lora_tools.peft_load import load_peft_lora

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "te", method="lora", max_steps=1, learning_rate=5e-2,
                          output_dtype="float32", **{"text_encoder.train": True, "lora.rank": 4, "lora.alpha": 8})
    trainer.train()
    saved = load_file(tmp_path / "te" / "lora.safetensors")
    fresh = ErnieImagePipeline.from_pretrained(base, local_files_only=True)
    comfy = {f"text_encoders.ministral3_3b.transformer.model.{name}"
             for name, module in fresh.text_encoder.language_model.named_modules()
             if isinstance(module, torch.nn.Linear)}
    text = {k.rsplit(".lora_", 1)[0] for k in saved if not k.startswith("transformer.")}
    assert text and text <= comfy, sorted(text - comfy)[:3]
    assert load_peft_lora(fresh, tmp_path / "te" / "lora.safetensors") == ["text_encoder", "transformer"]
    family, tokenizers = trainer.model.family, trainer.model.tokenizers
    with torch.no_grad():
        tokens = family.tokenize(tokenizers, ["a dot"])
        ours = family.encode_text(trainer.model.text_encoders, tokens)["hidden"]
        theirs = family.encode_text({"text_encoder": fresh.text_encoder}, tokens)["hidden"]
        untrained = family.encode_text({"text_encoder": ErnieImagePipeline.from_pretrained(
            base, local_files_only=True).text_encoder}, tokens)["hidden"]
    assert (ours - untrained).abs().max() > 1e-4
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_comfyuis_diffusion_model_file_loads_to_the_same_outputs(family_models, tmp_path):
    """The transformer's keys under model.diffusion_model. in bfloat16, with `model.config` = the diffusers folder,
    predicts as the folder's transformer with the same weights rounded to bfloat16; a key the config's transformer
    lacks is named before anything loads."""
    import pytest
    from diffusers import ErnieImagePipeline
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    folder = ErnieImagePipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        for t in folder.transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    state = {"model.diffusion_model." + k: v.to(torch.bfloat16).contiguous()
             for k, v in folder.transformer.state_dict().items()}
    save_file(state, tmp_path / "ernie.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "ernie.safetensors"), config=str(base)))
    family = loaded.family
    expected = prediction(family, folder.transformer, folder.text_encoder, folder.tokenizer)
    got = prediction(family, loaded.denoiser, loaded.text_encoders["text_encoder"], loaded.tokenizers["tokenizer"])
    assert torch.equal(got, expected)
    state["model.diffusion_model.layers.7.mlp.up_proj.weight"] = state[
        "model.diffusion_model.layers.0.mlp.up_proj.weight"].clone()
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match="unexpected 1 key.*layers.7.mlp.up_proj.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))
