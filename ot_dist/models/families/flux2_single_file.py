"""FLUX.2 single files: Black Forest Labs' transformer keys (flux2-dev.safetensors, flux-2-klein-*.safetensors, and
ComfyUI's diffusion-model files, the same keys) <-> diffusers Flux2Transformer2DModel.

Original layout (bare keys; ComfyUI saves them under ``model.diffusion_model.``, accepted on input and stripped):

* ``img_in``, ``txt_in``, ``time_in`` / ``guidance_in`` ([dev] only) ``.in_layer`` / ``.out_layer``;
* the modulations every block shares: ``double_stream_modulation_img.lin``, ``double_stream_modulation_txt.lin``,
  ``single_stream_modulation.lin``;
* ``double_blocks.N``: ``img_attn.qkv`` (q|k|v fused), ``img_attn.norm.{query,key}_norm.scale``, ``img_attn.proj``,
  ``img_mlp.{0,2}`` (SwiGLU in, out), the same for ``txt_``;
* ``single_blocks.N``: ``linear1`` (= diffusers' fused ``attn.to_qkv_mlp_proj``), ``linear2`` (``attn.to_out``),
  ``norm.{query,key}_norm.scale``;
* ``final_layer.linear`` and ``final_layer.adaLN_modulation.1`` (shift, scale: diffusers' is scale, shift).

The names are diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` (loaders/single_file_utils.py) and
OneTrainer's Flux2Model.diffusers_to_original read backwards; every size comes from the config (width = heads x
head_dim), so tiny test models convert too. FLUX.2 has no biases: a module's bias rule exists only where the model
has one. The converters never change dtype or values.
"""

from __future__ import annotations

from typing import Any, Sequence

from diffusers import Flux2Transformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, SAME, SWAP, Rule

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)


def flux2_rules(config: Any) -> list[Rule]:
    """The key map of a Flux2Transformer2DModel with this config ([dev]: guidance_embeds=True)."""
    cfg = K.full_config(Flux2Transformer2DModel, config)
    keys = K.meta_state_dict(Flux2Transformer2DModel, cfg)
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    qkv = (width, width, width)

    def module(original: str, diffusers: str | Sequence[str], kind: str = SAME, sizes: Sequence[int] = ()):
        pieces = (diffusers,) if isinstance(diffusers, str) else tuple(diffusers)
        return [Rule(f"{original}.{p}", tuple(f"{d}.{p}" for d in pieces), kind, tuple(sizes))
                for p in ("weight", "bias") if f"{pieces[0]}.{p}" in keys]

    emb = "time_guidance_embed."
    rules = module("img_in", "x_embedder") + module("txt_in", "context_embedder")
    rules += module("time_in.in_layer", emb + "timestep_embedder.linear_1")
    rules += module("time_in.out_layer", emb + "timestep_embedder.linear_2")
    if cfg["guidance_embeds"]:  # [dev]'s distilled guidance; [klein] has none
        rules += module("guidance_in.in_layer", emb + "guidance_embedder.linear_1")
        rules += module("guidance_in.out_layer", emb + "guidance_embedder.linear_2")
    for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        rules += module(f"{name}.lin", f"{name}.linear")
    for i in range(cfg["num_layers"]):
        d, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        rules += module(o + "img_attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], CAT, qkv)
        rules += module(o + "txt_attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"],
                        CAT, qkv)
        rules += [Rule(o + "img_attn.norm.query_norm.scale", (d + "attn.norm_q.weight",)),
                  Rule(o + "img_attn.norm.key_norm.scale", (d + "attn.norm_k.weight",)),
                  Rule(o + "txt_attn.norm.query_norm.scale", (d + "attn.norm_added_q.weight",)),
                  Rule(o + "txt_attn.norm.key_norm.scale", (d + "attn.norm_added_k.weight",))]
        rules += module(o + "img_attn.proj", d + "attn.to_out.0") + module(o + "txt_attn.proj", d + "attn.to_add_out")
        rules += module(o + "img_mlp.0", d + "ff.linear_in") + module(o + "img_mlp.2", d + "ff.linear_out")
        rules += module(o + "txt_mlp.0", d + "ff_context.linear_in")
        rules += module(o + "txt_mlp.2", d + "ff_context.linear_out")
    for i in range(cfg["num_single_layers"]):
        d, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        rules += module(o + "linear1", d + "attn.to_qkv_mlp_proj") + module(o + "linear2", d + "attn.to_out")
        rules += [Rule(o + "norm.query_norm.scale", (d + "attn.norm_q.weight",)),
                  Rule(o + "norm.key_norm.scale", (d + "attn.norm_k.weight",))]
    rules += module("final_layer.linear", "proj_out")
    rules += module("final_layer.adaLN_modulation.1", "norm_out.linear", SWAP)
    return rules


# diffusers Flux2Transformer2DModel state dict <-> BFL keys (to_original's prefix COMFY_PREFIX for ComfyUI's), ComfyUI's
# prefix accepted when reading; other components under other prefixes are ignored
FLUX2 = K.TransformerFileLayout(Flux2Transformer2DModel, flux2_rules, "FLUX.2", _INPUT_PREFIXES)
