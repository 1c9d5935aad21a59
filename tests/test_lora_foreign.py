"""LoRA files of other trainers for the transformer families (issue 24): `ot-dist lora merge` and `lora.init_from`
read them. Each file is written here by the other trainer's naming rule, written down below with its source, with
alpha != rank; the check is W + alpha / rank * up @ down on every module it names (and no other weight changed).

Naming rules:
- kohya sd-scripts, networks/lora_flux.py: LORA_PREFIX_FLUX = "lora_unet", LORA_PREFIX_TEXT_ENCODER_CLIP =
  "lora_te1", LORA_PREFIX_TEXT_ENCODER_T5 = "lora_te3"; a module is `<prefix>.<module path>` with every "." as "_".
  The transformer's paths are Black Forest Labs' (library/flux_models.py): `double_blocks.N.img_attn.qkv` (output
  rows q | k | v -> diffusers attn.to_q / to_k / to_v), `txt_attn.qkv` (-> add_q_proj / add_k_proj / add_v_proj),
  `img_mlp.0` (-> ff.net.0.proj), `single_blocks.N.linear1` (rows q | k | v | MLP -> to_q / to_k / to_v / proj_mlp),
  `final_layer.adaLN_modulation.1` (rows shift | scale -> norm_out.linear, whose rows are scale | shift). CLIP-L's
  paths are transformers 4's (`text_model.encoder.layers.N.self_attn.q_proj`). `.lora_down.weight`,
  `.lora_up.weight`, `.alpha`. With `split_qkv` kohya keeps q / k / v LoRAs of rank r and saves them as one rank-3r
  pair: down matrices stacked, the up matrix block-diagonal.
- kohya sd-scripts, networks/lora_sd3.py: LORA_PREFIX_SD3 = "lora_unet" over the MMDiT paths
  (library/sd3_models.py: `joint_blocks.N.x_block.attn.qkv`, `joint_blocks.N.context_block.attn.qkv`,
  `x_block.mlp.fc1`), "lora_te1" / "lora_te2" / "lora_te3" for CLIP-L / CLIP-G / T5.
- OneTrainer, modules/util/convert/lora/convert_flux_lora.py and convert_sd3_lora.py: its own (diffusers-side) keys
  are "lora_transformer" + the diffusers module path, CLIP-L "lora_te1", Flux's T5 "lora_te2" (SD3: CLIP-G
  "lora_te2", T5 "lora_te3"), "." as "_" (diffusers' lora_conversion_utils `_convert_mixture_state_dict_to_diffusers`
  reads such files: `lora_transformer_single_transformer_blocks_N_...`), with `.alpha` tensors.
- ComfyUI, comfy/lora.py model_lora_keys_unet (Flux / SD3 branches): `diffusion_model.<original path>` (the BFL /
  MMDiT path with its dots), suffixes lora_up / lora_down (or lora_B / lora_A) and `.alpha`.
- diffusers / PEFT: `transformer.<diffusers path>.lora_A.weight` / `.lora_B.weight`, an `.alpha` tensor per module.
"""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from diffusers import DiffusionPipeline
from safetensors.torch import save_file
from test_lora_tools import run_cli

from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.methods.lora import LoraMethod
from ot_dist.models.loading import load_model

RANK, ALPHA = 4, 1.5


