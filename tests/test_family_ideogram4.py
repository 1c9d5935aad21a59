"""Ideogram 4 on the family contract: the conditioning against Ideogram4Pipeline.encode_prompt (Qwen3-VL's 13 tapped
layers interleaved, the caption at the end of its left padding), the objective against diffusers'
train_dreambooth_lora_ideogram4.py written out for one batch (batch-norm statistics on the pipeline's 2x2 packing,
a logit-normal sigma with the resolution-aware mean, the packed [text padding][image] sequence at t = 1 - sigma, MSE
against x - n), training (full: only the conditional transformer moves and the export reloads through
from_pretrained; LoRA: the file Ideogram4Pipeline.load_lora_weights reads) and samples equal to the pipeline's
(the frozen unconditional transformer guiding). The 2-rank fsdp comparison rides in PixArt's launch
(tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from family_training import family_trainer, first_batch, losses_around_training
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "ideogram4"
trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The pipeline's packed features hold ours at the end of each caption's left padding; the padding is zero."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, captions = trainer.model, ["a red circle on a blue background", "a big yellow square"]
    tokenizer = model.tokenizers["tokenizer"]
    turn = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                         tokenize=False, add_generation_prompt=True)
    assert turn == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"  # Qwen3-VL's text-only user turn
    width = model.family.pipeline_call_options(model.pipeline)["max_sequence_length"]
    assert width == 32  # bounded by the tiny tokenizer's model_max_length
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        theirs, _, _, indicator = model.pipeline.encode_prompt(captions, grid_h=2, grid_w=3, max_sequence_length=width,
                                                               device="cpu")
    lengths = ours["mask"].sum(1).tolist()
    assert lengths == (indicator == 3).sum(1).tolist() and lengths[0] != lengths[1]  # a padded caption, masked
    for hidden, mask, expected, length in zip(ours["hidden"], ours["mask"], theirs, lengths):
        torch.testing.assert_close(hidden[:length], expected[width - length:width])
        assert mask[:length].all() and not mask[length:].any() and not hidden[length:].any()
        assert not expected[:width - length].any() and not expected[width:].any()


def script_patchify(z):
    """train_dreambooth_lora_ideogram4.py's patchify_latents (patch 2), written out."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).contiguous()
    return z.view(b, (h // 2) * (w // 2), 4 * c)


def test_objective_equals_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against train_dreambooth_lora_ideogram4.py's step written out with the same draws:
    its sigma is compute_density_for_timestep_sampling's logit-normal at _resolution_aware_mu(height, width) and
    --logit_std 1.5 (loss.logit_normal_std 1.5 here)."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
    from diffusers.training_utils import compute_density_for_timestep_sampling

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", **{"loss.logit_normal_std": 1.5})
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer = model.vae, model.denoiser
    pixels = batch["pixels"]
    height, width = pixels.shape[-2:]
    shape = (32, height // 8, width // 8)
    mu = _resolution_aware_mu(height, width, base_mu=0.0)
    eps, noise, timesteps, sigmas = [], [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        state = g.get_state()
        timesteps.append(model.objective.draw(g, options, torch.Size(shape)))
        g.set_state(state)  # the script's draw from the same state
        sigmas.append(compute_density_for_timestep_sampling("logit_normal", 1, logit_mean=mu, logit_std=1.5,
                                                            generator=g))
    eps, noise, timesteps, sigmas = torch.stack(eps), torch.stack(noise), torch.cat(timesteps), torch.cat(sigmas)
    torch.testing.assert_close(timesteps / 1000, sigmas, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        mean = vae.bn.running_mean.view(1, 1, -1)
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
        x = (script_patchify(posterior.mean + posterior.std * eps) - mean) / std
        n = script_patchify(noise)
        s = (timesteps / 1000).view(-1, 1, 1)
        noisy = (1.0 - s) * x + s * n
        length = 32
        prompt_embeds, position_ids, segment_ids, indicator = model.pipeline.encode_prompt(
            list(batch["caption"]), grid_h=height // 16, grid_w=width // 16, max_sequence_length=length, device="cpu")
        packed = torch.cat([torch.zeros(2, length, 128), noisy], dim=1)
        pred = transformer(hidden_states=packed, timestep=(1.0 - s).reshape(2), encoder_hidden_states=prompt_embeds,
                           position_ids=position_ids, segment_ids=segment_ids, indicator=indicator,
                           return_dict=False)[0][:, length:]
        expected = torch.mean((pred.float() - (x - n).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # the shift is e^mu with mu = 0.5 ln(pixels / 512^2): a 1024^2 image's 4096 tokens give e^(ln 2) = 2
    u = torch.tensor([0.25], dtype=torch.float64)
    torch.testing.assert_close(model.objective.shifted(u, torch.Size((32, 128, 128))), 2 * u / (1 + u))
    assert math.isclose(model.objective.shift_value(torch.Size(shape), options), math.exp(mu))


def prediction(family, transformer, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 32, 8, 6), torch.tensor([300.0, 800.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot", "a big yellow circle"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def test_full_finetune_moves_the_transformer_only_and_reloads_through_from_pretrained(family_models, shapes_data,
                                                                                       tmp_path):
    """The folder reloads through Ideogram4Pipeline.from_pretrained: the conditional transformer moved, the
    unconditional one, the VAE and Qwen3-VL are as loaded; the reloaded transformer predicts as the trained one."""
    from diffusers import Ideogram4Pipeline

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-2)
    trainer.train()
    export = tmp_path / "o" / "model"
    original = Ideogram4Pipeline.from_pretrained(base, local_files_only=True)
    loaded = Ideogram4Pipeline.from_pretrained(export, local_files_only=True)
    for component, moves in (("transformer", True), ("unconditional_transformer", False), ("vae", False),
                             ("text_encoder", False)):
        before, after = (getattr(pipe, component).state_dict() for pipe in (original, loaded))
        assert before.keys() == after.keys(), component
        moved = max((before[k].float() - after[k].float()).abs().max().item() for k in before)
        assert (moved > 1e-4) == moves, (component, moved)
    model = trainer.model
    assert all(torch.equal(v, model.denoiser.state_dict()[k]) for k, v in loaded.transformer.state_dict().items())
    torch.testing.assert_close(
        prediction(model.family, loaded.transformer, loaded.text_encoder, loaded.tokenizer),
        prediction(model.family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"]),
        rtol=1e-5, atol=1e-6)


def test_lora_file_loads_in_the_pipeline_and_samples_equal_it(family_models, shapes_data, tmp_path):
    """LoRA on the default modules (the script's: attention and SwiGLU): Ideogram4Pipeline.load_lora_weights gives
    the trained outputs; the end-of-training sample equals the pipeline's at guidance_scale s (neg + s (pos - neg),
    the unconditional transformer's neg)."""
    from diffusers import Ideogram4Pipeline
    from PIL import Image

    base = family_models[FAMILY]
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 5.0, "width": 64, "height": 48}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    suffixes = {m.split(".", 3)[-1] for m in modules}
    assert suffixes == {"attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}, suffixes
    assert all(m.startswith("transformer.layers.") for m in modules)
    trained = prediction(family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"])
    pipe = Ideogram4Pipeline.from_pretrained(base, local_files_only=True)
    before = prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer), trained,
                               rtol=1e-5, atol=1e-6)

    def image(guidance_scale):
        return np.asarray(pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3,
                               guidance_scale=guidance_scale, guidance_schedule=None,
                               generator=torch.Generator().manual_seed(3), max_sequence_length=32,
                               output_type="pil").images[0]).astype(int)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - image(5.0)).max() <= 1
    assert np.abs(ours - image(1.0)).max() > 4  # unguided differs: the comparison above can fail


def test_lora_and_full_lower_the_loss_on_the_demo_data(family_models, shapes_data, tmp_path):
    """The same batch's loss with the same draws, before and after an epoch of the demo data, for each method."""
    for method, rate in (("lora", 5e-2), ("full", 2e-3)):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / method, method=method, max_steps=8,
                              learning_rate=rate, **({"lora.rank": 8, "lora.alpha": 8} if method == "lora" else {}))
        before, after = losses_around_training(trainer)
        assert after < before - 0.1, (method, before, after)


def test_cached_latents_and_text_train_as_the_images_and_captions_do(family_models, shapes_data, tmp_path):
    """data.cache_text stores the padded features and the mask; each step packs the captions from the cached mask:
    the first step's loss is the uncached one."""
    losses = {}
    for cache in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache, "data.cache_text": cache})
        batch = first_batch(trainer)
        assert ("text_mask" in batch) == cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def swarmui_recognises_an_ideogram4_lora(keys: set[str], last_block: int) -> bool:
    """SwarmUI's T2IModelClassSorter.isIdeogram4Lora (mcmonkeyprojects/SwarmUI, src/Text2Image/T2IModelClassSorter.cs)
    for a model of `last_block` + 1 blocks (the real one's 34: layers.33): hasLoraKey of layers.0.adaln_modulation,
    layers.0.attention.o, layers.0.feed_forward.w3 and layers.<last>.attention.qkv, where hasLoraKey(key) looks for
    `key.lora_A.weight`, `key.lora_up.weight`, ... and tryGetKey also under `diffusion_model.`."""
    def has(key):
        return any(f"{prefix}{key}{suffix}" in keys for prefix in ("", "diffusion_model.", "model.diffusion_model.")
                   for suffix in (".lora_A.weight", ".lora_up.weight"))
    return all(has(k) for k in ("layers.0.adaln_modulation", "layers.0.attention.o", "layers.0.feed_forward.w3",
                                f"layers.{last_block}.attention.qkv"))


def test_comfyui_lora_file_has_the_original_names_and_loads_in_the_pipeline(family_models, shapes_data, tmp_path):
    """lora_comfyui.safetensors: the original names (diffusion_model., fused attention.qkv, attention.o; the rest as
    diffusers names it), which SwarmUI's sorter recognises; each module's up @ down (alpha = its rank) is the trained
    change, q / k / v stacked by rows; Ideogram4Pipeline.load_lora_weights reads it (its converter for the original
    layout) to the trained outputs."""
    from diffusers import Ideogram4Pipeline

    base = family_models[FAMILY]
    # the blocks' modulation, not the final layer's (diffusers' converter reads per-block modules only)
    targets = ["attention.to_q", "attention.to_v", "attention.to_out.0", "feed_forward.w3", "layers.0.adaln_modulation",
               "layers.1.adaln_modulation"]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "lora.transformer_targets": targets})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    modules = {k.rsplit(".lora_", 1)[0].removesuffix(".alpha") for k in comfy}
    assert modules == {f"diffusion_model.layers.{i}.{m}" for i in range(2)
                       for m in ("attention.qkv", "attention.o", "feed_forward.w3", "adaln_modulation")}
    assert swarmui_recognises_an_ideogram4_lora(set(comfy), last_block=1)
    layers = dict(model.denoiser.named_modules())

    def change(path):
        layer = layers[path]
        return (layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]).detach()

    for i in range(2):
        name = f"diffusion_model.layers.{i}.attention.qkv"
        assert comfy[f"{name}.alpha"].item() == comfy[f"{name}.lora_down.weight"].shape[0] == 3 * 4
        q, k, v = (comfy[f"{name}.lora_up.weight"] @ comfy[f"{name}.lora_down.weight"]).chunk(3)
        torch.testing.assert_close(q, change(f"layers.{i}.attention.to_q"), rtol=1e-5, atol=1e-7)
        assert not k.any()  # to_k not adapted: no change to its rows
        torch.testing.assert_close(v, change(f"layers.{i}.attention.to_v"), rtol=1e-5, atol=1e-7)
        name = f"diffusion_model.layers.{i}.attention.o"
        torch.testing.assert_close(comfy[f"{name}.lora_up.weight"] @ comfy[f"{name}.lora_down.weight"],
                                   change(f"layers.{i}.attention.to_out.0"), rtol=1e-5, atol=1e-7)
    trained = prediction(family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"])
    pipe = Ideogram4Pipeline.from_pretrained(base, local_files_only=True)
    assert (prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer) - trained).abs().max() > 1e-4
    pipe.load_lora_weights(tmp_path / "o" / "lora_comfyui.safetensors")
    torch.testing.assert_close(prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer), trained,
                               rtol=1e-5, atol=1e-6)


