"""Qwen-Image on the family contract: the conditioning against QwenImagePipeline.encode_prompt (chat template, first
34 tokens dropped, mask), the objective against diffusers' train_dreambooth_lora_qwen_image.py formulas (5-D VAE
latents normalised by latents_mean / latents_std, packed, img_shapes, t / 1000, target n - x) and its shift against
the pipeline's calculate_shift, training (which weights move), the LoRA file in QwenImagePipeline.load_lora_weights,
the latent cache through the family's one-frame VAE call, and samples equal to the pipeline's."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file
from test_qwen_image_single_file import comfy_detects_qwen_image

from family_training import family_trainer, first_batch
from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.errors import InputFileError
from ot_dist.models.families.qwen_image import PROMPT_TEMPLATE, TEMPLATE_TOKENS_DROPPED
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "qwen_image"
trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, captions = trainer.model, ["a red circle on a blue background", "a big green square"]
    tokenizer = model.tokenizers["tokenizer"]
    # The tiny tokenizer splits the template as the real one does: the dropped part is the system prompt and header.
    header = PROMPT_TEMPLATE.split("{}")[0]
    assert len(tokenizer(header).input_ids) == TEMPLATE_TOKENS_DROPPED
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32  # bounded by the tiny tokenizer's model_max_length
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        hidden, mask = model.pipeline.encode_prompt(captions, device="cpu", **options)
    longest = hidden.shape[1]  # the pipeline pads to the longest caption, ours to a fixed length (the text cache)
    assert torch.equal(ours["mask"][:, :longest], mask.long()) and 0 < mask.sum() < mask.numel()
    assert not ours["mask"][:, longest:].any() and not ours["hidden"][:, longest:].any()
    torch.testing.assert_close(ours["hidden"][:, :longest], hidden)


def test_dynamic_shift_is_the_pipelines(family_models, shapes_data, tmp_path):
    """The noise level of a draw u: the scheduler's exponential time shift at the pipeline's calculate_shift(mu) for
    the image's packed token count."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    scheduler, objective = trainer.model.pipeline.scheduler, trainer.model.objective
    config = scheduler.config
    u = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    for side in (64, 512):  # latent sides: 1024 and 8192 image tokens
        mu = calculate_shift((side // 2) ** 2, config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        expected = scheduler.time_shift(mu, 1.0, u)
        torch.testing.assert_close(objective.shifted(u, torch.Size((16, side, side))), expected)
    assert objective.shifted(u, torch.Size((16, 512, 512)))[0] > objective.shifted(u, torch.Size((16, 64, 64)))[0]


def test_objective_equals_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against train_dreambooth_lora_qwen_image.py's step, written out with the same draws:
    5-D latents (x - mean) / std, x_t = (1 - s) x + s n, permute + QwenImagePipeline._pack_latents, the transformer at
    t / 1000 with img_shapes and the pipeline's prompt embeddings and mask, _unpack_latents, MSE against n - x."""
    from diffusers import QwenImagePipeline

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer = model.vae, model.denoiser
    pixels = batch["pixels"]
    height, width = pixels.shape[-2:]
    shape = (16, height // 8, width // 8)
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
        packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), 2, 16, shape[1], shape[2])
        pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds,
                           encoder_hidden_states_mask=prompt_mask, timestep=t / 1000,
                           img_shapes=[(1, shape[1] // 2, shape[2] // 2)] * 2, return_dict=False)[0]
        pred = QwenImagePipeline._unpack_latents(pred, height, width, 8)
        expected = torch.mean((pred.float() - (noise - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert 0 < t.min() and t.max() < 1000


def transformer_prediction(family, transformer, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, 8, 6), torch.tensor([300.0, 800.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot", "a big red circle"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def test_full_finetune_moves_the_transformer_only(family_models, shapes_data, tmp_path):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-2)
    trainer.train()
    export = tmp_path / "o" / "model"
    # ComfyUI's diffusion-model file beside the folder: bare keys, taken for Qwen-Image by ComfyUI's detection rule
    single = load_file(tmp_path / "o" / "model.safetensors")
    assert comfy_detects_qwen_image({k: tuple(v.shape) for k, v in single.items()}, dict(trainer.model.denoiser.config))
    original = QwenImagePipeline.from_pretrained(base, local_files_only=True)
    loaded = QwenImagePipeline.from_pretrained(export, local_files_only=True)
    # Compared as loaded: transformers 5 writes Qwen2.5-VL's own key names, the base folder holds the original ones.
    # The untied lm_head is in the export (not dropped as a tied copy, then initialised at random on loading).
    for component, moves in (("transformer", True), ("vae", False), ("text_encoder", False)):
        before, after = (getattr(pipe, component).state_dict() for pipe in (original, loaded))
        assert before.keys() == after.keys(), component
        moved = max((before[k] - after[k]).abs().max().item() for k in before)
        assert (moved > 1e-4) == moves, (component, moved)
    # the file is the folder's transformer, key for key and value for value, as diffusers' from_single_file reads it
    folder_state = loaded.transformer.state_dict()
    assert single.keys() == folder_state.keys()
    assert all(torch.equal(single[k], v) for k, v in folder_state.items())
    read = QwenImageTransformer2DModel.from_single_file(str(tmp_path / "o" / "model.safetensors"), config=str(export),
                                                        subfolder="transformer", local_files_only=True)
    assert all(torch.equal(v, folder_state[k]) for k, v in read.state_dict().items())
    model = trainer.model
    torch.testing.assert_close(
        transformer_prediction(model.family, loaded.transformer, loaded.text_encoder, loaded.tokenizer),
        transformer_prediction(model.family, model.denoiser, model.text_encoders["text_encoder"],
                               model.tokenizers["tokenizer"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_e4m3fn"])
def test_comfyuis_diffusion_model_file_loads_to_the_same_outputs(dtype, family_models, tmp_path):
    """A transformer in ComfyUI's layout (its keys under model.diffusion_model., as ComfyUI saves them; Comfy-Org's
    qwen_image_bf16 / qwen_image_fp8_e4m3fn dtypes) with `model.config` = the diffusers folder predicts as the
    folder's transformer with the same weights rounded to the file's dtype; the other components are the folder's."""
    from diffusers import QwenImagePipeline
    from safetensors.torch import save_file

    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    folder = QwenImagePipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        for t in folder.transformer.state_dict().values():
            t.copy_(t.to(dtype).float())  # what the file holds
    state = {"model.diffusion_model." + k: v.to(dtype).contiguous() for k, v in folder.transformer.state_dict().items()}
    save_file(state, tmp_path / "qwen_image.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "qwen_image.safetensors"), config=str(base)))
    family = loaded.family
    expected = transformer_prediction(family, folder.transformer, folder.text_encoder, folder.tokenizer)
    got = transformer_prediction(family, loaded.denoiser, loaded.text_encoders["text_encoder"],
                                 loaded.tokenizers["tokenizer"])
    assert torch.equal(got, expected)
    assert loaded.denoiser.dtype == torch.float32
    # a key the config's transformer lacks is named before anything loads
    state["model.diffusion_model.transformer_blocks.9.attn.to_q.weight"] = state[
        "model.diffusion_model.transformer_blocks.0.attn.to_q.weight"].clone()
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match="unexpected 1 key.*transformer_blocks.9.attn.to_q.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))


def test_lora_file_loads_into_the_pipeline_with_the_trained_outputs(family_models, shapes_data, tmp_path):
    """The diffusers layout (transformer.<module>.lora_A/B.weight, the ComfyUI Qwen-Image key map's names) read by
    QwenImagePipeline.load_lora_weights gives the trained transformer's predictions; the text encoder's LoRA (its
    language model's attention) loads through ot_dist's peft loader."""
    from diffusers import QwenImagePipeline

    from ot_dist.lora_tools.matching import module_index
    from ot_dist.lora_tools.peft_load import load_peft_lora

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8})
    trainer.train()
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert {m.rsplit(".", 1)[-1] for m in modules} == {"to_q", "to_k", "to_v", "0"}  # to_out.0: the script's set
    # ComfyUI's Qwen-Image LoRA rule (comfy/lora.py model_lora_keys_unet): transformer.<k> for each key k of its model,
    # whose module names are diffusers' (comfy/ldm/qwen_image/model.py); no .alpha: it applies up @ down at strength 1
    keys = {f"transformer.{k[:-len('.weight')]}" for k in
            load_file(base / "transformer" / "diffusion_pytorch_model.safetensors") if k.endswith(".weight")}
    assert all(m.startswith("transformer.transformer_blocks.") for m in modules) and modules <= keys
    assert not any(k.endswith(".alpha") for k in saved)
    model = trainer.model
    layers = dict(model.denoiser.named_modules())
    for module in modules:
        layer = layers[module[len("transformer."):]]
        change = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        comfy = saved[f"{module}.lora_B.weight"] @ saved[f"{module}.lora_A.weight"]
        torch.testing.assert_close(comfy, change.detach(), rtol=1e-5, atol=1e-7)
    trained = transformer_prediction(model.family, model.denoiser, model.text_encoders["text_encoder"],
                                     model.tokenizers["tokenizer"])
    pipe = QwenImagePipeline.from_pretrained(base, local_files_only=True)
    before = transformer_prediction(model.family, pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    again = transformer_prediction(model.family, pipe.transformer, pipe.text_encoder, pipe.tokenizer)
    torch.testing.assert_close(again, trained, rtol=1e-5, atol=1e-6)

    text = trainer_for(base, shapes_data, tmp_path / "te", method="lora", max_steps=1, learning_rate=5e-2,
                       output_dtype="float32", **{"text_encoder.train": True, "lora.rank": 4, "lora.alpha": 8})
    text.train()
    te_file = load_file(tmp_path / "te" / "lora.safetensors")
    te_tensors = {k: v for k, v in te_file.items() if not k.startswith("transformer.")}
    # ComfyUI's names, at the trained strength (the scale inside the up matrices: no .alpha, strength 1.0)
    comfy = comfy_qwen_text_lora_keys(text.model.text_encoders["text_encoder"].config.text_config.num_hidden_layers)
    te_modules = {k.rsplit(".lora_", 1)[0] for k in te_tensors}
    assert te_modules and te_modules <= comfy.keys(), sorted(te_modules - comfy.keys())[:3]
    assert set(te_tensors) == {m + s for m in te_modules for s in (".lora_A.weight", ".lora_B.weight")}
    layers = dict(text.model.text_encoders["text_encoder"].named_modules())
    for module in te_modules:
        layer = layers[comfy[module]]
        change = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        torch.testing.assert_close(te_tensors[f"{module}.lora_B.weight"] @ te_tensors[f"{module}.lora_A.weight"],
                                   change.detach(), rtol=1e-5, atol=1e-7)
    QwenImagePipeline.from_pretrained(base, local_files_only=True).load_lora_weights(tmp_path / "te" / "lora.safetensors")
    fresh = QwenImagePipeline.from_pretrained(base, local_files_only=True)
    # the names `ot-dist lora merge` and lora.init_from match a file's modules by, on a model without adapters
    index = module_index(text.model, "diffusers", parts={"text_encoder": fresh.text_encoder})
    assert all(index[m].part == "text_encoder" and index[m].path == comfy[m] for m in te_modules)
    assert load_peft_lora(fresh, tmp_path / "te" / "lora.safetensors") == ["text_encoder", "transformer"]
    with torch.no_grad():
        tokens = text.model.family.tokenize(text.model.tokenizers, ["a dot"])
        ours = text.model.family.encode_text(text.model.text_encoders, tokens)["hidden"]
        theirs = text.model.family.encode_text({"text_encoder": fresh.text_encoder}, tokens)["hidden"]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def comfy_qwen_text_lora_keys(layers: int) -> dict[str, str]:
    """ComfyUI's LoRA names for Qwen-Image's text encoder -> the module path in transformers' Qwen2.5-VL.
    Read from github.com/Comfy-Org/ComfyUI @ a125cd84b054a57729b5eecab930ca9408719832: comfy/lora.py
    model_lora_keys_clip maps `text_encoders.<k>` for every weight key k of the text-encoder model (nothing else for
    Qwen2.5-VL); comfy/text_encoders/qwen_image.py QwenImageTEModel (SD1ClipModel, name "qwen25_7b") holds
    Qwen25_7BVLIModel as `qwen25_7b`, an SDClipModel whose `transformer` is llama.py's Qwen25_7BVLI, with the language
    model Llama2_ as `model`: layers.<i>.self_attn.{q,k,v,o}_proj, layers.<i>.mlp.{gate,up,down}_proj.
    comfy/weight_adapter/lora.py reads `x.lora_B.weight` / `x.lora_A.weight`, scale 1.0 without `x.alpha`."""
    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
    return {f"text_encoders.qwen25_7b.transformer.model.layers.{i}.{c}": f"model.language_model.layers.{i}.{c}"
            for i in range(layers) for c in linears}


def test_cached_latents_and_text_train_as_the_images_and_captions_do(family_models, shapes_data, tmp_path):
    """data.cache_latents encodes through the family's one-frame VAE call, data.cache_text stores the padded hidden
    states and mask: the first step's loss is the uncached one."""
    losses = {}
    for cache in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache, "data.cache_text": cache})
        batch = first_batch(trainer)
        assert ("latent_mean" in batch) == cache and ("text_mask" in batch) == cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_samples_equal_the_pipeline_on_the_export(family_models, shapes_data, tmp_path):
    """A sample prompt's guidance_scale is the pipeline's true_cfg_scale, with the blank negative prompt (a large scale:
    the tiny model's text moves its output little)."""
    from diffusers import QwenImagePipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 20.0, "width": 64, "height": 48}
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", max_steps=1,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = QwenImagePipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True)

    def image(**guidance):
        return np.asarray(pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3,
                               generator=torch.Generator().manual_seed(3), max_sequence_length=32, output_type="pil",
                               **guidance).images[0]).astype(int)

    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - image(negative_prompt=" ", true_cfg_scale=20.0)).max() <= 1
    assert np.abs(ours - image(true_cfg_scale=1.0)).max() > 4  # unguided differs: the comparison above can fail


def test_a_trained_text_encoder_is_never_left_out_of_every_exported_file(family_models, shapes_data, tmp_path):
    """ComfyUI's Qwen-Image file is the transformer alone: with a trained text encoder, `--format single-file` alone is
    refused by name (the text encoder would be in no file); the default export writes the folder beside it."""
    from ot_dist.errors import ConfigError
    from ot_dist.methods.registry import build_method
    from ot_dist.models.loading import load_model

    config = validate(base_config(family_models[FAMILY], shapes_data, tmp_path / "o", family=FAMILY,
                                  **{"text_encoder.train": True}))
    model = load_model(config.model)
    method = build_method(config)
    method.prepare(model)
    with pytest.raises(ConfigError, match="single file holds the denoiser alone and this run trained a text encoder"):
        method.export(model, tmp_path / "o", formats=("single-file",))
    assert {p.name for p in method.export(model, tmp_path / "o")} == {"model", "model.safetensors"}
