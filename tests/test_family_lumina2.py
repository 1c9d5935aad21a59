"""Lumina 2 on the family contract: the conditioning against Lumina2Pipeline.encode_prompt (the system prompt, Gemma's
penultimate layer, the mask), the objective against the formulas of diffusers' train_dreambooth_lora_lumina2.py (the
reversed flow: x_t = (1 - t) n + t x, the transformer at t, target x - n) with the noise level shifted by the
scheduler's shift as SimpleTuner draws it, training (full: the transformer alone changes, the export reloads through
from_pretrained; LoRA: the file Lumina2Pipeline.load_lora_weights reads gives the trained outputs) and samples equal
to the pipeline's. The 2-rank fsdp comparison rides in PixArt-α's launch (tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from safetensors.torch import load_file

from family_training import family_trainer, quiet
from ot_dist.data.reader import collate
from ot_dist.models.families.lumina2 import SYSTEM_PROMPT
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "lumina2"
SHIFT = 6.0  # the tiny model's scheduler, as Lumina-Image-2.0's (and ComfyUI's sampling shift for it)


trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The system prompt in front of each caption, right padding with the mask (whatever the tokenizer's config
    says), Gemma's second-to-last hidden states."""
    model = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o").model
    captions = ["a red circle", "a big green square on a white background"]
    options = model.family.pipeline_call_options(model.pipeline)
    assert options == {"max_sequence_length": 256, "system_prompt": model.pipeline.system_prompt}
    assert model.pipeline.system_prompt == SYSTEM_PROMPT
    tokenizer = model.tokenizers["tokenizer"]
    tokenizer.padding_side = "left"  # as a tokenizer config may say: Lumina pads right regardless
    with torch.no_grad():
        tokens = model.family.tokenize(model.tokenizers, captions)
        ours = model.family.encode_text(model.text_encoders, tokens)
    tokenizer.padding_side = "right"  # what Lumina2Pipeline.__init__ sets
    with torch.no_grad():
        hidden, mask, _, _ = model.pipeline.encode_prompt(captions, do_classifier_free_guidance=False,
                                                          max_sequence_length=256)
        last = model.text_encoders["text_encoder"](tokens["text_encoder"], attention_mask=mask)[0]
    assert tokens["text_encoder"][:, 0].eq(model.tokenizers["tokenizer"].bos_token_id).all()
    assert torch.equal(ours["mask"], mask.long()) and 0 < mask.sum() < mask.numel()  # padding is masked
    torch.testing.assert_close(ours["hidden"], hidden)
    assert (last - hidden).abs().max() > 1e-3  # not the last layer's output


