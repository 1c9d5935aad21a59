"""Z-Image single files: ComfyUI's diffusion-model file (Comfy-Org's `z_image_turbo_bf16.safetensors`), in the
original Z-Image layout that ComfyUI's Lumina 2 model (comfy/ldm/lumina/model.py) holds <-> diffusers
ZImageTransformer2DModel.

The layouts differ in a few names only (comfy.utils.z_image_to_diffusers, and diffusers'
convert_z_image_transformer_checkpoint_to_diffusers, which reads such a file, undo the same ones):
- each block's `attention.to_q` / `to_k` / `to_v` are one fused `attention.qkv` (rows q | k | v, no bias);
- `attention.norm_q` / `norm_k` are `attention.q_norm` / `k_norm`, `attention.to_out.0` is `attention.out`;
- the patch embedder and the final layer drop diffusers' ModuleDict level: `all_x_embedder.2-1.` is `x_embedder.`,
  `all_final_layer.2-1.` is `final_layer.`.
Everything else (refiners, adaLN modulations, cap_embedder, t_embedder, the pad tokens) keeps its name. ComfyUI tells
the file by `cap_embedder.1.weight` (comfy/model_detection.py: Lumina 2; width 3840 is Z-Image). The file is the
transformer alone, bare or under ComfyUI's `model.diffusion_model.`; the rest comes from the `model.config` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from diffusers import ZImageTransformer2DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, HeaderReport, Rule

COMFY_PREFIX = "model.diffusion_model."
_INPUT_PREFIXES = (COMFY_PREFIX,)
# diffusers name -> original name, applied to every key that holds the diffusers part
RENAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
           (".attention.norm_q.", ".attention.q_norm."), (".attention.norm_k.", ".attention.k_norm."),
           (".attention.to_out.0.", ".attention.out."))
FUSED = (".attention.to_q.weight", ".attention.to_k.weight", ".attention.to_v.weight")


def original_name(key: str) -> str:
    for diffusers, original in RENAMES:
        key = key.replace(diffusers, original)
    return key


def z_image_rules(config: Any) -> list[Rule]:
    """The key map of a ZImageTransformer2DModel with this config."""
    cfg = K.full_config(ZImageTransformer2DModel, config)
    rules = []
    for key in K.meta_state_dict(ZImageTransformer2DModel, cfg):
        if key.endswith(FUSED[0]):
            block = key[:-len(FUSED[0])]
            rules.append(Rule(f"{block}.attention.qkv.weight", tuple(block + part for part in FUSED), CAT,
                              (cfg["dim"],) * 3))
        elif not key.endswith(FUSED[1:]):
            rules.append(Rule(original_name(key), (key,)))
    return rules


def z_image_to_original(state: Mapping[str, torch.Tensor], config: Any, prefix: str = "") -> dict:
    """diffusers state dict -> the original keys (bare, as Comfy-Org ship the file)."""
    return K.to_original(state, z_image_rules(config), prefix)


def z_image_from_original(state: Mapping[str, torch.Tensor], config: Any) -> dict:
    """The original keys (bare or under model.diffusion_model.) -> diffusers; other components' keys are ignored."""
    return K.from_original(state, z_image_rules(config), _INPUT_PREFIXES)


def check_z_image_header(header: Mapping[str, Sequence[int]], config: Any) -> HeaderReport:
    """Which keys of a Z-Image file (names -> shapes) are missing / unexpected / wrong-shaped for `config`."""
    cfg = K.full_config(ZImageTransformer2DModel, config)
    expected = K.expected_header(ZImageTransformer2DModel, cfg, z_image_rules(cfg))
    return K.check_header(header, expected, "Z-Image", _INPUT_PREFIXES)


def validate_z_image_file(path: str | Path, config: Any) -> None:
    """InputFileError naming the file and the offending keys unless its header fits `config`."""
    check_z_image_header(K.read_safetensors_header(path), config).raise_if_bad(path)
