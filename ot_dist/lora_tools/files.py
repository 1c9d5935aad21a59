"""A LoRA file as (file module name -> Pair), whatever layout it was written in, and back.

Layouts read:
- kohya (ComfyUI, A1111 / Forge, kohya's scripts, ot_dist's default for SD families): `<name>.lora_down.weight`,
  `<name>.lora_up.weight`, optional `<name>.alpha`. Without an alpha tensor a loader applies the change at
  alpha = rank (strength 1.0), which is what `Pair.scale` returns then.
- diffusers / peft: `<component>.<module path>.lora_A.weight` / `.lora_B.weight`, alpha from an `.alpha` tensor
  when present (ComfyUI reads it), else from the adapter metadata diffusers writes (`lora_adapter_metadata`),
  else alpha = rank. ot_dist's files of T5 families name their T5-XXL modules kohya-style in this layout
  (`lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_A.weight` + `.alpha`); the name is kept as it is.
Anything else (old diffusers attention-processor files, LoHa / LoKr, DoRA scales) is refused naming a key:
merging it as plain LoRA would silently apply the wrong change."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ot_dist.errors import InputFileError

KOHYA = ("kohya", ".lora_down.weight", ".lora_up.weight")
DIFFUSERS = ("diffusers", ".lora_A.weight", ".lora_B.weight")
ALPHA = ".alpha"


@dataclass
class Pair:
    """One module's low-rank change: delta W = scale * up @ down (conv: over the flattened input dims)."""

    down: torch.Tensor  # [rank, in] or [rank, in, kh, kw]
    up: torch.Tensor  # [out, rank] or [out, rank, 1, 1]
    alpha: float | None  # None: the file gives none (loaders then use alpha = rank)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def delta(self) -> torch.Tensor:
        """The weight change in float32, in the module weight's shape."""
        down, up = self.down.float(), self.up.float()
        change = up.flatten(1) @ down.flatten(1)
        if down.dim() == 4:
            change = change.reshape(up.shape[0], *down.shape[1:])
        return change * self.scale


@dataclass
class LoraFile:
    layout: str  # "kohya" or "diffusers"
    pairs: dict[str, Pair]  # file module name ("lora_unet_..." or "unet.down_blocks...") -> its pair
    metadata: dict[str, str]


def read_lora_file(path: str | Path) -> LoraFile:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path}: no such LoRA file")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for damaged headers
        raise InputFileError(f"{path}: not a readable safetensors file ({err})") from None
    layout, down_suffix, up_suffix = _layout_of(path, tensors)
    names = sorted(k[: -len(down_suffix)] for k in tensors if k.endswith(down_suffix))
    alphas = _metadata_alphas(metadata) if layout == "diffusers" else {}
    pairs = {}
    for name in names:
        up = tensors.get(name + up_suffix)
        if up is None:
            raise InputFileError(f"{path}: {name}{down_suffix} has no {name}{up_suffix}")
        alpha_tensor = tensors.get(name + ALPHA)
        alpha = float(alpha_tensor) if alpha_tensor is not None else alphas.get(_component(name))
        pairs[name] = Pair(tensors[name + down_suffix], up, alpha)
    known = {n + s for n in names for s in (down_suffix, up_suffix, ALPHA)}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise InputFileError(f"{path}: tensor {unknown[0]!r} (and {len(unknown) - 1} more) is not a plain LoRA "
                             "down / up / alpha tensor (LoHa, LoKr, DoRA or an older layout): not supported here")
    return LoraFile(layout, pairs, metadata)


def _layout_of(path: Path, tensors: dict) -> tuple[str, str, str]:
    for layout, down, up in (KOHYA, DIFFUSERS):
        if any(k.endswith(down) for k in tensors):
            return layout, down, up
    example = next(iter(tensors), "(none)")
    raise InputFileError(f"{path}: no LoRA tensors in a known layout (kohya '.lora_down.weight' or diffusers "
                         f"'.lora_A.weight'); first key {example!r}")


def _component(name: str) -> str:
    return name.split(".", 1)[0]


def _metadata_alphas(metadata: dict[str, str]) -> dict[str, float]:
    """component -> lora_alpha from diffusers' `lora_adapter_metadata` (written by save_lora_weights)."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    alphas = {}
    for key, value in parsed.items():  # "unet.lora_alpha": 8, "text_encoder.r": 4, ...
        component, _, field = key.rpartition(".")
        if field == "lora_alpha" and component:
            alphas[component] = float(value)
    return alphas


def write_lora_file(path: str | Path, layout: str, pairs: dict[str, Pair], metadata: dict[str, str] | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write pairs under their file names in `layout`, so that every loader applies the same strength: kohya's
    layout with an `.alpha` tensor (float32) per module; the diffusers layout with the scale multiplied into the up
    matrices and no alpha at all (diffusers then uses alpha = rank, and so does ComfyUI without an alpha tensor).
    Atomic: a reader never sees half a file."""
    from safetensors.torch import save_file

    from ot_dist.checkpoint.export import atomic_path

    kohya = layout == "kohya"
    _, down_suffix, up_suffix = KOHYA if kohya else DIFFUSERS
    tensors = {}
    for name in sorted(pairs):
        pair = pairs[name]
        down, up = pair.down, pair.up if kohya else pair.up.float() * pair.scale
        if dtype is not None:
            down, up = down.to(dtype), up.to(dtype)
        tensors[name + down_suffix] = down.contiguous()
        tensors[name + up_suffix] = up.contiguous()
        if kohya:
            tensors[name + ALPHA] = torch.tensor(float(pair.alpha if pair.alpha is not None else pair.rank))
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(sorted((metadata or {}).items())))
    return path
