"""An Anima LoRA in the original model's names: `lora_comfyui.safetensors` beside the diffusers-layout lora.safetensors.

ComfyUI's Anima model is Cosmos-Predict2's MiniTrainDIT with the LLM adapter as its `llm_adapter` child, loaded with
the checkpoint's `net.` wrapper stripped; its generic LoRA rule (comfy/lora.py model_lora_keys_unet) maps
`diffusion_model.<state-dict key without .weight>` for every key of that model. Those are the names OneTrainer's COMFY
and KOHYA LoRA formats write for Anima (AnimaModel._diffusers_to_dit) and the names diffusers' Anima loader converts
back (`_convert_non_diffusers_anima_lora_to_diffusers`: `diffusion_model.llm_adapter.` -> `text_conditioner.`, the DiT's
renames), so this one file serves ComfyUI and diffusers alike. Anima keeps q / k / v unfused: every module maps to one
original module. Each module is written as `.lora_A.weight` / `.lora_B.weight` with the scale inside the up matrix and
no alpha (ComfyUI then applies strength 1, diffusers alpha = rank, both exactly the trained change). The Qwen3 text
encoder's LoRA stays in the diffusers-layout file only (ot_dist's tools read it; diffusers' Anima loader reads none).
Plain LoRA only (DoRA's magnitude and LoHa / LoKr factors have no form here).
"""

from __future__ import annotations

import torch

COMFY_PREFIX = "diffusion_model."
# The adapter's names are the original's (diffusers' converter loads its state dict unchanged)
COMFY_ADAPTER_PREFIX = COMFY_PREFIX + "llm_adapter."
# diffusers module path -> the original DiT's, outside the blocks (the inverse of diffusers' converter's renames)
TOP_LEVEL = (("patch_embed.proj", "x_embedder.proj.1"), ("time_embed.t_embedder", "t_embedder.1"),
             ("time_embed.norm", "t_embedding_norm"), ("norm_out.linear_1", "final_layer.adaln_modulation.1"),
             ("norm_out.linear_2", "final_layer.adaln_modulation.2"), ("proj_out", "final_layer.linear"))
# ... and inside `transformer_blocks.<i>` (the original's `blocks.<i>`)
IN_BLOCK = (("norm1.linear_1", "adaln_modulation_self_attn.1"), ("norm1.linear_2", "adaln_modulation_self_attn.2"),
            ("attn1.to_q", "self_attn.q_proj"), ("attn1.to_k", "self_attn.k_proj"),
            ("attn1.to_v", "self_attn.v_proj"), ("attn1.to_out.0", "self_attn.output_proj"),
            ("norm2.linear_1", "adaln_modulation_cross_attn.1"), ("norm2.linear_2", "adaln_modulation_cross_attn.2"),
            ("attn2.to_q", "cross_attn.q_proj"), ("attn2.to_k", "cross_attn.k_proj"),
            ("attn2.to_v", "cross_attn.v_proj"), ("attn2.to_out.0", "cross_attn.output_proj"),
            ("norm3.linear_1", "adaln_modulation_mlp.1"), ("norm3.linear_2", "adaln_modulation_mlp.2"),
            ("ff.net.0.proj", "mlp.layer1"), ("ff.net.2", "mlp.layer2"))


def original_path(path: str) -> str:
    """The original DiT's module path of a CosmosTransformer3DModel module path (Anima's layout)."""
    if path.startswith("transformer_blocks."):
        _, index, inner = path.split(".", 2)
        for ours, theirs in IN_BLOCK:
            if inner == ours or inner.startswith(ours + "."):
                return f"blocks.{index}.{theirs}{inner[len(ours):]}"
        raise KeyError(f"no original name for the Anima transformer module {path}")
    for ours, theirs in TOP_LEVEL:
        if path == ours or path.startswith(ours + "."):
            return theirs + path[len(ours):]
    raise KeyError(f"no original name for the Anima transformer module {path}")


def original_rules(config) -> list:
    """The single-file key rules (single_file_keys.Rule) of the transformer's Linear weights: original DiT key <-
    diffusers key, one to one (Anima keeps q / k / v unfused). What `lora merge` and `lora.init_from` read other
    trainers' Anima LoRA names through (ComfyUI's and OneTrainer's COMFY `diffusion_model.<key>`, kohya's and
    OneTrainer's KOHYA `lora_unet_<key with _>`)."""
    from ot_dist.models.families.single_file_keys import Rule

    paths = [ours for ours, _ in TOP_LEVEL if ours != "time_embed.t_embedder" and ours != "time_embed.norm"]
    paths += ["time_embed.t_embedder.linear_1", "time_embed.t_embedder.linear_2"]
    paths += [f"transformer_blocks.{i}.{ours}" for i in range(config["num_layers"]) for ours, _ in IN_BLOCK]
    return [Rule(f"{original_path(path)}.weight", (f"{path}.weight",)) for path in paths]


def comfyui_lora_state(states: dict[str, dict], adapter_configs: dict[str, dict]) -> dict[str, torch.Tensor] | None:
    """The transformer's and the adapter's peft states (`get_peft_model_state_dict`, per part) in the original names,
    or None when an adapter is not a plain LoRA."""
    from ot_dist.methods.lora_layouts import renamed_plain_lora

    out: dict[str, torch.Tensor] = {}
    for part, name_of in (("transformer", lambda p: COMFY_PREFIX + original_path(p)),
                          ("text_conditioner", lambda p: COMFY_ADAPTER_PREFIX + p)):
        if part not in states:
            continue
        renamed = renamed_plain_lora(states[part], adapter_configs[part], name_of)
        if renamed is None:
            return None
        out |= renamed
    return out
