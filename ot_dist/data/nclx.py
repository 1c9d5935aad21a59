"""Colour given by an nclx box (ITU-T H.273 code points) instead of an ICC profile: AVIF and HEIC from phones.

Decoders (libavif through Pillow, libheif through pillow-heif) turn YCbCr into RGB with the matrix coefficients but
leave the primaries and transfer alone: a Display P3 photo comes out as P3 numbers, which read as sRGB look dull.
- Primaries: the D65 sets below are converted to sRGB in linear light with the 3x3 matrix derived from their
  chromaticities (H.273 table 2); colours outside sRGB are clipped. BT.709 (= sRGB), unspecified and the sets
  with another white (BT.470M, film, XYZ, DCI) are left as they are, as before.
- Transfer: sRGB (13) and the BT.709 family (1, 6, 14, 15) are read as the sRGB curve, as Chromium does for
  AVIF (ui/gfx/color_space.cc: "use the same transfer function as sRGB ... more closely match other media
  players"). PQ (16) and HLG (18) are HDR: there is no faithful SDR reading without a tone-mapping choice, so they
  raise ValueError (the callers name the file). Other transfers are taken as sRGB, as before.
"""

from __future__ import annotations

import struct

import numpy as np
from PIL import Image

D65 = (0.3127, 0.3290)
# colour_primaries -> (red, green, blue) xy, all with D65 white (ITU-T H.273 table 2)
D65_PRIMARIES = {
    1: ((0.640, 0.330), (0.300, 0.600), (0.150, 0.060)),  # BT.709 / sRGB
    5: ((0.640, 0.330), (0.290, 0.600), (0.150, 0.060)),  # BT.470 B/G, BT.601 625
    6: ((0.630, 0.340), (0.310, 0.595), (0.155, 0.070)),  # SMPTE 170M, BT.601 525
    7: ((0.630, 0.340), (0.310, 0.595), (0.155, 0.070)),  # SMPTE 240M
    9: ((0.708, 0.292), (0.170, 0.797), (0.131, 0.046)),  # BT.2020 / BT.2100
    12: ((0.680, 0.320), (0.265, 0.690), (0.150, 0.060)),  # Display P3 (SMPTE EG 432-1)
    22: ((0.630, 0.340), (0.295, 0.605), (0.155, 0.077)),  # EBU Tech 3213-E
}
HDR_TRANSFERS = {16: "PQ (SMPTE ST 2084)", 18: "HLG (ARIB STD-B67)"}


def rgb_to_xyz(primaries) -> np.ndarray:
    """The RGB -> XYZ matrix of a set of primaries with D65 white (each primary scaled so that RGB 1,1,1 is white)."""
    xyz = np.array([[x / y, 1.0, (1 - x - y) / y] for x, y in primaries]).T
    white = np.array([D65[0] / D65[1], 1.0, (1 - D65[0] - D65[1]) / D65[1]])
    return xyz * np.linalg.solve(xyz, white)


def to_srgb_matrix(code: int) -> np.ndarray:
    """Linear RGB in the primaries `code` -> linear sRGB."""
    return np.linalg.solve(rgb_to_xyz(D65_PRIMARIES[1]), rgb_to_xyz(D65_PRIMARIES[code]))


def nclx_to_srgb(rgb: Image.Image, nclx: dict) -> Image.Image:
    """8-bit RGB pixels described by `nclx` -> sRGB (unchanged when they already are, or we cannot tell)."""
    transfer = nclx.get("transfer_characteristics")
    if transfer in HDR_TRANSFERS:
        raise ValueError(f"HDR image (nclx transfer {transfer} = {HDR_TRANSFERS[transfer]}): ot_dist reads SDR "
                         "images only; export it as SDR (or with an ICC profile) first")
    primaries = nclx.get("color_primaries")
    if primaries == 1 or primaries not in D65_PRIMARIES:
        return rgb
    # float32 and a 256-entry decoding table: a 12-megapixel phone photo needs ~150 MB per array, not twice that
    linear = _srgb_decode(np.arange(256) / 255.0).astype(np.float32)[np.asarray(rgb)]
    srgb = np.clip(linear @ to_srgb_matrix(primaries).T.astype(np.float32), 0.0, 1.0)  # out-of-gamut colours clipped
    return Image.fromarray(np.round(_srgb_encode(srgb) * 255.0).astype(np.uint8), "RGB")


def _srgb_decode(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 0.04045, v / 12.92, ((v + 0.055) / 1.055) ** 2.4)


def _srgb_encode(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 0.0031308, v * 12.92, 1.055 * v ** (1 / 2.4) - 0.055)


def avif_nclx(data: bytes) -> dict | None:
    """The nclx colour box of an AVIF's primary item (ISO/IEC 14496-12 / 23008-12 boxes), or None."""
    meta = _child(data, 0, len(data), b"meta")
    if meta is None:
        return None
    start, end = meta[0] + 4, meta[1]  # meta is a FullBox: version and flags first
    pitm, iprp = _child(data, start, end, b"pitm"), _child(data, start, end, b"iprp")
    if pitm is None or iprp is None:
        return None
    primary = struct.unpack_from(">H" if data[pitm[0]] == 0 else ">I", data, pitm[0] + 4)[0]
    ipco, ipma = _child(data, *iprp, b"ipco"), _child(data, *iprp, b"ipma")
    if ipco is None or ipma is None:
        return None
    properties = list(_boxes(data, *ipco))
    for index in _item_properties(data, ipma, primary):
        if 0 < index <= len(properties):
            kind, body_start, body_end = properties[index - 1]
            if kind == b"colr" and data[body_start:body_start + 4] == b"nclx" and body_end - body_start >= 11:
                p, t, m = struct.unpack_from(">HHH", data, body_start + 4)
                return {"color_primaries": p, "transfer_characteristics": t, "matrix_coefficients": m,
                        "full_range_flag": data[body_start + 10] >> 7}
    return None


def _boxes(data: bytes, start: int, end: int):
    """(type, body start, body end) of each box between start and end."""
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        header = 8
        if size == 1 and start + 16 <= end:
            size, header = struct.unpack_from(">Q", data, start + 8)[0], 16
        elif size == 0:
            size = end - start
        if size < header or start + size > end:
            return
        yield kind, start + header, start + size
        start += size


def _child(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    return next(((s, e) for k, s, e in _boxes(data, start, end) if k == kind), None)


def _item_properties(data: bytes, ipma: tuple[int, int], item: int) -> list[int]:
    """The 1-based ipco indices associated with `item` in an ipma box."""
    pos, end = ipma
    version, flags = data[pos], int.from_bytes(data[pos + 1:pos + 4], "big")
    (count,), pos = struct.unpack_from(">I", data, pos + 4), pos + 8
    for _ in range(count):
        if pos + 3 > end:
            break
        if version < 1:
            (item_id,), pos = struct.unpack_from(">H", data, pos), pos + 2
        else:
            (item_id,), pos = struct.unpack_from(">I", data, pos), pos + 4
        n, pos = data[pos], pos + 1
        wide = flags & 1
        indices = [(int.from_bytes(data[pos + i * (1 + wide):pos + (i + 1) * (1 + wide)], "big")
                    & (0x7FFF if wide else 0x7F)) for i in range(n)]
        pos += n * (1 + wide)
        if item_id == item:
            return indices
    return []
