"""FLUX.2 [dev] (`flux2`) and [klein] (`flux2_klein`) on the family contract: the conditioning against the pipelines'
encode_prompt (chat templates, stacked hidden layers), the objective against diffusers' train_dreambooth_lora_flux2.py
/ _klein.py step (patchified latents normalised by the VAE's batch-norm statistics, packed, position ids, t / 1000,
guidance for [dev], target n - x), training (full and LoRA lower the loss), exports diffusers loads (the folder, the
LoRA file through Flux2Pipeline.load_lora_weights), cached latents / text, and samples equal to the pipelines'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.models.families.flux import pack, unpack
from ot_dist.models.families.flux2 import patchify, unpatchify
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

FAMILIES = ("flux2", "flux2_klein")


def quiet(*_):
    pass


def trainer_for(family, model, data, out, method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family=family, method=method, **settings)), log=quiet)


def first_batch(trainer):
    return trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))


def test_patchify_and_packing_are_the_pipelines():
    from diffusers import Flux2Pipeline

    latents = torch.randn(2, 32, 8, 6)
    patches = patchify(latents)
    assert torch.equal(patches, Flux2Pipeline._patchify_latents(latents))
    assert torch.equal(unpatchify(patches), latents)
    # Flux.1's 2x2 packing of the raw latents is FLUX.2's patchify + raster packing
    assert torch.equal(pack(latents), Flux2Pipeline._pack_latents(patches))
    ids = Flux2Pipeline._prepare_latent_ids(patches)
    assert torch.equal(unpack(pack(latents), 8, 6), unpatchify(Flux2Pipeline._unpack_latents_with_ids(pack(latents), ids)))


@pytest.mark.parametrize("family", FAMILIES)
def test_text_conditioning_equals_the_pipelines_encode_prompt(family, family_models, shapes_data, tmp_path):
    trainer = trainer_for(family, family_models[family], shapes_data, tmp_path / "o")
    model = trainer.model
    captions = ["a red circle on a blue background", "a big yellow square"]  # "yellow" splits: lengths differ
    # the pipeline's own hidden layers (its default), the tiny tokenizer's length
    options = {"max_sequence_length": model.family.pipeline_call_options(model.pipeline)["max_sequence_length"]}
    tokens = model.family.tokenize(model.tokenizers, captions)
    assert 0 < tokens["text_encoder_mask"].sum() < tokens["text_encoder_mask"].numel()  # padding is in play
    assert len(set(tokens["text_encoder_mask"].sum(1).tolist())) == 2
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, tokens)
        embeds, text_ids = model.pipeline.encode_prompt(captions, device="cpu", **options)
    assert set(ours) == {"hidden"}
    torch.testing.assert_close(ours["hidden"], embeds, rtol=0, atol=0)
    assert embeds.shape[-1] == 3 * model.text_encoders["text_encoder"].config.get_text_config().hidden_size


@pytest.mark.parametrize("family", FAMILIES)
def test_objective_equals_the_diffusers_training_script(family, family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against the script's step, written out with the same draws (the posterior sample
    where the script takes its mode): Flux2Pipeline._patchify_latents, (x - bn mean) / sqrt(bn var + eps), the noise
    patchified the same way, x_t = (1 - s) x + s n, _pack_latents, _prepare_latent_ids, the pipeline's prompt
    embeddings and text ids, t / 1000, guidance (dev: model.guidance_scale) or None, _unpack_latents_with_ids, MSE
    against n - x; the draw is the scheduler's resolution-dependent shift of a logit-normal u."""
    import math

    from diffusers import Flux2Pipeline

    trainer = trainer_for(family, family_models[family], shapes_data, tmp_path / "o", **{"model.guidance_scale": 2.5})
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer = model.vae, model.denoiser
    pixels = batch["pixels"]
    shape = (32, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    tokens = (shape[1] // 2) * (shape[2] // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)  # the published config's base / max shift
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    eps, noise = torch.stack(eps), Flux2Pipeline._patchify_latents(torch.stack(noise))
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        x = Flux2Pipeline._patchify_latents(posterior.mean + posterior.std * eps)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        x = (x - mean) / std
        s = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        noisy = (1.0 - s) * x + s * noise
        prompt_embeds, text_ids = model.pipeline.encode_prompt(list(batch["caption"]), device="cpu",
                                                               max_sequence_length=32 if family == "flux2_klein" else 64)
        ids = Flux2Pipeline._prepare_latent_ids(x)
        guidance = torch.full((2,), 2.5) if transformer.config.guidance_embeds else None
        pred = transformer(hidden_states=Flux2Pipeline._pack_latents(noisy), timestep=s.flatten(), guidance=guidance,
                           encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=ids, return_dict=False)[0]
        pred = Flux2Pipeline._unpack_latents_with_ids(pred, ids)
        expected = torch.mean((pred.float() - (noise - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert (transformer.config.guidance_embeds) == (family == "flux2")


def prediction(family, transformer, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 32, 8, 8), torch.tensor([500.0])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


@pytest.mark.parametrize("family,method", [("flux2", "full"), ("flux2", "lora"), ("flux2_klein", "lora")])
def test_training_lowers_the_loss_and_the_exports_load_in_diffusers(family, method, family_models, shapes_data,
                                                                  tmp_path):
    """Full: the folder reloads through the pipeline's from_pretrained with the trained transformer; LoRA: the file
    (diffusers' layout, transformer.<module>.lora_A / lora_B) through load_lora_weights gives the trained outputs."""
    import diffusers

    lr = 3e-4 if method == "full" else 3e-3
    trainer = trainer_for(family, family_models[family], shapes_data, tmp_path / "o", method=method, epochs=4,
                          learning_rate=lr, output_dtype="float32")
    result = trainer.train()
    per_epoch = np.array(result.losses).reshape(4, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"

    model = trainer.model
    pipeline_cls = getattr(diffusers, model.family.pipeline_class)
    trained = prediction(model.family, model.denoiser, model.text_encoders["text_encoder"],
                         model.tokenizers["tokenizer"])
    base = pipeline_cls.from_pretrained(family_models[family], local_files_only=True)
    before = prediction(model.family, base.transformer, base.text_encoder, base.tokenizer)
    assert (before - trained).abs().max() > 1e-4  # it trained: the comparison below means something
    if method == "full":
        loaded = pipeline_cls.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
        # Black Forest Labs' transformer file beside the folder: bare keys, as diffusers' from_single_file reads it
        single = load_file(tmp_path / "o" / "model.safetensors")
        assert "double_blocks.0.img_attn.qkv.weight" in single and "single_blocks.0.linear1.weight" in single
        read = diffusers.Flux2Transformer2DModel.from_single_file(
            str(tmp_path / "o" / "model.safetensors"), config=str(tmp_path / "o" / "model"), subfolder="transformer",
            local_files_only=True)
        folder_state = loaded.transformer.state_dict()
        assert all(torch.equal(v, folder_state[k]) for k, v in read.state_dict().items())
    else:
        saved = load_file(tmp_path / "o" / "lora.safetensors")
        modules = {k.rsplit(".lora_", 1)[0] for k in saved}
        # the script's default targets: image attention of the double blocks, the single blocks' both projections
        assert {m.split(".", 2)[1] for m in modules} == {"transformer_blocks", "single_transformer_blocks"}
        assert {m.rsplit(".", 2)[-2] + "." + m.rsplit(".", 1)[-1] for m in modules} == {
            "attn.to_q", "attn.to_k", "attn.to_v", "to_out.0", "attn.to_qkv_mlp_proj", "attn.to_out"}
        # written for every plain LoRA, also one ComfyUI reads whole in diffusers' names (docs/families.md FLUX.2)
        assert (tmp_path / "o" / "lora_comfyui.safetensors").is_file()
        loaded = base
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    again = prediction(model.family, loaded.transformer, loaded.text_encoder, loaded.tokenizer)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)


def test_cached_latents_and_text_train_as_the_images_and_captions_do(family_models, shapes_data, tmp_path):
    """data.cache_latents stores the VAE posterior in its own 32-channel layout (normalised after the draw), data.cache_text
    the stacked hidden layers: the first step's loss is the uncached one."""
    losses = {}
    for cache in (False, True):
        trainer = trainer_for("flux2", family_models["flux2"], shapes_data, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache, "data.cache_text": cache})
        batch = first_batch(trainer)
        assert ("latent_mean" in batch) == cache and ("text_hidden" in batch) == cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_samples_equal_the_pipeline_on_the_export(family, family_models, shapes_data, tmp_path):
    """[dev]: the sample's guidance_scale is the distilled guidance input; [klein]: classifier-free guidance against
    the empty caption, or against a sample prompt's negative prompt, passed as its embeddings."""
    import diffusers
    from PIL import Image

    negative = {"negative_prompt": "a green square"} if family == "flux2_klein" else {}
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 8.0, "width": 64, "height": 48,
              **negative}
    trainer = trainer_for(family, family_models[family], shapes_data, tmp_path / "o", max_steps=1,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = getattr(diffusers, trainer.model.family.pipeline_class).from_pretrained(tmp_path / "o" / "model",
                                                                                   local_files_only=True)
    options = {"max_sequence_length": trainer.model.family.pipeline_call_options(pipe)["max_sequence_length"]}

    def image(scale, **extra):
        return np.asarray(pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3,
                               generator=torch.Generator().manual_seed(3), guidance_scale=scale, output_type="pil",
                               **options, **extra).images[0]).astype(int)

    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    if family == "flux2_klein":
        embeds = pipe.encode_prompt("a green square", device="cpu", **options)[0]
        assert np.abs(ours - image(8.0, negative_prompt_embeds=embeds)).max() <= 1
        assert np.abs(ours - image(8.0)).max() > 4  # the negative prompt shows: the comparison above can fail
    else:
        assert np.abs(ours - image(8.0)).max() <= 1
    assert np.abs(ours - image(1.0)).max() > 4  # so does the guidance


@pytest.mark.parametrize("family", FAMILIES)
def test_text_encoder_sharded_by_the_family_units_encodes_and_trains_as_unsharded(family, one_rank_group):
    """The tiny Mistral-3 / Qwen3 under FSDP2 with the family's text-encoder units (each language-model layer; the
    vision tower, embedding and head in the root), as the fsdp strategy wraps a trained text encoder, in a 1-rank gloo
    group: the stacked hidden layers and a layer's gradient equal the unwrapped model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ot_dist.models.families.registry import get_family
    from ot_dist.parallel.fsdp import wrap_units

    spec = get_family(family)
    pipeline = spec.build_tiny()
    tokens = spec.tokenize({"tokenizer": pipeline.tokenizer}, ["a red dot", "a big yellow square"])
    plain, sharded = pipeline.text_encoder, copy.deepcopy(pipeline.text_encoder)
    mesh = init_device_mesh("cpu", (1,))
    units = wrap_units(sharded, spec.shard_units["text_encoder"])
    assert len(units) == sharded.config.get_text_config().num_hidden_layers
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    results = []
    for encoder in (plain, sharded):
        hidden = spec.encode_text({"text_encoder": encoder}, tokens)["hidden"]
        hidden.square().mean().backward()
        layer = dict(encoder.named_modules())[
            "model.language_model.layers.5" if family == "flux2" else "model.layers.5"]
        grad = layer.self_attn.q_proj.weight.grad
        results.append((hidden.detach(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad))
    torch.testing.assert_close(results[1], results[0])
    assert results[0][1].abs().max() > 0


def comfy_flux2_lora_targets(config: dict) -> dict[str, tuple[str, int | None]]:
    """ComfyUI's LoRA names for a FLUX.2 transformer -> (the Black Forest Labs weight it patches, the rows of a fused
    q / k / v it takes, or None for the whole weight). Read from github.com/Comfy-Org/ComfyUI: comfy/model_base.py and
    comfy/supported_models.py define Flux2 as a subclass of Flux, so comfy/lora.py model_lora_keys_unet (@ 17358c8f)
    maps `transformer.<k>` for each key k of comfy/utils.py flux_to_diffusers (@ 09708eae): in double block N, attn.to_q /
    to_k / to_v -> thirds of img_attn.qkv, add_q_proj / add_k_proj / add_v_proj -> thirds of txt_attn.qkv, attn.to_out.0 ->
    img_attn.proj, attn.to_add_out -> txt_attn.proj, ff.linear_in / linear_out -> img_mlp.0 / .2, ff_context.* ->
    txt_mlp.*; in single block N, attn.to_qkv_mlp_proj -> linear1, attn.to_out -> linear2 ("# Flux 2"). Without an
    `.alpha` ComfyUI applies lora_B @ lora_A at strength 1.0."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    names = {}
    for n in range(config["num_layers"]):
        block, bfl = f"transformer.transformer_blocks.{n}", f"double_blocks.{n}"
        for i, name in enumerate(("to_q", "to_k", "to_v")):
            names[f"{block}.attn.{name}"] = (f"{bfl}.img_attn.qkv", i * width)
        for i, name in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
            names[f"{block}.attn.{name}"] = (f"{bfl}.txt_attn.qkv", i * width)
        names |= {f"{block}.attn.to_out.0": (f"{bfl}.img_attn.proj", None),
                  f"{block}.attn.to_add_out": (f"{bfl}.txt_attn.proj", None),
                  f"{block}.ff.linear_in": (f"{bfl}.img_mlp.0", None), f"{block}.ff.linear_out": (f"{bfl}.img_mlp.2", None),
                  f"{block}.ff_context.linear_in": (f"{bfl}.txt_mlp.0", None),
                  f"{block}.ff_context.linear_out": (f"{bfl}.txt_mlp.2", None)}
    for n in range(config["num_single_layers"]):
        block, bfl = f"transformer.single_transformer_blocks.{n}", f"single_blocks.{n}"
        names |= {f"{block}.attn.to_qkv_mlp_proj": (f"{bfl}.linear1", None), f"{block}.attn.to_out": (f"{bfl}.linear2", None)}
    return names


def test_lora_file_is_read_by_comfyuis_flux2_rule_at_the_trained_strength(family_models, shapes_data, tmp_path):
    """Every module of a LoRA on every projection (attention_mlp) is a name ComfyUI maps for FLUX.2, onto a weight (or
    a third of a fused q / k / v) of the module's shape; no `.alpha`, and lora_B @ lora_A is the trained change (the
    scale inside the up matrices), which ComfyUI applies at strength 1."""
    trainer = trainer_for("flux2", family_models["flux2"], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp"})
    trainer.train()
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    assert not any(k.endswith(".alpha") for k in saved)
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    transformer = trainer.model.denoiser
    comfy = comfy_flux2_lora_targets(dict(transformer.config))
    assert modules == set(comfy)  # attention_mlp adapts exactly the projections ComfyUI maps
    layers = dict(transformer.named_modules())
    for module in modules:
        layer = layers[module[len("transformer."):]]
        change = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        applied = saved[f"{module}.lora_B.weight"].float() @ saved[f"{module}.lora_A.weight"].float()
        assert applied.shape == layer.base_layer.weight.shape
        if comfy[module][1] is not None:  # a third of the fused q / k / v: one projection's rows
            assert applied.shape[0] == transformer.config.num_attention_heads * transformer.config.attention_head_dim
        torch.testing.assert_close(applied, change.detach(), rtol=1e-5, atol=1e-7)
    assert any(saved[k].abs().max() > 0 for k in saved if k.endswith("lora_B.weight"))


def test_comfyuis_diffusion_model_file_loads_to_the_same_outputs(family_models, tmp_path):
    """A [klein] transformer in Black Forest Labs' keys under ComfyUI's model.diffusion_model. (as ComfyUI saves it),
    in bf16, with `model.config` = the diffusers folder predicts as the folder's transformer rounded to bf16; a key
    the config's transformer lacks is named before anything loads."""
    from diffusers import Flux2KleinPipeline
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.families.flux2_single_file import COMFY_PREFIX, FLUX2
    from ot_dist.models.loading import load_model

    base = family_models["flux2_klein"]
    folder = Flux2KleinPipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        for t in folder.transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    state = FLUX2.to_original(folder.transformer.state_dict(), dict(folder.transformer.config), COMFY_PREFIX)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, tmp_path / "flux2.safetensors")
    loaded = load_model(ModelConfig(family="flux2_klein", path=str(tmp_path / "flux2.safetensors"), config=str(base)))
    family = loaded.family
    expected = prediction(family, folder.transformer, folder.text_encoder, folder.tokenizer)
    got = prediction(family, loaded.denoiser, loaded.text_encoders["text_encoder"], loaded.tokenizers["tokenizer"])
    assert torch.equal(got, expected)
    state[COMFY_PREFIX + "single_blocks.9.linear2.weight"] = state[COMFY_PREFIX + "single_blocks.0.linear2.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match="unexpected 1 key.*single_blocks.9.linear2.weight"):
        load_model(ModelConfig(family="flux2_klein", path=str(tmp_path / "bad.safetensors"), config=str(base)))



def comfy_flux2_generic_lora_keys(transformer_state: dict, config) -> dict[str, str]:
    """comfy/lora.py model_lora_keys_unet's generic rule (@ 17358c8f, every model): for each weight key k of the
    model's state dict (`diffusion_model.` + Black Forest Labs' keys for Flux2), `lora_unet_<k without
    diffusion_model. and .weight, . -> _>` and `diffusion_model.<...>` map onto k."""
    from ot_dist.models.families.flux2_single_file import FLUX2

    keys = {}
    for key in FLUX2.to_original(transformer_state, config, "diffusion_model."):
        if key.endswith(".weight"):
            stem = key[len("diffusion_model."):-len(".weight")]
            keys["lora_unet_" + stem.replace(".", "_")] = key
            keys["diffusion_model." + stem] = key
    return keys


# ComfyUI's text encoder for each family (comfy/text_encoders/flux.py: Flux2TEModel name="mistral3_24b"; klein_te
# model_type "qwen3_4b" / "qwen3_8b", sd.py choosing the 8B for Qwen3-8B), its language model under
# `<name>.transformer.model.` (sd1_clip.SD1ClipModel keeps a named model under its bare name; SDClipModel.transformer = llama.py's Mistral3Small24B / Qwen3_4B, whose `model` is
# Llama2_ with transformers' layer names); model_lora_keys_clip maps `text_encoders.<k>` for each of its weight keys k.
# Our tiny Qwen3 is not 4096 wide: qwen3_4b.
COMFY_TEXT_ENCODER = {"flux2": ("model.language_model.", "mistral3_24b.transformer.model."),
                      "flux2_klein": ("model.", "qwen3_4b.transformer.model.")}


@pytest.mark.parametrize("family", FAMILIES)
def test_comfyui_file_holds_every_module_of_an_all_linear_and_text_encoder_lora(family, family_models, shapes_data,
                                                                                tmp_path):
    """An all_linear LoRA (modulations and time / guidance embedders included) with a trained text encoder:
    lora_comfyui.safetensors names every module by a key ComfyUI's rules map (the transformer's BFL keys, q / k / v
    fused; the text encoder's own keys), and applying it as ComfyUI does (W + alpha / rank x up @ down) to the base
    weights in the original layout gives the weights `ot-dist lora merge` makes of lora.safetensors and the trained
    model's outputs."""
    from diffusers import Flux2Transformer2DModel

    from ot_dist.lora_tools.merge import merge_command
    from ot_dist.models.families.flux2_single_file import FLUX2

    trainer = trainer_for(family, family_models[family], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, output_dtype="float32",
                          **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "all_linear", "text_encoder.train": True})
    trainer.train()
    model = trainer.model
    model.text_encoders["text_encoder"].eval()
    trained = prediction(model.family, model.denoiser, model.text_encoders["text_encoder"],
                         model.tokenizers["tokenizer"])
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    modules = {k.removesuffix(".alpha").removesuffix(".lora_down.weight").removesuffix(".lora_up.weight")
               for k in comfy}
    base = Flux2Transformer2DModel.from_pretrained(family_models[family], subfolder="transformer")
    unet_keys = comfy_flux2_generic_lora_keys(base.state_dict(), base.config)
    own, comfy_te = COMFY_TEXT_ENCODER[family]
    merged_folder = merge_command(str(family_models[family]), family, [str(tmp_path / "o" / "lora.safetensors")],
                                  [1.0], str(tmp_path / "merged"), "diffusers", None, "float32", log=quiet)
    merged = load_model_folder(family, merged_folder)
    text_state = merged.text_encoders["text_encoder"].state_dict()  # only to list ComfyUI's text encoder keys
    clip_keys = {"text_encoders." + comfy_te + k[len(own):-len(".weight")]: k for k in text_state
                 if k.startswith(own) and k.endswith(".weight")}
    assert modules <= unet_keys.keys() | clip_keys.keys(), sorted(modules - unet_keys.keys() - clip_keys.keys())[:3]
    # the kinds ComfyUI's diffusers-name map lacks are there, and the fused q / k / v
    stems = {unet_keys[m] for m in modules if m in unet_keys}
    for kind in ("double_stream_modulation_img.lin", "single_stream_modulation.lin", "time_in.in_layer",
                 "double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "single_blocks.0.linear1",
                 "final_layer.adaLN_modulation.1"):
        assert f"diffusion_model.{kind}.weight" in stems, kind
    assert ("diffusion_model.guidance_in.in_layer.weight" in stems) == (family == "flux2")
    assert any(m in clip_keys for m in modules)

    original = FLUX2.to_original(base.state_dict(), base.config, "diffusion_model.")
    base_text = load_model_folder(family, family_models[family]).text_encoders["text_encoder"].state_dict()
    for module in modules:
        down, up = comfy[f"{module}.lora_down.weight"], comfy[f"{module}.lora_up.weight"]
        change = comfy[f"{module}.alpha"] / down.shape[0] * (up @ down)
        if module in unet_keys:
            original[unet_keys[module]] = original[unet_keys[module]] + change
        else:
            base_text[clip_keys[module]] = base_text[clip_keys[module]] + change
    applied = FLUX2.from_original({k.removeprefix("diffusion_model."): v for k, v in original.items()}, base.config)
    merged_transformer = merged.denoiser.state_dict()
    changed = [k for k, v in merged_transformer.items() if not torch.equal(v, base.state_dict()[k])]
    assert any("stream_modulation" in k for k in changed) and any("text_encoder" not in k for k in changed)
    for key, value in merged_transformer.items():
        torch.testing.assert_close(applied[key], value, rtol=1e-5, atol=1e-6, msg=key)
    for key, value in merged.text_encoders["text_encoder"].state_dict().items():
        torch.testing.assert_close(base_text[key], value, rtol=1e-5, atol=1e-6, msg=key)
    base.load_state_dict(applied)
    text_encoder = load_model_folder(family, family_models[family]).text_encoders["text_encoder"]
    text_encoder.load_state_dict(base_text)
    got = prediction(model.family, base, text_encoder, model.tokenizers["tokenizer"])
    torch.testing.assert_close(got, trained, rtol=1e-4, atol=1e-5)


def load_model_folder(family, folder):
    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model

    return load_model(ModelConfig(family=family, path=str(folder)))


def test_comfyui_names_fuse_a_partly_adapted_qkv_with_zero_rows():
    """to_q alone and norm_out.linear (rsLoRA, alpha 8, rank 2): the fused `img_attn.qkv` module has rank 6, its
    up @ down is the q change (scale alpha / sqrt(rank) inside) over zero rows for k and v, at `.alpha` = its rank; the
    final modulation's rows are (shift, scale) as BFL's, diffusers' (scale, shift) swapped."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from ot_dist.models.families.flux2 import Flux2Klein
    from ot_dist.models.families.flux2_lora import comfyui_lora_state

    torch.manual_seed(0)
    transformer = Flux2Klein().tiny_transformer(guidance=False)
    config = LoraConfig(r=2, lora_alpha=8, use_rslora=True, target_modules=["to_q", "norm_out.linear"],
                        init_lora_weights="gaussian")
    transformer.add_adapter(config)
    for name, parameter in transformer.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_()
    state = get_peft_model_state_dict(transformer)
    comfy = comfyui_lora_state(state, transformer.peft_config["default"].to_dict(), dict(transformer.config))
    scale = 8 / 2 ** 0.5
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    down, up = comfy[f"{name}.lora_down.weight"], comfy[f"{name}.lora_up.weight"]
    assert down.shape == (6, 32) and up.shape == (96, 6) and comfy[f"{name}.alpha"].item() == 6
    change = comfy[f"{name}.alpha"] / 6 * (up @ down)
    q = state["transformer_blocks.0.attn.to_q.lora_B.weight"] @ state["transformer_blocks.0.attn.to_q.lora_A.weight"]
    torch.testing.assert_close(change[:32], q * scale)
    assert not change[32:].any()
    name = "lora_unet_final_layer_adaLN_modulation_1"
    final = comfy[f"{name}.lora_up.weight"] @ comfy[f"{name}.lora_down.weight"]
    ours = state["norm_out.linear.lora_B.weight"] @ state["norm_out.linear.lora_A.weight"] * scale
    torch.testing.assert_close(final, torch.cat([ours[32:], ours[:32]]))
    assert {k.rsplit(".", 2)[0] for k in comfy if k.endswith("down.weight")} == {
        "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_1_img_attn_qkv", name}
