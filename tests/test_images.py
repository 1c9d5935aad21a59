"""Images as cameras and other tools write them (issue 26): a folder of camera-like files, built into a shard set
and read back. EXIF orientations 1-8 (stored pixels = the exif-transposed source), AVIF / TIFF / GIF / animated
WebP / HEIC, alpha on the background, 16-bit, CMYK and an Adobe RGB ICC profile with known colours, a
decompression bomb, a tiny image and files that are not images; the build report names every unused file."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image, ImageOps

from ot_dist.config.load import validate
from ot_dist.data import images as image_files
from ot_dist.data.shards import build_shard_set, read_manifest
from ot_dist.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BACKGROUND = (32, 64, 128)
SOURCE_ADOBE = (120, 170, 110)  # an Adobe RGB green inside sRGB's gamut: sRGB (90.4, 171.5, 106.8), no clipping


# ---- files as cameras and tools write them ------------------------------------------------------------------

def noise(width, height, seed):
    """Asymmetric content: any flip or rotation of it differs from it."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width, height, bit_depth, colour_type, raw_rows: bytes) -> bytes:
    """A PNG written by hand (Pillow cannot write 16-bit RGB, nor a header that lies about its size)."""
    header = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(raw_rows))
            + png_chunk(b"IEND", b""))


def s15(value: float) -> bytes:
    return struct.pack(">i", round(value * 65536))


def xy_to_xyz(x, y):
    return np.array([x / y, 1.0, (1 - x - y) / y])


def rgb_to_xyz(primaries, white) -> np.ndarray:
    """The RGB -> XYZ matrix of a colour space from its primaries' and white's xy."""
    columns = np.stack([xy_to_xyz(*p) for p in primaries], axis=1)
    scale = np.linalg.solve(columns, xy_to_xyz(*white))
    return columns * scale


ADOBE_PRIMARIES = [(0.64, 0.33), (0.21, 0.71), (0.15, 0.06)]
SRGB_PRIMARIES = [(0.64, 0.33), (0.30, 0.60), (0.15, 0.06)]
D65 = (0.3127, 0.3290)
ADOBE_GAMMA = 563 / 256  # 2.19921875, as the Adobe RGB (1998) profile stores it


def adobe_rgb_profile() -> bytes:
    """An ICC v2 matrix/TRC display profile with Adobe RGB (1998)'s primaries and gamma, built here (PIL.ImageCms
    only creates sRGB, LAB and XYZ); its colorants adapted to the D50 PCS by Bradford, as ICC asks."""
    bradford = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])
    d50 = np.array([0.9642, 1.0, 0.8249])
    cone = np.diag((bradford @ d50) / (bradford @ xy_to_xyz(*D65)))
    matrix = np.linalg.inv(bradford) @ cone @ bradford @ rgb_to_xyz(ADOBE_PRIMARIES, D65)

    def xyz_tag(v):
        return b"XYZ \0\0\0\0" + b"".join(s15(c) for c in v)

    text = b"Adobe RGB test\0"
    desc = (b"desc\0\0\0\0" + struct.pack(">I", len(text)) + text + b"\0" * 8 + b"\0\0\0" + b"\0" * 67)
    curve = b"curv\0\0\0\0" + struct.pack(">IH", 1, round(ADOBE_GAMMA * 256)) + b"\0\0"
    tags = [(b"desc", desc), (b"wtpt", xyz_tag(d50)), (b"rXYZ", xyz_tag(matrix[:, 0])),
            (b"gXYZ", xyz_tag(matrix[:, 1])), (b"bXYZ", xyz_tag(matrix[:, 2])),
            (b"rTRC", curve), (b"gTRC", curve), (b"bTRC", curve)]
    offset = 128 + 4 + 12 * len(tags)
    table, body = struct.pack(">I", len(tags)), b""
    for signature, data in tags:
        data += b"\0" * (-len(data) % 4)
        table += signature + struct.pack(">II", offset + len(body), len(data))
        body += data
    size = offset + len(body)
    header = (struct.pack(">I", size) + b"\0\0\0\0" + bytes([2, 0x10, 0, 0]) + b"mntrRGB XYZ " + b"\0" * 12
              + b"acsp" + b"\0" * 24 + struct.pack(">I", 0) + s15(d50[0]) + s15(d50[1]) + s15(d50[2]) + b"\0" * 48)
    assert len(header) == 128
    return header + table + body


def adobe_to_srgb(rgb) -> np.ndarray:
    """The reference conversion, by the colour spaces' definitions (both D65: no adaptation)."""
    linear = (np.array(rgb) / 255.0) ** ADOBE_GAMMA
    srgb_linear = np.linalg.solve(rgb_to_xyz(SRGB_PRIMARIES, D65), rgb_to_xyz(ADOBE_PRIMARIES, D65) @ linear)
    srgb_linear = np.clip(srgb_linear, 0, 1)
    encoded = np.where(srgb_linear <= 0.0031308, 12.92 * srgb_linear, 1.055 * srgb_linear ** (1 / 2.4) - 0.055)
    return encoded * 255


