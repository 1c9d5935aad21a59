"""Ideogram 4 single files: the conditional transformer in the original checkpoint's layout <-> diffusers
Ideogram4Transformer2DModel.

diffusers 0.42 has no single-file converter for this transformer (Ideogram4Transformer2DModel is not among
from_single_file's loadable classes) and the ComfyUI snapshot ot_dist reads predates Ideogram 4, so the layout is the
one the tools users move files between document:
- OneTrainer's IdeogramModel (fusion_groups, diffusers_to_original), which writes this layout as its
  ORIGINAL_TRANSFORMER format: the diffusers names, but each block's `attention.to_q / to_k / to_v` are one fused
  `attention.qkv` (rows q | k | v, no bias) and `attention.to_out.0` is `attention.o`;
- diffusers' _convert_non_diffusers_ideogram4_lora_to_diffusers, which reads LoRAs on those module names (`qkv` split
  in thirds by rows, `o` -> `to_out.0`, feed_forward and adaln_modulation one to one);
- SwarmUI's model sorter, which tells an Ideogram 4 file by `embed_image_indicator.weight`, `llm_cond_proj.weight`,
  `t_embedding.mlp_in.weight` and `layers.0.attention.qkv.weight` (bare keys).
The file is the conditional transformer alone, bare or under `model.diffusion_model.`; the unconditional transformer
(sampling's guidance), the text encoder, the VAE and every config come from the `model.config` folder.
"""

from __future__ import annotations

from typing import Any

from diffusers import Ideogram4Transformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, Rule

_INPUT_PREFIXES = ("model.diffusion_model.",)
FUSED = (".attention.to_q.weight", ".attention.to_k.weight", ".attention.to_v.weight")
OUT = (".attention.to_out.0.", ".attention.o.")


def ideogram4_rules(config: Any) -> list[Rule]:
    """The key map of an Ideogram4Transformer2DModel with this config."""
    cfg = K.full_config(Ideogram4Transformer2DModel, config)
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    rules = []
    for key in K.meta_state_dict(Ideogram4Transformer2DModel, cfg):
        if key.endswith(FUSED[0]):
            block = key[: -len(FUSED[0])]
            rules.append(Rule(f"{block}.attention.qkv.weight", tuple(block + part for part in FUSED), CAT,
                              (width,) * 3))
        elif not key.endswith(FUSED[1:]):
            rules.append(Rule(key.replace(*OUT), (key,)))
    return rules


IDEOGRAM4 = K.TransformerFileLayout(Ideogram4Transformer2DModel, ideogram4_rules, "Ideogram 4", _INPUT_PREFIXES)
