"""A Lumina 2 LoRA in the names ComfyUI reads: `lora_comfyui.safetensors` beside the diffusers-layout lora.safetensors.

ComfyUI maps a Lumina 2 LoRA by the original model's keys only (comfy/lora.py model_lora_keys_unet has no Lumina 2
branch; its generic rule gives `lora_unet_<original key with _>` and `diffusion_model.<original key>`), and diffusers'
Lumina 2 loader reads a file in those names only when it holds every module of every block at Lumina-Image-2.0's
widths (`_convert_non_diffusers_lumina2_lora_to_diffusers`): so one file cannot serve both, and this one is written
beside the other. Its modules are kohya sd-scripts' names for Lumina (`lora_unet_layers_0_attention_qkv`, ...;
lumina2_single_file.py's map), `.lora_down.weight` / `.lora_up.weight` and an `.alpha` tensor each:
- the scale (alpha / rank, or rsLoRA's) is inside the up matrices and `.alpha` is the module's rank, so every loader
  applies the trained change at strength 1;
- q / k / v are one fused `attention.qkv` in the original: their three LoRAs become one of rank 3r, the down matrices
  stacked and the up matrices block-diagonal, so up @ down is exactly the three changes stacked by rows (a projection
  the run did not adapt contributes zero rows). kohya's `split_qkv` files have this form, and `ot-dist lora merge` /
  `lora.init_from` split it back (ot_dist/lora_tools/foreign.py).
A trained Gemma's LoRA goes into the same file under ComfyUI's names for it (comfy/lora.py model_lora_keys_clip:
`text_encoders.<key>` for each weight key of its Lumina 2 text encoder, whose Gemma 2 is `gemma2_2b.transformer.model.`
with transformers' layer names), the scale again inside the up matrices. Plain LoRA only (DoRA's magnitude and LoHa /
LoKr factors have no fused form here).
"""

from __future__ import annotations

import torch

from ot_dist.models.families.lumina2_single_file import original_name

QKV = ("to_q", "to_k", "to_v")
# ComfyUI's LoRA names of Gemma 2's modules: "text_encoders." + its LuminaModel's state-dict path (comfy/text_encoders/
# lumina2.py: Gemma2_2BModel named gemma2_2b, llama.py's Gemma2_2B with the layers under `transformer.model`)
COMFY_GEMMA_PREFIX = "text_encoders.gemma2_2b.transformer.model."
DOWN, UP = ".lora_A.weight", ".lora_B.weight"


def comfyui_lora_state(state: dict[str, torch.Tensor], adapter_config: dict,
                       transformer: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The transformer's peft adapter state (`get_peft_model_state_dict`) in ComfyUI's names, or None when the adapter
    is not a plain LoRA."""
    from ot_dist.methods.lora import scale_baked_in
    from ot_dist.methods.lora_variants import split_modules

    if adapter_config.get("use_dora"):
        return None
    baked, _ = scale_baked_in(state, adapter_config)
    out: dict[str, torch.Tensor] = {}
    attention: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for path, factors in split_modules(baked).items():
        if set(factors) != {DOWN, UP}:  # LoHa / LoKr factors
            return None
        head, _, name = path.rpartition(".")
        if name in QKV:
            attention.setdefault(head, {})[name] = (factors[DOWN], factors[UP])
        else:
            _put(out, original_name(f"{path}.weight"), factors[DOWN], factors[UP])
    for head, pieces in attention.items():
        rank, like = next(iter(pieces.values()))[0].shape[0], next(iter(pieces.values()))[0]
        downs, ups = [], []
        for name in QKV:
            if name not in pieces:  # not adapted: no change to its rows
                layer = transformer.get_submodule(f"{head}.{name}")
                pieces[name] = (like.new_zeros(rank, layer.in_features), like.new_zeros(layer.out_features, rank))
            downs.append(pieces[name][0])
            ups.append(pieces[name][1])
        _put(out, original_name(f"{head}.qkv.weight"), torch.cat(downs), torch.block_diag(*ups))
    return out


def comfyui_text_lora_state(state: dict[str, torch.Tensor], adapter_config: dict) -> dict[str, torch.Tensor] | None:
    """Gemma's peft adapter state in ComfyUI's names (`text_encoders.gemma2_2b.transformer.model.<path>`), or None
    when the adapter is not a plain LoRA."""
    from ot_dist.methods.lora import scale_baked_in
    from ot_dist.methods.lora_variants import split_modules

    if adapter_config.get("use_dora"):
        return None
    baked, _ = scale_baked_in(state, adapter_config)
    out: dict[str, torch.Tensor] = {}
    for path, factors in split_modules(baked).items():
        if set(factors) != {DOWN, UP}:
            return None
        _name(out, COMFY_GEMMA_PREFIX + path.removeprefix("model."), factors[DOWN], factors[UP])
    return out


def _put(out: dict, original_key: str, down: torch.Tensor, up: torch.Tensor) -> None:
    _name(out, "lora_unet_" + original_key.removesuffix(".weight").replace(".", "_"), down, up)


def _name(out: dict, name: str, down: torch.Tensor, up: torch.Tensor) -> None:
    out[f"{name}.lora_down.weight"] = down.contiguous()
    out[f"{name}.lora_up.weight"] = up.contiguous()
    out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))  # the scale is inside the up matrix
