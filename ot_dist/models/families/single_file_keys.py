"""A small engine for key maps between diffusers state dicts and original single-file layouts.

A family describes its layout as a list of `Rule`s built from the diffusers config: each rule names
ONE key of the original file and the diffusers key(s) it is made of. The same list drives both
directions, so `to_original` and `from_original` are exact inverses by construction (the values are
moved, split and concatenated, never recomputed), and the same list gives the expected file header
for `check_header` (the rules applied to a meta-device model: shapes without memory).

Used by `flux_single_file` (Flux.1, Chroma), `sd3_single_file` (SD3 / 3.5 and their VAE) and
`qwen_image_single_file` (an identity map: ComfyUI's Qwen-Image keys are diffusers'), among others. A family whose
file is its transformer alone, read and written with the engine's plain calls, states that once as a
`TransformerFileLayout` (class, rules, name, input prefixes) instead of writing the four calls out again.
Besides torch and diffusers it depends only on `ot_dist.errors`.
"""

from __future__ import annotations

import inspect
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ot_dist.errors import InputFileError

Tensor = torch.Tensor

SAME, CAT, SWAP, CONV1X1, FLAT = "same", "cat", "swap", "conv1x1", "flat"
_MAX_NAMED = 6  # keys named per category in a message; the rest are counted


class KeyLayoutError(ValueError):
    """A state dict does not have the keys (or shapes) of the layout it is being converted from."""


@dataclass(frozen=True)
class Rule:
    """original key <- diffusers key(s).

    kinds:
      same     one tensor, renamed;
      cat      the diffusers pieces concatenated along dim 0 in order (fused qkv, Flux's linear1);
               `sizes` are the rows of each piece, -1 for "whatever is left" (Flux's MLP part);
      swap     one tensor whose two halves along dim 0 trade places (the original final
               AdaLayerNorm emits shift, scale; diffusers' AdaLayerNormContinuous scale, shift);
      conv1x1  a Linear weight (out, in) that the original stores as a 1x1 conv (out, in, 1, 1);
      flat     a table of `sizes[0]` rows that the original stores flattened (Krea 2's per-block modulation).
    """

    original: str
    diffusers: tuple[str, ...]
    kind: str = SAME
    sizes: tuple[int, ...] = ()


def module_rules(original: str, diffusers: str | Sequence[str], kind: str = SAME, sizes: Sequence[int] = ()):
    """Rules for the weight and bias of one (possibly fused) module."""
    pieces = (diffusers,) if isinstance(diffusers, str) else tuple(diffusers)
    return [
        # A 1x1 conv's bias is already 1-D: only its weight changes shape.
        Rule(
            f"{original}.{p}",
            tuple(f"{d}.{p}" for d in pieces),
            SAME if kind == CONV1X1 and p != "weight" else kind,
            tuple(sizes),
        )
        for p in ("weight", "bias")
    ]


def full_config(cls: type, config: Any) -> dict:
    """The diffusers config with the class's own defaults filled in (a partial dict is accepted)."""
    params = inspect.signature(cls.__init__).parameters
    merged = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    given = dict(config) if isinstance(config, Mapping) else vars(config)
    # Only the constructor's arguments: saved configs also carry _class_name, _diffusers_version, ...
    merged.update((k, v) for k, v in given.items() if k in params)
    return merged


# Keys that only ComfyUI's quantized files have (comfy/utils.py convert_old_quants: a `scaled_fp8` marker and per layer
# `.scale_weight` / `.scale_input`; its newer mixed-precision files: `.weight_scale`, `.input_scale`, `.comfy_quant`).
_QUANTIZATION_SUFFIXES = ("scaled_fp8", ".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")


def quantization_hint(unexpected: Iterable[str]) -> str:
    """Why a file of the right model has keys too many, when they are ComfyUI's fp8 scales (its `*_fp8_scaled` files)."""
    if any(k.endswith(_QUANTIZATION_SUFFIXES) for k in unexpected):
        return (" (the extra keys are ComfyUI's scaled-fp8 quantization, which ot_dist does not read: train from the "
                "unquantized bf16 / fp16 / fp32 file)")
    return ""


def _names(keys: Sequence[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_NAMED])
    return shown + (f" and {len(keys) - _MAX_NAMED} more" if len(keys) > _MAX_NAMED else "")


def _check_keys(what: str, missing: list[str], unexpected: list[str]) -> None:
    parts = [f"missing {_names(missing)}"] if missing else []
    parts += [f"unexpected {_names(unexpected)}"] if unexpected else []
    if parts:
        raise KeyLayoutError(f"{what} does not match the config: " + "; ".join(parts))


