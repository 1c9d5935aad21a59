"""One byte layout per content for the .safetensors files we export.

safetensors (0.8, Rust) writes the `__metadata__` map of the header in hash-map order, which changes from one
process to the next: the same LoRA written by training and by `ot-dist export` differed in its first bytes. The
header is rewritten with the metadata keys sorted and the tensors in data order; the tensor bytes are not touched
(offsets are relative to the end of the header), and the file stays a valid safetensors file for every reader.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

ALIGNMENT = 8  # safetensors pads the header with spaces to this multiple


def canonical_header(raw: bytes, extra_metadata: dict[str, str] | None = None) -> bytes:
    header = json.loads(raw)
    ordered = {}
    if "__metadata__" in header or extra_metadata:
        metadata = {**(header.pop("__metadata__", None) or {}), **(extra_metadata or {})}
        ordered["__metadata__"] = dict(sorted(metadata.items()))
    ordered.update(sorted(header.items(), key=lambda item: (item[1]["data_offsets"], item[0])))
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % ALIGNMENT)


def make_canonical(path: str | Path, extra_metadata: dict[str, str] | None = None) -> None:
    """Rewrite one .safetensors file's header in the canonical order (in place when its length is unchanged), with
    `extra_metadata` added to its metadata (strings, as safetensors requires)."""
    path = Path(path)
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
        new = canonical_header(raw, extra_metadata)
        if new == raw:
            return
        if len(new) == len(raw):
            f.seek(8)
            f.write(new)
            return
    # Another length (escapes written differently): a new file with the same tensor bytes.
    tmp = path.with_name(f".{path.name}.canonical-{os.getpid()}")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(8 + length)
        dst.write(struct.pack("<Q", len(new)) + new)
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def make_all_canonical(path: str | Path) -> None:
    """Every .safetensors file written under `path` (a file or an export folder)."""
    path = Path(path)
    for file in [path] if path.is_file() else sorted(path.rglob("*.safetensors")) if path.is_dir() else []:
        make_canonical(file)


def with_metadata(path: str | Path, metadata: dict[str, str]) -> None:
    """Add metadata keys to a written .safetensors file whose writer takes none of ours (diffusers'
    `save_lora_weights`); the tensors are untouched. The whole file is copied once: meant for small files."""
    if any(not isinstance(v, str) for v in metadata.values()):
        raise TypeError("safetensors metadata values must be strings")
    make_canonical(path, metadata)
