"""Flux.1 and Chroma single files: Black Forest Labs' / lodestones' original keys <-> diffusers.

Original layout (bare keys as BFL ship them; ComfyUI saves them under ``model.diffusion_model.``,
which is accepted on input and stripped):

* ``time_in`` / ``vector_in`` / ``guidance_in`` (dev only) ``.in_layer`` / ``.out_layer``, ``txt_in``,
  ``img_in``;
* ``double_blocks.N``: ``img_mod.lin`` / ``txt_mod.lin``, ``img_attn.qkv`` (q|k|v fused),
  ``img_attn.norm.{query,key}_norm.scale``, ``img_attn.proj``, ``img_mlp.{0,2}``, the same for ``txt_``;
* ``single_blocks.N``: ``linear1`` = q|k|v|mlp fused, ``norm.{query,key}_norm.scale``, ``linear2``,
  ``modulation.lin``;
* ``final_layer.linear`` and ``final_layer.adaLN_modulation.1`` (shift, scale: diffusers' is scale, shift).

Chroma is Flux.1-schnell without any per-block modulation (no ``*_mod``, ``modulation``, no final
adaLN, no time / vector / guidance embedders): one ``distilled_guidance_layer`` (``in_proj``,
``layers.N.{in,out}_layer``, ``norms.N.scale``, ``out_proj``) computes all modulations.

diffusers 0.42's own converters hard-code the width 3072 and MLP ratio 4 to split ``linear1``; here
every size comes from the config (width = heads x head_dim, the MLP part is whatever rows remain), so
tiny test models convert too. The converters never change dtype or values.
"""

from __future__ import annotations

from typing import Any

from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, SWAP, Rule, module_rules

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)


def _blocks(cfg: dict, *, modulation: bool) -> list[Rule]:
    """Rules of the double and single blocks, shared by Flux.1 and Chroma."""
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    qkv = (inner, inner, inner)
    rules: list[Rule] = []
    for i in range(cfg["num_layers"]):
        d, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        if modulation:
            rules += module_rules(o + "img_mod.lin", d + "norm1.linear")
            rules += module_rules(o + "txt_mod.lin", d + "norm1_context.linear")
        rules += module_rules(o + "img_attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], CAT, qkv)
        rules += module_rules(
            o + "txt_attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], CAT, qkv
        )
        # RMSNorm: BFL call the weight `scale`.
        rules += [
            Rule(o + "img_attn.norm.query_norm.scale", (d + "attn.norm_q.weight",)),
            Rule(o + "img_attn.norm.key_norm.scale", (d + "attn.norm_k.weight",)),
            Rule(o + "txt_attn.norm.query_norm.scale", (d + "attn.norm_added_q.weight",)),
            Rule(o + "txt_attn.norm.key_norm.scale", (d + "attn.norm_added_k.weight",)),
        ]
        rules += module_rules(o + "img_attn.proj", d + "attn.to_out.0")
        rules += module_rules(o + "txt_attn.proj", d + "attn.to_add_out")
        rules += module_rules(o + "img_mlp.0", d + "ff.net.0.proj")
        rules += module_rules(o + "img_mlp.2", d + "ff.net.2")
        rules += module_rules(o + "txt_mlp.0", d + "ff_context.net.0.proj")
        rules += module_rules(o + "txt_mlp.2", d + "ff_context.net.2")
    for i in range(cfg["num_single_layers"]):
        d, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        if modulation:
            rules += module_rules(o + "modulation.lin", d + "norm.linear")
        # One matmul for attention and MLP input: q|k|v (width each), then the MLP rows (-1: the rest).
        rules += module_rules(
            o + "linear1", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"], CAT, (*qkv, -1)
        )
        rules += [
            Rule(o + "norm.query_norm.scale", (d + "attn.norm_q.weight",)),
            Rule(o + "norm.key_norm.scale", (d + "attn.norm_k.weight",)),
        ]
        rules += module_rules(o + "linear2", d + "proj_out")
    return rules


def flux_rules(config: Any) -> list[Rule]:
    """The key map of a FluxTransformer2DModel with this config (dev: guidance_embeds=True)."""
    cfg = K.full_config(FluxTransformer2DModel, config)
    emb = "time_text_embed."
    rules = module_rules("time_in.in_layer", emb + "timestep_embedder.linear_1")
    rules += module_rules("time_in.out_layer", emb + "timestep_embedder.linear_2")
    rules += module_rules("vector_in.in_layer", emb + "text_embedder.linear_1")
    rules += module_rules("vector_in.out_layer", emb + "text_embedder.linear_2")
    if cfg["guidance_embeds"]:  # dev distils CFG into an embedded guidance scale; schnell has none
        rules += module_rules("guidance_in.in_layer", emb + "guidance_embedder.linear_1")
        rules += module_rules("guidance_in.out_layer", emb + "guidance_embedder.linear_2")
    rules += module_rules("txt_in", "context_embedder")
    rules += module_rules("img_in", "x_embedder")
    rules += _blocks(cfg, modulation=True)
    rules += module_rules("final_layer.linear", "proj_out")
    rules += module_rules("final_layer.adaLN_modulation.1", "norm_out.linear", SWAP)
    return rules


def chroma_rules(config: Any) -> list[Rule]:
    """The key map of a ChromaTransformer2DModel with this config."""
    cfg = K.full_config(ChromaTransformer2DModel, config)
    g = "distilled_guidance_layer."
    rules = module_rules(g + "in_proj", g + "in_proj")
    for j in range(cfg["approximator_layers"]):
        rules += module_rules(f"{g}layers.{j}.in_layer", f"{g}layers.{j}.linear_1")
        rules += module_rules(f"{g}layers.{j}.out_layer", f"{g}layers.{j}.linear_2")
        rules.append(Rule(f"{g}norms.{j}.scale", (f"{g}norms.{j}.weight",)))
    rules += module_rules(g + "out_proj", g + "out_proj")
    rules += module_rules("txt_in", "context_embedder")
    rules += module_rules("img_in", "x_embedder")
    rules += _blocks(cfg, modulation=False)
    rules += module_rules("final_layer.linear", "proj_out")
    return rules


# ---- the two files ----------------------------------------------------------------------------

# BFL's keys, bare or under ComfyUI's prefix; other components under other prefixes are ignored.
FLUX = K.TransformerFileLayout(FluxTransformer2DModel, flux_rules, "Flux.1", _INPUT_PREFIXES)
CHROMA = K.TransformerFileLayout(ChromaTransformer2DModel, chroma_rules, "Chroma", _INPUT_PREFIXES)