class ForeignFile:
    """A LoRA file under another trainer's names, and the change it makes to each (component, module path)."""

    def __init__(self, pipe, seed: int, down_suffix=".lora_down.weight", up_suffix=".lora_up.weight"):
        self.pipe, self.tensors, self.expected = pipe, {}, {}
        self.suffixes = down_suffix, up_suffix
        self.generator = torch.Generator().manual_seed(seed)

    def module(self, name: str, pieces: list[tuple[str, str]], swap=False, split_rank: int = 0):
        """`name` changes the rows of `pieces` (component, diffusers path) stacked in order; `swap`: its two row
        halves are the module's in the other order; `split_rank`: kohya's split_qkv (block-diagonal up)."""
        weights = [getattr(self.pipe, c).get_submodule(p).weight for c, p in pieces]
        rows = [w.shape[0] for w in weights]
        rank = split_rank * len(pieces) if split_rank else RANK
        down = torch.randn(rank, weights[0].shape[1], generator=self.generator) * 0.1
        up = torch.randn(sum(rows), rank, generator=self.generator) * 0.1
        if split_rank:
            mask = torch.zeros_like(up)
            for i, start in enumerate(torch.tensor([0, *rows]).cumsum(0)[:-1].tolist()):
                mask[start:start + rows[i], i * split_rank:(i + 1) * split_rank] = 1
            up = up * mask
        change = up @ down * ALPHA / rank
        if swap:
            first, second = change.chunk(2)
            change = torch.cat([second, first])
        for (component, path), part in zip(pieces, change.split(rows)):
            self.expected[(component, path)] = part
        self.tensors |= {name + self.suffixes[0]: down, name + self.suffixes[1]: up,
                         name + ".alpha": torch.tensor(ALPHA)}

    def save(self, path):
        save_file(self.tensors, str(path))
        return path


def underscored(prefix: str, path: str) -> str:
    return f"{prefix}_{path}".replace(".", "_")


def flux_kohya(pipe, split=False) -> ForeignFile:
    f = ForeignFile(pipe, 1)
    t = "transformer"
    f.module(underscored("lora_unet", "double_blocks.0.img_attn.qkv"),
             [(t, f"transformer_blocks.0.attn.to_{x}") for x in "qkv"])
    f.module(underscored("lora_unet", "double_blocks.1.txt_attn.qkv"),
             [(t, f"transformer_blocks.1.attn.add_{x}_proj") for x in "qkv"])
    f.module(underscored("lora_unet", "double_blocks.0.img_mlp.0"), [(t, "transformer_blocks.0.ff.net.0.proj")])
    f.module(underscored("lora_unet", "single_blocks.1.linear1"),
             [(t, f"single_transformer_blocks.1.attn.to_{x}") for x in "qkv"]
             + [(t, "single_transformer_blocks.1.proj_mlp")])
    if split:
        f.module(underscored("lora_unet", "double_blocks.1.img_attn.qkv"),
                 [(t, f"transformer_blocks.1.attn.to_{x}") for x in "qkv"], split_rank=RANK)
        return f  # (the training-start case: modules of lora's default targets only)
    f.module(underscored("lora_unet", "final_layer.adaLN_modulation.1"), [(t, "norm_out.linear")], swap=True)
    f.module(underscored("lora_te1", "text_model.encoder.layers.0.self_attn.q_proj"),
             [("text_encoder", "encoder.layers.0.self_attn.q_proj")])
    f.module(underscored("lora_te3", "encoder.block.0.layer.0.SelfAttention.q"),
             [("text_encoder_2", "encoder.block.0.layer.0.SelfAttention.q")])
    return f


def flux_onetrainer(pipe) -> ForeignFile:
    f = ForeignFile(pipe, 2)
    for path in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_add_out",
                 "single_transformer_blocks.0.proj_mlp", "norm_out.linear"):
        f.module(underscored("lora_transformer", path), [("transformer", path)])
    f.module(underscored("lora_te1", "text_model.encoder.layers.1.mlp.fc1"),
             [("text_encoder", "encoder.layers.1.mlp.fc1")])
    f.module(underscored("lora_te2", "encoder.block.1.layer.1.DenseReluDense.wo"),
             [("text_encoder_2", "encoder.block.1.layer.1.DenseReluDense.wo")])
    return f


def flux_lycoris(pipe) -> ForeignFile:
    """SimpleTuner's LyCORIS naming (ComfyUI comfy/lora.py, Flux branch: "lycoris_" + the diffusers path with "_")."""
    f = ForeignFile(pipe, 9)
    f.module(underscored("lycoris", "transformer_blocks.1.ff.net.2"),
             [("transformer", "transformer_blocks.1.ff.net.2")])
    return f


