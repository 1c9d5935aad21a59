"""Krea 2 on the family contract: the conditioning against Krea2Pipeline.encode_prompt (the stacked taps, each caption's
real tokens moved to the front), the dynamic shift against the pipeline's, the objective against diffusers'
train_dreambooth_lora_krea2.py written out for one batch (with the pipeline's fixed-length, mid-padded text: the
trimmed text stream predicts the same), training (full: the transformer alone moves and the export reloads through
from_pretrained; LoRA: the file Krea2Pipeline.load_lora_weights reads) and samples equal to the pipeline's with the
guidance convention converted. The 2-rank fsdp comparison rides in PixArt's launch (tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from family_training import family_trainer, first_batch, losses_around_training
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "krea2"
trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The pipeline's (B, L, taps, D) states at its mask are ours at the front, in order; the rest is zero, masked."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, captions = trainer.model, ["a red circle on a blue background", "a big yellow square"]
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32  # bounded by the tiny tokenizer's model_max_length
    assert model.pipeline.config.text_encoder_select_layers == (2, 5)  # every third from 2, as (2, 5, ..., 35)
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        theirs, their_mask = model.pipeline.encode_prompt(list(captions), device="cpu", **options)
    assert ours["hidden"].shape == theirs.shape == (2, 32, 2, 32)
    lengths = ours["mask"].sum(1).tolist()
    assert lengths == their_mask.sum(1).tolist() and lengths[0] != lengths[1]  # a padded caption
    assert not their_mask[:, -1 - 5].any()  # theirs is padded before the 5 suffix tokens: a real move to check
    for hidden, mask, expected, expected_mask in zip(ours["hidden"], ours["mask"], theirs, their_mask):
        length = int(mask.sum())
        torch.testing.assert_close(hidden[:length], expected[expected_mask])
        assert mask[:length].all() and not mask[length:].any() and not hidden[length:].any()


def test_dynamic_shift_is_the_pipelines(family_models, shapes_data, tmp_path):
    """The noise level of a draw u: the scheduler's exponential time shift at Krea2Pipeline's calculate_shift(mu) for
    the image's packed token count (base 0.5 / max 1.15 over 256..6400 tokens)."""
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    scheduler, objective = trainer.model.pipeline.scheduler, trainer.model.objective
    config = scheduler.config
    assert (config.max_image_seq_len, config.max_shift) == (6400, 1.15)
    u = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    for side in (64, 160):  # latent sides: 1024 and 6400 image tokens
        mu = calculate_shift((side // 2) ** 2, config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        torch.testing.assert_close(objective.shifted(u, torch.Size((16, side, side))), scheduler.time_shift(mu, 1.0, u))


def test_objective_equals_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against train_dreambooth_lora_krea2.py's step, written out with the same draws: 5-D
    latents (x - mean) / std, x_t = (1 - s) x + s n, the 2x2 packing, position ids, the transformer at t / 1000 on the
    pipeline's fixed-length prompt embeddings and mask, unpacking, MSE against n - x."""
    from diffusers import Krea2Pipeline

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
    eps, noise = torch.stack(eps)[:, :, None], torch.stack(noise)[:, :, None]  # the script's (B, C, 1, h, w)
    t = torch.cat(timesteps)
    with torch.no_grad():
        posterior = vae.encode(pixels[:, :, None]).latent_dist
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std_inverse = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        x = (posterior.mean + posterior.std * eps - mean) * std_inverse
        sigmas = (t / 1000).view(-1, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * x + sigmas * noise
        prompt_embeds, prompt_mask = model.pipeline.encode_prompt(list(batch["caption"]), device="cpu",
                                                                  max_sequence_length=32)
        assert prompt_mask.sum(1).tolist()[0] != prompt_mask.sum(1).tolist()[1]  # the trimmed stream is masked too
        b, c, _, h, w = noisy.shape
        packed = noisy.permute(0, 2, 1, 3, 4).reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        packed = packed.reshape(b, (h // 2) * (w // 2), c * 4)
        position_ids = Krea2Pipeline.prepare_position_ids(prompt_embeds.shape[1], h // 2, w // 2, "cpu")
        pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds, timestep=t / 1000,
                           position_ids=position_ids, encoder_attention_mask=prompt_mask, return_dict=False)[0]
        pred = pred.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, 1, h, w)
        expected = torch.mean((pred.float() - (noise - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert 0 < t.min() and t.max() < 1000


def prediction(family, transformer, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, 8, 6), torch.tensor([300.0, 800.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot", "a big yellow circle"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def test_full_finetune_moves_the_transformer_only_and_reloads_through_from_pretrained(family_models, shapes_data,
                                                                                       tmp_path):
    """The folder reloads through Krea2Pipeline.from_pretrained; beside it, the single file in the original layout
    (raw.safetensors' keys, OneTrainer's names too), which diffusers' from_single_file reads back to the folder's
    transformer."""
    from diffusers import Krea2Pipeline, Krea2Transformer2DModel

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-2)
    trainer.train()
    export = tmp_path / "o" / "model"
    single = load_file(tmp_path / "o" / "model.safetensors")
    assert {"first.weight", "txtfusion.projector.weight", "txtmlp.0.scale", "last.modulation.lin",
            "blocks.1.attn.qknorm.knorm.scale", "txtfusion.layerwise_blocks.0.mlp.gate.weight"} <= set(single)
    assert single["blocks.0.mod.lin"].shape == (6 * 32,)  # the (6, width) table flattened
    read = Krea2Transformer2DModel.from_single_file(str(tmp_path / "o" / "model.safetensors"), config=str(export),
                                                    subfolder="transformer", local_files_only=True)
    folder_state = Krea2Transformer2DModel.from_pretrained(export / "transformer").state_dict()
    assert read.state_dict().keys() == folder_state.keys()
    assert all(torch.equal(v, folder_state[k]) for k, v in read.state_dict().items())
    original = Krea2Pipeline.from_pretrained(base, local_files_only=True)
    loaded = Krea2Pipeline.from_pretrained(export, local_files_only=True)
    assert loaded.config.text_encoder_select_layers == original.config.text_encoder_select_layers
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


def test_lora_file_loads_in_the_pipeline_and_samples_equal_it(family_models, shapes_data, tmp_path):
    """The default LoRA (the training script's targets): each module of the file is `transformer.<module>` of a layer
    the script adapts; Krea2Pipeline.load_lora_weights gives the trained outputs, from lora.safetensors and from
    lora_comfyui.safetensors (the original names, which diffusers' single-file converter maps back onto the same
    modules); the end-of-training sample equals the pipeline's with guidance_scale s - 1."""
    from diffusers import Krea2Pipeline
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from PIL import Image

    from ot_dist.models.families.krea2 import KREA2_LORA_TARGETS

    base = family_models[FAMILY]
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 20.0, "width": 64, "height": 48}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert all(m.startswith("transformer.") and m.endswith(KREA2_LORA_TARGETS) for m in modules)
    assert {"transformer.img_in", "transformer.time_mod_proj", "transformer.text_fusion.projector",
            "transformer.transformer_blocks.1.attn.to_gate"} <= modules
    trained = prediction(family, model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"])
    pipe = Krea2Pipeline.from_pretrained(base, local_files_only=True)
    before = prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(prediction(family, pipe.transformer, pipe.text_encoder, pipe.tokenizer), trained,
                               rtol=1e-5, atol=1e-6)

    # lora_comfyui.safetensors: the same adapters in the original names under diffusion_model. (every module one the
    # original model has, as diffusers' converter renames them), no .alpha; diffusers' Krea 2 loader reads it to the
    # trained outputs
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    assert len(comfy) == len(saved) and all(k.startswith("diffusion_model.") for k in comfy)
    assert {"diffusion_model.first.lora_A.weight", "diffusion_model.blocks.1.attn.gate.lora_B.weight",
            "diffusion_model.txtfusion.refiner_blocks.0.mlp.down.lora_A.weight",
            "diffusion_model.tproj.1.lora_B.weight"} <= set(comfy)
    original = set(convert_krea2_transformer_checkpoint_to_diffusers(
        {f"{k.removeprefix('diffusion_model.').rsplit('.lora_', 1)[0]}.weight": 0 for k in comfy}))
    assert original == {f"{m.removeprefix('transformer.')}.weight" for m in modules}
    other = Krea2Pipeline.from_pretrained(base, local_files_only=True)
    other.load_lora_weights(tmp_path / "o" / "lora_comfyui.safetensors")
    torch.testing.assert_close(prediction(family, other.transformer, other.text_encoder, other.tokenizer), trained,
                               rtol=1e-5, atol=1e-6)

    def image(guidance_scale):
        return np.asarray(pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3,
                               guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(3),
                               max_sequence_length=32, output_type="pil").images[0]).astype(int)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    # the tiny model's text moves an 8-bit sample too little to tell g = 19 from 20: the conversion is read directly
    assert family.sampling_arguments(pipe, {"guidance_scale": 20.0})["guidance_scale"] == 19.0
    assert np.abs(ours - image(19.0)).max() <= 1
    assert np.abs(ours - image(0.0)).max() > 4  # unguided differs: the comparison above can fail


def test_lora_and_full_lower_the_loss_on_the_demo_data(family_models, shapes_data, tmp_path):
    """The same batch's loss with the same draws, before and after an epoch of the demo data, for each method."""
    for method, rate in (("lora", 5e-2), ("full", 2e-3)):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / method, method=method, max_steps=8,
                              learning_rate=rate, **({"lora.rank": 8, "lora.alpha": 8} if method == "lora" else {}))
        before, after = losses_around_training(trainer)
        assert after < before - 0.1, (method, before, after)


def test_cached_latents_and_text_train_as_the_images_and_captions_do(family_models, shapes_data, tmp_path):
    """data.cache_text stores the compacted states and the mask; each step trims to the longest caption from the
    cached mask: the first step's loss is the uncached one."""
    losses = {}
    for cache in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache, "data.cache_text": cache})
        batch = first_batch(trainer)
        assert ("text_mask" in batch) == cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_a_folder_tapping_other_layers_is_refused(family_models, tmp_path):
    """encode_text derives the taps from the text encoder's depth (Krea 2's rule); a pipeline naming others would
    train on conditioning it was not made for."""
    import json
    import shutil

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import ConfigError
    from ot_dist.models.loading import load_model

    folder = tmp_path / "other_taps"
    shutil.copytree(family_models[FAMILY], folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder_select_layers"] = [1, 4]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"taps text_encoder_select_layers \(1, 4\).*\(2, 5\)"):
        load_model(ModelConfig(family=FAMILY, path=str(folder)))


def test_the_original_single_file_loads_to_the_same_outputs(family_models, tmp_path):
    """A transformer in the original layout (raw.safetensors' keys) under ComfyUI's model.diffusion_model., in
    bfloat16, with `model.config` = the diffusers folder, predicts as the folder's transformer with the same weights
    rounded to bfloat16; a key the config's transformer lacks is named before anything loads."""
    from diffusers import Krea2Pipeline
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.families.krea2_single_file import KREA2
    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    folder = Krea2Pipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        for t in folder.transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    original = KREA2.to_original(folder.transformer.state_dict(), dict(folder.transformer.config),
                                 prefix="model.diffusion_model.")
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in original.items()}
    save_file(state, tmp_path / "raw.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "raw.safetensors"), config=str(base)))
    family = loaded.family
    expected = prediction(family, folder.transformer, folder.text_encoder, folder.tokenizer)
    got = prediction(family, loaded.denoiser, loaded.text_encoders["text_encoder"], loaded.tokenizers["tokenizer"])
    assert torch.equal(got, expected)
    state["model.diffusion_model.blocks.7.attn.wq.weight"] = state["model.diffusion_model.blocks.0.attn.wq.weight"]
    save_file({k: v.clone() for k, v in state.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match=r"unexpected 1 key.*blocks.7.attn.wq.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))


def test_text_encoder_lora_adapts_the_language_model_and_loads_back(family_models, shapes_data, tmp_path):
    """text_encoder.train with LoRA: only Qwen3-VL's language model is adapted (its vision tower, never run, names its
    layers otherwise), the adapters of the layers the taps read move, and the file loads back through peft to the
    trained conditioning (the layer after the last tap runs unread: its adapters keep their zero start)."""
    from diffusers import Krea2Pipeline

    from ot_dist.lora_tools.peft_load import load_peft_lora

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "te", method="lora", max_steps=1, learning_rate=5e-2,
                          output_dtype="float32", **{"text_encoder.train": True, "lora.rank": 4, "lora.alpha": 8})
    trainer.train()
    saved = load_file(tmp_path / "te" / "lora.safetensors")
    text = {k.rsplit(".lora_", 1)[0] for k in saved if k.startswith("text_encoder.")}
    assert text and all(m.startswith("text_encoder.language_model.layers.") for m in text)
    unread = [k for k in saved if k.startswith("text_encoder.language_model.layers.5.") and ".lora_B." in k]
    assert unread and not any(saved[k].any() for k in unread)  # hidden_states[5] is layer 4's output
    read = [k for k in saved if k.startswith("text_encoder.language_model.layers.4.") and ".lora_B." in k]
    assert any(saved[k].any() for k in read)
    fresh = Krea2Pipeline.from_pretrained(base, local_files_only=True)
    assert load_peft_lora(fresh, tmp_path / "te" / "lora.safetensors") == ["text_encoder", "transformer"]
    family, tokenizers = trainer.model.family, trainer.model.tokenizers
    with torch.no_grad():
        tokens = family.tokenize(tokenizers, ["a dot"])
        ours = family.encode_text(trainer.model.text_encoders, tokens)["hidden"]
        theirs = family.encode_text({"text_encoder": fresh.text_encoder}, tokens)["hidden"]
        untrained = family.encode_text({"text_encoder": Krea2Pipeline.from_pretrained(
            base, local_files_only=True).text_encoder}, tokens)["hidden"]
    assert (ours - untrained).abs().max() > 1e-4
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
