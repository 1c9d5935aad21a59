"""`model.component_files`: text encoders and VAEs read from their own files in ComfyUI's layouts, with a model.config
folder that holds only configs and tokenizers (no weights of the replaced components).

Each file is written here from a tiny model by the rule ComfyUI's loaders read it with (comfy/sd.py load_clip: a
text-encoder file is the state dict of the model class ComfyUI builds, loaded as is), stated per layout below, not by
ot_dist's own converters; the component loaded through the override must then give exactly the outputs of the tiny
model whose weights went through the file's dtype (float32 / bfloat16: exact; float8 and scaled float8: exact against
the dequantized weights, and within float8's rounding of the originals)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ot_dist.config.schema import ModelConfig
from ot_dist.errors import InputFileError
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import load_model

CAPTIONS = ["a red square", "two blue circles on a green background"]
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


# ---- ComfyUI's file layouts, as its loaders read them ------------------------------------------------------------


def comfy_clip(module) -> dict:
    """comfy/clip_model.py CLIPTextModel: transformers' CLIP names under `text_model.` (embeddings, encoder,
    final_layer_norm), `text_projection.weight` beside; no position_ids buffer."""
    out = {}
    for k, v in module.state_dict().items():
        if k.endswith("position_ids"):
            continue
        out[k if k.startswith(("text_model.", "text_projection.")) else "text_model." + k] = v
    return out


def comfy_t5(module) -> dict:
    """comfy/text_encoders/t5.py T5: transformers' T5 encoder names, `shared.weight` the input embedding, no tied
    `encoder.embed_tokens.weight` copy."""
    return {k: v for k, v in module.state_dict().items() if k != "encoder.embed_tokens.weight"}


def comfy_qwen3(module) -> dict:
    """comfy/text_encoders/llama.py Qwen3_4B: the Llama2_ decoder under `model.` (embed_tokens, layers, norm)."""
    return {"model." + k: v for k, v in module.state_dict().items()}


def comfy_qwen25_vl(module, lm_head: bool) -> dict:
    """comfy/text_encoders/llama.py Qwen25_7BVLI: the language model under `model.`, the vision tower under `visual.`
    (Qwen2.5-VL's original checkpoint names); ComfyUI's model has no lm_head, a file may carry one."""
    out = {}
    for k, v in module.state_dict().items():
        if k.startswith("model.language_model."):
            out["model." + k[len("model.language_model."):]] = v
        elif k.startswith("model.visual."):
            out["visual." + k[len("model.visual."):]] = v
        elif lm_head:
            out[k] = v
    return out


def ldm_vae(module) -> dict:
    """Black Forest Labs' ae.safetensors (comfy/ldm/models/autoencoder.py, the LDM autoencoder): encoder.down.N.block.M
    / downsample, mid.block_1 / attn_1 (1x1 convs: q, k, v, proj_out) / block_2, norm_out; the decoder counts its up
    levels from the highest resolution; bare keys. Written through diffusers' reader's inverse: the test checks the
    loaded VAE's outputs, so a wrong name or order shows."""
    from ot_dist.models.families.sd3_single_file import sd3_vae_to_original

    return sd3_vae_to_original(module.state_dict(), dict(module.config), prefix="")


def scaled_fp8(state: dict, new_format: bool = False) -> tuple[dict, dict]:
    """ComfyUI's scaled float8 file (comfy/ops.py scaled_fp8_ops: a Linear's weight is `weight * scale_weight`; the
    file is marked by a `scaled_fp8` tensor; the newer form names the scale `weight_scale` and gives the format in a
    per-layer `comfy_quant` JSON tensor): every 2-D weight but the embeddings float8 with a per-tensor scale
    (amax / 448), the rest bfloat16. Returns (the file's tensors, the dequantized state the model must hold)."""
    out, reference = {}, {}
    for k, v in state.items():
        if v.ndim == 2 and k.endswith(".weight") and "embed" not in k and "shared" not in k:
            scale = (v.abs().max() / FP8_MAX).float().reshape(())
            q = (v / scale).to(FP8)
            layer = k[: -len(".weight")]
            out[k] = q
            if new_format:
                out[layer + ".weight_scale"] = scale
                out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                           dtype=torch.uint8)
            else:
                out[layer + ".scale_weight"] = scale
            reference[k] = q.float() * scale
        else:
            out[k] = v.to(torch.bfloat16)
            reference[k] = out[k].float()
    if not new_format:
        out["scaled_fp8"] = torch.empty(0, dtype=FP8)
    return out, reference


