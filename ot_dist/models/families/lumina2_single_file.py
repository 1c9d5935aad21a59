"""Lumina 2 single files: the original NextDiT layout (Alpha-VLLM's Lumina-Image-2.0 checkpoint, ComfyUI's
diffusion-model file `lumina_2_model_bf16.safetensors`, Neta Lumina's) <-> diffusers Lumina2Transformer2DModel.

The names are ComfyUI's (comfy/ldm/lumina/model.py NextDiT) and the original repository's; diffusers'
`convert_lumina2_to_diffusers` (loaders/single_file_utils.py) reads them with the same renames, but splits the fused
q|k|v at Lumina-Image-2.0's widths (2304 / 768 / 768), so it cannot read a file of any other width:
- `x_embedder`, `noise_refiner.N` / `context_refiner.N` / `layers.N` and their `feed_forward.w1 / w2 / w3`
  (`feed_forward.linear_1 / 2 / 3`), `attention.qkv` (q | k | v of `attn.to_q / to_k / to_v`, fused by rows),
  `attention.out` (`attn.to_out.0`), `attention.q_norm / k_norm` (`attn.norm_q / norm_k`), `attention_norm1`
  (`norm1.norm`; a context-refiner block, which has no modulation: `norm1`), `attention_norm2` (`norm2`),
  `ffn_norm1 / 2` (the same), `adaLN_modulation.1` (`norm1.linear`);
- `t_embedder.mlp.0 / 2` (`time_caption_embed.timestep_embedder.linear_1 / 2`), `cap_embedder` (the caption
  embedder's RMSNorm and Linear), `final_layer.adaLN_modulation.1` / `final_layer.linear` (`norm_out.linear_1 / 2`);
- `norm_final.weight`: an RMSNorm the original model builds and never uses (diffusers drops it). It is written as
  ones, the module's own initial value, so that ComfyUI's NextDiT finds every key, and ignored when read.

ComfyUI tells the file by `cap_embedder.1.weight` (comfy/model_detection.py "Lumina 2") and reads its caption width
from that key's columns and its depth from the `layers.N.` it counts (the other sizes there are Lumina-Image-2.0's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from diffusers import Lumina2Transformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, HeaderReport, Rule

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)
UNUSED_NORM = "norm_final.weight"
QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
# (diffusers name part, original name part), applied in order to every diffusers key of a block or the root
_BLOCK_RENAMES = (("attn.to_out.0.", "attention.out."), ("attn.norm_q.", "attention.q_norm."),
                  ("attn.norm_k.", "attention.k_norm."), ("feed_forward.linear_1.", "feed_forward.w1."),
                  ("feed_forward.linear_2.", "feed_forward.w2."), ("feed_forward.linear_3.", "feed_forward.w3."),
                  ("norm1.linear.", "adaLN_modulation.1."), ("norm1.norm.", "attention_norm1."),
                  ("norm1.", "attention_norm1."), ("norm2.", "attention_norm2."), ("attn.", "attention."))
_ROOT_RENAMES = {"time_caption_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
                 "time_caption_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
                 "time_caption_embed.caption_embedder.": "cap_embedder.",
                 "norm_out.linear_1.": "final_layer.adaLN_modulation.1.", "norm_out.linear_2.": "final_layer.linear."}
_BLOCK_LISTS = ("noise_refiner.", "context_refiner.", "layers.")


def original_name(key: str) -> str:
    """The original key of a diffusers key (a parameter's, or a module path + `.weight`); `attn.qkv` names the fused
    projection."""
    for old, new in _ROOT_RENAMES.items():
        if key.startswith(old):
            return new + key[len(old):]
    if key.startswith(_BLOCK_LISTS):
        block_list, index, rest = key.split(".", 2)
        for old, new in _BLOCK_RENAMES:
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        return f"{block_list}.{index}.{rest}"
    return key  # x_embedder


def lumina2_rules(config: Any) -> list[Rule]:
    """The key map of a Lumina2Transformer2DModel with this config (original key <- diffusers key(s))."""
    cfg = K.full_config(Lumina2Transformer2DModel, config)
    state = K.meta_state_dict(Lumina2Transformer2DModel, cfg)
    rules = []
    for key, value in state.items():
        block, _, suffix = key.rpartition(".")
        if block.endswith(QKV[1:]):  # to_k / to_v: part of their block's to_q rule
            continue
        if block.endswith(QKV[0]):
            base = block[: -len(QKV[0])]
            pieces = tuple(f"{base}{name}.{suffix}" for name in QKV)
            rules.append(Rule(original_name(f"{base}attn.qkv.{suffix}"), pieces, CAT,
                              tuple(state[p].shape[0] for p in pieces)))
            continue
        rules.append(Rule(original_name(key), (key,)))
    return rules


def lumina2_to_original(state: Mapping[str, torch.Tensor], config: Any, prefix: str = "") -> dict:
    """diffusers state dict -> the original keys (bare, as the original checkpoint and ComfyUI's file have them;
    `prefix` = COMFY_PREFIX for a checkpoint-style file), with the unused `norm_final.weight` as ones."""
    out = K.to_original(state, lumina2_rules(config), prefix)
    width = K.full_config(Lumina2Transformer2DModel, config)["hidden_size"]
    reference = next(iter(state.values()))
    out[prefix + UNUSED_NORM] = torch.ones(width, dtype=reference.dtype, device=reference.device)
    return out


def lumina2_from_original(state: Mapping[str, torch.Tensor], config: Any) -> dict:
    """The original keys (bare or under model.diffusion_model.) -> diffusers; the unused norm is dropped."""
    state = {k: v for k, v in state.items() if not k.endswith(UNUSED_NORM)}
    return K.from_original(state, lumina2_rules(config), _INPUT_PREFIXES)


def expected_lumina2_header(config: Any) -> dict[str, tuple[int, ...]]:
    cfg = K.full_config(Lumina2Transformer2DModel, config)
    return K.expected_header(Lumina2Transformer2DModel, cfg, lumina2_rules(cfg))


def check_lumina2_header(header: Mapping[str, Sequence[int]], config: Any) -> HeaderReport:
    """Which keys of a Lumina 2 file (names -> shapes) are missing / unexpected / wrong-shaped for `config` (the
    unused norm may be there or not)."""
    header = {k: v for k, v in header.items() if not k.endswith(UNUSED_NORM)}
    return K.check_header(header, expected_lumina2_header(config), "Lumina 2", _INPUT_PREFIXES)


def validate_lumina2_file(path: str | Path, config: Any) -> None:
    """InputFileError naming the file and the offending keys unless its header fits `config`."""
    check_lumina2_header(K.read_safetensors_header(path), config).raise_if_bad(path)
