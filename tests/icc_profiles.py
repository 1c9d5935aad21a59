"""ICC profiles written byte by byte for the colour tests, and the reference colour maths they are checked
against (numpy, from the colour spaces' definitions: primaries, white points, transfer curves, Bradford).

PIL.ImageCms only creates sRGB, LAB and XYZ profiles, and no Display P3 or CMYK profile ships with this
machine's system or Python packages, so the profiles are built here after ICC.1 (v2 and v4):
- `matrix_trc_profile`: an RGB display profile (colorants adapted to the D50 PCS by Bradford, as ICC asks),
  with a gamma `curv` (Adobe RGB) or the sRGB parametric curve `para` (Display P3, as Apple's profile has).
- `cmyk_lut_profile`: a CMYK output profile whose A2B0 (`mft2`, lut16) tabulates a given CMYK -> XYZ (D50)
  function on a grid; a colour on a grid node is exactly what the function says.
"""

from __future__ import annotations

import struct
from itertools import product

import numpy as np

D50 = np.array([0.9642, 1.0, 0.8249])  # the ICC PCS white
D65_XY = (0.3127, 0.3290)
SRGB_PRIMARIES = [(0.64, 0.33), (0.30, 0.60), (0.15, 0.06)]
ADOBE_PRIMARIES = [(0.64, 0.33), (0.21, 0.71), (0.15, 0.06)]
P3_PRIMARIES = [(0.680, 0.320), (0.265, 0.690), (0.150, 0.060)]  # Display P3: DCI-P3 primaries, D65, sRGB curve
ADOBE_GAMMA = 563 / 256  # 2.19921875, as the Adobe RGB (1998) profile stores it
BRADFORD = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])


# ---- colour maths -------------------------------------------------------------------------------------------

def xy_to_xyz(x, y) -> np.ndarray:
    return np.array([x / y, 1.0, (1 - x - y) / y])


def rgb_to_xyz(primaries, white) -> np.ndarray:
    """The linear RGB -> XYZ matrix of a colour space from its primaries' xy and its white (xy or XYZ)."""
    white = xy_to_xyz(*white) if len(white) == 2 else np.asarray(white)
    columns = np.stack([xy_to_xyz(*p) for p in primaries], axis=1)
    return columns * np.linalg.solve(columns, white)


def bradford(source_white, target_white) -> np.ndarray:
    """The Bradford chromatic adaptation matrix between two XYZ whites."""
    cone = np.diag((BRADFORD @ target_white) / (BRADFORD @ source_white))
    return np.linalg.inv(BRADFORD) @ cone @ BRADFORD


def srgb_decode(encoded) -> np.ndarray:
    encoded = np.asarray(encoded, dtype=float)
    return np.where(encoded <= 0.04045, encoded / 12.92, ((encoded + 0.055) / 1.055) ** 2.4)


def srgb_encode(linear) -> np.ndarray:
    linear = np.clip(np.asarray(linear, dtype=float), 0, 1)  # out of gamut: clipped, as an 8-bit transform does
    return np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055)


def xyz_d65_to_srgb8(xyz) -> np.ndarray:
    """XYZ (D65-relative) -> 8-bit sRGB values (floats, to compare with a tolerance)."""
    return srgb_encode(np.linalg.solve(rgb_to_xyz(SRGB_PRIMARIES, D65_XY), np.asarray(xyz))) * 255


def adobe_to_srgb(rgb) -> np.ndarray:
    """An Adobe RGB (1998) colour in sRGB (both D65: no adaptation)."""
    return xyz_d65_to_srgb8(rgb_to_xyz(ADOBE_PRIMARIES, D65_XY) @ ((np.array(rgb) / 255.0) ** ADOBE_GAMMA))


def p3_to_srgb(rgb) -> np.ndarray:
    """A Display P3 colour in sRGB (both D65, both with the sRGB transfer curve)."""
    return xyz_d65_to_srgb8(rgb_to_xyz(P3_PRIMARIES, D65_XY) @ srgb_decode(np.array(rgb) / 255.0))


def xyz_d50_to_srgb(xyz_d50) -> np.ndarray:
    """A PCS colour (XYZ relative to D50) in sRGB: Bradford to D65, then sRGB's matrix and curve."""
    return xyz_d65_to_srgb8(bradford(D50, xy_to_xyz(*D65_XY)) @ np.asarray(xyz_d50))


# ---- ICC bytes ----------------------------------------------------------------------------------------------

def s15(value: float) -> bytes:
    return struct.pack(">i", round(value * 65536))


def _xyz_tag(v) -> bytes:
    return b"XYZ \0\0\0\0" + b"".join(s15(c) for c in v)