# ----------------------------------------------------------------------------------------------
# conversion
# ----------------------------------------------------------------------------------------------


def to_original(state: Mapping[str, Tensor], rules: Iterable[Rule], prefix: str = "") -> dict[str, Tensor]:
    """diffusers state dict -> original keys (with `prefix`). Every key must be covered by a rule."""
    rules = list(rules)
    covered = {k for r in rules for k in r.diffusers}
    missing = [k for k in covered if k not in state]
    unexpected = [k for k in state if k not in covered]
    _check_keys("the diffusers state dict", missing, unexpected)
    out: dict[str, Tensor] = {}
    for r in rules:
        pieces = [state[k] for k in r.diffusers]
        if r.kind == CAT:
            for k, t, n in zip(r.diffusers, pieces, r.sizes):
                if n != -1 and t.shape[0] != n:
                    raise KeyLayoutError(f"{k} has {t.shape[0]} rows, the config says {n}")
            value = torch.cat(pieces, dim=0)
        elif r.kind == SWAP:
            a, b = pieces[0].chunk(2, dim=0)
            value = torch.cat([b, a], dim=0)
        elif r.kind == CONV1X1:
            value = pieces[0].reshape(*pieces[0].shape, 1, 1)
        elif r.kind == FLAT:
            value = pieces[0].reshape(-1)
        else:
            value = pieces[0]
        out[prefix + r.original] = value
    return out


def strip_prefix(
    state: Mapping[str, Any], prefixes: Sequence[str], bare_ok: bool = True
) -> tuple[str, dict[str, Any]]:
    """(prefix found, the entries under it with the prefix removed).

    A file that uses one of `prefixes` may hold other components beside (VAE, text encoders under
    their own prefixes): only the entries under the prefix belong to this model. A file without any
    of them is taken whole (Black Forest Labs' bare keys), unless `bare_ok` is false (a component
    that must sit under its prefix, like the VAE of a full file): then it holds nothing of this model.
    """
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in state):
            return prefix, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    return ("", dict(state)) if bare_ok else (prefixes[0], {})


def from_original(
    state: Mapping[str, Tensor], rules: Iterable[Rule], prefixes: Sequence[str] = ()
) -> dict[str, Tensor]:
    """original state dict -> diffusers keys. Split pieces are views of the fused tensor (no copy):
    `.clone()` them before saving with safetensors, which refuses tensors that share memory."""
    rules = list(rules)
    prefix, state = strip_prefix(state, prefixes)
    wanted = {r.original for r in rules}
    missing = [prefix + k for k in wanted if k not in state]
    unexpected = [prefix + k for k in state if k not in wanted]
    _check_keys("the checkpoint", missing, unexpected)
    out: dict[str, Tensor] = {}
    for r in rules:
        value = state[r.original]
        if r.kind == CAT:
            sizes = list(r.sizes)
            known = sum(n for n in sizes if n != -1)
            if -1 in sizes:
                sizes[sizes.index(-1)] = value.shape[0] - known
            if value.shape[0] != sum(sizes) or min(sizes) < 0:
                expects = " + ".join(map(str, r.sizes))
                raise KeyLayoutError(f"{prefix}{r.original} has {value.shape[0]} rows; the config expects {expects}")
            out.update(zip(r.diffusers, value.split(sizes, dim=0)))
        elif r.kind == SWAP:
            a, b = value.chunk(2, dim=0)
            out[r.diffusers[0]] = torch.cat([b, a], dim=0)
        elif r.kind == CONV1X1:
            out[r.diffusers[0]] = value.reshape(value.shape[:2]) if value.ndim == 4 else value
        elif r.kind == FLAT:
            out[r.diffusers[0]] = value.reshape(r.sizes[0], -1)
        else:
            out[r.diffusers[0]] = value
    return out


# ----------------------------------------------------------------------------------------------
# header validation
# ----------------------------------------------------------------------------------------------


def meta_state_dict(cls: type, config: Mapping) -> dict[str, Tensor]:
    """The state dict of `cls(**config)` on the meta device: every name and shape, no memory."""
    with torch.device("meta"):
        model = cls.from_config(config)
    return model.state_dict()


def expected_header(cls: type, config: Mapping, rules: Iterable[Rule]) -> dict[str, tuple[int, ...]]:
    """original key -> shape that a file for this config must have (prefix not included)."""
    return {k: tuple(v.shape) for k, v in to_original(meta_state_dict(cls, config), rules).items()}


