"""Qwen-Image's single file, ComfyUI's diffusion-model layout (ot_dist/models/families/qwen_image_single_file.py).

The rules tested against, as read in ComfyUI (Comfy-Org/ComfyUI a125cd84b054a57729b5eecab930ca9408719832):
* comfy/model_detection.py detect_unet_config takes a state dict (bare, or with the `model.diffusion_model.` prefix
  that unet_prefix_from_state_dict strips) for Qwen-Image when it has `txt_norm.weight` and none of the keys its
  earlier branches test (EARLIER_DETECTION_KEYS below); `in_channels` = the columns of `img_in.weight`, `num_layers` =
  how many `transformer_blocks.N.` it counts;
* comfy/ldm/qwen_image/model.py's modules (COMFY_TOP_LEVEL, COMFY_BLOCK below, written out from its __init__s: a
  Linear has weight and bias, an RMSNorm a weight, `img_mod` / `txt_mod` are Sequential(SiLU, Linear), FeedForward's
  `net` is [GELU(proj), Dropout, Linear]);
* its LastLayer splits `norm_out.linear`'s output as scale, shift: diffusers' order, so the values are not moved.
Every weight of the tiny model is drawn at random so that a swapped name or piece changes values.
"""

from __future__ import annotations

import pytest
import torch

from ot_dist.errors import InputFileError
from ot_dist.models.families import qwen_image_single_file as Q
from ot_dist.models.families.flux_single_file import FLUX

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=3, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6))

# comfy/model_detection.py: the keys its branches before "Qwen Image" look for (a file with any of them is taken for
# another model).
EARLIER_DETECTION_KEYS = (
    "joint_blocks.0.context_block.attn.qkv.weight", "clf.1.weight", "transformer.rotary_pos_emb.inv_freq",
    "double_layers.0.attn.w1q.weight", "mlp_t5.0.weight", "txt_in.individual_token_refiner.blocks.0.norm1.weight",
    "double_blocks.0.img_attn.norm.key_norm.scale", "t5_yproj.weight", "adaln_single.emb.timestep_embedder.linear_1.bias",
    "genre_embedder.weight", "t_block.1.weight", "blocks.block0.blocks.0.block.attn.to_q.0.weight",
    "cap_embedder.1.weight", "head.modulation", "latent_in.weight", "t_embedder.mlp.2.weight",
    "caption_projection.0.linear.weight", "blocks.0.mlp.layer1.weight",
    "time_caption_embed.timestep_embedder.linear_1.bias",
)  # fmt: skip
_LINEAR = ("weight", "bias")
COMFY_TOP_LEVEL = (
    [f"time_text_embed.timestep_embedder.linear_{i}.{p}" for i in (1, 2) for p in _LINEAR] + ["txt_norm.weight"]
    + [f"{m}.{p}" for m in ("img_in", "txt_in", "norm_out.linear", "proj_out") for p in _LINEAR]
)  # fmt: skip
COMFY_BLOCK = (
    [f"{m}.{p}" for m in ("img_mod.1", "txt_mod.1", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                          "txt_mlp.net.2") for p in _LINEAR]
    + [f"attn.{m}.{p}" for m in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0",
                                 "to_add_out") for p in _LINEAR]
    + [f"attn.{n}.weight" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
)  # fmt: skip


def _model():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**TINY)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t))
    return model


def _header(state):
    return {k: tuple(v.shape) for k, v in state.items()}


def comfy_detects_qwen_image(keys, config) -> bool:
    """comfy/model_detection.py's Qwen-Image rule (the module docstring) on a file's names -> shapes."""
    prefix = Q.COMFY_PREFIX if any(k.startswith(Q.COMFY_PREFIX) for k in keys) else ""
    bare = {k[len(prefix):]: v for k, v in keys.items() if k.startswith(prefix)}
    blocks = {int(k.split(".")[1]) for k in bare if k.startswith("transformer_blocks.")}
    return ("txt_norm.weight" in bare and not any(k in bare for k in EARLIER_DETECTION_KEYS)
            and bare["img_in.weight"][1] == config["in_channels"] and blocks == set(range(config["num_layers"])))


def test_export_has_comfyuis_names_and_is_detected_as_qwen_image():
    model = _model()
    original = Q.QWEN_IMAGE.to_original(model.state_dict(), model.config)
    comfy_names = set(COMFY_TOP_LEVEL) | {f"transformer_blocks.{i}.{k}" for i in range(3) for k in COMFY_BLOCK}
    assert set(original) == comfy_names, sorted(set(original) ^ comfy_names)[:8]
    assert comfy_detects_qwen_image(_header(original), dict(model.config))
    prefixed = Q.QWEN_IMAGE.to_original(model.state_dict(), model.config, Q.COMFY_PREFIX)
    assert comfy_detects_qwen_image(_header(prefixed), dict(model.config))
    # The rule itself tells other layouts apart: a Flux file is not taken for Qwen-Image.
    from diffusers import FluxTransformer2DModel

    flux = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))
    assert not comfy_detects_qwen_image(_header(FLUX.to_original(flux.state_dict(), flux.config)), TINY)


def test_round_trip_bare_and_prefixed_keeps_every_value():
    model = _model()
    state = model.state_dict()
    for prefix in ("", Q.COMFY_PREFIX):
        original = Q.QWEN_IMAGE.to_original(state, model.config, prefix)
        original["vae.decoder.conv_in.weight"] = torch.zeros(1)  # another component beside: ignored when prefixed
        if not prefix:
            del original["vae.decoder.conv_in.weight"]
        back = Q.QWEN_IMAGE.from_original(original, model.config)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)
        assert Q.QWEN_IMAGE.check_header(_header(original), model.config).ok


def test_header_check_names_what_is_wrong():
    model = _model()
    header = _header(Q.QWEN_IMAGE.to_original(model.state_dict(), model.config))
    fewer = {k: v for k, v in header.items() if not k.startswith("transformer_blocks.2.")}
    report = Q.QWEN_IMAGE.check_header(fewer, model.config)
    assert "transformer_blocks.2.attn.to_q.weight" in report.missing and not report.unexpected
    wide = {**header, "img_in.weight": (32, 16)}
    assert Q.QWEN_IMAGE.check_header(wide, model.config).wrong_shape == [("img_in.weight", (32, 16), (32, 64))]
    # ComfyUI's scaled-fp8 files: a scale per quantized weight and a marker, refused by name
    scaled = header | {k[: -len(".weight")] + ".scale_weight": () for k, s in header.items() if len(s) == 2}
    message = Q.QWEN_IMAGE.check_header(scaled | {"scaled_fp8": (0,)}, model.config).message()
    assert "scaled-fp8" in message and "unquantized" in message
    # another family's file says what it looks like
    from diffusers import FluxTransformer2DModel

    flux = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))
    report = Q.QWEN_IMAGE.check_header(_header(FLUX.to_original(flux.state_dict(), flux.config)), model.config)
    assert "look like a Flux.1 checkpoint" in report.message()
    with pytest.raises(InputFileError, match="file.safetensors: not a Qwen-Image checkpoint"):
        report.raise_if_bad("file.safetensors")
