"""HunyuanVideo on the family contract, images as one-frame videos: text encoding against
HunyuanVideoPipeline.encode_prompt, the objective against the pipeline's conventions and OneTrainer's step written out
(5-D latents x scaling_factor, x_t = (1 - s) x + s n with s shifted by the scheduler's shift, the raw timestep and the
distilled guidance x 1000 in, MSE against n - x), training (full: the transformer alone changes and reloads; LoRA: the
file HunyuanVideoPipeline.load_lora_weights reads gives the trained outputs) and samples equal to the pipeline's
one-frame output."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from family_training import family_trainer
from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "hunyuan_video"
SHIFT = 7.0  # the tiny model's scheduler: FlowMatchEulerDiscreteScheduler(shift=7.0), hunyuanvideo-community's
CAPTION_TOKENS = 24  # the tiny tokenizer's length after the template (256 with Llava-Llama-3's)


trainer_for = partial(family_trainer, FAMILY)


def pipeline_template(pipeline):
    from ot_dist.models.families.hunyuan_video import crop_start, prompt_template

    return {"template": prompt_template(), "crop_start": crop_start(pipeline.tokenizer)}


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """The caption in the prompt template, Llama's third hidden state from the end with the template's tokens cropped
    off (states and mask), CLIP-L's pooled output: equal to HunyuanVideoPipeline.encode_prompt with its template (the
    crop counted for this tokenizer) at the same max_sequence_length."""
    model = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o").model
    captions = ["a red circle", "a big green square on a white background"]
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == CAPTION_TOKENS
    with torch.no_grad():
        tokens = model.family.tokenize(model.tokenizers, captions)
        ours = model.family.encode_text(model.text_encoders, tokens)
        hidden, pooled, mask = model.pipeline.encode_prompt(
            captions, prompt_template=options["prompt_template"], device="cpu",
            max_sequence_length=options["max_sequence_length"])
    assert ours["hidden"].shape[1] == CAPTION_TOKENS
    assert 0 < mask.sum() < mask.numel() and mask[0].sum() < mask[1].sum()  # padded, the first caption shorter
    torch.testing.assert_close(ours["mask"], mask)
    torch.testing.assert_close(ours["hidden"], hidden)
    torch.testing.assert_close(ours["pooled"], pooled)


def test_crop_is_the_templates_prefix():
    """crop_start counts the template's tokens before the caption: the state kept first is the caption's first token
    (the pipeline's constant 95 is this count for Llava-Llama-3's tokenizer, which cannot be read offline)."""
    from ot_dist.models.families.hunyuan_video import crop_start, prompt_template, tiny_llava_llama_tokenizer

    tokenizer = tiny_llava_llama_tokenizer()
    ids = tokenizer(prompt_template().format("a red circle")).input_ids
    crop = crop_start(tokenizer)
    assert tokenizer.convert_ids_to_tokens(ids[crop:]) == ["a", "Ġred", "Ġcircle", "<|eot_id|>"]
    assert tokenizer.decode(ids[:crop]) == "<|begin_of_text|>" + prompt_template().split("{}")[0]


def test_objective_equals_the_pipelines_conventions_and_onetrainers_step(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against the step written out with the same draws: the VAE's posterior of the images
    as (B, 3, 1, H, W) clips, x scaling_factor (OneTrainer's latent_image * scaling_factor, the inverse of the
    pipeline's decode), sigma the logit-normal u shifted by the scheduler's shift, x_t = (1 - s) x + s n, the
    transformer called as the pipeline calls it (5-D latents, the timestep 1000 s in float32, the prompt embeddings and
    their mask, CLIP's pooled output, the guidance 1.0 x 1000 OneTrainer trains with), MSE against n - x."""
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
        x = (posterior.mean + posterior.std * eps) * vae.config.scaling_factor
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1, 1)
        call = model.family.pipeline_call_options(model.pipeline)
        hidden, pooled, mask = model.pipeline.encode_prompt(list(batch["caption"]), device="cpu", **call)
        out = model.denoiser(hidden_states=(1 - sigma) * x + sigma * noise, timestep=sigma.flatten() * 1000,
                             encoder_hidden_states=hidden, encoder_attention_mask=mask, pooled_projections=pooled,
                             guidance=torch.full((2,), 1000.0), return_dict=False)[0]
        expected = torch.nn.functional.mse_loss(out, noise - x)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def outputs(pipeline_or_model, family):
    """The transformer's prediction for fixed noisy latents and a caption, the text encoded by its text encoders."""
    transformer, encoders, tokenizers = pipeline_or_model
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([500.0])
    conditioning = family.encode_text(encoders, family.tokenize(tokenizers, ["a red dot"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def parts(pipe):
    return (pipe.transformer, {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2},
            {"tokenizer": pipe.tokenizer, "tokenizer_2": pipe.tokenizer_2})


def trained_parts(model):
    return model.denoiser, model.text_encoders, model.tokenizers


def test_lora_file_loads_in_the_pipeline_and_samples_equal_its_one_frame(family_models, shapes_data, tmp_path):
    """One LoRA run (attention of both streams and the feed-forwards): its file through
    HunyuanVideoPipeline.load_lora_weights gives the trained transformer's outputs, and its end-of-training sample
    equals the pipeline's frame (num_frames=1) on the base model with that file, the same seed and guidance."""
    from diffusers import HunyuanVideoPipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 64, "height": 48}
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp",
                                                 "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert all(k.startswith("transformer.") for k in saved)
    assert any(".single_transformer_blocks.0.proj_mlp" in m for m in modules)
    assert any(".transformer_blocks.0.attn.add_q_proj" in m for m in modules)
    trained = outputs(trained_parts(model), family)

    pipe = HunyuanVideoPipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    base = outputs(parts(pipe), family)
    assert (base - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(outputs(parts(pipe), family), trained, rtol=1e-4, atol=1e-5)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    frame = pipe(prompt="a red circle", width=64, height=48, num_frames=1, num_inference_steps=3, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(3), output_type="pil",
                 **family.pipeline_call_options(pipe)).frames[0][0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - np.asarray(frame).astype(int)).max() <= 1


def test_full_finetune_trains_the_transformer_and_the_export_reloads(family_models, shapes_data, tmp_path):
    """Two steps from the latent and text caches (the cropped states, their mask and the pooled output cached per
    caption): the transformer alone changes, and the export reloads through HunyuanVideoPipeline.from_pretrained with
    the trained outputs."""
    from diffusers import HunyuanVideoPipeline

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-3,
                          **{"data.cache_text": True, "data.cache_latents": True})
    trainer.train()
    export = tmp_path / "o" / "model"
    for part, trained in (("transformer", True), ("vae", False), ("text_encoder", False), ("text_encoder_2", False)):
        name = "diffusion_pytorch_model.safetensors" if part in ("transformer", "vae") else "model.safetensors"
        before, after = load_file(base / part / name), load_file(export / part / name)
        changed = max((before[k].float() - after[k].float()).abs().max().item() for k in before)
        assert (changed > 1e-4) if trained else (changed == 0), (part, changed)
    loaded = HunyuanVideoPipeline.from_pretrained(export, local_files_only=True)
    family = trainer.model.family
    torch.testing.assert_close(outputs(parts(loaded), family), outputs(trained_parts(trainer.model), family))


@pytest.mark.parametrize("method,lr", [("lora", 3e-2), ("full", 1e-3)])
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


def test_guidance_and_layer_skip_reach_the_transformer_and_the_text(family_models, shapes_data, tmp_path):
    """model.guidance_scale is the distilled guidance shown in training (x 1000); model.text_encoder_layer_skip takes
    Llama's hidden states one layer further back, as OneTrainer's text_encoder_layer_skip."""
    model = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o").model
    family = model.family
    assert family.guidance_scale == 1.0
    seen = {}
    hook = model.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        outputs(trained_parts(model), family)
        assert seen["guidance"].tolist() == [1000.0]
        outputs(trained_parts(model), family.configure(validate(base_config(
            "x", "y", "z", family=FAMILY, **{"model.guidance_scale": 3.5})).model))
        assert seen["guidance"].tolist() == [3500.0]
    finally:
        hook.remove()
    skipped = family.configure(validate(base_config("x", "y", "z", family=FAMILY,
                                                    **{"model.text_encoder_layer_skip": 1})).model)
    tokens = family.tokenize(model.tokenizers, ["a red dot"])
    with torch.no_grad():
        states = model.text_encoders["text_encoder"](input_ids=tokens["text_encoder"],
                                                     attention_mask=tokens["text_encoder_mask"],
                                                     output_hidden_states=True).hidden_states
        crop = int(tokens["text_encoder_crop"][0])
        torch.testing.assert_close(skipped.encode_text(model.text_encoders, tokens)["hidden"], states[-4][:, crop:])


def test_image_to_video_transformers_are_refused(shapes_data, tmp_path):
    """An image-to-video transformer (SkyReels' 32 input channels: the image latents beside the noisy ones;
    HunyuanVideo-I2V's image_condition_type) would train wrongly as text-to-video: a folder holding one is refused when
    it loads, and so is its single file read with that folder as model.config."""
    from diffusers import HunyuanVideoTransformer3DModel
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import ConfigError
    from ot_dist.models.families.hunyuan_video import refuse_image_to_video
    from ot_dist.models.families.hunyuan_video_single_file import HUNYUAN_VIDEO
    from ot_dist.models.families.registry import get_family
    from ot_dist.models.loading import load_model

    pipeline = get_family(FAMILY).build_tiny()
    refuse_image_to_video(pipeline.transformer)  # text-to-video: accepted
    config = {**pipeline.transformer.config, "in_channels": 32}
    pipeline.transformer = HunyuanVideoTransformer3DModel.from_config(config)
    pipeline.save_pretrained(tmp_path / "i2v")
    with pytest.raises(ConfigError, match="image-to-video"):
        trainer_for(tmp_path / "i2v", shapes_data, tmp_path / "o")
    # its single file, with the folder as model.config, is refused the same way
    state = HUNYUAN_VIDEO.to_original(pipeline.transformer.state_dict(), pipeline.transformer.config)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "i2v.safetensors")
    with pytest.raises(ConfigError, match="image-to-video"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "i2v.safetensors"), config=str(tmp_path / "i2v")))
    pipeline.transformer.register_to_config(in_channels=16, image_condition_type="token_replace")
    with pytest.raises(ConfigError, match="image-to-video"):
        refuse_image_to_video(pipeline.transformer)


