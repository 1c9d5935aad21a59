"""Other trainers' LoRA names, resolved onto the model's own modules for `ot-dist lora merge` and `lora.init_from`.

A file whose module names are not the family's own (ot_dist/lora_tools/matching.py) is read through the names other
trainers give the same modules, as the family declares them (no family is named here):
- `Family.lora_foreign_prefixes`: `<prefix>_<diffusers module path with "_">` per component (OneTrainer's
  `lora_transformer_transformer_blocks_0_attn_to_q`, `lora_te1_text_model_encoder_layers_0_self_attn_q_proj`);
- `Family.lora_original_prefixes` with `Family.denoiser_original_rules`: the denoiser's modules by their original
  single-file paths (kohya sd-scripts' `lora_unet_double_blocks_0_img_attn_qkv`, ComfyUI's
  `diffusion_model.double_blocks.0.img_attn.qkv`). A fused original module (Flux's q|k|v, `linear1` =
  q|k|v|MLP, SD3's qkv) is split by output rows onto the diffusers modules: each gets the file's down matrix and
  its rows of the up matrix, so up_i @ down is exactly the rows of the fused change. A "swap" module (the final
  AdaLayerNorm: shift, scale in the original, scale, shift in diffusers) gets its up matrix's halves exchanged.
  kohya's `split_qkv` files concatenate q / k / v LoRAs of rank r each into one rank-3r pair with a block-diagonal
  up matrix; such a pair is split back into the three rank-r pairs (as diffusers' own converter does).
The result is the file in the family's own diffusers-layout names, at the same change per module (alpha / rank kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_dist.errors import InputFileError
from ot_dist.lora_tools.files import LoraFile, Pair
from ot_dist.lora_tools.matching import Target, adaptable_modules, module_index
from ot_dist.methods.lora_layouts import KohyaNames


@dataclass(frozen=True)
class Piece:
    """One model module that a file module covers: rows [start, stop) of the file module's output, halves swapped."""

    target: Target
    start: int
    stop: int
    swap: bool = False


def own_index(model, layout: str, parts) -> dict[str, Target]:
    try:
        return module_index(model, layout, parts)
    except InputFileError:  # no kohya names of its own (transformer families)
        return {}


def foreign_index(model, parts: dict[str, torch.nn.Module]) -> dict[str, tuple[Piece, ...]]:
    """Other trainers' module name -> the model modules (row ranges) it covers, for the parts given."""
    from ot_dist.models.families.single_file_keys import CAT, SWAP

    family = model.family
    index: dict[str, tuple[Piece, ...]] = {}
    for part, prefixes in family.lora_foreign_prefixes.items():
        if part not in parts:
            continue
        root = family.lora_file_roots.get(part, "")
        if root in dict(parts[part].named_children()):
            root = ""
        for prefix in prefixes:
            names = KohyaNames(prefix, root)
            for path, module in adaptable_modules(parts[part]).items():
                rows = module.weight.shape[0]
                index[names.module_name(path)] = (Piece(Target(part, path, module), 0, rows),)
    denoiser = family.denoiser
    if family.lora_original_prefixes and denoiser in parts:
        modules = adaptable_modules(parts[denoiser])
        config = model.part(denoiser).config
        for rule in family.denoiser_original_rules(config):
            if not rule.original.endswith(".weight"):
                continue
            paths = [d[: -len(".weight")] for d in rule.diffusers]
            if not all(p in modules for p in paths):
                continue  # norms' scales and other non-adaptable weights
            pieces, start = [], 0
            for path in paths:
                rows = modules[path].weight.shape[0]
                pieces.append(Piece(Target(denoiser, path, modules[path]), start, start + rows, rule.kind == SWAP))
                start += rows
            if rule.kind not in (CAT, SWAP) and len(pieces) != 1:
                continue
            original = rule.original[: -len(".weight")]
            for prefix, separator in family.lora_original_prefixes:
                index[f"{prefix}{separator}{original.replace('.', separator)}"] = tuple(pieces)
    return index