def test_objective_follows_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against train_dreambooth_lora_lumina2.py's step written out with the same draws:
    model_input = (posterior sample - shift_factor) x scaling_factor, Lumina's t = 1 - s for the drawn noise level s,
    noisy = (1 - t) n + t x, the transformer at t with the pipeline's prompt embeddings and mask, MSE of its output
    against x - n. The noise level is the scheduler's shift applied to the logit-normal draw (towards noise)."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    assert model.objective.shift == SHIFT
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    pixels = batch["pixels"]
    shape = (16, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, levels = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        levels.append(SHIFT * u / (1 + (SHIFT - 1) * u))
    eps, noise = torch.stack(eps), torch.stack(noise)
    vae = model.vae
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        x = (posterior.mean + posterior.std * eps - vae.config.shift_factor) * vae.config.scaling_factor
        t = 1 - torch.tensor(levels, dtype=torch.float32)  # the script's `sigmas`: Lumina's time, 1 = the image
        sigmas = t.view(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * noise + sigmas * x
        hidden, mask, _, _ = model.pipeline.encode_prompt(list(batch["caption"]), do_classifier_free_guidance=False,
                                                          max_sequence_length=256)
        pred = model.denoiser(hidden_states=noisy, encoder_hidden_states=hidden, encoder_attention_mask=mask,
                              timestep=t, return_dict=False)[0]
        expected = torch.mean((pred.float() - (x - noise).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def outputs(transformer, text_encoder, tokenizer, family):
    """The transformer's prediction for fixed noisy latents and two captions of different lengths."""
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, 8, 6), torch.tensor([300.0, 800.0])
    conditioning = family.encode_text({"text_encoder": text_encoder}, family.tokenize({"tokenizer": tokenizer},
                                                                                      ["a dot", "a big red circle"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def per_epoch(result, epochs):
    return np.array(result.losses).reshape(epochs, -1).mean(axis=1)


def test_full_finetune_lowers_the_loss_and_the_export_reloads_through_from_pretrained(family_models, shapes_data,
                                                                                     tmp_path):
    from diffusers import Lumina2Pipeline

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", epochs=3, batch_size=4, learning_rate=1e-3)
    losses = per_epoch(trainer.train(), 3)
    assert losses[-1] < losses[0] - 0.02, f"loss did not fall: {losses}"
    export = tmp_path / "o" / "model"
    for part, trained in (("transformer", True), ("vae", False), ("text_encoder", False)):
        name = "model.safetensors" if part == "text_encoder" else "diffusion_pytorch_model.safetensors"
        before, after = load_file(base / part / name), load_file(export / part / name)
        changed = max((before[k].float() - after[k].float()).abs().max().item() for k in before)
        assert (changed > 1e-4) if trained else (changed == 0), (part, changed)
    loaded = Lumina2Pipeline.from_pretrained(export, local_files_only=True)
    model = trainer.model
    for key, value in model.denoiser.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    torch.testing.assert_close(outputs(loaded.transformer, loaded.text_encoder, loaded.tokenizer, model.family),
                               outputs(model.denoiser, model.text_encoders["text_encoder"],
                                       model.tokenizers["tokenizer"], model.family))
    # the single file: the transformer alone in the original keys (ComfyUI's detection key among them), read back as
    # model.path with the folder as model.config
    single = load_file(tmp_path / "o" / "model.safetensors")
    assert {"cap_embedder.1.weight", "layers.1.attention.qkv.weight", "norm_final.weight"} <= single.keys()
    assert not any(k.startswith(("text_encoder", "vae", "transformer.")) for k in single)
    again = model.family.load_single_file(tmp_path / "o" / "model.safetensors", str(export), None).transformer
    for key, value in model.denoiser.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_lora_lowers_the_loss_loads_in_the_pipeline_and_samples_equal_it(family_models, shapes_data, tmp_path):
    """One LoRA run (attention and the SwiGLU feed-forward of every block): the loss falls, its file through
    Lumina2Pipeline.load_lora_weights gives the trained transformer's outputs, and its end-of-training sample equals
    Lumina2Pipeline's on the base model with that file (same seed, the system prompt and length as training). The
    default preset is the training script's --lora_layers default."""
    from diffusers import Lumina2Pipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 64, "height": 48}
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", epochs=3,
                          batch_size=4, learning_rate=2e-2,
                          **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp",
                             "sampling.prompts": [prompt]})
    losses = per_epoch(trainer.train(), 3)
    assert losses[-1] < losses[0] - 0.02, f"loss did not fall: {losses}"
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0].removesuffix(".0").rsplit(".", 1)[-1] for k in saved}
    assert modules == {"to_q", "to_k", "to_v", "to_out", "linear_1", "linear_2", "linear_3"}
    blocks = {k.split(".")[1] for k in saved}
    assert blocks == {"layers", "noise_refiner", "context_refiner"}
    assert family.denoiser_lora_presets["default"] == ("to_q", "to_k", "to_v", "to_out.0")
    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], family)

    pipe = Lumina2Pipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    base = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    assert (base - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family), trained,
                               rtol=1e-4, atol=1e-5)

    comfyui_file_applies_the_trained_change(tmp_path / "o" / "lora_comfyui.safetensors", trained, family,
                                            family_models[FAMILY], tmp_path)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    image = pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=256, output_type="pil").images[0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1


def comfy_lumina2_lora_keys(transformer_state: dict, config) -> dict[str, str]:
    """comfy/lora.py model_lora_keys_unet for a Lumina 2 model, which has no Lumina 2 branch: the generic rule over
    its state dict (`diffusion_model.` + the original keys): `lora_unet_<key with _>` and `diffusion_model.<key>`,
    without `.weight`."""
    from ot_dist.models.families.lumina2_single_file import lumina2_to_original

    keys = {}
    for key in lumina2_to_original(transformer_state, config, "diffusion_model."):
        if key.endswith(".weight"):
            stem = key[len("diffusion_model."):-len(".weight")]
            keys["lora_unet_" + stem.replace(".", "_")] = key
            keys["diffusion_model." + stem] = key
    return keys


def comfyui_file_applies_the_trained_change(path, trained: torch.Tensor, family, base_folder, out):
    """lora_comfyui.safetensors: every module one ComfyUI's rule maps onto Lumina 2's original keys (q / k / v as one
    `attention.qkv`), applied as ComfyUI applies a LoRA (W + alpha / rank x up @ down, rank = the down matrix's rows)
    to the base model in its original layout, read back into diffusers: the trained outputs. `ot-dist lora merge`
    reads the same file (the fused modules split back onto q / k / v): the trained outputs too."""
    from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

    from ot_dist.lora_tools.merge import merge_command
    from ot_dist.models.families.lumina2_single_file import lumina2_from_original, lumina2_to_original

    comfy = load_file(path)
    transformer = Lumina2Transformer2DModel.from_pretrained(base_folder, subfolder="transformer")
    comfy_keys = comfy_lumina2_lora_keys(transformer.state_dict(), transformer.config)
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in comfy}
    assert modules <= comfy_keys.keys(), sorted(modules - comfy_keys.keys())[:3]
    assert any(m.endswith("_attention_qkv") for m in modules) and not any("to_q" in m for m in modules)
    original = lumina2_to_original(transformer.state_dict(), transformer.config, "diffusion_model.")
    for module in modules:
        down, up = comfy[f"{module}.lora_down.weight"], comfy[f"{module}.lora_up.weight"]
        key = comfy_keys[module]
        original[key] = original[key] + comfy[f"{module}.alpha"] / down.shape[0] * (up @ down)
    bare = {k.removeprefix("diffusion_model."): v for k, v in original.items()}
    transformer.load_state_dict(lumina2_from_original(bare, transformer.config))
    pipe = Lumina2Pipeline.from_pretrained(base_folder, transformer=transformer, local_files_only=True)
    torch.testing.assert_close(outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family), trained,
                               rtol=1e-4, atol=1e-5)
    merged = merge_command(str(base_folder), FAMILY, [str(path)], [1.0], str(out / "merged"), "diffusers", None,
                           "float32", log=quiet)
    pipe = Lumina2Pipeline.from_pretrained(merged, local_files_only=True)
    torch.testing.assert_close(outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family), trained,
                               rtol=1e-4, atol=1e-5)