def with_orientation(img: Image.Image, orientation: int, path: Path) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(path, "JPEG", quality=95, exif=exif.tobytes())


def camera_folder(folder: Path) -> dict:
    """Write the camera-like folder; returns what the test needs to know about it."""
    folder.mkdir(parents=True)
    expected = {}  # file name -> (colour it must come out as, tolerance) for flat-colour files

    def caption(name):
        (folder / name).with_suffix(".txt").write_text(f"photo {name}\n")

    for orientation in range(1, 9):  # stored 96x48: upright 96x48 (1-4) or 48x96 (5-8), both a bucket at 64 / 16
        with_orientation(noise(96, 48, orientation), orientation, folder / f"orient{orientation}.jpg")
        caption(f"orient{orientation}.jpg")
    # The orientation-6 photo has a mask, drawn on the photo as displayed (upright 48x96).
    mask = np.zeros((96, 48), np.uint8)
    mask[:20, :] = 255  # the top of the upright picture
    Image.fromarray(mask).save(folder / "orient6-masklabel.png")

    def flat(name, colour, tolerance, **save):
        Image.new("RGB", (64, 64), colour).save(folder / name, **save)
        caption(name)
        expected[name] = (colour, tolerance)

    flat("photo.avif", (200, 40, 90), 8, quality=90)
    flat("scan.tiff", (30, 160, 70), 0)
    heic_available = image_files.heif_available()
    if heic_available:
        flat("iphone.heic", (90, 120, 220), 8, quality=95)
    # An animated GIF and WebP: the first frame is used.
    for name in ("anim.gif", "anim.webp"):
        frames = [Image.new("RGB", (64, 64), (250, 0, 0)), Image.new("RGB", (64, 64), (0, 0, 250))]
        frames[0].save(folder / name, save_all=True, append_images=frames[1:], duration=100, loop=0,
                       **({"lossless": True} if name.endswith("webp") else {}))
        caption(name)
        expected[name] = ((250, 0, 0), 3)
    # RGBA: left half opaque orange, right half transparent, a 50 % strip in the middle.
    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[:, :, :3] = (240, 120, 10)
    rgba[:, :24, 3] = 255
    rgba[:, 24:40, 3] = 128
    Image.fromarray(rgba, "RGBA").save(folder / "cutout.png")
    caption("cutout.png")
    # A palette image whose index 0 is transparent (a GIF-style cut-out).
    palette = Image.new("P", (64, 64), 0)
    palette.putpalette([255, 0, 255, 10, 200, 10] + [0] * 762)
    palette.paste(1, (0, 0, 32, 64))
    palette.save(folder / "palette.png", transparency=0)
    caption("palette.png")
    # 16-bit: greyscale (Pillow opens it as I;16) and RGB (written by hand).
    Image.fromarray(np.full((64, 64), 0x8080, np.uint16)).save(folder / "grey16.png")
    caption("grey16.png")
    expected["grey16.png"] = ((128, 128, 128), 0)
    rgb16 = np.empty((64, 64, 3), ">u2")
    rgb16[...] = (0x1234, 0x8080, 0xFF00)
    rows = b"".join(b"\0" + row.tobytes() for row in rgb16)
    (folder / "rgb16.png").write_bytes(png_bytes(64, 64, 16, 2, rows))
    caption("rgb16.png")
    expected["rgb16.png"] = ((0x1234 / 257, 0x8080 / 257, 0xFF00 / 257), 1)
    # CMYK JPEG (print workflows): cyan and a red made of magenta + yellow + a little black.
    cmyk = Image.new("CMYK", (64, 64), (255, 0, 0, 0))
    cmyk.paste((0, 200, 200, 50), (32, 0, 64, 64))
    cmyk.save(folder / "print.jpg", quality=95)
    caption("print.jpg")
    # An Adobe RGB photo: the same numbers mean a different colour than in sRGB.
    Image.new("RGB", (64, 64), SOURCE_ADOBE).save(folder / "adobe.png", icc_profile=adobe_rgb_profile())
    caption("adobe.png")
    expected["adobe.png"] = (tuple(adobe_to_srgb(SOURCE_ADOBE)), 2)
    # A decompression bomb: a small PNG declaring 20000 x 20000 pixels.
    (folder / "bomb.png").write_bytes(png_bytes(20000, 20000, 8, 0, b"\0" * 20001))
    caption("bomb.png")
    # A tiny image: 8x8 for a 64x64 bucket.
    Image.new("RGB", (8, 8), (5, 5, 5)).save(folder / "tiny.png")
    caption("tiny.png")
    # Not samples: a PDF and an orphan caption (listed), sidecars (not listed).
    (folder / "notes.pdf").write_bytes(b"%PDF-1.4\n")
    (folder / "orphan.txt").write_text("no image\n")
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder / "orient1.xmp").write_text("<x:xmpmeta/>")
    return {"expected": expected, "heic": heic_available}


