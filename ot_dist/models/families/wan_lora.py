"""A Wan LoRA in the names ComfyUI reads: `lora_comfyui.safetensors` beside the diffusers-layout lora.safetensors.

ComfyUI maps a Wan LoRA by the original model's keys only (comfy/lora.py model_lora_keys_unet has no Wan branch; its
generic rule maps `diffusion_model.<original key>` and `lora_unet_<original key with _>`). The file uses the first:
`diffusion_model.blocks.0.self_attn.q.lora_A.weight` / `.lora_B.weight`, which diffusers' WanPipeline.load_lora_weights
reads too (`_convert_non_diffusers_wan_lora_to_diffusers`). The scale (alpha / rank, or rsLoRA's) is inside the up
matrices and no `.alpha` tensor is written: ComfyUI applies a module without one at strength 1, as diffusers does, and
diffusers 0.42's converter refuses the `.alpha` of the modules outside the blocks (text / time embedding, head). Each diffusers module is one original module (Wan has no fused projections), renamed as diffusers'
single-file converter renames them back (convert_wan_transformer_to_diffusers). Plain LoRA only (DoRA's magnitude and
LoHa / LoKr factors are not written here); a module outside the renames (none of the presets) leaves the file out.
"""

from __future__ import annotations

import torch

COMFY_PREFIX = "diffusion_model."
# diffusers' path -> the original Wan module path (the inverse of diffusers' TRANSFORMER_KEYS_RENAME_DICT for Wan),
# for the Linear layers a LoRA adapts. Block-level pieces first: they are matched inside `blocks.<n>.`.
BLOCK_RENAMES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
TOP_RENAMES = {
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
}


def original_path(path: str) -> str | None:
    """The original Wan module path of a diffusers WanTransformer3DModel module, or None when it has no rename here."""
    if path.startswith("blocks."):
        _, number, rest = path.split(".", 2)
        renamed = BLOCK_RENAMES.get(rest)
        return f"blocks.{number}.{renamed}" if renamed else None
    return TOP_RENAMES.get(path)


def comfyui_lora_state(state: dict[str, torch.Tensor], adapter_config: dict) -> dict[str, torch.Tensor] | None:
    """The transformer's peft adapter state (`get_peft_model_state_dict`) in ComfyUI's names, or None when the adapter
    is not a plain LoRA or adapts a module without an original name here."""
    from ot_dist.methods.lora_layouts import renamed_plain_lora

    return renamed_plain_lora(state, adapter_config,
                              lambda path: None if original_path(path) is None else COMFY_PREFIX + original_path(path))
