"""A HunyuanVideo LoRA in the names ComfyUI reads: `lora_comfyui.safetensors` beside the diffusers-layout file.

ComfyUI maps a HunyuanVideo LoRA by the original (Tencent) module names only (comfy/lora.py model_lora_keys_unet, its
HunyuanVideo branch: `transformer.<name>` and `diffusion_model.<name>`, the names of diffusion-pipe's files, which its
own keys give after `_mod.lin.` -> `_mod.linear.`, `_attn.qkv.` -> `_attn_qkv.`, `mlp.0.` -> `mlp.fc1.` ...); a
diffusers-layout file (`transformer.transformer_blocks.0.attn.to_q`) maps to nothing there. The file names each module
`diffusion_model.<original name>` with `.lora_A.weight` / `.lora_B.weight`, which diffusers'
HunyuanVideoPipeline.load_lora_weights reads too (`_convert_hunyuan_video_lora_to_diffusers`, for the double blocks:
its single-block split assumes the 13 B model's width, its refiner split no LoRA form):
- the scale (alpha / rank, or rsLoRA's) is inside the up matrices and no `.alpha` tensor is written: both loaders then
  apply the trained change at strength 1;
- the original fuses what diffusers keeps apart: q / k / v (`img_attn_qkv`, `txt_attn_qkv`, the refiner's
  `self_attn_qkv`) and, in the single blocks, q / k / v with the MLP's input (`linear1`). Their LoRAs become one whose
  down matrices are stacked and up matrices block-diagonal, so up @ down is exactly the changes stacked by rows (a part
  the run did not adapt contributes zero rows), as OneTrainer's and kohya's fused files.
Only the blocks (double, single, refiner) and the output projection have names here: an adapter on any other module
(the embedders, whose ComfyUI names differ from the original ones) or other than plain LoRA leaves the file out.
"""

from __future__ import annotations

import re

import torch

