"""Stable Cascade's stage C in Stability's original layout (`stage_c.safetensors`, `stage_c_lite.safetensors`: what
ComfyUI's UNET loader / StableSwarm and diffusers' `StableCascadeUNet.from_single_file` read). It differs from the
diffusers layout only in the attention: the original nn.MultiheadAttention holds q / k / v stacked in
`attention.attn.in_proj_weight` / `in_proj_bias` and the output projection as `attention.attn.out_proj`; diffusers
splits them into `attention.to_q / to_k / to_v` and `attention.to_out.0` (convert_stable_cascade_unet_single_file_
to_diffusers)."""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.errors import InputFileError
from ot_dist.models.families.full_checkpoint import DENOISER_PREFIX
from ot_dist.models.families.single_file_keys import strip_prefix

QKV = ("to_q", "to_k", "to_v")


def cascade_to_original(state: dict[str, torch.Tensor], config: dict | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        head, sep, tail = key.rpartition(".attention.")
        if not sep:
            out[key] = value
            continue
        name, kind = tail.rsplit(".", 1)  # "to_q", "weight"
        if name == "to_q":
            stacked = torch.cat([state[f"{head}.attention.{n}.{kind}"] for n in QKV], dim=0)
            out[f"{head}.attention.attn.in_proj_{kind}"] = stacked
        elif name == "to_out.0":
            out[f"{head}.attention.attn.out_proj.{kind}"] = value
        elif name not in QKV:
            out[key] = value
    return out


def cascade_from_original(state: dict[str, torch.Tensor], config: dict | None = None) -> dict[str, torch.Tensor]:
    """Stage C's own keys (bare, or under model.diffusion_model. in a checkpoint with its text encoder) -> diffusers."""
    _, state = strip_prefix(state, (DENOISER_PREFIX,))
    out = {}
    for key, value in state.items():
        head, sep, tail = key.rpartition(".attention.attn.")
        if not sep:
            out[key] = value
        elif tail.startswith("in_proj_"):
            kind = tail[len("in_proj_"):]
            for name, part in zip(QKV, value.chunk(3, dim=0)):
                out[f"{head}.attention.{name}.{kind}"] = part
        elif tail.startswith("out_proj."):
            out[f"{head}.attention.to_out.0.{tail[len('out_proj.'):]}"] = value
        else:
            out[key] = value
    return out


def validate_cascade_file(path: Path, config: dict) -> None:
    """The file's keys and shapes against the original layout of the config's prior (before any tensor is read)."""
    from diffusers import StableCascadeUNet
    from safetensors import safe_open

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cascade_to_original(
            StableCascadeUNet.from_config(config).state_dict()).items()}
    with safe_open(str(path), "pt") as f:
        _, found = strip_prefix({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, (DENOISER_PREFIX,))
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or unexpected or wrong:
        from ot_dist.models.families.single_file_keys import quantization_hint

        raise InputFileError(f"model.path: {path} is not a stage C of this prior config: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, wrong shapes {wrong[:3]}" + quantization_hint(unexpected))