def test_a_video_clip_in_a_concept_is_refused_not_skipped(family_models, shapes_data, tmp_path):
    """Video clips are out of scope (images as one-frame videos only): one in the data folder stops the run."""
    import shutil

    from ot_dist.errors import InputFileError

    data = tmp_path / "data"
    shutil.copytree(shapes_data, data)
    (data / "clip.mp4").write_bytes(b"\0" * 16)
    with pytest.raises(InputFileError, match=r"1 video clip \(.*clip\.mp4\).*cannot train on video clips"):
        trainer_for(family_models[FAMILY], data, tmp_path / "o")


def comfyui_model_weights(config) -> dict[str, tuple[int, int]]:
    """The Linear weights of ComfyUI's HunyuanVideo model (comfy/ldm/hunyuan_video/model.py on comfy/ldm/flux/layers.py:
    DoubleStreamBlock's img_/txt_mod.lin, _attn.qkv, _attn.proj, _mlp.0 / .2; SingleStreamBlock's linear1 (q|k|v|mlp),
    linear2, modulation.lin; the refiner's self_attn.qkv / .proj, mlp.0 / .2, adaLN_modulation.1; LastLayer.linear), as
    `diffusion_model.<key>` -> (out, in), for a tiny config."""
    h = config.num_attention_heads * config.attention_head_dim
    mlp = int(h * config.mlp_ratio)
    keys = {}
    for n in range(config.num_layers):
        for stream in ("img", "txt"):
            block = f"double_blocks.{n}.{stream}"
            keys.update({f"{block}_mod.lin": (6 * h, h), f"{block}_attn.qkv": (3 * h, h), f"{block}_attn.proj": (h, h),
                         f"{block}_mlp.0": (mlp, h), f"{block}_mlp.2": (h, mlp)})
    for n in range(config.num_single_layers):
        keys.update({f"single_blocks.{n}.linear1": (3 * h + mlp, h), f"single_blocks.{n}.linear2": (h, h + mlp),
                     f"single_blocks.{n}.modulation.lin": (3 * h, h)})
    for n in range(config.num_refiner_layers):
        block = f"txt_in.individual_token_refiner.blocks.{n}"
        keys.update({f"{block}.self_attn.qkv": (3 * h, h), f"{block}.self_attn.proj": (h, h),
                     f"{block}.mlp.0": (mlp, h), f"{block}.mlp.2": (h, mlp), f"{block}.adaLN_modulation.1": (2 * h, h)})
    keys["final_layer.linear"] = (config.patch_size ** 2 * config.out_channels, h)
    return {f"diffusion_model.{k}.weight": shape for k, shape in keys.items()}


