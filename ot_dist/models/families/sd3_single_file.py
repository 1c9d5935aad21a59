"""SD3 / SD3.5 single files: Stability's original keys <-> diffusers SD3Transformer2DModel (+ VAE).

Original transformer layout, under ``model.diffusion_model.`` (a bare transformer file is accepted too):

* ``pos_embed`` (the fixed sin-cos table, saved), ``x_embedder.proj``, ``context_embedder``,
  ``t_embedder.mlp.{0,2}``, ``y_embedder.mlp.{0,2}`` (pooled text);
* ``joint_blocks.N.x_block`` / ``.context_block``: ``adaLN_modulation.1``, ``attn.qkv`` (q|k|v fused),
  ``attn.proj``, ``attn.ln_q`` / ``ln_k`` (SD3.5's RMS qk-norm), ``mlp.fc1`` / ``fc2``; SD3.5-medium's
  dual-attention layers add ``x_block.attn2.{qkv,proj,ln_q,ln_k}``;
* the last block's context stream is "pre-only" (its output is never used): it keeps ``adaLN_modulation``
  (2 chunks, shift|scale: diffusers stores scale|shift), ``attn.qkv`` and the qk-norms, and has no
  ``attn.proj`` / ``mlp``;
* ``final_layer.linear`` and ``final_layer.adaLN_modulation.1`` (shift|scale again).

The VAE of a full SD3 file sits under ``first_stage_model.`` in the LDM layout (what diffusers'
``AutoencoderKL.from_single_file`` reads through ``convert_ldm_vae_checkpoint``); SD3's VAE has no
quant convs. Sizes come from the configs, never from constants.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, CONV1X1, SWAP, HeaderReport, Rule, module_rules

TRANSFORMER_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
_VAE_INPUT_PREFIXES = (VAE_PREFIX, "vae.")  # diffusers' loader accepts both


def sd3_rules(config: Any) -> list[Rule]:
    """The key map of an SD3Transformer2DModel with this config (SD3 and SD3.5 large / medium)."""
    cfg = K.full_config(SD3Transformer2DModel, config)
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    qkv = (inner, inner, inner)
    n = cfg["num_layers"]
    dual = set(cfg["dual_attention_layers"] or ())
    qk_norm = cfg["qk_norm"] is not None
    emb = "time_text_embed."
    rules = [Rule("pos_embed", ("pos_embed.pos_embed",))]
    rules += module_rules("x_embedder.proj", "pos_embed.proj")
    rules += module_rules("t_embedder.mlp.0", emb + "timestep_embedder.linear_1")
    rules += module_rules("t_embedder.mlp.2", emb + "timestep_embedder.linear_2")
    rules += module_rules("y_embedder.mlp.0", emb + "text_embedder.linear_1")
    rules += module_rules("y_embedder.mlp.2", emb + "text_embedder.linear_2")
    rules += module_rules("context_embedder", "context_embedder")
    for i in range(n):
        d, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        pre_only = i == n - 1  # diffusers builds the last block with context_pre_only=True
        rules += module_rules(x + "adaLN_modulation.1", d + "norm1.linear")
        # The pre-only context norm is an AdaLayerNormContinuous in diffusers: halves swapped.
        rules += module_rules(c + "adaLN_modulation.1", d + "norm1_context.linear", SWAP if pre_only else K.SAME)
        rules += module_rules(x + "attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], CAT, qkv)
        rules += module_rules(
            c + "attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], CAT, qkv
        )
        rules += module_rules(x + "attn.proj", d + "attn.to_out.0")
        if qk_norm:
            rules += [
                Rule(x + "attn.ln_q.weight", (d + "attn.norm_q.weight",)),
                Rule(x + "attn.ln_k.weight", (d + "attn.norm_k.weight",)),
                Rule(c + "attn.ln_q.weight", (d + "attn.norm_added_q.weight",)),
                Rule(c + "attn.ln_k.weight", (d + "attn.norm_added_k.weight",)),
            ]
        if i in dual:  # SD3.5 medium: a second, image-only self-attention in the x stream
            rules += module_rules(x + "attn2.qkv", [d + "attn2.to_q", d + "attn2.to_k", d + "attn2.to_v"], CAT, qkv)
            rules += module_rules(x + "attn2.proj", d + "attn2.to_out.0")
            if qk_norm:
                rules += [
                    Rule(x + "attn2.ln_q.weight", (d + "attn2.norm_q.weight",)),
                    Rule(x + "attn2.ln_k.weight", (d + "attn2.norm_k.weight",)),
                ]
        rules += module_rules(x + "mlp.fc1", d + "ff.net.0.proj")
        rules += module_rules(x + "mlp.fc2", d + "ff.net.2")
        if not pre_only:
            rules += module_rules(c + "attn.proj", d + "attn.to_add_out")
            rules += module_rules(c + "mlp.fc1", d + "ff_context.net.0.proj")
            rules += module_rules(c + "mlp.fc2", d + "ff_context.net.2")
    rules += module_rules("final_layer.linear", "proj_out")
    rules += module_rules("final_layer.adaLN_modulation.1", "norm_out.linear", SWAP)
    return rules


def vae_rules(config: Any) -> list[Rule]:
    """The LDM key map of an AutoencoderKL with this config (SD3 / Flux / SD VAEs alike)."""
    cfg = K.full_config(AutoencoderKL, config)
    levels = len(cfg["down_block_types"])
    lpb = cfg["layers_per_block"]
    widths = list(cfg["block_out_channels"])
    resnet = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2"}

    def res(o: str, d: str, cin: int, cout: int) -> list[Rule]:
        out = [r for k, v in resnet.items() for r in module_rules(f"{o}.{v}", f"{d}.{k}")]
        if cin != cout:  # a 1x1 shortcut only where the width changes (diffusers' ResnetBlock2D)
            out += module_rules(f"{o}.nin_shortcut", f"{d}.conv_shortcut")
        return out

    def mid(part: str, width: int) -> list[Rule]:
        o, d = f"{part}.mid.", f"{part}.mid_block."
        rules = res(o + "block_1", d + "resnets.0", width, width) + res(o + "block_2", d + "resnets.1", width, width)
        if cfg.get("mid_block_add_attention", True):
            a, da = o + "attn_1.", d + "attentions.0."
            rules += module_rules(a + "norm", da + "group_norm")
            # The LDM attention uses 1x1 convs where diffusers uses Linear layers.
            for ldm, dif in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
                rules += module_rules(a + ldm, da + dif, CONV1X1)
        return rules

    rules: list[Rule] = []
    for part in ("encoder", "decoder"):
        rules += module_rules(f"{part}.conv_in", f"{part}.conv_in")
        rules += module_rules(f"{part}.norm_out", f"{part}.conv_norm_out")
        rules += module_rules(f"{part}.conv_out", f"{part}.conv_out")
    cin = widths[0]
    for i in range(levels):
        for j in range(lpb):
            rules += res(f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}", cin, widths[i])
            cin = widths[i]
        if i < levels - 1:
            rules += module_rules(f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv")
    rules += mid("encoder", widths[-1])
    rules += mid("decoder", widths[-1])
    # The LDM decoder counts levels from the highest resolution (up.0 = last diffusers up block).
    cin = widths[-1]
    for i in range(levels):
        level, width = levels - 1 - i, widths[levels - 1 - i]
        for j in range(lpb + 1):
            rules += res(f"decoder.up.{level}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}", cin, width)
            cin = width
        if i < levels - 1:
            rules += module_rules(f"decoder.up.{level}.upsample.conv", f"decoder.up_blocks.{i}.upsamplers.0.conv")
    if cfg.get("use_quant_conv", True):  # SD3 / Flux VAEs have none
        rules += module_rules("quant_conv", "quant_conv")
    if cfg.get("use_post_quant_conv", True):
        rules += module_rules("post_quant_conv", "post_quant_conv")
    return rules


# ---- conversions -------------------------------------------------------------------------------


def sd3_to_original(state: Mapping[str, torch.Tensor], config: Any, prefix: str = TRANSFORMER_PREFIX) -> dict:
    """diffusers SD3Transformer2DModel state dict -> Stability's keys (under `prefix`)."""
    return K.to_original(state, sd3_rules(config), prefix)