def chroma_onetrainer(pipe) -> ForeignFile:
    """OneTrainer's Chroma keys (convert_chroma_lora.py): lora_transformer_ and, for its T5, lora_te_."""
    f = ForeignFile(pipe, 10)
    f.module(underscored("lora_transformer", "single_transformer_blocks.1.proj_out"),
             [("transformer", "single_transformer_blocks.1.proj_out")])
    f.module(underscored("lora_te", "encoder.block.0.layer.1.DenseReluDense.wi_0"),
             [("text_encoder", "encoder.block.0.layer.1.DenseReluDense.wi_0")])
    return f


def flux_comfyui(pipe) -> ForeignFile:
    f = ForeignFile(pipe, 3)
    f.module("diffusion_model.double_blocks.1.img_attn.qkv", [("transformer", f"transformer_blocks.1.attn.to_{x}")
                                                               for x in "qkv"])
    f.module("diffusion_model.single_blocks.0.linear2", [("transformer", "single_transformer_blocks.0.proj_out")])
    f.module("diffusion_model.double_blocks.0.txt_mod.lin",
             [("transformer", "transformer_blocks.0.norm1_context.linear")])
    return f


def flux_peft(pipe) -> ForeignFile:
    f = ForeignFile(pipe, 4, ".lora_A.weight", ".lora_B.weight")
    for path in ("transformer_blocks.0.attn.to_k", "single_transformer_blocks.1.attn.to_v"):
        f.module(f"transformer.{path}", [("transformer", path)])
    return f


def chroma_kohya(pipe) -> ForeignFile:
    f = ForeignFile(pipe, 5)
    f.module(underscored("lora_unet", "double_blocks.0.txt_attn.qkv"),
             [("transformer", f"transformer_blocks.0.attn.add_{x}_proj") for x in "qkv"])
    f.module(underscored("lora_unet", "single_blocks.0.linear1"),
             [("transformer", f"single_transformer_blocks.0.attn.to_{x}") for x in "qkv"]
             + [("transformer", "single_transformer_blocks.0.proj_mlp")])
    return f


def sd3_kohya(pipe) -> ForeignFile:
    f = ForeignFile(pipe, 6)
    t = "transformer"
    f.module(underscored("lora_unet", "joint_blocks.0.x_block.attn.qkv"), [(t, f"transformer_blocks.0.attn.to_{x}")
                                                                           for x in "qkv"])
    f.module(underscored("lora_unet", "joint_blocks.0.context_block.attn.qkv"),
             [(t, f"transformer_blocks.0.attn.add_{x}_proj") for x in "qkv"])
    f.module(underscored("lora_unet", "joint_blocks.1.x_block.mlp.fc1"), [(t, "transformer_blocks.1.ff.net.0.proj")])
    f.module(underscored("lora_te2", "text_model.encoder.layers.0.self_attn.v_proj"),
             [("text_encoder_2", "text_model.encoder.layers.0.self_attn.v_proj")])
    f.module(underscored("lora_te3", "encoder.block.0.layer.0.SelfAttention.o"),
             [("text_encoder_3", "encoder.block.0.layer.0.SelfAttention.o")])
    return f


def sd3_onetrainer(pipe) -> ForeignFile:
    f = ForeignFile(pipe, 7)
    f.module(underscored("lora_transformer", "transformer_blocks.1.attn.add_k_proj"),
             [("transformer", "transformer_blocks.1.attn.add_k_proj")])
    f.module(underscored("lora_te1", "text_model.encoder.layers.1.mlp.fc2"),
             [("text_encoder", "text_model.encoder.layers.1.mlp.fc2")])
    return f


