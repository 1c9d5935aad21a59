"""Z-Image on the family contract: the conditioning against ZImagePipeline.encode_prompt (Qwen3's chat turn, the
second-to-last hidden layer, each caption cut to its tokens), the objective against diffusers'
train_dreambooth_lora_z_image.py written out for one batch ((x - shift) x scale, x_t = (1 - s) x + s n, the
transformer at (1000 - t) / 1000 on lists of one-frame latents and variable-length captions, its output negated,
MSE against n - x), training (full: the transformer alone moves and the export reloads through from_pretrained; LoRA:
the file ZImagePipeline.load_lora_weights reads, under ComfyUI's Z-Image key rule) and samples equal to the
pipeline's with the guidance convention converted, ComfyUI's diffusion-model file both ways. The 2-rank fsdp and zero2
comparisons ride in Flux's launch (tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from safetensors.torch import load_file

from family_training import family_trainer, first_batch, losses_around_training
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "z_image"
trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The pipeline's list of per-caption hidden states is ours cut at each caption's length; the padding is zero."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, captions = trainer.model, ["a red circle on a blue background", "a big yellow square"]
    tokenizer = model.tokenizers["tokenizer"]
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)
    assert turn == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"  # ComfyUI's ZImageTokenizer template
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32  # bounded by the tiny tokenizer's model_max_length
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        theirs, _ = model.pipeline.encode_prompt(list(captions), device="cpu", do_classifier_free_guidance=False,
                                                 **options)
    lengths = ours["mask"].sum(1).tolist()
    assert lengths == [len(t) for t in theirs] and lengths[0] != lengths[1]  # a padded caption, masked
    for hidden, mask, expected in zip(ours["hidden"], ours["mask"], theirs):
        torch.testing.assert_close(hidden[:len(expected)], expected)
        assert mask[:len(expected)].all() and not mask[len(expected):].any() and not hidden[len(expected):].any()


def test_objective_equals_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against train_dreambooth_lora_z_image.py's step written out with the same draws."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer = model.vae, model.denoiser
    pixels = batch["pixels"]
    shape = (16, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        timesteps.append(model.objective.draw(g, options, torch.Size(shape)))
    eps, noise, timesteps = torch.stack(eps), torch.stack(noise), torch.cat(timesteps)
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        x = (posterior.mean + posterior.std * eps - vae.config.shift_factor) * vae.config.scaling_factor
        sigmas = (timesteps / 1000).view(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * x + sigmas * noise
        prompt_embeds, _ = model.pipeline.encode_prompt(list(batch["caption"]), device="cpu",
                                                        do_classifier_free_guidance=False, max_sequence_length=32)
        pred = transformer(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, prompt_embeds,
                           return_dict=False)[0]
        pred = -torch.stack(pred, dim=0).squeeze(2)
        expected = torch.mean((pred.float() - (noise - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # the scheduler config's fixed shift 3: s = 3u / (1 + 2u) lies above u
    u = torch.tensor([0.25], dtype=torch.float64)
    torch.testing.assert_close(model.objective.shifted(u, torch.Size(shape)), 3 * u / (1 + 2 * u))


def prediction(family, transformer, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, 8, 6), torch.tensor([300.0, 800.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot", "a big yellow circle"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def comfy_z_image_file_keys(config: dict) -> set[str]:
    """The keys of ComfyUI's Z-Image diffusion model (the original layout) for a transformer config: the values of
    comfy.utils.z_image_to_diffusers (pollockjj/ComfyUI @ 618b803d314a525faca8f8163d85eaa9ebc1d774), which maps each
    diffusers key to ComfyUI's: per block of `layers`, `context_refiner`, `noise_refiner`: attention.to_q / to_k / to_v
    -> slices of attention.qkv, attention.norm_q / norm_k -> attention.q_norm / k_norm, attention.to_out.0 ->
    attention.out, attention_norm1 / 2, feed_forward.w1 / w2 / w3, ffn_norm1 / 2 and adaLN_modulation.0 (blocks with
    modulation) unchanged; all_final_layer.2-1.* -> final_layer.*, all_x_embedder.2-1.* -> x_embedder.*; x_pad_token,
    cap_pad_token, cap_embedder.0 / .1, t_embedder.mlp.0 / .2 unchanged. Biases only where the module has one (the
    attention projections and norms have none; context_refiner blocks have no modulation)."""
    block = ["attention.qkv.weight", "attention.q_norm.weight", "attention.k_norm.weight", "attention.out.weight",
             "attention_norm1.weight", "attention_norm2.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
             "feed_forward.w3.weight", "ffn_norm1.weight", "ffn_norm2.weight"]
    keys = {f"layers.{i}.{k}" for i in range(config["n_layers"]) for k in block}
    keys |= {f"{kind}.{i}.{k}" for kind in ("context_refiner", "noise_refiner") for i in range(config["n_refiner_layers"])
             for k in block}
    keys |= {f"{kind}.{i}.adaLN_modulation.0.{p}" for kind in ("layers", "noise_refiner")
             for i in range(config["n_layers"] if kind == "layers" else config["n_refiner_layers"]) for p in ("weight", "bias")}
    keys |= {"final_layer.linear.weight", "final_layer.linear.bias", "final_layer.adaLN_modulation.1.weight",
             "final_layer.adaLN_modulation.1.bias", "x_embedder.weight", "x_embedder.bias", "x_pad_token",
             "cap_embedder.0.weight", "cap_embedder.1.weight", "cap_embedder.1.bias", "cap_pad_token",
             "t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias", "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias"}
    return keys


def test_full_finetune_moves_the_transformer_only_and_reloads_through_from_pretrained(family_models, shapes_data,
                                                                                       tmp_path):
    """The folder reloads through ZImagePipeline.from_pretrained; beside it, ComfyUI's diffusion-model file: its keys
    are ComfyUI's for Z-Image (detected by cap_embedder.1.weight) and diffusers' from_single_file reads the folder's
    transformer back from it."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-2)
    trainer.train()
    export = tmp_path / "o" / "model"
    single = load_file(tmp_path / "o" / "model.safetensors")
    assert set(single) == comfy_z_image_file_keys(dict(trainer.model.denoiser.config))
    assert "cap_embedder.1.weight" in single  # ComfyUI's Lumina 2 / Z-Image detection key
    read = ZImageTransformer2DModel.from_single_file(str(tmp_path / "o" / "model.safetensors"), config=str(export),
                                                     subfolder="transformer", local_files_only=True)
    folder_state = ZImageTransformer2DModel.from_pretrained(export / "transformer").state_dict()
    assert read.state_dict().keys() == folder_state.keys()
    assert all(torch.equal(v, folder_state[k]) for k, v in read.state_dict().items())
    original = ZImagePipeline.from_pretrained(base, local_files_only=True)
    loaded = ZImagePipeline.from_pretrained(export, local_files_only=True)
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