def comfyui_key_map(weights) -> dict[str, str]:
    """comfy/lora.py model_lora_keys_unet for a HunyuanVideo model: its generic rule (`diffusion_model.<key>`,
    `lora_unet_<key with _>`) and its HunyuanVideo branch (diffusion-pipe's names: `transformer.` / `diffusion_model.`
    + the key after its renames)."""
    key_map = {}
    for k in weights:
        key_map["lora_unet_" + k[len("diffusion_model."):-len(".weight")].replace(".", "_")] = k
        key_map[k[:-len(".weight")]] = k
        renamed = k.replace("_mod.lin.", "_mod.linear.").replace("_attn.qkv.", "_attn_qkv.").replace(
            "_attn.proj.", "_attn_proj.")
        renamed = renamed.replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2.")
        renamed = renamed.replace(".modulation.lin.", ".modulation.linear.")[len("diffusion_model."):-len(".weight")]
        key_map[f"transformer.{renamed}"] = k
        key_map[f"diffusion_model.{renamed}"] = k
    return key_map


def test_comfyui_file_follows_comfyuis_hunyuan_video_rule(family_models, shapes_data, tmp_path):
    """lora_comfyui.safetensors names every module by ComfyUI's HunyuanVideo rule (comfy/lora.py: diffusion-pipe's
    original names, q / k / v fused, the single blocks' q / k / v / MLP input in one linear1), `.lora_A/B.weight` and no
    `.alpha` (the scale inside: strength 1), each module's up @ down the shape of the ComfyUI weight it maps to and the
    trained changes (B @ A of the diffusers file's modules, whose scale is inside too) stacked by rows, zero rows for
    the parts not adapted; read back by ot_dist (the original names' rules), each module at its trained change."""
    from ot_dist.models.families.hunyuan_video_lora import original_place

    # the original fused modules' rows (diffusers' _convert_hunyuan_video_lora_to_diffusers splits them so)
    def fused_parts(original):
        if original.endswith("txt_attn_qkv"):
            return ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
        return ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")[:4 if original.endswith("linear1") else 3]

    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=1,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp"})
    trainer.train()
    transformer = trainer.model.denoiser
    diffusers_file = load_file(tmp_path / "o" / "lora.safetensors")
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    weights = comfyui_model_weights(transformer.config)
    key_map = comfyui_key_map(weights)
    modules = {k.rsplit(".lora_", 1)[0] for k in comfy}
    assert len(comfy) == 2 * len(modules) and not any(k.endswith(".alpha") for k in comfy)
    assert {"diffusion_model.double_blocks.0.img_attn_qkv", "diffusion_model.single_blocks.1.linear1",
            "diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn_qkv",
            "diffusion_model.double_blocks.1.img_attn_proj", "diffusion_model.single_blocks.0.linear2",
            "diffusion_model.txt_in.individual_token_refiner.blocks.0.mlp.fc2", "diffusion_model.final_layer.linear",
            "diffusion_model.double_blocks.0.txt_mlp.fc1", "diffusion_model.double_blocks.0.txt_attn_qkv"} <= modules
    changes = {}  # diffusers module -> its trained change
    for key in diffusers_file:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            up = diffusers_file[f"transformer.{module}.lora_B.weight"]
            changes[module] = up @ diffusers_file[key]  # the scale (alpha 2 / rank 4) is inside its up matrices too
    expected = {}  # original module -> the trained changes in its rows
    for module, change in changes.items():
        original, part = original_place(module)
        if part is None:
            expected[original] = change
            continue
        head = module.removesuffix(part)
        rows = [changes.get(head + p, torch.zeros(transformer.get_submodule(head + p).weight.shape))
                for p in fused_parts(original)]
        expected[original] = torch.cat(rows)
    assert len(expected) == len(modules)
    for module in modules:
        assert module in key_map, module  # ComfyUI maps it to one of its model's weights...
        change = comfy[f"{module}.lora_B.weight"] @ comfy[f"{module}.lora_A.weight"]
        assert tuple(change.shape) == weights[key_map[module]], module  # ...of that weight's shape
        torch.testing.assert_close(change, expected[module.removeprefix("diffusion_model.")], rtol=1e-5, atol=1e-7)
    # ot_dist reads the file back (lora.init_from, ot-dist lora merge): each diffusers module at its trained change
    from ot_dist.lora_tools.files import read_lora_file
    from ot_dist.lora_tools.foreign import in_family_names

    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model

    base = load_model(ModelConfig(family=FAMILY, path=str(family_models[FAMILY])))
    read = in_family_names(base, read_lora_file(tmp_path / "o" / "lora_comfyui.safetensors"), "comfyui")
    assert len(read.pairs) == len(changes)
    for name, pair in read.pairs.items():
        module = name.removeprefix("transformer.")
        torch.testing.assert_close(pair.scale * pair.delta(), changes[module], rtol=1e-5, atol=1e-7, msg=module)