def _desc_tag(text: str, version: int) -> bytes:
    if version >= 4:  # multiLocalizedUnicodeType
        utf16 = text.encode("utf-16-be")
        return b"mluc\0\0\0\0" + struct.pack(">II", 1, 12) + b"enUS" + struct.pack(">II", len(utf16), 28) + utf16
    ascii_ = text.encode("ascii") + b"\0"  # v2 textDescriptionType: ASCII, no Unicode, no ScriptCode
    return b"desc\0\0\0\0" + struct.pack(">I", len(ascii_)) + ascii_ + b"\0" * 8 + b"\0\0\0" + b"\0" * 67


def _profile(device_class: bytes, colour_space: bytes, pcs: bytes, version: int, tags: list) -> bytes:
    offset = 128 + 4 + 12 * len(tags)
    table, body = struct.pack(">I", len(tags)), b""
    for signature, data in tags:
        data += b"\0" * (-len(data) % 4)
        table += signature + struct.pack(">II", offset + len(body), len(data))
        body += data
    version_bytes = bytes([4, 0x30, 0, 0]) if version >= 4 else bytes([2, 0x10, 0, 0])
    header = (struct.pack(">I", offset + len(body)) + b"\0\0\0\0" + version_bytes + device_class + colour_space
              + pcs + b"\0" * 12 + b"acsp" + b"\0" * 24 + struct.pack(">I", 0) + b"".join(s15(c) for c in D50)
              + b"\0" * 48)
    assert len(header) == 128
    return header + table + body


def matrix_trc_profile(primaries, white_xy, curve: float | str, description: str, version: int = 2) -> bytes:
    """An RGB matrix/TRC display profile. `curve`: a gamma (stored as `curv`) or "srgb" (`para` type 3)."""
    matrix = bradford(xy_to_xyz(*white_xy), D50) @ rgb_to_xyz(primaries, white_xy)
    if curve == "srgb":
        trc = b"para\0\0\0\0" + struct.pack(">HH", 3, 0) + b"".join(
            s15(v) for v in (2.4, 1 / 1.055, 0.055 / 1.055, 1 / 12.92, 0.04045))
    else:
        trc = b"curv\0\0\0\0" + struct.pack(">IH", 1, round(curve * 256))
    tags = [(b"desc", _desc_tag(description, version)), (b"wtpt", _xyz_tag(D50)),
            (b"rXYZ", _xyz_tag(matrix[:, 0])), (b"gXYZ", _xyz_tag(matrix[:, 1])), (b"bXYZ", _xyz_tag(matrix[:, 2])),
            (b"rTRC", trc), (b"gTRC", trc), (b"bTRC", trc)]
    return _profile(b"mntr", b"RGB ", b"XYZ ", version, tags)


def grey_profile(gamma: float) -> bytes:
    """A greyscale display profile: one tone curve (`kTRC`), white D50."""
    trc = b"curv\0\0\0\0" + struct.pack(">IH", 1, round(gamma * 256))
    return _profile(b"mntr", b"GRAY", b"XYZ ", 2, [(b"desc", _desc_tag("Grey test", 2)), (b"wtpt", _xyz_tag(D50)),
                                                    (b"kTRC", trc)])


def adobe_rgb_profile() -> bytes:
    return matrix_trc_profile(ADOBE_PRIMARIES, D65_XY, ADOBE_GAMMA, "Adobe RGB test")


def display_p3_profile() -> bytes:
    return matrix_trc_profile(P3_PRIMARIES, D65_XY, "srgb", "Display P3 test", version=4)


def cmyk_lut_profile(cmyk_to_xyz_d50, grid: int) -> bytes:
    """A CMYK printer profile (v2, PCS XYZ) whose A2B0 tabulates `cmyk_to_xyz_d50` (ink fractions 0..1, C
    outermost) on `grid` points per ink, with identity input and output curves."""
    nodes = np.linspace(0.0, 1.0, grid)
    clut = b""
    for cmyk in product(nodes, repeat=4):  # the first input channel varies slowest, as ICC orders a CLUT
        xyz = np.asarray(cmyk_to_xyz_d50(np.array(cmyk)))
        clut += struct.pack(">3H", *np.clip(np.round(xyz * 32768), 0, 65535).astype(int))  # u1Fixed15 XYZ
    identity_matrix = b"".join(s15(v) for v in (1, 0, 0, 0, 1, 0, 0, 0, 1))
    identity_curve = struct.pack(">HH", 0, 65535)
    a2b0 = (b"mft2\0\0\0\0" + bytes([4, 3, grid, 0]) + identity_matrix + struct.pack(">HH", 2, 2)
            + identity_curve * 4 + clut + identity_curve * 3)
    tags = [(b"desc", _desc_tag("CMYK press test", 2)), (b"wtpt", _xyz_tag(D50)), (b"A2B0", a2b0)]
    return _profile(b"prtr", b"CMYK", b"XYZ ", 2, tags)