def flux2_comfyui(pipe) -> ForeignFile:
    """FLUX.2 under Black Forest Labs' paths (ComfyUI's `diffusion_model.` and kohya-style `lora_unet_`): the double
    blocks' fused q | k | v, the single blocks' linear1 / linear2 (diffusers' fused to_qkv_mlp_proj / to_out, one
    module each), a shared modulation and the final adaLN (rows swapped)."""
    f = ForeignFile(pipe, 11)
    t = "transformer"
    f.module("diffusion_model.double_blocks.1.img_attn.qkv", [(t, f"transformer_blocks.1.attn.to_{x}") for x in "qkv"])
    f.module("diffusion_model.single_blocks.0.linear1", [(t, "single_transformer_blocks.0.attn.to_qkv_mlp_proj")])
    f.module("diffusion_model.double_blocks.0.txt_mlp.0", [(t, "transformer_blocks.0.ff_context.linear_in")])
    f.module("diffusion_model.double_stream_modulation_txt.lin", [(t, "double_stream_modulation_txt.linear")])
    f.module(underscored("lora_unet", "double_blocks.0.txt_attn.qkv"),
             [(t, f"transformer_blocks.0.attn.add_{x}_proj") for x in "qkv"])
    f.module(underscored("lora_unet", "single_blocks.1.linear2"), [(t, "single_transformer_blocks.1.attn.to_out")])
    f.module(underscored("lora_unet", "final_layer.adaLN_modulation.1"), [(t, "norm_out.linear")], swap=True)
    return f


def z_image_comfyui(pipe) -> ForeignFile:
    """ComfyUI's own names for Z-Image modules (its model's keys, comfy.utils.z_image_to_diffusers' values)."""
    f = ForeignFile(pipe, 8)
    f.module("diffusion_model.layers.1.attention.qkv", [("transformer", f"layers.1.attention.to_{x}") for x in "qkv"])
    f.module("diffusion_model.noise_refiner.0.attention.out", [("transformer", "noise_refiner.0.attention.to_out.0")])
    f.module("diffusion_model.final_layer.linear", [("transformer", "all_final_layer.2-1.linear")])
    f.module("diffusion_model.x_embedder", [("transformer", "all_x_embedder.2-1")])
    return f


def z_image_kohya(pipe) -> ForeignFile:
    """kohya-style names over diffusers paths, as diffusers' _convert_non_diffusers_z_image_lora_to_diffusers reads
    them (`lora_unet_layers_0_attention_to_q`)."""
    f = ForeignFile(pipe, 9)
    for path in ("layers.0.attention.to_q", "layers.1.feed_forward.w2", "context_refiner.0.attention.to_out.0"):
        f.module(underscored("lora_unet", path), [("transformer", path)])
    return f


CASES = {"flux-kohya": ("flux", flux_kohya), "flux-onetrainer": ("flux", flux_onetrainer),
         "flux-comfyui": ("flux", flux_comfyui), "flux-peft": ("flux", flux_peft),
         "flux-lycoris": ("flux", flux_lycoris), "chroma-kohya": ("chroma", chroma_kohya),
         "chroma-onetrainer": ("chroma", chroma_onetrainer), "sd3-kohya": ("sd3", sd3_kohya),
         "sd3-onetrainer": ("sd3", sd3_onetrainer), "flux2-comfyui": ("flux2", flux2_comfyui)}
CASES |= {"z_image-comfyui": ("z_image", z_image_comfyui), "z_image-kohya": ("z_image", z_image_kohya)}


def krea2_original(pipe) -> ForeignFile:
    """The original Krea 2 names under diffusion_model. (the reference trainer's, ai-toolkit's after its prefix, what
    ot_dist's lora_comfyui.safetensors writes): a joint block's attention and MLP, a text-fusion block's, the embedders."""
    f = ForeignFile(pipe, 4)
    for original, path in (("blocks.1.attn.wq", "transformer_blocks.1.attn.to_q"),
                           ("blocks.0.attn.gate", "transformer_blocks.0.attn.to_gate"),
                           ("blocks.0.mlp.down", "transformer_blocks.0.ff.down"),
                           ("txtfusion.refiner_blocks.0.attn.wo", "text_fusion.refiner_blocks.0.attn.to_out.0"),
                           ("first", "img_in"), ("tproj.1", "time_mod_proj"), ("txtmlp.3", "txt_in.linear_2")):
        f.module(f"diffusion_model.{original}", [("transformer", path)])
    return f


CASES["krea2-original"] = ("krea2", krea2_original)


