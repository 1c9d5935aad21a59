"""A Krea 2 LoRA in the original module names: `lora_comfyui.safetensors` beside the diffusers-layout lora.safetensors.

Krea 2 LoRAs outside diffusers name the original model's modules (krea-ai/krea-2's `blocks.<n>.attn.wq`,
`txtfusion.refiner_blocks.<n>.mlp.up`, `first`, `tmlp.0`, ...) under `diffusion_model.`: diffusers' Krea 2 loader
(`_convert_non_diffusers_krea2_lora_to_diffusers`) reads them as the reference trainer's and ComfyUI's layout, and
ComfyUI's generic LoRA rule (comfy/lora.py model_lora_keys_unet) maps `diffusion_model.<key>` for every weight key of
the model it loads, whose keys are the original file's (`txtfusion.projector.weight` is how a Krea 2 checkpoint is
told). The file uses those names: `diffusion_model.blocks.0.attn.wq.lora_A.weight` / `.lora_B.weight`, the scale
(alpha / rank, or rsLoRA's) inside the up matrices and no `.alpha` tensor (a module without one applies at strength 1;
diffusers' converter refuses any key it does not rename). Each diffusers module is one original module (Krea 2 keeps
q / k / v apart), renamed as diffusers' single-file converter (convert_krea2_transformer_checkpoint_to_diffusers)
renames them back. Plain LoRA only (DoRA's magnitude and LoHa / LoKr factors are not written here).
"""

from __future__ import annotations

import torch

COMFY_PREFIX = "diffusion_model."
# diffusers' path inside a block (transformer_blocks.<n>. / text_fusion.<kind>.<n>.) -> the original's
BLOCK_RENAMES = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_out.0": "attn.wo",
                 "attn.to_gate": "attn.gate", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
BLOCK_LISTS = {"transformer_blocks": "blocks", "text_fusion.layerwise_blocks": "txtfusion.layerwise_blocks",
               "text_fusion.refiner_blocks": "txtfusion.refiner_blocks"}
TOP_RENAMES = {"img_in": "first", "final_layer.linear": "last.linear", "time_embed.linear_1": "tmlp.0",
               "time_embed.linear_2": "tmlp.2", "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1",
               "txt_in.linear_2": "txtmlp.3", "text_fusion.projector": "txtfusion.projector"}


def original_path(path: str) -> str | None:
    """The original module path of a Krea2Transformer2DModel Linear layer, or None when it has no rename here."""
    for blocks, original in BLOCK_LISTS.items():
        if path.startswith(blocks + "."):
            number, rest = path[len(blocks) + 1:].split(".", 1)
            renamed = BLOCK_RENAMES.get(rest)
            return f"{original}.{number}.{renamed}" if renamed else None
    return TOP_RENAMES.get(path)


def comfyui_lora_state(state: dict[str, torch.Tensor], adapter_config: dict) -> dict[str, torch.Tensor] | None:
    """The transformer's peft adapter state (`get_peft_model_state_dict`) in the original names, or None when the
    adapter is not a plain LoRA or adapts a module without an original name here."""
    from ot_dist.methods.lora_layouts import renamed_plain_lora

    return renamed_plain_lora(state, adapter_config,
                              lambda path: None if original_path(path) is None else COMFY_PREFIX + original_path(path))