def sd3_from_original(state: Mapping[str, torch.Tensor], config: Any) -> dict:
    """Stability's keys -> diffusers; other components of a full file (VAE, text encoders) are ignored."""
    return K.from_original(state, sd3_rules(config), (TRANSFORMER_PREFIX,))


def sd3_vae_to_original(state: Mapping[str, torch.Tensor], vae_config: Any, prefix: str = VAE_PREFIX) -> dict:
    """diffusers AutoencoderKL state dict -> LDM keys under `first_stage_model.`."""
    return K.to_original(state, vae_rules(vae_config), prefix)


def sd3_vae_from_original(state: Mapping[str, torch.Tensor], vae_config: Any) -> dict:
    """LDM VAE keys (under first_stage_model. or vae.) -> diffusers AutoencoderKL keys."""
    return K.from_original(state, vae_rules(vae_config), _VAE_INPUT_PREFIXES)


# ---- header validation -------------------------------------------------------------------------


def expected_sd3_header(config: Any) -> dict[str, tuple[int, ...]]:
    cfg = K.full_config(SD3Transformer2DModel, config)
    return K.expected_header(SD3Transformer2DModel, cfg, sd3_rules(cfg))


def expected_vae_header(vae_config: Any) -> dict[str, tuple[int, ...]]:
    cfg = K.full_config(AutoencoderKL, vae_config)
    return K.expected_header(AutoencoderKL, cfg, vae_rules(cfg))


def check_sd3_header(
    header: Mapping[str, Sequence[int]], config: Any, vae_config: Any | None = None
) -> list[HeaderReport]:
    """Reports for the transformer and, when `vae_config` is given, the VAE under first_stage_model.
    Keys of other components (text encoders) are not judged."""
    reports = [K.check_header(header, expected_sd3_header(config), "SD3", (TRANSFORMER_PREFIX,))]
    if vae_config is not None:
        expected = expected_vae_header(vae_config)
        reports.append(K.check_header(header, expected, "SD3 VAE", _VAE_INPUT_PREFIXES, bare_ok=False))
    return reports


def validate_sd3_file(path: str | Path, config: Any, vae_config: Any | None = None) -> None:
    """InputFileError naming the file and the offending keys unless its header fits the config(s)."""
    header = K.read_safetensors_header(path)
    for report in check_sd3_header(header, config, vae_config):
        report.raise_if_bad(path)