def comfy_z_image_lora_keys(config: dict) -> set[str]:
    """The LoRA module names ComfyUI maps for a Z-Image model with this transformer config. Read from
    github.com/pollockjj/ComfyUI @ 618b803d314a525faca8f8163d85eaa9ebc1d774 (a ComfyUI fork kept in step with
    upstream): comfy/lora.py model_lora_keys_unet, for a Lumina2 model (Z-Image's model class), maps
    `transformer.<k>` and `diffusion_model.<k>` for every key k ending in `.weight` of
    comfy.utils.z_image_to_diffusers(unet_config) (names without `.weight`); that map lists, per block of `layers`,
    `context_refiner` and `noise_refiner` (n_refiner_layers each), attention.to_q / to_k / to_v (slices of its fused
    qkv), attention.to_out.0, attention.norm_q / norm_k, attention_norm1 / 2, feed_forward.w1 / w2 / w3, ffn_norm1 /
    2, adaLN_modulation.0; and all_final_layer.2-1.linear, all_final_layer.2-1.adaLN_modulation.1,
    all_x_embedder.2-1, cap_embedder.0 / .1, t_embedder.mlp.0 / .2. comfy/weight_adapter/lora.py reads
    `x.lora_B.weight` / `x.lora_A.weight`, scale 1.0 without `x.alpha`."""
    block = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "attention.norm_q",
             "attention.norm_k", "attention_norm1", "attention_norm2", "feed_forward.w1", "feed_forward.w2",
             "feed_forward.w3", "ffn_norm1", "ffn_norm2", "adaLN_modulation.0")
    blocks = [f"layers.{i}" for i in range(config["n_layers"])] + [
        f"{kind}.{i}" for kind in ("context_refiner", "noise_refiner") for i in range(config["n_refiner_layers"])]
    names = {f"{b}.{m}" for b in blocks for m in block}
    names |= {"all_final_layer.2-1.linear", "all_final_layer.2-1.adaLN_modulation.1", "all_x_embedder.2-1",
              "cap_embedder.0", "cap_embedder.1", "t_embedder.mlp.0", "t_embedder.mlp.2"}
    return {f"transformer.{n}" for n in names}


