"""A FLUX.2 LoRA in the names ComfyUI reads: `lora_comfyui.safetensors` beside the diffusers-layout lora.safetensors.

Why a second file: ComfyUI maps a FLUX.2 LoRA in diffusers' names through its Flux key map (comfy/lora.py
model_lora_keys_unet, `transformer.<k>` for each k of comfy/utils.py flux_to_diffusers), which names the blocks'
projections but not the modulations every block shares (`double_stream_modulation_img / _txt`,
`single_stream_modulation`) nor the time / guidance embedders: an `all_linear` LoRA loses those there, with a
warning. Its generic rule maps every weight of the model by Black Forest Labs' key (`lora_unet_<key with _>`,
`diffusion_model.<key>`), but diffusers' FLUX.2 loader takes a file with such names for a foreign one and converts
the whole file, so one file cannot serve both. A trained text encoder's LoRA is not read by either program under
the `text_encoder.` names lora.safetensors gives it; ComfyUI reads it under its own names for the model
(comfy/lora.py model_lora_keys_clip: `text_encoders.<key>` for each weight key of its text encoder).

The file is written for every plain LoRA, not only where lora.safetensors would be incomplete in ComfyUI: its names
come from ComfyUI's generic rule, which every ComfyUI that loads FLUX.2 has, while which diffusers names its Flux map
covers changes between versions (its `ff.linear_in` entries came later, for LyCORIS files), and "in ComfyUI, load
lora_comfyui.safetensors" is then one rule for every run.

Its modules are kohya-style names of the BFL keys (`lora_unet_double_blocks_0_img_attn_qkv`, ...;
flux2_single_file.py's map), `.lora_down.weight` / `.lora_up.weight` and an `.alpha` tensor each:
- the scale (alpha / rank, or rsLoRA's) is inside the up matrices and `.alpha` is the module's rank, so every loader
  applies the trained change at strength 1;
- the double blocks' q / k / v are one fused `img_attn.qkv` / `txt_attn.qkv` in the original: their three LoRAs
  become one of rank 3r, the down matrices stacked and the up matrices block-diagonal, so up @ down is exactly the
  three changes stacked by rows (a projection the run did not adapt contributes zero rows). The single blocks'
  `linear1` is already one module in diffusers (`attn.to_qkv_mlp_proj`): renamed only;
- `final_layer.adaLN_modulation.1` holds diffusers' `norm_out.linear` rows as (shift, scale), diffusers' as
  (scale, shift): the up matrix's halves are swapped.
The text encoder's modules: `text_encoders.mistral3_24b.transformer.model.<layer path>` for [dev]'s Mistral-3
(comfy/text_encoders/flux.py Flux2TEModel, name "mistral3_24b"; llama.py's Mistral3Small24B keeps the layers under
`model` with transformers' names), `text_encoders.qwen3_4b.` / `qwen3_8b.transformer.model.` for [klein]'s Qwen3
(klein_te: its model_type, the 8B for a 4096-wide Qwen3, as ComfyUI's sd.py detects it). Plain LoRA only (DoRA's
magnitude and LoHa / LoKr factors have no fused form here).
"""

from __future__ import annotations

import torch

from ot_dist.models.families.single_file_keys import CAT, SWAP

DOWN, UP = ".lora_A.weight", ".lora_B.weight"
COMFY_MISTRAL_PREFIX = "text_encoders.mistral3_24b.transformer.model."
QWEN3_8B_WIDTH = 4096  # Qwen3-8B's hidden size ([klein] 9B's encoder); Qwen3-4B's is 2560


def comfy_qwen3_prefix(hidden_size: int) -> str:
    """ComfyUI's name for [klein]'s Qwen3: qwen3_8b for the 8B's width, qwen3_4b otherwise."""
    return f"text_encoders.{'qwen3_8b' if hidden_size == QWEN3_8B_WIDTH else 'qwen3_4b'}.transformer.model."


def _plain_lora(state: dict[str, torch.Tensor], adapter_config: dict) -> dict[str, dict] | None:
    """module path -> {DOWN: ..., UP: ...} with the scale inside the up matrix; None unless a plain LoRA."""
    from ot_dist.methods.lora import scale_baked_in
    from ot_dist.methods.lora_variants import split_modules

    if adapter_config.get("use_dora"):
        return None
    modules = split_modules(scale_baked_in(state, adapter_config)[0])
    return None if any(set(f) != {DOWN, UP} for f in modules.values()) else modules


def comfyui_lora_state(state: dict[str, torch.Tensor], adapter_config: dict,
                       transformer_config) -> dict[str, torch.Tensor] | None:
    """The transformer's peft adapter state (`get_peft_model_state_dict`) in ComfyUI's names, or None when the adapter
    is not a plain LoRA."""
    from ot_dist.models.families.flux2_single_file import flux2_rules

    modules = _plain_lora(state, adapter_config)
    if modules is None:
        return None
    out: dict[str, torch.Tensor] = {}
    placed = set()
    for rule in flux2_rules(transformer_config):
        if not rule.original.endswith(".weight"):
            continue
        pieces = [d.removesuffix(".weight") for d in rule.diffusers]
        present = [p for p in pieces if p in modules]
        if not present:
            continue
        placed.update(present)
        if rule.kind == CAT:
            like = modules[present[0]][DOWN]
            downs, ups = [], []
            for piece, rows in zip(pieces, rule.sizes):
                if piece in modules:
                    downs.append(modules[piece][DOWN])
                    ups.append(modules[piece][UP])
                else:  # not adapted: no change to its rows
                    downs.append(like.new_zeros(like.shape))
                    ups.append(like.new_zeros(rows, like.shape[0]))
            down, up = torch.cat(downs), torch.block_diag(*ups)
        else:
            down, up = modules[present[0]][DOWN], modules[present[0]][UP]
            if rule.kind == SWAP:
                scale, shift = up.chunk(2, dim=0)
                up = torch.cat([shift, scale], dim=0)
        _put(out, "lora_unet_" + rule.original.removesuffix(".weight").replace(".", "_"), down, up)
    unplaced = sorted(set(modules) - placed)
    if unplaced:  # a module without a BFL weight would be silently lost
        raise ValueError(f"FLUX.2 LoRA modules without an original key: {unplaced[:3]}")
    return out


def comfyui_text_lora_state(state: dict[str, torch.Tensor], adapter_config: dict, own_prefix: str,
                            comfy_prefix: str) -> dict[str, torch.Tensor] | None:
    """The text encoder's peft adapter state with `own_prefix` (transformers' path of the language model's layers)
    replaced by `comfy_prefix` (ComfyUI's), or None when the adapter is not a plain LoRA."""
    modules = _plain_lora(state, adapter_config)
    if modules is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for path, factors in modules.items():
        if not path.startswith(own_prefix):
            raise ValueError(f"text encoder LoRA module {path} is not under {own_prefix}")
        _put(out, comfy_prefix + path.removeprefix(own_prefix), factors[DOWN], factors[UP])
    return out


def _put(out: dict, name: str, down: torch.Tensor, up: torch.Tensor) -> None:
    out[f"{name}.lora_down.weight"] = down.contiguous()
    out[f"{name}.lora_up.weight"] = up.contiguous()
    out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))  # the scale is inside the up matrix
