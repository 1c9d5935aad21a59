"""ERNIE-Image single files: the transformer alone as one file <-> diffusers ErnieImageTransformer2DModel.

ComfyUI's ERNIE-Image model (comfy/ldm/ernie/model.py, read at Comfy-Org/ComfyUI
7b30bf37b09aa4b59c58f69a392f20c97cf6c0a6) names every module as diffusers does (``x_embedder.proj``, ``text_proj``,
``time_embedding.linear_1`` / ``linear_2``, ``adaLN_modulation.1``, ``layers.N.adaLN_sa_ln`` /
``self_attention.{to_q,to_k,to_v,norm_q,norm_k,to_out.0}`` / ``adaLN_mlp_ln`` / ``mlp.{gate_proj,up_proj,linear_fc2}``,
``final_norm.linear``, ``final_linear``), and diffusers 0.42 reads such a file through ``from_single_file`` after
stripping ``model.diffusion_model.`` (convert_ernie_image_transformer_checkpoint_to_diffusers). So the layout is the
diffusers state dict itself, bare or under that prefix; this module adds the key-by-key check against the
`model.config` folder's transformer config before any tensor is read (Qwen-Image's file is the same case).
"""

from __future__ import annotations

from typing import Any

from diffusers import ErnieImageTransformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import Rule

COMFY_PREFIX = "model.diffusion_model."


def ernie_image_rules(config: Any) -> list[Rule]:
    """The key map of an ErnieImageTransformer2DModel with this config: every key is its own original name."""
    cfg = K.full_config(ErnieImageTransformer2DModel, config)
    return [Rule(key, (key,)) for key in K.meta_state_dict(ErnieImageTransformer2DModel, cfg)]


ERNIE_IMAGE = K.TransformerFileLayout(ErnieImageTransformer2DModel, ernie_image_rules, "ERNIE-Image", (COMFY_PREFIX,))
