"""Z-Image single files: ComfyUI's diffusion-model file (Comfy-Org's `z_image_turbo_bf16.safetensors`), in the
original Z-Image layout that ComfyUI's Lumina 2 model (comfy/ldm/lumina/model.py) holds <-> diffusers
ZImageTransformer2DModel.

The layouts differ in a few names only (comfy.utils.z_image_to_diffusers, and diffusers'
convert_z_image_transformer_checkpoint_to_diffusers, which reads such a file, undo the same ones):
- each block's `attention.to_q` / `to_k` / `to_v` are one fused `attention.qkv` (rows q | k | v, no bias);
- `attention.norm_q` / `norm_k` are `attention.q_norm` / `k_norm`, `attention.to_out.0` is `attention.out`;
- the patch embedder and the final layer drop diffusers' ModuleDict level: `all_x_embedder.2-1.` is `x_embedder.`,
  `all_final_layer.2-1.` is `final_layer.`.
Everything else (refiners, adaLN modulations, cap_embedder, t_embedder, the pad tokens) keeps its name. ComfyUI tells
the file by `cap_embedder.1.weight` (comfy/model_detection.py: Lumina 2; width 3840 is Z-Image). The file is the
transformer alone, bare or under ComfyUI's `model.diffusion_model.`; the rest comes from the `model.config` folder.
"""

from __future__ import annotations

from typing import Any

from diffusers import ZImageTransformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, Rule

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)
# diffusers name -> original name, applied to every key that holds the diffusers part
RENAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
           (".attention.norm_q.", ".attention.q_norm."), (".attention.norm_k.", ".attention.k_norm."),
           (".attention.to_out.0.", ".attention.out."))
FUSED = (".attention.to_q.weight", ".attention.to_k.weight", ".attention.to_v.weight")


def original_name(key: str) -> str:
    for diffusers, original in RENAMES:
        key = key.replace(diffusers, original)
    return key


def z_image_rules(config: Any) -> list[Rule]:
    """The key map of a ZImageTransformer2DModel with this config."""
    cfg = K.full_config(ZImageTransformer2DModel, config)
    rules = []
    for key in K.meta_state_dict(ZImageTransformer2DModel, cfg):
        if key.endswith(FUSED[0]):
            block = key[:-len(FUSED[0])]
            rules.append(Rule(f"{block}.attention.qkv.weight", tuple(block + part for part in FUSED), CAT,
                              (cfg["dim"],) * 3))
        elif not key.endswith(FUSED[1:]):
            rules.append(Rule(original_name(key), (key,)))
    return rules


Z_IMAGE = K.TransformerFileLayout(ZImageTransformer2DModel, z_image_rules, "Z-Image", _INPUT_PREFIXES)