@dataclass
class HeaderReport:
    """What a file's header lacks, has in excess, or has in the wrong shape (names as in the file)."""

    what: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    # (name, found, expected)
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    looks_like: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape)

    def message(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"missing {len(self.missing)} key(s): {_names(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected {len(self.unexpected)} key(s): {_names(self.unexpected)}")
        if self.wrong_shape:
            shown = ", ".join(f"{n} is {list(f)}, expected {list(e)}" for n, f, e in self.wrong_shape[:_MAX_NAMED])
            more = len(self.wrong_shape) - _MAX_NAMED
            parts.append(f"wrong shape: {shown}" + (f" and {more} more" if more > 0 else ""))
        text = f"not a {self.what} checkpoint for this config: " + "; ".join(parts)
        if self.looks_like and self.looks_like != self.what:
            text += f" (the keys look like a {self.looks_like} checkpoint)"
        return text + quantization_hint(self.unexpected)

    def raise_if_bad(self, path: str | Path | None = None) -> None:
        if not self.ok:
            raise InputFileError((f"{path}: " if path else "") + self.message())


def check_header(
    header: Mapping[str, Sequence[int]],
    expected: Mapping[str, tuple[int, ...]],
    what: str,
    prefixes: Sequence[str] = (),
    bare_ok: bool = True,
) -> HeaderReport:
    """Compare a file's names -> shapes with the expected ones, before reading any tensor."""
    prefix, found = strip_prefix(header, prefixes, bare_ok)
    report = HeaderReport(what, looks_like=guess_layout(header))
    report.missing = [prefix + k for k in expected if k not in found]
    report.unexpected = [prefix + k for k in found if k not in expected]
    report.wrong_shape = [
        (prefix + k, tuple(s), expected[k]) for k, s in found.items() if k in expected and tuple(s) != expected[k]
    ]
    return report


# One key that only a given layout has (with or without ComfyUI's model.diffusion_model.).
_SIGNATURES = (
    ("Chroma", "distilled_guidance_layer.in_proj.weight"),
    ("Flux.1", "double_blocks.0.img_mod.lin.weight"),
    ("SD3", "joint_blocks.0.x_block.attn.qkv.weight"),
    ("Qwen-Image", "txt_norm.weight"),  # comfy/model_detection.py's Qwen-Image key
    ("Krea 2", "txtfusion.projector.weight"),  # diffusers' single_file_utils CHECKPOINT_KEY_NAMES["krea2"]
    ("SD 1.x / 2.x / SDXL UNet", "input_blocks.0.0.weight"),
)


def guess_layout(header: Mapping[str, Any]) -> str | None:
    for name, key in _SIGNATURES:
        if key in header or "model.diffusion_model." + key in header:
            return name
    return None


def read_safetensors_header(path: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from a .safetensors file's JSON header (8-byte little-endian length, then JSON);
    no tensor is read."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:  # real headers are a few MB at most
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such file") from None
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise InputFileError(f"{path}: not a readable .safetensors file ({e})") from None


# ----------------------------------------------------------------------------------------------
# one family's transformer file
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerFileLayout:
    """A transformer's single file whose layout is `rules(config)` alone: the conversions both ways, the header check
    and the file check, all driven by that one key map. `name` is the model as messages call it ("Flux.1"); the file
    may hold its keys bare or under one of `input_prefixes` (ComfyUI's model.diffusion_model.)."""

    model_class: type
    rules: Callable[[Any], list[Rule]]
    name: str
    input_prefixes: tuple[str, ...] = ()

    def to_original(self, state: Mapping[str, Tensor], config: Any, prefix: str = "") -> dict[str, Tensor]:
        """diffusers state dict -> the original keys (bare, or under `prefix`). Every key must be one the config's
        model has."""
        return to_original(state, self.rules(config), prefix)

    def from_original(self, state: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
        """The original keys (bare or under an input prefix) -> diffusers; other components' keys are ignored."""
        return from_original(state, self.rules(config), self.input_prefixes)

    def expected_header(self, config: Any) -> dict[str, tuple[int, ...]]:
        cfg = full_config(self.model_class, config)
        return expected_header(self.model_class, cfg, self.rules(cfg))

    def check_header(self, header: Mapping[str, Sequence[int]], config: Any) -> HeaderReport:
        """Which keys of a file (names -> shapes) are missing / unexpected / wrong-shaped for `config`."""
        return check_header(header, self.expected_header(config), self.name, self.input_prefixes)

    def validate(self, path: str | Path, config: Any) -> None:
        """InputFileError naming the file and the offending keys unless its header fits `config`."""
        self.check_header(read_safetensors_header(path), config).raise_if_bad(path)
