"""A LoRA file as (file module name -> Pair), whatever layout it was written in, and back.

Layouts read:
- kohya (ComfyUI, A1111 / Forge, kohya's scripts, ot_dist's default for SD families): `<name>.lora_down.weight`,
  `<name>.lora_up.weight`, optional `<name>.alpha`. Without an alpha tensor a loader applies the change at
  alpha = rank (strength 1.0), which is what `Pair.scale` returns then.
- diffusers / peft: `<component>.<module path>.lora_A.weight` / `.lora_B.weight`, alpha from an `.alpha` tensor
  when present (ComfyUI reads it), else from the adapter metadata diffusers writes (`lora_adapter_metadata`),
  else alpha = rank. ot_dist's files of T5 families name their T5-XXL modules kohya-style in this layout
  (`lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_A.weight` + `.alpha`); the name is kept as it is.
The variants (ot_dist/methods/lora_variants.py), in either layout: DoRA (`.dora_scale`, or peft's
`.lora_magnitude_vector`, beside the down / up pair), LoHa (`.hada_w1_a` / `_b`, `.hada_w2_a` / `_b`), LoKr
(`.lokr_w1` or `.lokr_w1_a` / `_b`, `.lokr_w2` or `.lokr_w2_a` / `_b`), OFT (`.oft_blocks`, 3-d: LyCORIS' diag-oft,
ot_dist's oft; its `.alpha` is a constraint), each with an optional `.alpha`. Only
`ot-dist lora merge` applies them (`read_lora_file(path, variants=VARIANTS)`); the other tools take plain LoRA and
refuse a variant naming it. Anything else (old diffusers attention-processor files, Tucker / CP factors
`hada_t1` / `lokr_t2` / `lora_mid`) is refused naming a key: merging it as plain LoRA would silently apply the wrong
change."""

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
    magnitude: torch.Tensor | None = None  # DoRA: the magnitude (dora_scale), [out, 1, ...] or [1, in, ...]

    @property
    def variant(self) -> str:
        return "lora" if self.magnitude is None else "dora"

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

    def merged(self, weight: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
        """The module's weight with the change applied at `strength` (float32). DoRA: weight + strength x
        (magnitude x (W + delta) / ||W + delta|| - W), as ComfyUI applies a strength."""
        delta = self.delta()
        if self.magnitude is None:
            return weight.float() + strength * delta
        from ot_dist.lora_tools.variant_changes import dora_weight

        return weight.float() + strength * (dora_weight(weight, delta, self.magnitude) - weight.float())


@dataclass
class LoraFile:
    layout: str  # "kohya" or "diffusers"
    pairs: dict[str, Pair]  # file module name ("lora_unet_..." or "unet.down_blocks...") -> its pair
    metadata: dict[str, str]


ALL_VARIANTS = ("lora", "dora", "loha", "lokr", "oft")
DORA_SUFFIXES = (".dora_scale", ".lora_magnitude_vector.weight", ".lora_magnitude_vector")
HADA = tuple(f".hada_{n}" for n in ("w1_a", "w1_b", "w2_a", "w2_b"))
LOKR = tuple(f".lokr_{n}" for n in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b"))
OFT = ".oft_blocks"
FULL_DIFFS = (".diff", ".diff_b")  # ComfyUI's LoraSave: a weight's / bias's whole difference, no low-rank pair


def read_lora_file(path: str | Path, variants: tuple[str, ...] = ("lora",), tool: str = "this tool") -> LoraFile:
    """The file's modules. `variants`: the ones the caller can apply; a file of another variant is refused naming it
    and `tool`."""
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
    alphas = _metadata_alphas(metadata) if layout == "diffusers" else {}
    pairs, known = {}, set()

    def alpha_of(name):
        alpha_tensor = tensors.get(name + ALPHA)
        known.add(name + ALPHA)
        return float(alpha_tensor) if alpha_tensor is not None else alphas.get(_component(name))

    for name in sorted(k[: -len(down_suffix)] for k in tensors if k.endswith(down_suffix)):
        up = tensors.get(name + up_suffix)
        if up is None:
            raise InputFileError(f"{path}: {name}{down_suffix} has no {name}{up_suffix}")
        magnitude = next((tensors[name + s] for s in DORA_SUFFIXES if name + s in tensors), None)
        if magnitude is not None and name + DORA_SUFFIXES[0] not in tensors:
            # peft's magnitude is per output row always ([out], or [1, out, 1, 1] for a conv): as a dora_scale
            magnitude = magnitude.reshape(-1, *[1] * (tensors[name + down_suffix].dim() - 1))
        known.update(name + s for s in (down_suffix, up_suffix, *DORA_SUFFIXES))
        pairs[name] = Pair(tensors[name + down_suffix], up, alpha_of(name), magnitude)
    for name in sorted(k[: -len(HADA[0])] for k in tensors if k.endswith(HADA[0])):
        from ot_dist.lora_tools.variant_changes import Hadamard

        missing = [name + s for s in HADA if name + s not in tensors]
        if missing:
            raise InputFileError(f"{path}: LoHa module {name} lacks {missing[0]}")
        known.update(name + s for s in HADA)
        pairs[name] = Hadamard(*(tensors[name + s] for s in HADA), alpha_of(name))
    for name in sorted({k.rsplit(".lokr_", 1)[0] for k in tensors if k.rsplit(".", 1)[-1] in [s[1:] for s in LOKR]}):
        from ot_dist.lora_tools.variant_changes import Kronecker

        factors = [tensors.get(name + s) for s in LOKR]
        w1, w1_a, w1_b, w2, w2_a, w2_b = factors
        if (w1 is None and (w1_a is None or w1_b is None)) or (w2 is None and (w2_a is None or w2_b is None)):
            raise InputFileError(f"{path}: LoKr module {name} lacks lokr_w1 (or lokr_w1_a / _b) or lokr_w2 (or _a / _b)")
        known.update(name + s for s in LOKR)
        pairs[name] = Kronecker(*factors, alpha_of(name))
    for name in sorted(k[: -len(OFT)] for k in tensors if k.endswith(OFT) and tensors[k].dim() == 3):
        from ot_dist.lora_tools.variant_changes import Orthogonal

        known.add(name + OFT)
        pairs[name] = Orthogonal(tensors[name + OFT], alpha_of(name))
    unknown = sorted(set(tensors) - known)
    full_diffs = [k for k in unknown if k.endswith(FULL_DIFFS)]
    if full_diffs:
        raise InputFileError(f"{path}: tensor {full_diffs[0]!r} (and {len(full_diffs) - 1} more) is a whole weight "
                             "or bias difference (.diff / .diff_b), as ComfyUI's \"Extract and Save Lora\" node "
                             "writes with bias_diff on (its default) or lora_type full_diff; ot-dist's LoRA tools "
                             "apply low-rank pairs only: extract with bias_diff off and lora_type standard there, or "
                             "with ot-dist lora extract")
    if unknown:
        raise InputFileError(f"{path}: tensor {unknown[0]!r} (and {len(unknown) - 1} more) is not a LoRA / DoRA / LoHa / "
                             "LoKr / OFT tensor this tool reads (Tucker factors, an older layout): not supported here")
    found = sorted({change.variant for change in pairs.values()})
    refused = [v for v in found if v not in variants]
    if refused:
        raise InputFileError(f"{path}: a {refused[0]} file ({refused[0]} tensors, e.g. "
                             f"{next(n for n, c in pairs.items() if c.variant == refused[0])!r}); {tool} takes "
                             f"{' / '.join(variants)} only" + ("" if "loha" in variants else
                                                               " (ot-dist lora merge applies every variant)"))
    return LoraFile(layout, pairs, metadata)


def _layout_of(path: Path, tensors: dict) -> tuple[str, str, str]:
    for layout, down, up in (KOHYA, DIFFUSERS):
        if any(k.endswith(down) for k in tensors):
            return layout, down, up
    names = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(HADA + LOKR + (OFT,))}
    # LoHa / LoKr / OFT: kohya names have no dots (lora_unet_..., lycoris_...), diffusers ones do (unet.<path>)
    if names:
        return ("diffusers", *DIFFUSERS[1:]) if any("." in n for n in names) else ("kohya", *KOHYA[1:])
    example = next(iter(tensors), "(none)")
    raise InputFileError(f"{path}: no LoRA tensors in a known layout (kohya '.lora_down.weight' or diffusers "
                         f"'.lora_A.weight', LoHa '.hada_w1_a', LoKr '.lokr_w1'); first key {example!r}")


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


def shared_alpha(pairs: dict[str, Pair]) -> float:
    """The one alpha a kohya-layout file written by `write_lora_file` gives every module: the most common one."""
    from collections import Counter

    alphas = [float(pair.alpha if pair.alpha is not None else pair.rank) for pair in pairs.values()]
    return Counter(alphas).most_common(1)[0][0] if alphas else 1.0


def write_lora_file(path: str | Path, layout: str, pairs: dict[str, Pair], metadata: dict[str, str] | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write pairs under their file names in `layout`, so that every loader applies the same strength: kohya's
    layout with an `.alpha` tensor (float32) per module; the diffusers layout with the scale multiplied into the up
    matrices and no alpha at all (diffusers then uses alpha = rank, and so does ComfyUI without an alpha tensor).
    In kohya's layout every module gets the same alpha (the most common one; a module whose own alpha differs has
    alpha / that alpha multiplied into its up matrix): diffusers' kohya loader applies one alpha to every module
    (peft_utils `get_peft_kwargs` builds its per-module alpha_pattern under names peft does not match, so a module of
    another alpha, e.g. an extracted module whose full rank is below --rank, would get the wrong scale).
    Atomic: a reader never sees half a file."""
    from safetensors.torch import save_file

    from ot_dist.checkpoint.export import atomic_path

    kohya = layout == "kohya"
    _, down_suffix, up_suffix = KOHYA if kohya else DIFFUSERS
    alphas = {name: float(pair.alpha if pair.alpha is not None else pair.rank) for name, pair in pairs.items()}
    common = shared_alpha(pairs)
    tensors = {}
    for name in sorted(pairs):
        pair = pairs[name]
        if kohya:
            up = pair.up if alphas[name] == common else pair.up.float() * (alphas[name] / common)
        else:
            up = pair.up.float() * pair.scale
        down = pair.down
        if dtype is not None:
            down, up = down.to(dtype), up.to(dtype)
        tensors[name + down_suffix] = down.contiguous()
        tensors[name + up_suffix] = up.contiguous()
        if kohya:
            tensors[name + ALPHA] = torch.tensor(common)
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(sorted((metadata or {}).items())))
    return path
