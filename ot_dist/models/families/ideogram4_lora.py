"""An Ideogram 4 LoRA in the original module names: `lora_comfyui.safetensors` beside the diffusers-layout
lora.safetensors.

Why a second file: ComfyUI's Ideogram 4 model (Comfy-Org's ideogram4_*.safetensors) keeps the original checkpoint's
names, which SwarmUI's model sorter recognises a LoRA by (T2IModelClassSorter.isIdeogram4Lora: `layers.0.attention.o`,
`layers.33.attention.qkv`, `layers.0.feed_forward.w3`, `layers.0.adaln_modulation`), and which ai-toolkit writes:
`diffusion_model.<original path>`. The original differs from diffusers in two names only (OneTrainer's
IdeogramModel.fusion_groups / diffusers_to_original, diffusers' _convert_non_diffusers_ideogram4_lora_to_diffusers):
each block's q / k / v are one fused `attention.qkv` and its `attention.to_out.0` is `attention.o`. Diffusers'
Ideogram 4 loader converts a file with these names as a foreign one (the whole file), so one file cannot serve both.

The modules: `diffusion_model.<path>.lora_down.weight` / `.lora_up.weight` and an `.alpha` tensor each, the scale
(alpha / rank, or rsLoRA's) inside the up matrices and `.alpha` the module's rank, so every loader applies the trained
change at strength 1. A block's q / k / v LoRAs become one of rank 3r on the fused qkv: the down matrices stacked, the
up matrices block-diagonal, so up @ down is exactly the three changes stacked by rows (one the run did not adapt
contributes zero rows); diffusers' converter splits it back by rows (up in thirds, down shared). Plain LoRA only
(DoRA's magnitude and LoHa / LoKr factors have no fused form here).
"""

from __future__ import annotations

import re

import torch

from ot_dist.models.families.flux2_lora import DOWN, UP, _plain_lora

PREFIX = "diffusion_model."
QKV = re.compile(r"(layers\.\d+\.attention)\.to_([qkv])")
OUT = re.compile(r"(layers\.\d+\.attention)\.to_out\.0")


def original_lora_state(state: dict[str, torch.Tensor], adapter_config: dict) -> dict[str, torch.Tensor] | None:
    """The transformer's peft adapter state (`get_peft_model_state_dict`) in the original names, or None when the
    adapter is not a plain LoRA."""
    modules = _plain_lora(state, adapter_config)
    if modules is None:
        return None
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, dict]] = {}
    for path, factors in sorted(modules.items()):
        qkv = QKV.fullmatch(path)
        if qkv:
            fused.setdefault(qkv.group(1), {})[qkv.group(2)] = factors
            continue
        out_proj = OUT.fullmatch(path)
        put(out, f"{out_proj.group(1)}.o" if out_proj else path, factors[DOWN], factors[UP])
    for attention, parts in fused.items():
        like = next(iter(parts.values()))
        rank, rows = like[DOWN].shape[0], like[UP].shape[0]
        downs = [parts[p][DOWN] if p in parts else like[DOWN].new_zeros(like[DOWN].shape) for p in "qkv"]
        ups = [parts[p][UP] if p in parts else like[UP].new_zeros(rows, rank) for p in "qkv"]
        put(out, f"{attention}.qkv", torch.cat(downs), torch.block_diag(*ups))
    return out


def put(out: dict, path: str, down: torch.Tensor, up: torch.Tensor) -> None:
    name = PREFIX + path
    out[f"{name}.lora_down.weight"] = down.contiguous()
    out[f"{name}.lora_up.weight"] = up.contiguous()
    out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))  # the scale is inside the up matrix