def test_comfyui_file_loads_in_the_pipeline(family_models, shapes_data, tmp_path):
    """HunyuanVideoPipeline.load_lora_weights reads the ComfyUI file (its original-format converter) to the trained
    outputs, for a LoRA on the double blocks (its split of the single blocks' linear1 assumes the 13 B model's width, it
    splits the refiner's fused LoRA as a weight) with the image stream's q / k / v among them (it takes a file for the
    original layout by an `img_attn_qkv` key)."""
    from diffusers import HunyuanVideoPipeline

    targets = [f"transformer_blocks.{n}.attn.to_{p}" for n in (0, 1) for p in "qkv"] + [
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context.net.0.proj", "ff_context.net.2"]
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.transformer_targets": targets})
    trainer.train()
    trained = outputs(trained_parts(trainer.model), trainer.model.family)
    pipe = HunyuanVideoPipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    assert (outputs(parts(pipe), trainer.model.family) - trained).abs().max() > 1e-4
    pipe.load_lora_weights(tmp_path / "o" / "lora_comfyui.safetensors")
    torch.testing.assert_close(outputs(parts(pipe), trainer.model.family), trained, rtol=1e-4, atol=1e-5)


def test_sharding_units_are_the_blocks_of_every_component():
    """Each component's units (what fsdp / ZeRO-3 wrap one by one) exist in the real classes: the transformer's dual-
    and single-stream blocks, Llama's embedding table and layers, CLIP-L's encoder layers (transformers 5's
    CLIPTextModel has no `text_model.` level)."""
    from ot_dist.models.families.registry import get_family
    from ot_dist.parallel.fsdp import wrap_units

    family = get_family(FAMILY)
    pipeline = family.build_tiny()
    counts = {part: len(wrap_units(getattr(pipeline, part), units)) for part, units in family.shard_units.items()}
    assert counts == {"transformer": 2 + 2, "text_encoder": 1 + 3, "text_encoder_2": 2}


def comfyui_renamed(key: str) -> str:
    """supported_models.HunyuanVideo.process_unet_state_dict (ComfyUI), restated: an original key -> ComfyUI's own."""
    key = key.replace("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer.").replace(
        "txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer.")
    key = key.replace("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer.").replace(
        "txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer.")
    key = key.replace("_mod.linear.", "_mod.lin.").replace("_attn_qkv.", "_attn.qkv.")
    key = key.replace("mlp.fc1.", "mlp.0.").replace("mlp.fc2.", "mlp.2.")
    key = key.replace("_attn_q_norm.weight", "_attn.norm.query_norm.scale").replace(
        "_attn_k_norm.weight", "_attn.norm.key_norm.scale")
    key = key.replace(".q_norm.weight", ".norm.query_norm.scale").replace(".k_norm.weight", ".norm.key_norm.scale")
    key = key.replace("_attn_proj.", "_attn.proj.").replace(".modulation.linear.", ".modulation.lin.")
    return key.replace("_in.mlp.2.", "_in.out_layer.").replace("_in.mlp.0.", "_in.in_layer.")


def test_the_original_single_file_is_what_diffusers_and_comfyui_read_and_loads_back(family_models, tmp_path):
    """Tencent's layout: at the 13 B model's widths (diffusers' converter hard-codes its 3072), every tensor of the
    file goes back to its own diffusers key through diffusers' convert_hunyuan_video_transformer_to_diffusers (rows
    tracked: one value per row, so fused q / k / v, linear1's q / k / v / MLP and the final layer's swapped halves
    must land in order); on the tiny model ComfyUI's detection keys are there and its renames give its model's Linear
    weights. A bf16 file under model.diffusion_model. loads (model.config = the folder) to the folder's outputs; a
    missing or unknown key is named before anything loads."""
    from diffusers import HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.families import single_file_keys as K
    from ot_dist.models.families.hunyuan_video_lora import original_rules
    from ot_dist.models.families.hunyuan_video_single_file import HUNYUAN_VIDEO
    from ot_dist.models.loading import load_model

    published = dict(num_attention_heads=24, attention_head_dim=128, num_layers=20, num_single_layers=40,
                     num_refiner_layers=2, text_embed_dim=4096, pooled_projection_dim=768, rope_axes_dim=(16, 56, 56))
    meta = K.meta_state_dict(HunyuanVideoTransformer3DModel, K.full_config(HunyuanVideoTransformer3DModel, published))
    rows = {k: torch.randn(v.shape[0]) for k, v in meta.items()}
    converted = convert_hunyuan_video_transformer_to_diffusers(HUNYUAN_VIDEO.to_original(rows, published))
    assert converted.keys() == rows.keys(), sorted(set(converted) ^ set(rows))[:4]
    assert all(torch.equal(converted[k], v) for k, v in rows.items())

    base = family_models[FAMILY]
    folder = HunyuanVideoPipeline.from_pretrained(base, local_files_only=True)
    transformer, config = folder.transformer, folder.transformer.config
    with torch.no_grad():
        for t in transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    original = HUNYUAN_VIDEO.to_original(transformer.state_dict(), config)
    # comfy/model_detection.py's HunyuanVideo keys, and its renames onto its model's Linear weights
    assert {"txt_in.individual_token_refiner.blocks.0.norm1.weight", "img_in.proj.weight",
            "txt_in.input_embedder.weight", "final_layer.linear.weight"} <= set(original)
    comfy = {comfyui_renamed(k): tuple(v.shape) for k, v in original.items()}
    expected = {k.removeprefix("diffusion_model."): shape for k, shape in comfyui_model_weights(config).items()}
    assert {k: comfy.get(k) for k in expected} == expected
    # the LoRA files' original names are the file's
    full = {(r.original, r.diffusers, r.kind) for r in HUNYUAN_VIDEO.rules(config)}
    assert {(r.original, r.diffusers, r.kind) for r in original_rules(config)} <= full

    state = {f"model.diffusion_model.{k}": v.to(torch.bfloat16).contiguous() for k, v in original.items()}
    save_file(state, tmp_path / "hunyuan_video.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "hunyuan_video.safetensors"), config=str(base)))
    got = loaded.denoiser.state_dict()
    assert got.keys() == transformer.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in transformer.state_dict().items())
    family = loaded.family
    assert torch.equal(outputs(trained_parts(loaded), family), outputs(parts(folder), family))
    del state["model.diffusion_model.single_blocks.1.linear1.weight"]
    state["model.diffusion_model.double_blocks.0.img_attn.qkv.weight"] = original["double_blocks.0.img_attn_qkv.weight"]
    save_file({k: v.clone() for k, v in state.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match=r"missing 1 key.*single_blocks\.1\.linear1\.weight.*unexpected 1 key.*"
                                             r"double_blocks\.0\.img_attn\.qkv\.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))
