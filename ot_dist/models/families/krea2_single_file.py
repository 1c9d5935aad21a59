"""Krea 2 single files: krea/Krea-2-Raw's `raw.safetensors` (the original krea-ai/krea-2 layout, which diffusers'
Krea2Transformer2DModel.from_single_file and OneTrainer's ORIGINAL_TRANSFORMER format read and write) <-> diffusers
Krea2Transformer2DModel.

The layouts differ in names only, but for one shape (diffusers' convert_krea2_transformer_checkpoint_to_diffusers
undoes the same renames; OneTrainer's Krea2Model.diffusers_to_original lists them the other way):
- `img_in` is `first`, `time_embed.linear_1 / 2` `tmlp.0 / 2`, `time_mod_proj` `tproj.1`, `txt_in.norm / linear_1 /
  linear_2` `txtmlp.0 / 1 / 3`, `text_fusion.` `txtfusion.`, `transformer_blocks.` `blocks.`, `final_layer.linear /
  norm / scale_shift_table` `last.linear / norm / modulation.lin`;
- inside every block (the 28 joint blocks and the text fusion's): `attn.to_q / to_k / to_v / to_out.0 / to_gate` are
  `attn.wq / wk / wv / wo / gate`, `attn.norm_q / norm_k` `attn.qknorm.qnorm / knorm`, `ff.` `mlp.`, `norm1 / norm2`
  `prenorm / postnorm`, and the RMSNorm scales are `.scale` where diffusers has `.weight`;
- a joint block's `scale_shift_table` (6, width) is `mod.lin` flattened to 6 x width values.
The file is the transformer alone, bare or under `model.diffusion_model.`; the rest comes from the `model.config`
folder.
"""

from __future__ import annotations

from typing import Any

from diffusers import Krea2Transformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import FLAT, Rule

_INPUT_PREFIXES = ("model.diffusion_model.",)
# diffusers prefix -> original prefix (the first that matches)
TOP_RENAMES = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
               ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"),
               ("txt_in.linear_1.", "txtmlp.1."), ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."),
               ("transformer_blocks.", "blocks."), ("final_layer.linear.", "last.linear."),
               ("final_layer.norm.weight", "last.norm.scale"), ("final_layer.scale_shift_table", "last.modulation.lin"))
# inside a block: diffusers -> original, applied in turn
BLOCK_RENAMES = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
                 (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
                 (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"),
                 (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
                 (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
                 (".scale_shift_table", ".mod.lin"))
MODULATIONS = 6  # a joint block's table: prescale, preshift, pregate, postscale, postshift, postgate


def original_name(key: str) -> str:
    for diffusers, original in TOP_RENAMES:
        if key.startswith(diffusers):
            key = original + key[len(diffusers):]
            break
    for diffusers, original in BLOCK_RENAMES:
        key = key.replace(diffusers, original)
    return key


def krea2_rules(config: Any) -> list[Rule]:
    """The key map of a Krea2Transformer2DModel with this config."""
    cfg = K.full_config(Krea2Transformer2DModel, config)
    rules = []
    for key in K.meta_state_dict(Krea2Transformer2DModel, cfg):
        if key.startswith("transformer_blocks.") and key.endswith(".scale_shift_table"):
            rules.append(Rule(original_name(key), (key,), FLAT, (MODULATIONS,)))
        else:
            rules.append(Rule(original_name(key), (key,)))
    return rules


KREA2 = K.TransformerFileLayout(Krea2Transformer2DModel, krea2_rules, "Krea 2", _INPUT_PREFIXES)
