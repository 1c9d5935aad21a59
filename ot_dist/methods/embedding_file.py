"""`embedding.init_from`: start the textual-inversion vectors from an existing embedding file.

The layouts users have, all read from .safetensors only (a .pt / .bin is a pickle, which can run code when loaded:
refused, as everywhere in ot_dist):
- per encoder key (SDXL / SD3 / Flux / Chroma / PixArt / Stable Cascade): `clip_l` / `clip_g` / `t5` tensors
  (ot_dist's export, A1111 / Forge's SDXL layout, ComfyUI's embed_key, OneTrainer's); where the file lacks a key, a
  copy the family names (`t5xxl`, ComfyUI's T5 key); an encoder the family lets a file lack (SD3's and Flux's T5 in
  a CLIP-only file) is left out of the result and starts from init_text;
- one encoder (SD 1.x / 2.x), the first key that is present of: `clip_l` (ComfyUI's embed_key for SD 1.x),
  `emp_params` (OneTrainer), `string_to_param.*` (A1111's {'string_to_param': {'*': tensor}} written flat, as
  safetensors holds it), otherwise the file's only tensor (diffusers' {TOKEN: tensor}, ot_dist's own export).
A 1-D tensor is one vector (A1111 / Forge unsqueeze it). The file decides the vector count.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.models.families.base import EMBEDDING_TOKEN_KEY

SINGLE_ENCODER_KEYS = ("clip_l", "emp_params", "string_to_param.*")


def _open(path: str | Path):
    path = Path(path).expanduser()
    if path.suffix.lower() != ".safetensors":
        raise ConfigError(f"embedding.init_from: {path} is not a .safetensors file; .pt / .bin embeddings are Python "
                          "pickles, which can run code when loaded (convert it to .safetensors first)")
    if not path.is_file():
        raise InputFileError(f"embedding.init_from: {path} is not a file (an embedding .safetensors to start from)")
    return path, safe_open(str(path), framework="pt")


def _key_for(keys: list[str], family_key: str, path: Path, copies: tuple[str, ...] = (),
             optional: bool = False) -> str | None:
    """The file's key holding the vectors of the encoder whose exported key is `family_key` (or one of its `copies`);
    None for an `optional` encoder the file has no vectors for."""
    if family_key != EMBEDDING_TOKEN_KEY:
        for key in (family_key, *copies):
            if key in keys:
                return key
        if optional:
            return None
        raise ConfigError(f"embedding.init_from: {path} has no {family_key!r} tensor (it has {sorted(keys)})")
    for key in SINGLE_ENCODER_KEYS:
        if key in keys:
            return key
    if len(keys) == 1:
        return keys[0]
    raise ConfigError(f"embedding.init_from: {path} has {sorted(keys)}: expected one of {list(SINGLE_ENCODER_KEYS)} "
                      "or a single tensor")


def _as_vectors(shape: list[int]) -> tuple[int, int] | None:
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    return None


def read_embedding_file(path: str | Path, family_keys: dict[str, str], widths: dict[str, int] | None = None,
                        copies: dict[str, tuple[str, ...]] | None = None,
                        optional: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """{encoder name: float32 [vectors, width]} for each encoder of `family_keys` (encoder -> exported key) the file
    has vectors for. `widths` (encoder -> token embedding width) checks the shapes; without it only the header is read
    for the count (`vector_count`). `copies` (exported key -> other keys read where it is missing) and `optional`
    (encoders the file may lack): the family's embedding_key_copies and embedding_keys_optional."""
    path, handle = _open(path)
    with handle as f:
        keys = list(f.keys())
        found = {name: _key_for(keys, key, path, (copies or {}).get(key, ()), name in optional)
                 for name, key in family_keys.items()}
        found = {name: key for name, key in found.items() if key is not None}
        if not found:
            raise ConfigError(f"embedding.init_from: {path} has {sorted(keys)}: none of "
                              f"{sorted(family_keys.values())}")
        shapes = {name: _as_vectors(f.get_slice(key).get_shape()) for name, key in found.items()}
        for name, shape in shapes.items():
            width = (widths or {}).get(name)
            if shape is None or (width is not None and shape[1] != width):
                raw = f.get_slice(found[name]).get_shape()
                raise ConfigError(f"embedding.init_from: {path} key {found[name]!r} has shape {raw}; the {name} "
                                  f"takes [vectors, {width or 'width'}]")
        counts = {shape[0] for shape in shapes.values()}
        if len(counts) > 1:
            raise ConfigError(f"embedding.init_from: {path} has different vector counts per encoder: "
                              + ", ".join(f"{found[n]} {s[0]}" for n, s in shapes.items()))
        if widths is None:
            return {name: torch.empty(shape) for name, shape in shapes.items()}
        return {name: f.get_tensor(key).float().reshape(shapes[name]) for name, key in found.items()}


def vector_count(path: str | Path, family, configured: int | None) -> int:
    """The file's vector count for `family` (its embedding keys); `configured` (embedding.vectors when the config sets
    it) must equal it."""
    count = next(iter(read_family_file(path, family).values())).shape[0]
    if configured is not None and configured != count:
        raise ConfigError(f"embedding.vectors: {configured}, but embedding.init_from {path} holds {count} vectors "
                          "(leave vectors out: the file sets it)")
    return count


def read_family_file(path: str | Path, family, widths: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """`read_embedding_file` with the family's embedding keys, their copies and the encoders a file may lack."""
    return read_embedding_file(path, family.embedding_keys, widths, family.embedding_key_copies,
                               family.embedding_keys_optional)
