"""Decoding of shard members: images, text, json, npy and safetensors only; never pickle.

webdataset's default decoder unpickles `.pyd`/`.pickle` and torch-loads `.pth`; a shard from
elsewhere could run code that way. Here members are decoded by an allow-list of webdataset
handlers (without its `basichandlers`, which include pickle), and any other extension is refused
before its bytes are looked at.
"""

from __future__ import annotations

import io
import json

import numpy as np
from webdataset import autodecode

from ot_dist.errors import InputFileError

PICKLE_EXTENSIONS = {"pth", "pt", "pyd", "pickle", "pkl", "ckpt", "bin"}


def _npy(data: bytes) -> np.ndarray:
    return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)


def _safetensors(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


_DECODER = autodecode.Decoder(
    [
        autodecode.handle_extension("txt", lambda data: data.decode("utf-8")),
        autodecode.handle_extension("json", json.loads),
        autodecode.handle_extension("npy", _npy),
        autodecode.handle_extension("safetensors", _safetensors),
        autodecode.imagehandler("pil"),
    ],
    pre=[],
    post=[],
)
ALLOWED = {"txt", "json", "npy", "safetensors", *autodecode.IMAGE_EXTENSIONS}


def decode_member(name: str, data: bytes, where: str):
    """Decode one member (name like `key.512.png`); `where` (shard and key) goes into errors."""
    extension = name.rsplit(".", 1)[-1].lower()
    if extension in PICKLE_EXTENSIONS or extension not in ALLOWED:
        raise InputFileError(f"{where}: member {name} refused: only {', '.join(sorted(ALLOWED))} are decoded (never pickle)")
    try:
        value = _DECODER.decode1(name, data)
    except Exception as err:  # any decoder failure is bad data, reported with the sample
        raise InputFileError(f"{where}: member {name} could not be decoded: {err}") from None
    if isinstance(value, (bytes, bytearray)):
        raise InputFileError(f"{where}: member {name} could not be decoded (no decoder took it)")
    return value