def test_lora_file_follows_comfyuis_rule_and_loads_in_the_pipeline_and_samples_equal_it(family_models, shapes_data,
                                                                                        tmp_path):
    """LoRA on every linear layer: each module of the file is one ComfyUI maps for Z-Image, at the trained strength
    (no .alpha); ZImagePipeline.load_lora_weights gives the trained outputs; the end-of-training sample equals the
    pipeline's with guidance_scale s - 1."""
    from diffusers import ZImagePipeline
    from PIL import Image

    base = family_models[FAMILY]
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 20.0, "width": 64, "height": 48}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "lora.preset": "all_linear",
                                                     "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    comfy = comfy_z_image_lora_keys(dict(model.denoiser.config))
    assert modules <= comfy, sorted(modules - comfy)[:3]
    assert {m.split(".")[1] for m in modules} >= {"layers", "noise_refiner", "context_refiner", "t_embedder"}
    assert not any(k.endswith(".alpha") for k in saved)
    layers = dict(model.denoiser.named_modules())
    for module in modules:
        layer = layers[module[len("transformer."):]]
        change = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        torch.testing.assert_close(saved[f"{module}.lora_B.weight"] @ saved[f"{module}.lora_A.weight"],
                                   change.detach(), rtol=1e-5, atol=1e-7)
    trained = prediction(family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"])
    pipe = ZImagePipeline.from_pretrained(base, local_files_only=True)
    before = prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer), trained,
                               rtol=1e-5, atol=1e-6)

    def image(guidance_scale):
        return np.asarray(pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3,
                               guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(3),
                               max_sequence_length=32, output_type="pil").images[0]).astype(int)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - image(19.0)).max() <= 1
    assert np.abs(ours - image(0.0)).max() > 4  # unguided differs: the comparison above can fail


def test_lora_and_full_lower_the_loss_on_the_demo_data(family_models, shapes_data, tmp_path):
    """The same batch's loss with the same draws, before and after an epoch of the demo data, for each method."""
    for method, rate in (("lora", 5e-2), ("full", 2e-3)):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / method, method=method, max_steps=8,
                              learning_rate=rate, **({"lora.rank": 8, "lora.alpha": 8} if method == "lora" else {}))
        before, after = losses_around_training(trainer)
        assert after < before - 0.1, (method, before, after)  # seen: lora 1.59 -> 1.45, full 1.59 -> 1.34


def test_text_encoder_lora_carries_comfyuis_qwen3_names(family_models, shapes_data, tmp_path):
    """text_encoder.train with LoRA: its modules are written under ComfyUI's names for Z-Image's Qwen3-4B
    (comfy/lora.py model_lora_keys_clip: `text_encoders.<k>` for each weight key k of its ZImageTEModel, whose
    Qwen3-4B is `qwen3_4b.transformer.model.` with transformers' layer names), and load back through peft."""
    from diffusers import ZImagePipeline

    from ot_dist.lora_tools.peft_load import load_peft_lora

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "te", method="lora", max_steps=1, learning_rate=5e-2,
                          output_dtype="float32", **{"text_encoder.train": True, "lora.rank": 4, "lora.alpha": 8})
    trainer.train()
    saved = load_file(tmp_path / "te" / "lora.safetensors")
    fresh = ZImagePipeline.from_pretrained(base, local_files_only=True)
    comfy = {f"text_encoders.qwen3_4b.transformer.model.{name}"
             for name, module in fresh.text_encoder.named_modules() if isinstance(module, torch.nn.Linear)}
    text = {k.rsplit(".lora_", 1)[0] for k in saved if not k.startswith("transformer.")}
    assert text and text <= comfy, sorted(text - comfy)[:3]
    assert not any(k.endswith(".alpha") for k in saved)
    assert load_peft_lora(fresh, tmp_path / "te" / "lora.safetensors") == ["text_encoder", "transformer"]
    family, tokenizers = trainer.model.family, trainer.model.tokenizers
    with torch.no_grad():
        tokens = family.tokenize(tokenizers, ["a dot"])
        ours = family.encode_text(trainer.model.text_encoders, tokens)["hidden"]
        theirs = family.encode_text({"text_encoder": fresh.text_encoder}, tokens)["hidden"]
    assert (ours - family.encode_text({"text_encoder": ZImagePipeline.from_pretrained(
        base, local_files_only=True).text_encoder}, tokens)["hidden"]).abs().max() > 1e-4
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


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


def test_comfyuis_diffusion_model_file_loads_to_the_same_outputs(family_models, tmp_path):
    """A transformer in ComfyUI's layout under model.diffusion_model. (as ComfyUI saves it), in bfloat16 (Comfy-Org's
    z_image_turbo_bf16), with `model.config` = the diffusers folder, predicts as the folder's transformer with the same
    weights rounded to bfloat16; a key the config's transformer lacks is named before anything loads."""
    import pytest
    from diffusers import ZImagePipeline
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.families.z_image_single_file import Z_IMAGE
    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    folder = ZImagePipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        for t in folder.transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    original = Z_IMAGE.to_original(folder.transformer.state_dict(), dict(folder.transformer.config),
                                   prefix="model.diffusion_model.")
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in original.items()}
    save_file(state, tmp_path / "z_image.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "z_image.safetensors"), config=str(base)))
    family = loaded.family
    expected = prediction(family, folder.transformer, folder.text_encoder, folder.tokenizer)
    got = prediction(family, loaded.denoiser, loaded.text_encoders["text_encoder"], loaded.tokenizers["tokenizer"])
    assert torch.equal(got, expected)
    state["model.diffusion_model.layers.7.attention.qkv.weight"] = state[
        "model.diffusion_model.layers.0.attention.qkv.weight"].clone()
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match="unexpected 1 key.*layers.7.attention.qkv.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))