def test_the_single_file_is_what_diffusers_converter_and_comfyui_read_at_lumina_image_2s_widths():
    """Lumina-Image-2.0's transformer on the meta device, written in the single-file layout: diffusers'
    convert_lumina2_to_diffusers (which splits q | k | v at 2304 / 768 / 768) gives back every key at its shape, and
    the keys ComfyUI's model_detection.py reads ("Lumina 2": cap_embedder.1.weight's columns, the layers.N. count)
    describe the model; the keys are those of ComfyUI's NextDiT; the layout reads back into the same state dict (no
    tensor recomputed)."""
    from diffusers import Lumina2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    from ot_dist.memory.table import LUMINA_IMAGE_2
    from ot_dist.models.families.lumina2_single_file import lumina2_from_original, lumina2_rules, lumina2_to_original
    from ot_dist.models.families.single_file_keys import to_original

    with torch.device("meta"):
        transformer = Lumina2Transformer2DModel(**LUMINA_IMAGE_2)
    state = transformer.state_dict()
    original = lumina2_to_original(state, transformer.config)
    converted = convert_lumina2_to_diffusers(dict(original))
    assert converted.keys() == state.keys()
    assert all(converted[k].shape == v.shape for k, v in state.items())
    assert original["cap_embedder.1.weight"].shape[1] == LUMINA_IMAGE_2["cap_feat_dim"]
    assert len({k.split(".")[1] for k in original if k.startswith("layers.")}) == LUMINA_IMAGE_2["num_layers"]
    assert original["layers.0.attention.qkv.weight"].shape == (2304 + 768 + 768, 2304)
    back = lumina2_from_original({"model.diffusion_model." + k: v for k, v in original.items()}, transformer.config)
    assert back.keys() == state.keys() and all(back[k].shape == v.shape for k, v in state.items())
    assert original.keys() == comfy_nextdit_keys(LUMINA_IMAGE_2["num_refiner_layers"], LUMINA_IMAGE_2["num_layers"])
    # the fused rows in diffusers' (and ComfyUI's split: q heads, then k, then v) order, with values
    rules = [r for r in lumina2_rules(transformer.config) if r.original == "layers.3.attention.qkv.weight"]
    pieces = {key: torch.randn(value.shape) for key, value in state.items() if key in rules[0].diffusers}
    fused = to_original(pieces, rules)
    assert all(torch.equal(convert_lumina2_to_diffusers(dict(fused))[k], v) for k, v in pieces.items())


def comfy_nextdit_keys(refiner_layers: int, layers: int) -> set[str]:
    """The state-dict keys of ComfyUI's NextDiT (comfy/ldm/lumina/model.py), written out from its modules: joint
    blocks with qk norm and no biases in attention or feed-forward, modulated (`adaLN_modulation.1`) except in the
    context refiner; the caption embedder's RMSNorm + Linear; the final layer's scale-only modulation (its LayerNorm
    has no weights); the unused `norm_final` RMSNorm."""
    block = {"attention.qkv.weight", "attention.out.weight", "attention.q_norm.weight", "attention.k_norm.weight",
             "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight", "attention_norm1.weight",
             "ffn_norm1.weight", "attention_norm2.weight", "ffn_norm2.weight"}
    modulated = block | {"adaLN_modulation.1.weight", "adaLN_modulation.1.bias"}
    keys = {"x_embedder.weight", "x_embedder.bias", "t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias",
            "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias", "cap_embedder.0.weight", "cap_embedder.1.weight",
            "cap_embedder.1.bias", "norm_final.weight", "final_layer.linear.weight", "final_layer.linear.bias",
            "final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias"}
    for blocks, count, names in (("noise_refiner", refiner_layers, modulated),
                                 ("context_refiner", refiner_layers, block), ("layers", layers, modulated)):
        keys |= {f"{blocks}.{i}.{name}" for i in range(count) for name in names}
    return keys


