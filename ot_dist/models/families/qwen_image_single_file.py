"""Qwen-Image single files: ComfyUI's diffusion-model file (Comfy-Org's `qwen_image_bf16.safetensors`,
`qwen_image_fp8_e4m3fn.safetensors`) <-> diffusers QwenImageTransformer2DModel.

ComfyUI's own Qwen-Image transformer (comfy/ldm/qwen_image/model.py, read at Comfy-Org/ComfyUI
a125cd84b054a57729b5eecab930ca9408719832) names every module as diffusers does (``time_text_embed.timestep_embedder``,
``txt_norm``, ``img_in``, ``txt_in``, ``transformer_blocks.N.{img,txt}_mod.1`` / ``attn.*`` / ``{img,txt}_mlp.net.{0.proj,2}``,
``norm_out.linear`` with scale | shift in diffusers' order, ``proj_out``), and diffusers 0.42 reads such a file through
``from_single_file`` with an identity key map (loaders/single_file_model.py). So the layout is the diffusers state dict
itself, bare or under ComfyUI's ``model.diffusion_model.``; what this module adds is the key-by-key check against the
`model.config` folder's transformer config before any tensor is read, with the messages the other families give.

ComfyUI tells the file by ``txt_norm.weight`` (comfy/model_detection.py, "Qwen Image"), takes ``in_channels`` from
``img_in.weight``'s columns and ``num_layers`` from the ``transformer_blocks.N.`` it counts.

fp8: a plain float8_e4m3fn cast (``qwen_image_fp8_e4m3fn``) has the same keys and shapes and is upcast on loading
(transformer_single_file.py reads every tensor as float32); ComfyUI's scaled-fp8 files carry scale tensors beside the
weights, which the header check names as such (single_file_keys.quantization_hint) and refuses.
"""

from __future__ import annotations

from typing import Any

from diffusers import QwenImageTransformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import Rule

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)


def qwen_image_rules(config: Any) -> list[Rule]:
    """The key map of a QwenImageTransformer2DModel with this config: every key is its own original name."""
    cfg = K.full_config(QwenImageTransformer2DModel, config)
    return [Rule(key, (key,)) for key in K.meta_state_dict(QwenImageTransformer2DModel, cfg)]


# diffusers state dict <-> ComfyUI's keys (bare, as Comfy-Org ship the file; to_original's prefix COMFY_PREFIX for a
# checkpoint-style file), ComfyUI's prefix accepted when reading
QWEN_IMAGE = K.TransformerFileLayout(QwenImageTransformer2DModel, qwen_image_rules, "Qwen-Image", _INPUT_PREFIXES)