COMFY_PREFIX = "diffusion_model."
DOWN, UP = ".lora_A.weight", ".lora_B.weight"
# diffusers' block path -> the original block path
BLOCKS = ((re.compile(r"^transformer_blocks\.(\d+)\.(.+)$"), "double_blocks.{}."),
          (re.compile(r"^single_transformer_blocks\.(\d+)\.(.+)$"), "single_blocks.{}."),
          (re.compile(r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.(.+)$"),
           "txt_in.individual_token_refiner.blocks.{}."))
# per block kind: the original fused module -> its diffusers parts, in the order of its output rows
FUSED = {
    "double_blocks.{}.": {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                          "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")},
    "single_blocks.{}.": {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")},
    "txt_in.individual_token_refiner.blocks.{}.": {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")},
}
# per block kind: diffusers module -> original module, one to one (the inverse of diffusers' renames)
RENAMES = {
    "double_blocks.{}.": {"attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
                          "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
                          "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
                          "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2"},
    "single_blocks.{}.": {"proj_out": "linear2", "norm.linear": "modulation.linear"},
    "txt_in.individual_token_refiner.blocks.{}.": {"attn.to_out.0": "self_attn_proj", "ff.net.0.proj": "mlp.fc1",
                                                   "ff.net.2": "mlp.fc2", "norm_out.linear": "adaLN_modulation.1"},
}
TOP_RENAMES = {"proj_out": "final_layer.linear"}
# The embedders' original names (diffusers' _convert_hunyuan_video_lora_to_diffusers renames), read in other trainers'
# files only: ComfyUI's own names for them differ (time_in.in_layer ...), so the ComfyUI file leaves them out.
READ_RENAMES = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.mlp.0",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.mlp.2",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
}
# the final AdaLayerNorm: shift, scale rows in the original, scale, shift in diffusers
SWAPPED = {"norm_out.linear": "final_layer.adaLN_modulation.1"}


def original_place(path: str) -> tuple[str, str | None] | None:
    """(the original module's name, the diffusers part it holds rows of or None when one to one) of a diffusers
    HunyuanVideoTransformer3DModel module, or None when it has no name here."""
    for pattern, block in BLOCKS:
        match = pattern.match(path)
        if match:
            number, rest = match.groups()
            prefix = block.format(number)
            for fused, parts in FUSED[block].items():
                if rest in parts:
                    return prefix + fused, rest
            renamed = RENAMES[block].get(rest)
            return (prefix + renamed, None) if renamed else None
    return (TOP_RENAMES[path], None) if path in TOP_RENAMES else None


def fused_parts(original: str) -> tuple[str, ...]:
    """The diffusers parts of an original fused module's name, in row order."""
    kind = next(block for block in FUSED if original.startswith(block.split("{")[0]))
    return FUSED[kind][original.rsplit(".", 1)[1]]


def comfyui_lora_state(state: dict[str, torch.Tensor], adapter_config: dict,
                       transformer: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The transformer's peft adapter state (`get_peft_model_state_dict`) in ComfyUI's names, or None when the adapter
    is not a plain LoRA or adapts a module without an original name here."""
    from ot_dist.methods.lora import scale_baked_in
    from ot_dist.methods.lora_variants import split_modules

    if adapter_config.get("use_dora"):
        return None
    baked, _ = scale_baked_in(state, adapter_config)
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # original -> part -> (down, up)
    heads: dict[str, str] = {}  # original fused name -> its diffusers block path
    for path, factors in split_modules(baked).items():
        place = original_place(path)
        if set(factors) != {DOWN, UP} or place is None:
            return None
        original, part = place
        if part is None:
            _put(out, original, factors[DOWN], factors[UP])
        else:
            fused.setdefault(original, {})[part] = (factors[DOWN], factors[UP])
            heads[original] = path.removesuffix(part)
    for original, pieces in fused.items():
        like = next(iter(pieces.values()))[0]
        downs, ups = [], []
        for part in fused_parts(original):
            if part not in pieces:  # not adapted: no change to its rows
                layer = transformer.get_submodule(heads[original] + part)
                pieces[part] = (like.new_zeros(like.shape[0], layer.in_features),
                                like.new_zeros(layer.out_features, like.shape[0]))
            downs.append(pieces[part][0])
            ups.append(pieces[part][1])
        _put(out, original, torch.cat(downs), torch.block_diag(*ups))
    return out


def _put(out: dict, original: str, down: torch.Tensor, up: torch.Tensor) -> None:
    out[f"{COMFY_PREFIX}{original}{DOWN}"] = down.contiguous()
    out[f"{COMFY_PREFIX}{original}{UP}"] = up.contiguous()


def original_rules(config) -> list:
    """The Linear weights of a HunyuanVideoTransformer3DModel with this config by their original names (single_file_keys
    Rules: a fused module's diffusers parts concatenated by rows, the final AdaLayerNorm's halves swapped), what
    other trainers' LoRA files name (ot_dist/lora_tools/foreign.py): diffusion-pipe's / OneTrainer's ComfyUI files,
    musubi-tuner's `lora_unet_` ones."""
    from diffusers import HunyuanVideoTransformer3DModel

    from ot_dist.models.families import single_file_keys as K

    state = K.meta_state_dict(HunyuanVideoTransformer3DModel, K.full_config(HunyuanVideoTransformer3DModel, config))
    rules, fused_done = [], set()
    for key, value in state.items():
        if not key.endswith(".weight") or value.dim() != 2:
            continue
        path = key.removesuffix(".weight")
        if path in READ_RENAMES:
            rules.append(K.Rule(f"{READ_RENAMES[path]}.weight", (key,)))
            continue
        if path in SWAPPED:
            rules.append(K.Rule(f"{SWAPPED[path]}.weight", (key,), K.SWAP))
            continue
        place = original_place(path)
        if place is None:
            continue
        original, part = place
        if part is None:
            rules.append(K.Rule(f"{original}.weight", (key,)))
        elif original not in fused_done:
            fused_done.add(original)
            head = path.removesuffix(part)
            pieces = tuple(f"{head}{p}.weight" for p in fused_parts(original))
            rules.append(K.Rule(f"{original}.weight", pieces, K.CAT, tuple(state[p].shape[0] for p in pieces)))
    return rules