def make_config(folder: Path, shards: Path, **data):
    return validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                     "data": {"path": str(folder), "shards": str(shards), "bucket_step": 16,
                              "image_background": "#204080", "max_bad_fraction": 0.1, **data},
                     "resolution": 64, "batch_size": 1, "seed": 1})


def stored(shards: Path, manifest: dict) -> dict[str, dict]:
    """Source file name -> {image, mask, meta} read back from the tar shards."""
    out = {}
    for record in manifest["samples"]:
        shard = shards / manifest["shards"][record["shard"]]["file"]
        with tarfile.open(shard) as tar:
            members = {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar
                       if m.name.startswith(record["key"] + ".")}
        meta = json.loads(members["json"])
        out[Path(meta["source"]).name] = {
            "image": np.asarray(Image.open(io.BytesIO(members["64.png"]))),
            "mask": np.asarray(Image.open(io.BytesIO(members["64.mask.png"]))) if "64.mask.png" in members else None,
            "meta": meta}
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("camera")
    info = camera_folder(root / "photos")
    cfg = make_config(root / "photos", root / "shards")
    lines = []
    manifest = build_shard_set(cfg, root / "shards", log=lines.append)
    return {"root": root, "info": info, "manifest": manifest, "samples": stored(root / "shards", manifest),
            "log": "\n".join(lines), "config": cfg}


# ---- the tests -----------------------------------------------------------------------------------------------

def test_orientations_1_to_8_store_the_upright_pixels(built):
    samples, folder = built["samples"], built["root"] / "photos"
    for orientation in range(1, 9):
        source = Image.open(folder / f"orient{orientation}.jpg")
        upright = np.asarray(ImageOps.exif_transpose(source).convert("RGB"))
        got = samples[f"orient{orientation}.jpg"]
        assert got["image"].shape == upright.shape, orientation
        assert np.array_equal(got["image"], upright), orientation
        assert got["meta"]["original_size"] == [upright.shape[0], upright.shape[1]]  # (height, width) upright
        raw = np.asarray(source.convert("RGB"))
        if orientation > 1:  # the content is asymmetric: every transposition changes the pixels
            assert upright.shape != raw.shape or not np.array_equal(upright, raw), orientation
    # Orientation 6 (a phone portrait): stored 96 wide, shown turned 90 degrees clockwise, 48 wide and 96 tall.
    raw = np.asarray(Image.open(folder / "orient6.jpg").convert("RGB"))
    assert samples["orient6.jpg"]["image"].shape == (96, 48, 3)
    assert np.array_equal(samples["orient6.jpg"]["image"], np.rot90(raw, k=-1))
    # Its mask was drawn on the upright photo: it stays as drawn, aligned with the upright pixels.
    mask = samples["orient6.jpg"]["mask"]
    assert mask.shape == (96, 48) and (mask[:20] == 255).all() and (mask[20:] == 0).all()
    buckets = {b["bucket"]: b["sizes"]["64"] for b in built["manifest"]["buckets"]}
    assert buckets[samples["orient6.jpg"]["meta"]["bucket"]] == [96, 48]  # bucketed tall, not wide


def test_formats_and_colours_come_out_in_srgb(built):
    samples = built["samples"]
    for name, (colour, tolerance) in built["info"]["expected"].items():
        pixels = samples[name]["image"].reshape(-1, 3).astype(float)
        assert np.abs(pixels - np.array(colour)).max() <= tolerance, (name, pixels.mean(0), colour)
    # The Adobe RGB numbers read as sRGB would be far off: the profile conversion is what makes this pass.
    adobe = np.array(built["info"]["expected"]["adobe.png"][0])
    assert np.abs(adobe - SOURCE_ADOBE).max() > 20 and (adobe > 5).all() and (adobe < 250).all()  # not clipped
    # CMYK: cyan, and (0, 200, 200, 50) -> (205, 44, 44).
    cmyk = samples["print.jpg"]["image"].astype(int)
    assert np.abs(cmyk[:, :28] - (0, 255, 255)).max() <= 6 and np.abs(cmyk[:, 36:] - (205, 44, 44)).max() <= 6