# ---- helpers -----------------------------------------------------------------------------------------------------


def randomized(module, seed: int = 0):
    """Every weight re-drawn (ones / zeros would hide swapped names)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.2)
    return module


def through_dtype(module, dtype):
    """The module as a file of `dtype` stores it: each float weight rounded to it."""
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.to(dtype).float())
    return module


def holding(module, state: dict):
    with torch.no_grad():
        own = module.state_dict()
        for k, v in state.items():
            own[k].copy_(v)
    return module


def save(state: dict, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def configs_only(pipeline, folder: Path, keep: tuple[str, ...] = ()) -> Path:
    """The diffusers folder as `hf download --include '*.json' '*.txt' '*.model' 'tokenizer*'` leaves it: configs
    and tokenizers, no weights (but those of the `keep` components)."""
    pipeline.save_pretrained(folder)
    for weights in folder.glob("*/*.safetensors"):
        if weights.parent.name not in keep:
            weights.unlink()
    return folder


def encode(family, pipeline) -> dict:
    for name in family.text_encoders:  # as loading leaves them (a freshly built tiny model is in training mode)
        getattr(pipeline, name).eval()
    with torch.no_grad():
        tokens = family.tokenize({n: getattr(pipeline, n) for n in family.tokenizers}, CAPTIONS)
        return family.encode_text({n: getattr(pipeline, n) for n in family.text_encoders}, tokens)


def vae_outputs(vae) -> tuple[torch.Tensor, torch.Tensor]:
    vae.eval()
    torch.manual_seed(1)
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
        return latents, vae.decode(latents).sample


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def transformer_file(family, pipeline, path: Path) -> Path:
    state = pipeline.transformer.state_dict()
    original = family.transformer_to_original(state, dict(pipeline.transformer.config), "") \
        if hasattr(family, "transformer_to_original") else None
    if original is None:
        from ot_dist.models.families import qwen_image_single_file, sd3_single_file, z_image_single_file

        from ot_dist.models.families import hidream_single_file, lumina2_single_file

        convert = {"sd3": sd3_single_file.sd3_to_original, "qwen_image": qwen_image_single_file.QWEN_IMAGE.to_original,
                   "z_image": z_image_single_file.Z_IMAGE.to_original, "hidream": hidream_single_file.HIDREAM.to_original,
                   "lumina2": lumina2_single_file.lumina2_to_original}.get(family.name)
        if convert is None:  # FLUX.2: its own module's map
            from ot_dist.models.families.flux2_single_file import FLUX2

            convert = FLUX2.to_original
        original = convert(state, dict(pipeline.transformer.config))
    return save(original, path)


# ---- Flux: clip_l (float32), t5xxl (scaled float8), ae (bfloat16) -------------------------------------------------


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    family = get_family("flux")
    pipe = family.build_tiny()
    for name in ("text_encoder", "text_encoder_2", "vae"):
        randomized(getattr(pipe, name))
    folder = configs_only(pipe, root / "config")
    t5_file, t5_reference = scaled_fp8(comfy_t5(pipe.text_encoder_2))
    files = {"text_encoder": save(comfy_clip(pipe.text_encoder), root / "clip_l.safetensors"),
             "text_encoder_2": save(t5_file, root / "t5xxl_fp8_e4m3fn_scaled.safetensors"),
             "vae": save({k: v.to(torch.bfloat16) for k, v in ldm_vae(pipe.vae).items()}, root / "ae.safetensors")}
    return dict(family=family, pipe=pipe, folder=folder, files=files, t5_reference=t5_reference,
                single=transformer_file(family, pipe, root / "flux1-dev.safetensors"))


def flux_config(flux, **files) -> ModelConfig:
    return ModelConfig(family="flux", path=str(flux["single"]), config=str(flux["folder"]),
                       component_files={k: str(v) for k, v in (files or flux["files"]).items()})


def test_flux_components_from_comfyui_files(flux):
    import copy

    loaded = load_model(flux_config(flux))
    reference = copy.deepcopy(flux["pipe"])
    holding(reference.text_encoder_2, {k: v for k, v in flux["t5_reference"].items()})
    through_dtype(reference.vae, torch.bfloat16)
    family = flux["family"]
    assert_same(encode(family, loaded.pipeline), encode(family, reference))
    for got, want in zip(vae_outputs(loaded.vae), vae_outputs(reference.vae)):
        assert torch.equal(got, want)
    t5 = loaded.pipeline.text_encoder_2
    assert t5.encoder.embed_tokens.weight.data_ptr() == t5.shared.weight.data_ptr()  # the tie kept
    # the stated float8 error: the scaled file's encoder stays within e4m3's rounding of the original weights
    original = encode(family, flux["pipe"])["hidden"]
    got = encode(family, loaded.pipeline)["hidden"]
    assert (got - original).abs().max() <= 0.1 * original.abs().max()
    assert loaded.pipeline.transformer.state_dict().keys() == flux["pipe"].transformer.state_dict().keys()


def test_wrong_files_are_refused_naming_field_and_file(flux, tmp_path):
    from ot_dist.early_checks import check_input_paths

    files = flux["files"]
    # the CLIP file given as the T5: named by field and file before any tensor is read
    with pytest.raises(InputFileError, match=r"model\.component_files\.text_encoder_2: .*clip_l\.safetensors is not a "
                                             r"T5 encoder .*missing encoder\.block\.0\.layer"):
        load_model(flux_config(flux, text_encoder_2=files["text_encoder"]))
    with pytest.raises(InputFileError, match=r"model\.component_files\.vae: .*nowhere\.safetensors is not a file"):
        load_model(flux_config(flux, vae=tmp_path / "nowhere.safetensors"))
    # a VAE of another width: the shape is named
    bad = {k: (torch.zeros(3, *v.shape[1:]) if k == "encoder.conv_in.weight" else v)
           for k, v in ldm_vae(flux["pipe"].vae).items()}
    with pytest.raises(InputFileError, match=r"model\.component_files\.vae: .*encoder\.conv_in\.weight is \[3, "):
        load_model(flux_config(flux, vae=save(bad, tmp_path / "ae.safetensors")))
    # a single file without the folder that describes the components
    with pytest.raises(InputFileError, match=r"model\.config: model\.component_files builds each component"):
        from ot_dist.models.families.component_files import check_component_files

        check_component_files(flux["family"], ModelConfig(family="flux", path=str(flux["single"]),
                                                          component_files={"vae": str(files["vae"])}))
    # a format other than float8
    nvfp4 = dict(comfy_t5(flux["pipe"].text_encoder_2))
    nvfp4["encoder.block.0.layer.0.SelfAttention.q.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    with pytest.raises(InputFileError, match=r"model\.component_files\.text_encoder_2: .*quantized as nvfp4"):
        load_model(flux_config(flux, text_encoder_2=save(nvfp4, tmp_path / "t5_nvfp4.safetensors")))
    # the early checks (ot-dist config check, training before shards) refuse the same, without loading
    from ot_dist.config.load import validate

    raw = {"model": flux_config(flux, text_encoder=files["vae"]).model_dump(exclude_defaults=True), "method": "lora",
           "data": {"path": str(tmp_path)}, "output_dir": str(tmp_path / "out")}
    with pytest.raises(InputFileError, match=r"model\.component_files\.text_encoder: .*ae\.safetensors is not a CLIP"):
        check_input_paths(validate(raw))
    # a component the family takes from no file: refused when the config is validated
    raw["model"]["component_files"] = {"text_encoder_3": str(files["text_encoder"])}
    with pytest.raises(Exception, match=r"model\.component_files\.text_encoder_3: flux takes no text_encoder_3 from a "
                                        r"separate file \(it takes: text_encoder, text_encoder_2, vae\)"):
        validate(raw)


def test_export_writes_the_components_as_loaded(flux, tmp_path):
    """A full export of a run whose frozen components were stored rounded reloads them through the override (the
    single-file case's rule: the frozen components come from where the user's config loads them)."""
    from safetensors.torch import load_file

    from ot_dist.checkpoint.export import export_diffusers_folder
    from ot_dist.checkpoint.frozen_source import export_source

    config = flux_config(flux)
    model = load_model(config)
    loaded_t5 = {k: v.clone() for k, v in model.pipeline.text_encoder_2.state_dict().items()}
    model.pipeline.text_encoder_2.to(torch.bfloat16)  # as weight_dtype bfloat16 stores it
    source = export_source(model, config, {"transformer"}, lambda m: m.state_dict(), write=True)
    export_diffusers_folder(source.pipeline, tmp_path / "model", torch.float32, source.states, family=model.family)
    written = load_file(str(tmp_path / "model" / "text_encoder_2" / "model.safetensors"))
    for k, v in written.items():
        assert torch.equal(v, loaded_t5[k]), k


# ---- SD3.5: clip_l without its projection, clip_g with, t5xxl float16 --------------------------------------------


def test_sd3_clip_l_clip_g_t5xxl(tmp_path):
    import copy

    family = get_family("sd3")
    pipe = family.build_tiny(variant="sd35")
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        randomized(getattr(pipe, name), seed=len(name))
    folder = configs_only(pipe, tmp_path / "config", keep=("vae",))
    clip_l = {k: v for k, v in comfy_clip(pipe.text_encoder).items() if k != "text_projection.weight"}
    files = {"text_encoder": save(clip_l, tmp_path / "clip_l.safetensors"),
             "text_encoder_2": save(comfy_clip(pipe.text_encoder_2), tmp_path / "clip_g.safetensors"),
             "text_encoder_3": save({k: v.half() for k, v in comfy_t5(pipe.text_encoder_3).items()},
                                    tmp_path / "t5xxl_fp16.safetensors")}
    # Stability's file holds the VAE under first_stage_model.; a VAE file named in component_files wins over it
    from ot_dist.models.families.sd3_single_file import sd3_to_original, sd3_vae_to_original

    single = save(sd3_to_original(pipe.transformer.state_dict(), dict(pipe.transformer.config))
                  | sd3_vae_to_original(pipe.vae.state_dict(), dict(pipe.vae.config)), tmp_path / "sd3.5.safetensors")
    own_vae = randomized(copy.deepcopy(pipe.vae), seed=7)
    files["vae"] = save(ldm_vae(own_vae), tmp_path / "sd3_vae.safetensors")
    config = ModelConfig(family="sd3", path=str(single), config=str(folder),
                         component_files={k: str(v) for k, v in files.items()})
    # CLIP-G's projected pooled output is SD3's: a clip_g file without its projection is refused
    clip_g = {k: v for k, v in comfy_clip(pipe.text_encoder_2).items() if k != "text_projection.weight"}
    without = config.model_copy(update={"component_files": {
        **config.component_files, "text_encoder_2": str(save(clip_g, tmp_path / "clip_g_bare.safetensors"))}})
    with pytest.raises(InputFileError, match=r"component_files\.text_encoder_2: .* missing text_projection\.weight"):
        load_model(without)
    loaded = load_model(config)
    for got, want in zip(vae_outputs(loaded.vae), vae_outputs(own_vae)):
        assert torch.equal(got, want)
    reference = copy.deepcopy(pipe)
    through_dtype(reference.text_encoder_3, torch.float16)
    with torch.no_grad():  # a clip_l file without its projection: the identity (ComfyUI pools SD3's CLIP-L unprojected)
        reference.text_encoder.text_projection.weight.copy_(torch.eye(reference.text_encoder.text_projection.in_features))
    assert_same(encode(family, loaded.pipeline), encode(family, reference))


# ---- Qwen-Image: qwen_2.5_vl_7b (no lm_head, float32), the VAE from the folder ----------------------------------


def test_qwen_image_text_encoder(tmp_path):
    import copy

    family = get_family("qwen_image")
    pipe = family.build_tiny()
    randomized(pipe.text_encoder)
    folder = configs_only(pipe, tmp_path / "config", keep=("vae",))
    te_file = save(comfy_qwen25_vl(pipe.text_encoder, lm_head=False), tmp_path / "qwen_2.5_vl_7b.safetensors")
    config = ModelConfig(family="qwen_image", path=str(transformer_file(family, pipe, tmp_path / "q.safetensors")),
                         config=str(folder), component_files={"text_encoder": str(te_file)})
    loaded = load_model(config)
    assert_same(encode(family, loaded.pipeline), encode(family, copy.deepcopy(pipe)))
    assert not loaded.pipeline.text_encoder.lm_head.weight.any()  # not in ComfyUI's file: zeros, never random
    # with the lm_head, it is read
    te_file = save(comfy_qwen25_vl(pipe.text_encoder, lm_head=True), tmp_path / "with_head.safetensors")
    loaded = load_model(config.model_copy(update={"component_files": {"text_encoder": str(te_file)}}))
    assert torch.equal(loaded.pipeline.text_encoder.lm_head.weight, pipe.text_encoder.lm_head.weight)


# ---- Z-Image: qwen_3_4b (newer scaled float8 form), ae; model.path a folder without them -------------------------


def test_z_image_qwen3_and_ae_beside_a_folder(tmp_path):
    import copy

    family = get_family("z_image")
    pipe = family.build_tiny()
    randomized(pipe.text_encoder)
    randomized(pipe.vae, seed=3)
    folder = configs_only(pipe, tmp_path / "z", keep=("transformer",))  # model.path: a folder lacking both
    te_file, te_reference = scaled_fp8(comfy_qwen3(pipe.text_encoder), new_format=True)
    te_file["lm_head.weight"] = torch.zeros(3, 32)  # a file may carry the causal LM's head, which Qwen3Model lacks
    files = {"text_encoder": save(te_file, tmp_path / "qwen_3_4b_fp8_scaled.safetensors"),
             "vae": save(ldm_vae(pipe.vae), tmp_path / "ae.safetensors")}
    loaded = load_model(ModelConfig(family="z_image", path=str(folder),
                                    component_files={k: str(v) for k, v in files.items()}))
    reference = copy.deepcopy(pipe)
    holding(reference.text_encoder, {k[len("model."):]: v for k, v in te_reference.items()})
    assert_same(encode(family, loaded.pipeline), encode(family, reference))
    for got, want in zip(vae_outputs(loaded.vae), vae_outputs(reference.vae)):
        assert torch.equal(got, want)
    shutil.rmtree(folder)


# ---- Qwen-Image: qwen_image_vae (Wan 2.1's layout) ----------------------------------------------------------------


def comfy_wan_vae(vae) -> dict:
    """comfy/ldm/wan/vae.py WanVAE: encoder / decoder blocks in one flat Sequential each (`downsamples.N`, `upsamples.N`:
    per decoder level num_res_blocks + 1 ResidualBlocks, then a Resample), a ResidualBlock's `residual` Sequential
    (RMS_norm at 0, CausalConv3d at 2, RMS_norm at 3, CausalConv3d at 6) and `shortcut`, `middle` = ResidualBlock,
    AttentionBlock, ResidualBlock, `head` = RMS_norm, SiLU, conv, and `conv1` / `conv2` for the quant convs."""
    import re

    per_level = vae.config.num_res_blocks + 2
    resnet = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
              "conv_shortcut": "shortcut"}
    out = {}
    for key, value in vae.state_dict().items():
        k = re.sub(r"^(quant_conv|post_quant_conv)\.", lambda m: {"quant_conv": "conv1.", "post_quant_conv": "conv2."}[
            m.group(1)], key)
        k = re.sub(r"^(encoder|decoder)\.conv_in\.", r"\1.conv1.", k)
        k = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.head.0.", k)
        k = re.sub(r"^(encoder|decoder)\.conv_out\.", r"\1.head.2.", k)
        k = re.sub(r"\.mid_block\.attentions\.0\.", ".middle.1.", k)
        k = re.sub(r"\.mid_block\.resnets\.(\d)\.", lambda m: f".middle.{2 * int(m.group(1))}.", k)
        k = re.sub(r"^encoder\.down_blocks\.", "encoder.downsamples.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.",
                   lambda m: f"decoder.upsamples.{int(m.group(1)) * per_level + int(m.group(2))}.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"decoder.upsamples.{int(m.group(1)) * per_level + per_level - 1}.", k)
        k = re.sub(r"\.(norm1|conv1|norm2|conv2|conv_shortcut)\.(?=(gamma|weight|bias)$)",
                   lambda m: f".{resnet[m.group(1)]}.", k) if "samples." in k or ".middle." in k else k
        out[k] = value
    return out


def test_qwen_image_vae_in_wan_layout(tmp_path):
    import copy

    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    family = get_family("qwen_image")
    pipe = family.build_tiny()
    # Qwen-Image's VAE structure (dim_mult 1, 2, 4, 4; two residual blocks per level), narrow
    pipe.vae = randomized(AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                                 temperal_downsample=[False, True, True]), seed=5)
    written = comfy_wan_vae(pipe.vae)
    # the file's names are those diffusers' own reader of the Wan VAE file maps back onto the module
    assert convert_wan_vae_to_diffusers(written).keys() == pipe.vae.state_dict().keys()
    folder = configs_only(pipe, tmp_path / "config", keep=("text_encoder",))
    vae_file = save({k: v.to(torch.bfloat16) for k, v in written.items()}, tmp_path / "qwen_image_vae.safetensors")
    config = ModelConfig(family="qwen_image", path=str(transformer_file(family, pipe, tmp_path / "q.safetensors")),
                         config=str(folder), component_files={"vae": str(vae_file)})
    loaded = load_model(config)
    reference = through_dtype(copy.deepcopy(pipe.vae), torch.bfloat16).eval()
    pixels = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    with torch.no_grad():
        got, want = loaded.vae.encode(pixels).latent_dist.mean, reference.encode(pixels).latent_dist.mean
        assert torch.equal(got, want)
        assert torch.equal(loaded.vae.decode(got).sample, reference.decode(want).sample)


# ---- the families added beside: Flux.1 Kontext (Flux's files), Lumina 2 (gemma_2_2b, ae), HiDream (four encoders, ae),
# FLUX.2 [klein] (qwen_3_4b)


def test_kontext_lumina2_hidream_flux2_klein(tmp_path):
    import copy

    cases = {
        "flux_kontext": lambda p: {"text_encoder": comfy_clip(p.text_encoder), "text_encoder_2": comfy_t5(p.text_encoder_2),
                                   "vae": ldm_vae(p.vae)},
        # comfy/text_encoders/lumina2.py Gemma2_2B: Llama2_ under model.; its file carries the SentencePiece model too
        "lumina2": lambda p: {"text_encoder": {**comfy_qwen3(p.text_encoder),
                                               "spiece_model": torch.arange(8, dtype=torch.uint8)},
                              "vae": ldm_vae(p.vae)},
        # comfy/text_encoders/hidream.py: clip_l, clip_g (with projections), t5xxl, Llama 3.1 (llama.py, no lm_head)
        # comfy/text_encoders/llama.py Qwen3_4B: Llama2_ under model., no lm_head (Qwen3ForCausalLM's is tied or zero)
        "flux2_klein": lambda p: {"text_encoder": {k: v for k, v in p.text_encoder.state_dict().items()
                                                   if k.startswith("model.")}},
        "hidream": lambda p: {"text_encoder": comfy_clip(p.text_encoder), "text_encoder_2": comfy_clip(p.text_encoder_2),
                              "text_encoder_3": comfy_t5(p.text_encoder_3),
                              "text_encoder_4": {k: v for k, v in p.text_encoder_4.state_dict().items()
                                                 if k.startswith("model.")},
                              "vae": ldm_vae(p.vae)},
    }
    for name, layout in cases.items():
        family = get_family(name)
        pipe = family.build_tiny()
        for component in (*family.text_encoders, "vae"):
            randomized(getattr(pipe, component), seed=len(component))
        folder = configs_only(pipe, tmp_path / name / "config", keep=("vae",) if name == "flux2_klein" else ())
        files = {k: str(save(v, tmp_path / name / f"{k}.safetensors")) for k, v in layout(pipe).items()}
        config = ModelConfig(family=name, path=str(transformer_file(family, pipe, tmp_path / name / "dit.safetensors")),
                             config=str(folder), component_files=files)
        loaded = load_model(config)
        reference = copy.deepcopy(pipe)
        llm = {"hidream": "text_encoder_4", "flux2_klein": "text_encoder"}.get(name)
        head = getattr(reference, llm).lm_head if llm else None
        if head is not None and head.weight.data_ptr() != getattr(reference, llm).model.embed_tokens.weight.data_ptr():
            with torch.no_grad():  # ComfyUI's Llama / Qwen3 have no lm_head: an untied one is zero, never read
                head.weight.zero_()
        if llm:
            assert torch.equal(getattr(loaded.pipeline, llm).lm_head.weight, head.weight)
        assert_same(encode(family, loaded.pipeline), encode(family, reference)), name
        for got, want in zip(vae_outputs(loaded.vae), vae_outputs(reference.vae)):
            assert torch.equal(got, want), name