def in_family_names(model, lora: LoraFile, source: str, parts: dict[str, torch.nn.Module] | None = None) -> LoraFile:
    """The file with every module under the model's own diffusers-layout name, where it has another trainer's name;
    unchanged when all its names are the family's own. Names no index knows are kept (the caller reports them)."""
    family = model.family
    if not family.lora_foreign_prefixes and not family.lora_original_prefixes:
        return lora
    parts = parts if parts is not None else model.parts()
    own = own_index(model, lora.layout, parts)
    if all(name in own for name in lora.pairs):
        return lora
    canonical: dict[str, str] = {}  # "part.path" -> the family's own diffusers-layout name
    diffusers_index = own_index(model, "diffusers", parts)
    for name, target in diffusers_index.items():
        canonical.setdefault(f"{target.part}.{target.path}", name)
    foreign = foreign_index(model, parts)
    pairs: dict[str, object] = {}
    origin: dict[str, str] = {}

    def put(name: str, change, from_name: str) -> None:
        if name in pairs:
            raise InputFileError(f"{source}: {from_name!r} and {origin[name]!r} both change {name!r}")
        pairs[name], origin[name] = change, from_name

    for name, change in lora.pairs.items():
        target = own.get(name) or diffusers_index.get(name)
        if target is not None:
            put(canonical[f"{target.part}.{target.path}"], change, name)
        elif name in foreign:
            for piece, pair in split(name, change, foreign[name], source):
                put(canonical[f"{piece.target.part}.{piece.target.path}"], pair, name)
        else:
            put(name, change, name)
    return LoraFile("diffusers", pairs, lora.metadata)


def split(name: str, change, pieces: tuple[Piece, ...], source: str) -> list[tuple[Piece, object]]:
    """(piece, its change) for each model module a file module covers."""
    whole = len(pieces) == 1 and not pieces[0].swap
    if whole and (not isinstance(change, Pair) or change.down.dim() == pieces[0].target.module.weight.dim()):
        return [(pieces[0], change)]
    if not isinstance(change, Pair) or change.magnitude is not None:
        raise InputFileError(f"{source}: {name} is a {change.variant} module of a fused original module; only plain "
                             "LoRA can be split onto the diffusers modules")
    down, up = change.down, change.up
    if pieces[0].target.module.weight.dim() == 2:  # an original 1x1 conv that diffusers holds as a Linear
        down, up = down.flatten(1), up.flatten(1)
    if up.shape[0] != pieces[-1].stop:
        raise InputFileError(f"{source}: {name} changes {up.shape[0]} output rows, the model's modules have "
                             f"{pieces[-1].stop}: another model's LoRA?")
    scale = change.scale
    blocks = _diagonal_blocks(up, pieces, change.rank)
    out = []
    for i, piece in enumerate(pieces):
        rows = up[piece.start:piece.stop]
        if piece.swap:
            first, second = rows.chunk(2, dim=0)
            rows = torch.cat([second, first], dim=0)
        piece_down = down
        if blocks:
            rows, piece_down = rows[:, blocks * i: blocks * (i + 1)], down[blocks * i: blocks * (i + 1)]
        # the same alpha / rank as the file's module, at the piece's own rank
        out.append((piece, Pair(piece_down, rows, scale * piece_down.shape[0])))
    return out


def _diagonal_blocks(up: torch.Tensor, pieces: tuple[Piece, ...], rank: int) -> int:
    """The rank of each block when the up matrix is block-diagonal over the pieces (kohya's split_qkv), else 0."""
    n = len(pieces)
    if n < 2 or rank % n:
        return 0
    size = rank // n
    for i, piece in enumerate(pieces):
        rows = up[piece.start:piece.stop]
        outside = torch.cat([rows[:, : size * i], rows[:, size * (i + 1):]], dim=1)
        if outside.numel() and bool(outside.abs().max() > 0):
            return 0
    return size