def test_transparency_is_composited_on_the_background(built):
    cutout = built["samples"]["cutout.png"]["image"].astype(int)
    assert np.abs(cutout[:, :20] - (240, 120, 10)).max() <= 1
    assert np.abs(cutout[:, 44:] - BACKGROUND).max() <= 1
    half = (np.array((240, 120, 10)) * 128 + np.array(BACKGROUND) * 127) / 255
    assert np.abs(cutout[:, 28:36] - half).max() <= 2
    palette = built["samples"]["palette.png"]["image"].astype(int)
    assert np.abs(palette[:, :28] - (10, 200, 10)).max() <= 1 and np.abs(palette[:, 36:] - BACKGROUND).max() <= 1


def test_bomb_tiny_and_unused_files_are_reported(built):
    manifest, log = built["manifest"], built["log"]
    names = set(built["samples"])
    assert "bomb.png" not in names and "tiny.png" in names  # tiny is kept (skip_small_images off), with a warning
    (bad,) = manifest["unreadable_images"]
    assert bad["file"].endswith("bomb.png") and "data.max_image_pixels" in bad["error"]
    assert "bomb.png" in log and "1 of" in log
    assert "1 image with a side below a quarter" in log and "tiny.png (8x8 for a 64x64 bucket)" in log
    unused = {u["file"]: u["reason"] for u in manifest["unused_files"]}
    assert unused == {"notes.pdf": "not an image", "orphan.txt": "a caption without its image"}
    assert "2 files not used: notes.pdf (not an image), orphan.txt (a caption without its image)" in log


def test_skip_small_images_and_heic_without_the_extra(built, tmp_path, monkeypatch):
    folder = built["root"] / "photos"
    monkeypatch.setattr(image_files, "heif_available", lambda: False)
    (folder / "a.heic").write_bytes(b"\0\0\0\x18ftypheic")  # present whether or not pillow-heif is here
    try:
        manifest = build_shard_set(make_config(folder, tmp_path / "s", skip_small_images=True), tmp_path / "s",
                                   log=lambda *_: None)
    finally:
        (folder / "a.heic").unlink()
    unused = {u["file"]: u["reason"] for u in manifest["unused_files"]}
    assert unused["a.heic"] == "install ot-dist[heic]"
    assert unused["tiny.png"].startswith("too small: 8x8") and "data.skip_small_images" in unused["tiny.png"]
    if built["info"]["heic"]:
        assert unused["iphone.heic"] == "install ot-dist[heic]"


def test_heic_is_read_with_the_extra(built):
    if not built["info"]["heic"]:
        pytest.skip("pillow-heif is not installed (pip install ot-dist[heic])")
    assert "iphone.heic" in built["samples"]


def test_bomb_over_max_bad_fraction_exits_3_naming_it(built, tmp_path):
    """The CLI (a subprocess, as a user runs it): a bomb among a few images is more than the default 1 %."""
    folder = tmp_path / "few"
    folder.mkdir()
    for name in ("bomb.png", "bomb.txt", "scan.tiff", "scan.txt", "notes.pdf"):
        (folder / name).write_bytes((built["root"] / "photos" / name).read_bytes())
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                                      "data": {"path": str(folder)}, "resolution": 64}))
    run = subprocess.run([sys.executable, "-m", "ot_dist", "shard", "build", str(config), "--out",
                          str(tmp_path / "set")], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 3, run.stderr
    assert "bomb.png" in run.stderr and "data.max_image_pixels" in run.stderr and "data.max_bad_fraction" in run.stderr
    assert "Traceback" not in run.stderr
    # With the bomb allowed for by the fraction, the build goes on and its report names the unused file.
    run = subprocess.run([sys.executable, "-m", "ot_dist", "shard", "build", str(config), "--out",
                          str(tmp_path / "set"), "--set", "data.max_bad_fraction=0.5"], capture_output=True,
                         text=True, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert "1 file not used: notes.pdf (not an image)" in run.stdout
    assert read_manifest(tmp_path / "set")["unreadable_images"][0]["file"].endswith("bomb.png")


def test_bad_background_is_a_config_error():
    with pytest.raises(ConfigError, match="image_background: 'not-a-colour' is not a colour"):
        make_config(Path("."), Path("s"), image_background="not-a-colour")


def test_one_training_step_from_the_built_shards(built, tiny_models, tmp_path):
    from ot_dist.cli import main

    root = built["root"]
    raw = {"model": {"family": "sd1", "path": str(tiny_models["sd1"])}, "method": "full",
           "output_dir": str(tmp_path / "out"), "data": {"shards": str(root / "shards")}, "resolution": 64,
           "batch_size": 1, "max_steps": 1, "learning_rate": 1e-4, "seed": 1, "mlflow": {"enabled": False},
           "log_every_steps": 1000}
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config)]) == 0
    assert any((tmp_path / "out").rglob("*.safetensors"))