def test_text_encoder_lora_trains_the_language_model_and_loads_back_through_peft(family_models, shapes_data, tmp_path):
    """text_encoder.train with LoRA: Qwen3-VL's language-model projections are adapted (its vision tower, which text
    never runs, is not), written under `text_encoder.`, and load_peft_lora gives the trained conditioning."""
    from diffusers import Ideogram4Pipeline

    from ot_dist.lora_tools.peft_load import load_peft_lora

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "te", method="lora", max_steps=1, learning_rate=5e-2,
                          output_dtype="float32", **{"text_encoder.train": True, "lora.rank": 4, "lora.alpha": 8})
    trainer.train()
    saved = load_file(tmp_path / "te" / "lora.safetensors")
    text = {k.rsplit(".lora_", 1)[0] for k in saved if k.startswith("text_encoder.")}
    assert text and all(m.startswith("text_encoder.language_model.layers.") for m in text), sorted(text)[:3]
    assert {m.rsplit(".", 1)[-1] for m in text} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    fresh = Ideogram4Pipeline.from_pretrained(base, local_files_only=True)
    assert load_peft_lora(fresh, tmp_path / "te" / "lora.safetensors") == ["text_encoder", "transformer"]
    family, tokenizers = trainer.model.family, trainer.model.tokenizers
    with torch.no_grad():
        tokens = family.tokenize(tokenizers, ["a dot"])
        ours = family.encode_text(trainer.model.text_encoders, tokens)["hidden"]
        theirs = family.encode_text({"text_encoder": fresh.text_encoder}, tokens)["hidden"]
        before = family.encode_text({"text_encoder": Ideogram4Pipeline.from_pretrained(
            base, local_files_only=True).text_encoder}, tokens)["hidden"]
    assert (ours - before).abs().max() > 1e-4  # the LoRA changed the conditioning
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_the_original_single_file_loads_to_the_same_outputs_and_has_the_documented_names(family_models, tmp_path):
    """The conditional transformer in the original layout (OneTrainer's ORIGINAL_TRANSFORMER format: q / k / v fused in
    `attention.qkv`, `attention.to_out.0` as `attention.o`, every other name diffusers'), under ComfyUI's
    model.diffusion_model. and in bfloat16, read as model.path with model.config = the folder: predicts as the folder's
    transformer rounded to bfloat16; the unconditional transformer comes from the folder. Its Linear modules are the
    ones diffusers' Ideogram 4 LoRA converter names, its keys the ones SwarmUI tells an Ideogram 4 file by; a missing
    or unknown key is named before anything loads."""
    from diffusers import Ideogram4Pipeline
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.families.ideogram4_single_file import IDEOGRAM4
    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    folder = Ideogram4Pipeline.from_pretrained(base, local_files_only=True)
    transformer = folder.transformer
    with torch.no_grad():
        for t in transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    original = IDEOGRAM4.to_original(transformer.state_dict(), transformer.config)
    # SwarmUI's T2IModelClassSorter.isIdeogram4 (bare keys)
    assert {"embed_image_indicator.weight", "llm_cond_proj.weight", "t_embedding.mlp_in.weight",
            "layers.0.attention.qkv.weight", "layers.1.attention.o.weight"} <= set(original)
    assert not any(".to_q." in k or ".to_out." in k for k in original)
    # each block's Linear modules by their original names, as a LoRA on them: diffusers' converter maps each name to
    # the diffusers modules the rule reads (the fused qkv to q / k / v in row order)
    rules = [r for r in IDEOGRAM4.rules(transformer.config) if r.original.startswith("layers.")
             and original[r.original].dim() == 2]
    lora = {}
    for r in rules:
        rows = original[r.original].shape[0]
        lora[f"diffusion_model.{r.original[:-len('.weight')]}.lora_A.weight"] = torch.ones(1, 4)
        lora[f"diffusion_model.{r.original[:-len('.weight')]}.lora_B.weight"] = torch.arange(float(rows))[:, None]
    converted = _convert_non_diffusers_ideogram4_lora_to_diffusers(lora)
    for r in rules:
        ups = [converted[f"transformer.{d[:-len('.weight')]}.lora_B.weight"] for d in r.diffusers]
        assert torch.equal(torch.cat(ups), torch.arange(float(original[r.original].shape[0]))[:, None]), r.original
    state = {f"model.diffusion_model.{k}": v.to(torch.bfloat16).contiguous() for k, v in original.items()}
    save_file(state, tmp_path / "ideogram4.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "ideogram4.safetensors"), config=str(base)))
    got = loaded.denoiser.state_dict()
    assert all(torch.equal(got[k], v) for k, v in transformer.state_dict().items())
    family = loaded.family
    assert torch.equal(prediction(family, loaded.denoiser, loaded.text_encoders["text_encoder"],
                                  loaded.tokenizers["tokenizer"]),
                       prediction(family, transformer, folder.text_encoder, folder.tokenizer))
    unconditional = loaded.pipeline.unconditional_transformer.state_dict()
    assert all(torch.equal(unconditional[k], v) for k, v in folder.unconditional_transformer.state_dict().items())
    del state["model.diffusion_model.layers.1.attention.qkv.weight"]
    state["model.diffusion_model.layers.1.attention.to_q.weight"] = original["layers.0.attention.o.weight"].clone()
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match=r"missing 1 key.*layers\.1\.attention\.qkv\.weight.*unexpected 1 key.*"
                                             r"layers\.1\.attention\.to_q\.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))


def test_offloaded_unconditional_transformer_waits_in_cpu_memory_and_samples_the_same(family_models, shapes_data,
                                                                                       tmp_path):
    """offload_frozen_components: the unconditional transformer (only samples run it, as large as the trained one)
    is moved in block by block like the text encoders (Family.sampling_modules_offloadable), and the sample is the
    one of the run that keeps it on the device."""
    from PIL import Image

    from ot_dist.memory.offload import Visitor

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 2, "width": 64, "height": 48}
    samples = {}
    for offload in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / f"o{offload}", method="lora", max_steps=1,
                              offload_frozen_components=offload, **{"sampling.prompts": [prompt]})
        unconditional = trainer.model.family.sampling_modules(trainer.model.pipeline)[0]
        visited = [m for m in unconditional.modules()
                   if any(getattr(h, "__self__", None).__class__ is Visitor for h in m._forward_pre_hooks.values())]
        assert bool(visited) == offload
        trainer.train()
        (sample,) = sorted((tmp_path / f"o{offload}" / "samples").glob("step-*/*.png"))
        samples[offload] = np.asarray(Image.open(sample))
    assert np.array_equal(samples[False], samples[True])