def ernie_image_comfyui_kohya(pipe) -> ForeignFile:
    """ERNIE-Image: ComfyUI's `diffusion_model.<key>` (its model's names are diffusers') and kohya-style `lora_unet_`
    over the same paths (OneTrainer's KOHYA output)."""
    f = ForeignFile(pipe, 12)
    t = "transformer"
    f.module("diffusion_model.layers.0.self_attention.to_q", [(t, "layers.0.self_attention.to_q")])
    f.module("diffusion_model.final_norm.linear", [(t, "final_norm.linear")])
    f.module(underscored("lora_unet", "layers.1.mlp.linear_fc2"), [(t, "layers.1.mlp.linear_fc2")])
    f.module(underscored("lora_unet", "time_embedding.linear_1"), [(t, "time_embedding.linear_1")])
    return f


CASES["ernie_image-comfyui-kohya"] = ("ernie_image", ernie_image_comfyui_kohya)


def hunyuan_video_original(pipe) -> ForeignFile:
    """HunyuanVideo under the original (Tencent) names: diffusion-pipe's and OneTrainer's ComfyUI files
    (`diffusion_model.` or `transformer.` + the name: comfy/lora.py's HunyuanVideo branch) and musubi-tuner's
    (`lora_unet_` + the name with "_"): fused q | k | v (both streams and the token refiner), the single blocks'
    linear1 = q | k | v | MLP input, a modulation, an embedder and the final adaLN (rows swapped)."""
    f = ForeignFile(pipe, 12)
    t = "transformer"
    f.module("diffusion_model.double_blocks.0.img_attn_qkv", [(t, f"transformer_blocks.0.attn.to_{x}") for x in "qkv"])
    f.module("transformer.double_blocks.1.txt_attn_qkv",
             [(t, f"transformer_blocks.1.attn.add_{x}_proj") for x in "qkv"])
    f.module("diffusion_model.single_blocks.1.linear1",
             [(t, f"single_transformer_blocks.1.{x}") for x in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")])
    f.module("diffusion_model.single_blocks.0.modulation.linear", [(t, "single_transformer_blocks.0.norm.linear")])
    f.module(underscored("lora_unet", "double_blocks.0.img_mlp.fc1"), [(t, "transformer_blocks.0.ff.net.0.proj")])
    f.module(underscored("lora_unet", "txt_in.individual_token_refiner.blocks.0.self_attn_qkv"),
             [(t, f"context_embedder.token_refiner.refiner_blocks.0.attn.to_{x}") for x in "qkv"])
    f.module("diffusion_model.time_in.mlp.0", [(t, "time_text_embed.timestep_embedder.linear_1")])
    f.module("diffusion_model.final_layer.adaLN_modulation.1", [(t, "norm_out.linear")], swap=True)
    return f


CASES["hunyuan_video-original"] = ("hunyuan_video", hunyuan_video_original)


@pytest.mark.parametrize("family", ["flux", "chroma", "sd3", "z_image", "flux2", "krea2", "ernie_image",
                                    "hunyuan_video"])
def test_other_trainers_files_merge_at_their_strength(family_models, tmp_path, family):
    """Every module of each file is merged as W + weight * alpha / rank * up @ down (fused modules split onto the
    diffusers modules by rows); no other weight moves; nothing is reported skipped."""
    base = family_models[family]
    pipe = DiffusionPipeline.from_pretrained(base)
    for case, (case_family, build) in CASES.items():
        if case_family != family:
            continue
        made = build(pipe)
        lora = made.save(tmp_path / f"{case}.safetensors")
        out = tmp_path / f"merged-{case}"
        done = run_cli("lora", "merge", base, lora, "--family", family, "--weight", 0.8, "--out", out,
                       "--dtype", "float32")
        assert done.returncode == 0, f"{case}: {done.stderr}"
        assert "warning" not in done.stdout, f"{case}: {done.stdout}"
        merged = DiffusionPipeline.from_pretrained(out)
        for component in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(pipe, component, None) is None:
                continue
            before, after = getattr(pipe, component).state_dict(), getattr(merged, component).state_dict()
            for key, value in before.items():
                path = key.removesuffix(".weight")
                expected = value + 0.8 * made.expected[(component, path)] if (component, path) in made.expected \
                    else value
                torch.testing.assert_close(after[key], expected, rtol=1e-5, atol=1e-6, msg=f"{case}: {component}.{key}")


def test_a_kohya_flux_file_starts_training(family_models, shapes_data, tmp_path):
    """lora.init_from with kohya sd-scripts' fused names (incl. a split_qkv pair): each adapter starts at the
    change the file makes to its module."""
    base = family_models["flux"]
    made = flux_kohya(DiffusionPipeline.from_pretrained(base), split=True)
    lora = made.save(tmp_path / "kohya_flux.safetensors")
    config = validate(base_config(base, shapes_data, tmp_path / "o", family="flux", method="lora",
                                  **{"lora.rank": RANK, "lora.alpha": 8.0, "lora.init_from": str(lora)}))
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    for (part, path), change in made.expected.items():
        layer = model.part(part).get_submodule(path)
        torch.testing.assert_close(layer.get_delta_weight("default"), change, rtol=1e-5, atol=1e-7, msg=path)
    assert len(made.expected) == 14  # 5 file modules, split onto 14 model modules


def test_a_fused_module_of_another_size_is_refused(family_models, tmp_path):
    base = family_models["flux"]
    bad = tmp_path / "bad.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 32),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(9216, 2)}, str(bad))
    done = run_cli("lora", "merge", base, bad, "--family", "flux", "--out", tmp_path / "m")
    assert done.returncode != 0
    assert "lora_unet_double_blocks_0_img_attn_qkv changes 9216 output rows" in done.stderr


def test_kohya_flux_names_split_as_diffusers_converter_splits_them(family_models):
    """An independent oracle for the row split: diffusers' `FluxLoraLoaderMixin.lora_state_dict` converts a kohya
    sd-scripts Flux file (lora_conversion_utils `_convert_kohya_flux_lora_to_diffusers`) into per-module lora_A /
    lora_B with alpha / rank baked in. Compared on the modules where diffusers' converter fits any width: the double
    blocks' fused qkv (split in equal thirds), MLP and modulation linears. (Not `single_blocks.N.linear1`: diffusers
    splits it at Flux.1's fixed 3072 / 12288 rows; not `final_layer.adaLN_modulation.1`: diffusers copies it without
    its alpha / rank scale.)"""
    from diffusers import FluxPipeline

    from ot_dist.lora_tools.files import LoraFile, Pair
    from ot_dist.lora_tools.foreign import in_family_names

    base = family_models["flux"]
    model = load_model(ModelConfig(family="flux", path=str(base)))
    f = ForeignFile(model.pipeline, 8)
    t = "transformer"
    for i in range(2):
        f.module(underscored("lora_unet", f"double_blocks.{i}.img_attn.qkv"),
                 [(t, f"transformer_blocks.{i}.attn.to_{x}") for x in "qkv"])
        f.module(underscored("lora_unet", f"double_blocks.{i}.txt_attn.qkv"),
                 [(t, f"transformer_blocks.{i}.attn.add_{x}_proj") for x in "qkv"])
    f.module(underscored("lora_unet", "double_blocks.1.txt_mlp.2"), [(t, "transformer_blocks.1.ff_context.net.2")])
    f.module(underscored("lora_unet", "double_blocks.0.img_mod.lin"), [(t, "transformer_blocks.0.norm1.linear")])
    theirs = FluxPipeline.lora_state_dict(dict(f.tensors))
    names = {k.rsplit(".lora_", 1)[0] for k in f.tensors if k.endswith(".lora_down.weight")}
    lora = LoraFile("kohya", {n: Pair(f.tensors[n + ".lora_down.weight"], f.tensors[n + ".lora_up.weight"],
                                      float(f.tensors[n + ".alpha"])) for n in names}, {})
    ours = in_family_names(model, lora, "test").pairs
    assert len(ours) == len(f.expected) == 14
    for (component, path), expected in f.expected.items():
        key = f"{component}.{path}"
        diffusers_change = theirs[key + ".lora_B.weight"] @ theirs[key + ".lora_A.weight"]
        torch.testing.assert_close(diffusers_change, expected, rtol=1e-5, atol=1e-7, msg=key)
        torch.testing.assert_close(ours[key].delta(), expected, rtol=1e-5, atol=1e-7, msg=key)