def test_gemma_lora_loads_back_through_peft_and_is_in_comfyuis_file(family_models, shapes_data, tmp_path):
    """Lumina2Pipeline's LoRA loader reads the transformer only; a file with a trained Gemma LoRA holds it under
    `text_encoder.`, which load_peft_lora applies: the pipeline then gives the trained model's outputs. (Gemma's last
    layer, whose output Lumina never reads, gets no gradient: its LoRA stays at its zero start.) lora_comfyui.safetensors
    holds it too, under ComfyUI's names (comfy/lora.py model_lora_keys_clip: `text_encoders.<k>` for each weight key k
    of its Lumina 2 text encoder, Gemma 2 under `gemma2_2b.transformer.model.` with transformers' layer names), each
    module's up @ down x alpha / rank the trained change."""
    from diffusers import Lumina2Pipeline

    from ot_dist.lora_tools.peft_load import load_peft_lora

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"text_encoder.train": True})
    trainer.train()
    model = trainer.model
    model.text_encoders["text_encoder"].eval()
    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], model.family)
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    last = [v for k, v in saved.items() if k.startswith("text_encoder.layers.1.") and "lora_B" in k]
    assert last and all(not v.any() for v in last)
    assert any(v.any() for k, v in saved.items() if k.startswith("text_encoder.layers.0.") and "lora_B" in k)
    comfy_file = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    gemma = {path: module for path, module in model.text_encoders["text_encoder"].named_modules()
             if hasattr(module, "lora_A")}
    names = {k.rsplit(".lora_", 1)[0].removesuffix(".alpha") for k in comfy_file if k.startswith("text_encoders.")}
    assert names == {"text_encoders.gemma2_2b.transformer.model." + path.removeprefix("base_model.model.")
                     for path in gemma}
    for path, module in gemma.items():
        name = "text_encoders.gemma2_2b.transformer.model." + path.removeprefix("base_model.model.")
        up, down = comfy_file[f"{name}.lora_up.weight"], comfy_file[f"{name}.lora_down.weight"]
        change = module.lora_B["default"].weight @ module.lora_A["default"].weight * module.scaling["default"]
        torch.testing.assert_close(up @ down * (comfy_file[f"{name}.alpha"] / down.shape[0]), change.detach(),
                                   rtol=1e-5, atol=1e-7)
    pipe = Lumina2Pipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    assert load_peft_lora(pipe, tmp_path / "o" / "lora.safetensors") == ["text_encoder", "transformer"]
    torch.testing.assert_close(outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, model.family), trained,
                               rtol=1e-4, atol=1e-5)


def test_comfyui_names_fuse_a_partly_adapted_qkv_with_zero_rows():
    """lora.transformer_targets to_q alone (rsLoRA, alpha 8, rank 2): the fused `attention.qkv` module has rank 6, its
    up @ down is the q change (scale alpha / sqrt(rank) inside) over zero rows for k and v, at `.alpha` = its rank."""
    from diffusers import Lumina2Transformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from ot_dist.models.families.lumina2_lora import comfyui_lora_state

    torch.manual_seed(0)
    transformer = Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), cap_feat_dim=32)
    config = LoraConfig(r=2, lora_alpha=8, use_rslora=True, target_modules=["to_q"], init_lora_weights="gaussian")
    transformer.add_adapter(config)
    for name, parameter in transformer.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_()
    state = get_peft_model_state_dict(transformer)
    comfy = comfyui_lora_state(state, transformer.peft_config["default"].to_dict(), transformer)
    name = "lora_unet_layers_0_attention_qkv"
    down, up = comfy[f"{name}.lora_down.weight"], comfy[f"{name}.lora_up.weight"]
    assert down.shape == (6, 32) and up.shape == (32 + 16 + 16, 6) and comfy[f"{name}.alpha"].item() == 6
    change = comfy[f"{name}.alpha"] / 6 * (up @ down)
    q = state["layers.0.attn.to_q.lora_B.weight"] @ state["layers.0.attn.to_q.lora_A.weight"] * 8 / 2 ** 0.5
    torch.testing.assert_close(change[:32], q)
    assert not change[32:].any()
    assert {k.rsplit(".", 2)[0] for k in comfy if k.endswith("down.weight")} == {
        f"lora_unet_{block}_0_attention_qkv" for block in ("layers", "noise_refiner", "context_refiner")}
