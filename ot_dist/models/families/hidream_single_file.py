"""HiDream-I1 single files: ComfyUI's diffusion-model file (Comfy-Org's `hidream_i1_full_fp16.safetensors` and the Dev /
Fast ones, their fp8 casts) <-> diffusers HiDreamImageTransformer2DModel.

ComfyUI's own HiDream transformer (comfy/ldm/hidream/model.py, read at Comfy-Org/ComfyUI
a125cd84b054a57729b5eecab930ca9408719832) names every module as diffusers does (``t_embedder.timestep_embedder``,
``p_embedder.pooled_embedder``, ``x_embedder.proj``, ``{double,single}_stream_blocks.N.block.{adaLN_modulation.1,
attn1.*, ff_i.{gate, shared_experts, experts.M}.*, ff_t.*}``, ``final_layer`` (Flux's LastLayer: shift, scale in
diffusers' order), ``caption_projection.N.linear``), and diffusers 0.42 reads such a file through ``from_single_file``
with a converter that only strips ``model.diffusion_model.`` (convert_hidream_transformer_to_diffusers). So the layout
is the diffusers state dict itself, bare or under ComfyUI's prefix; this module adds the key-by-key check against the
`model.config` folder's transformer config before any tensor is read.

ComfyUI tells the file by ``caption_projection.0.linear.weight`` (comfy/model_detection.py, "HiDream") and builds
HiDream-I1's published config whatever the file's sizes. A plain fp8 cast has the same keys and is upcast on loading;
ComfyUI's scaled-fp8 files are refused by name (single_file_keys.quantization_hint).
"""

from __future__ import annotations

from typing import Any

from diffusers import HiDreamImageTransformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import Rule

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)


def hidream_rules(config: Any) -> list[Rule]:
    """The key map of a HiDreamImageTransformer2DModel with this config: every key is its own original name."""
    cfg = K.full_config(HiDreamImageTransformer2DModel, config)
    return [Rule(key, (key,)) for key in K.meta_state_dict(HiDreamImageTransformer2DModel, cfg)]


HIDREAM = K.TransformerFileLayout(HiDreamImageTransformer2DModel, hidream_rules, "HiDream-I1", _INPUT_PREFIXES)
