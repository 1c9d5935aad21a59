"""Images as cameras and other tools write them (issue 26): a folder of camera-like files, built into a shard set
and read back. EXIF orientations 1-8 (stored pixels = the exif-transposed source), AVIF / TIFF / GIF / animated
WebP / HEIC, alpha on the background, 16-bit, CMYK (with and without an ICC profile), Adobe RGB and Display P3
with known colours (the references computed from the colour spaces' definitions, tests/icc_profiles.py), a
decompression bomb, a tiny image and files that are not images; the build report names every unused file; a
2-rank training on the folder."""

from __future__ import annotations

import io
import json
import re
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from forked_ranks import run_ranks
import yaml
from PIL import Image, ImageOps

from icc_profiles import (D50, D65_XY, adobe_rgb_profile, adobe_to_srgb, cmyk_lut_profile, display_p3_profile,
                          grey_profile, p3_to_srgb, rgb_to_xyz, srgb_decode, srgb_encode, xyz_d50_to_srgb,
                          xyz_d65_to_srgb8)
from ot_dist.config.load import validate
from ot_dist.data import images as image_files
from ot_dist.data.shards import build_shard_set, read_manifest
from ot_dist.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BACKGROUND = (32, 64, 128)
SOURCE_ADOBE = (120, 170, 110)  # an Adobe RGB green inside sRGB's gamut: sRGB (90.4, 171.5, 106.8), no clipping
# Display P3 colours inside sRGB's gamut (an orange, a sky blue, a grey, a green), one per 32x32 quarter.
P3_PATCHES = [(230, 120, 60), (60, 140, 200), (128, 128, 128), (100, 180, 90)]
# CMYK ink values on the test press profile's grid (multiples of 51): a light cyan, an orange, a blue grey, a grey.
CMYK_PATCHES = [(204, 0, 0, 0), (0, 153, 204, 51), (102, 51, 0, 51), (0, 0, 0, 204)]
# The test press: band transmittances of full cyan, magenta, yellow and black ink, with dot gain, on a white paper
# whose bands are wide-gamut primaries (adapted to D50, so the paper is the PCS white).
PRESS_PRIMARIES = [(0.66, 0.32), (0.25, 0.66), (0.15, 0.07)]
PRESS_INKS = np.array([[0.10, 0.80, 0.95], [0.85, 0.12, 0.75], [0.95, 0.90, 0.10], [0.05, 0.05, 0.06]])


def press_xyz(cmyk) -> np.ndarray:
    """The test press's colour (XYZ relative to D50) of ink fractions cmyk (0..1)."""
    ink = np.asarray(cmyk, dtype=float) ** 0.8  # dot gain
    reflectance = np.prod(1 - ink[:, None] * (1 - PRESS_INKS), axis=0)
    return rgb_to_xyz(PRESS_PRIMARIES, D50) @ reflectance


def quarters(mode, colours):
    """A 64x64 image of 4 flat 32x32 quarters (JPEG's 8x8 blocks stay flat: no ringing at the borders)."""
    img = Image.new(mode, (64, 64))
    for i, colour in enumerate(colours):
        img.paste(colour, (32 * (i % 2), 32 * (i // 2), 32 * (i % 2) + 32, 32 * (i // 2) + 32))
    return img


def quarter_colours(pixels: np.ndarray) -> list[np.ndarray]:
    """Every pixel of each quarter but a 4-pixel border."""
    return [pixels[32 * (i // 2) + 4:32 * (i // 2) + 28, 32 * (i % 2) + 4:32 * (i % 2) + 28].reshape(-1, 3)
            for i in range(4)]


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
    # A CMYK JPEG with its press profile (a 6-point A2B0 grid: the patches lie on its nodes), and a Display P3 PNG.
    press_profile = cmyk_lut_profile(press_xyz, 6)
    quarters("CMYK", CMYK_PATCHES).save(folder / "press-icc.jpg", quality=95, icc_profile=press_profile)
    caption("press-icc.jpg")
    quarters("RGB", P3_PATCHES).save(folder / "display-p3.png", icc_profile=display_p3_profile())
    caption("display-p3.png")
    if heic_available:  # an iPhone photo: HEIC with Apple's Display P3 profile
        quarters("RGB", P3_PATCHES).save(folder / "iphone-p3.heic", quality=95, icc_profile=display_p3_profile())
        caption("iphone-p3.heic")
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
    # macOS AppleDouble files, as a Finder copy to a USB disk leaves them: metadata named like images and captions
    for name in ("._orient1.jpg", "._orient1.txt"):
        (folder / name).write_bytes(b"\0\x05\x16\x07\0\x02\0\0Mac OS X        " + bytes(64))
    return {"expected": expected, "heic": heic_available}


def make_config(folder: Path, shards: Path, **data):
    return validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                     "data": {"path": str(folder), "shards": str(shards), "bucket_step": 16, "image_format": "png",
                              "image_background": "#204080", "max_bad_fraction": 0.1, **data},
                     "resolution": 64, "batch_size": 1, "seed": 1})


def stored(shards: Path, manifest: dict) -> dict[str, dict]:
    """Source file name -> {image, mask, meta} read back from the tar shards."""
    out = {}
    for index, record in enumerate(manifest["samples"]):
        shard = shards / manifest["shards"][record["shard"]]["file"]
        with tarfile.open(shard) as tar:
            members = {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar
                       if m.name.startswith(record["key"] + ".")}
        meta = json.loads(members["json"])
        image = Image.open(io.BytesIO(members["64.png"]))
        out[Path(meta["source"]).name] = {
            "image": np.asarray(image), "info": image.info,
            "mask": np.asarray(Image.open(io.BytesIO(members["64.mask.png"]))) if "64.mask.png" in members else None,
            "meta": meta, "index": index}
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


def test_icc_profiles_cmyk_and_display_p3_give_the_known_srgb_colours(built):
    """Each quarter's stored pixels equal the sRGB of its known colour: the press profile's XYZ (D50) taken to
    sRGB by Bradford and sRGB's matrix (CMYK), and P3's primaries to sRGB's (both D65), computed in numpy."""
    samples = built["samples"]
    press = quarter_colours(samples["press-icc.jpg"]["image"].astype(float))
    p3 = quarter_colours(samples["display-p3.png"]["image"].astype(float))
    for patch, cmyk in zip(press, CMYK_PATCHES):
        reference = xyz_d50_to_srgb(press_xyz(np.array(cmyk) / 255))
        assert (reference > 2).sum() >= 2 and (reference < 253).all(), (cmyk, reference)  # in gamut, not clipped
        assert np.abs(patch - reference).max() <= 3, (cmyk, patch.mean(0), reference)
    iphone = quarter_colours(samples["iphone-p3.heic"]["image"].astype(float)) if built["info"]["heic"] else p3
    for patch, heic_patch, colour in zip(p3, iphone, P3_PATCHES):
        reference = p3_to_srgb(colour)
        assert np.abs(patch - reference).max() <= 1.5, (colour, patch.mean(0), reference)
        assert np.abs(heic_patch - reference).max() <= 4, (colour, heic_patch.mean(0), reference)  # lossy HEIC
    # Read without their profiles the same files would be far off: Pillow's naive CMYK, P3 numbers taken as sRGB.
    naive = [(255 - np.array(c[:3])) * (255 - c[3]) / 255 for c in CMYK_PATCHES]
    assert max(np.abs(n - xyz_d50_to_srgb(press_xyz(np.array(c) / 255))).max()
               for n, c in zip(naive, CMYK_PATCHES)) > 30
    assert max(np.abs(np.array(c) - p3_to_srgb(c)).max() for c in P3_PATCHES) > 20


def test_stored_pixels_carry_no_profile(built, tmp_path):
    """The stored pixels are sRGB, which a PNG without a profile means: no profile rides along, neither LittleCMS'
    sRGB (its header holds the time it was made: two builds would differ) nor one that was not applied (an RGB
    image carrying a CMYK profile: a colour-managed viewer would misread the PNG)."""
    for name, sample in built["samples"].items():
        assert "icc_profile" not in sample["info"] and "transparency" not in sample["info"], name
    Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / "mismatched.png", icc_profile=cmyk_lut_profile(
        press_xyz, 2))
    img = image_files.open_image(tmp_path / "mismatched.png")
    assert img.getpixel((0, 0)) == (10, 20, 30) and img.info == {}  # the profile that does not fit: ignored
    # A grey profile on colour pixels (a converter that kept the profile of a grey original) does not fit either: it
    # turned a red into grey; on grey pixels it holds (gamma 1.8, an old Mac's, re-encoded with sRGB's curve).
    Image.new("RGB", (8, 8), (220, 30, 30)).save(tmp_path / "colour-grey-profile.png", icc_profile=grey_profile(2.2))
    assert image_files.open_image(tmp_path / "colour-grey-profile.png").getpixel((0, 0)) == (220, 30, 30)
    Image.new("L", (8, 8), 100).save(tmp_path / "grey.png", icc_profile=grey_profile(1.8))
    grey = image_files.open_image(tmp_path / "grey.png").getpixel((0, 0))
    assert np.abs(np.subtract(grey, srgb_encode((100 / 255) ** 1.8) * 255)).max() <= 1 and grey[0] > 110


def test_transparency_is_composited_on_the_background(built):
    cutout = built["samples"]["cutout.png"]["image"].astype(int)
    assert np.abs(cutout[:, :20] - (240, 120, 10)).max() <= 1
    assert np.abs(cutout[:, 44:] - BACKGROUND).max() <= 1
    half = (np.array((240, 120, 10)) * 128 + np.array(BACKGROUND) * 127) / 255
    assert np.abs(cutout[:, 28:36] - half).max() <= 2
    palette = built["samples"]["palette.png"]["image"].astype(int)
    assert np.abs(palette[:, :28] - (10, 200, 10)).max() <= 1 and np.abs(palette[:, 36:] - BACKGROUND).max() <= 1


def test_a_16_bit_png_s_transparent_colour_is_composited_on_the_background(tmp_path):
    """A 16-bit PNG's tRNS names a 16-bit grey or RGB value; Pillow's RGBA conversion compared it with the 8-bit
    pixels and left the transparent area opaque. Left half: the transparent value, right half: an opaque one."""
    def halves(values, colour_type, key):
        row = b"\0" + struct.pack(f">{8 * len(values[0])}H", *(values[0] * 4 + values[1] * 4))
        plain = png_bytes(8, 2, 16, colour_type, row * 2)
        idat = plain.index(b"IDAT") - 4  # tRNS goes before the pixel data
        path = tmp_path / f"type{colour_type}.png"
        path.write_bytes(plain[:idat] + png_chunk(b"tRNS", key) + plain[idat:])
        return np.asarray(image_files.open_image(path, background=BACKGROUND)).astype(int)

    grey = halves(([0x1000], [0xF000]), 0, struct.pack(">H", 0x1000))
    assert (grey[:, :4] == BACKGROUND).all() and (grey[:, 4:] == round(0xF000 / 257)).all()
    rgb = halves(([0x1000, 0x2000, 0x3000], [0x9000, 0x2000, 0x3000]), 2, struct.pack(">3H", 0x1000, 0x2000, 0x3000))
    assert (rgb[:, :4] == BACKGROUND).all() and (rgb[:, 4:] == (0x90, 0x20, 0x30)).all()


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


def test_onetrainers_conditioning_images_and_non_png_masks_are_not_samples(tmp_path):
    """OneTrainer's collector leaves out every file whose name before the extension ends in -masklabel or -condlabel
    (mgds CollectPaths' exclude_postfix): a conditioning image beside its photo, or a mask saved as JPEG, is no sample
    (before: trained as an image, or the build stopped on its missing caption). Both are listed as not used."""
    from ot_dist.data.concepts import classify_files

    for name in ("a.png", "a-masklabel.png", "b.jpg", "b-condlabel.png", "b-masklabel.jpg"):
        Image.new("RGB", (16, 16)).save(tmp_path / name)
    for stem in ("a", "b"):
        (tmp_path / f"{stem}.txt").write_text("a photo")
    ((label, concept),) = make_config(tmp_path, tmp_path / "s").data.concept_list()
    images, unused = classify_files(label, concept)
    assert [p.name for p in images] == ["a.png", "b.jpg"]
    assert dict(unused) == {
        Path("b-condlabel.png"): "OneTrainer's conditioning image of its image (custom_conditioning_image), not a sample",
        Path("b-masklabel.jpg"): "a mask that is not a PNG (masks are <image name>-masklabel.png)"}


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
        assert unused["iphone.heic"] == unused["iphone-p3.heic"] == "install ot-dist[heic]"


# ---- colour given by an nclx box (H.273 code points), no ICC profile: AVIF / HEIC from phones and encoders ----

BT2020_PRIMARIES = [(0.708, 0.292), (0.170, 0.797), (0.131, 0.046)]  # ITU-R BT.2020, D65 white
BT2020_PATCHES = [(200, 150, 120), (140, 150, 190), (128, 128, 128), (140, 180, 120)]  # inside sRGB's gamut


def nclx_avif(path: Path, img: Image.Image, primaries: int, transfer: int) -> Path:
    """An AVIF whose colr box says nclx `primaries` / `transfer` (Pillow's writer always says BT.709 / sRGB: the
    two 16-bit code points are patched in the written box)."""
    out = io.BytesIO()
    img.save(out, "AVIF", quality=100, subsampling="4:4:4")
    data = bytearray(out.getvalue())
    at = data.index(b"colrnclx") + 8
    assert data[at:at + 4] == struct.pack(">HH", 1, 13)
    data[at:at + 4] = struct.pack(">HH", primaries, transfer)
    path.write_bytes(bytes(data))
    return path


def nclx_heic(path: Path, img: Image.Image, primaries: int, transfer: int) -> Path:
    pytest.importorskip("pillow_heif")
    image_files.heif_available()
    img.save(path, "HEIF", quality=-1, color_primaries=primaries, transfer_characteristics=transfer,
             matrix_coefficients=6, full_range_flag=1)
    return path


@pytest.mark.parametrize("write", [nclx_avif, nclx_heic], ids=["avif", "heic"])
def test_nclx_display_p3_and_bt2020_give_the_known_srgb_colours(write, tmp_path):
    """Decoders leave the primaries alone: a P3 (12) or BT.2020 (9) file with the sRGB curve (13) or BT.709's (1,
    read as sRGB's, as Chromium does) is converted in linear light, the reference computed from the primaries."""
    p3 = write(tmp_path / "p3.img", quarters("RGB", P3_PATCHES), 12, 13)
    bt2020 = write(tmp_path / "bt2020.img", quarters("RGB", BT2020_PATCHES), 9, 1)
    for path, colours, to_srgb in ((p3, P3_PATCHES, p3_to_srgb), (bt2020, BT2020_PATCHES, lambda c: xyz_d65_to_srgb8(
            rgb_to_xyz(BT2020_PRIMARIES, D65_XY) @ srgb_decode(np.array(c) / 255.0)))):
        patches = quarter_colours(np.asarray(image_files.open_image(path), dtype=float))
        with Image.open(path) as raw:  # the decoder's numbers, still in the file's primaries (lossy: near `colours`)
            decoded = quarter_colours(np.asarray(raw.convert("RGB"), dtype=float))
        for patch, colour, numbers in zip(patches, colours, decoded):
            assert np.abs(numbers - colour).max() <= 3, (path.name, colour, numbers.mean(0))
            reference = to_srgb(numbers[0])  # flat quarters: every pixel is the same
            assert (reference < 253).all(), (colour, reference)  # no channel over white (the sky blue clips at 0)
            assert np.abs(patch - reference).max() <= 1, (path.name, colour, patch.mean(0), reference)
        assert max(np.abs(np.array(c) - to_srgb(c)).max() for c in colours) > 20  # read as sRGB: far off


@pytest.mark.parametrize("write", [nclx_avif, nclx_heic], ids=["avif", "heic"])
def test_nclx_hdr_pq_and_hlg_are_refused_by_name(write, tmp_path):
    for transfer, name in ((16, "PQ"), (18, "HLG")):
        path = write(tmp_path / f"hdr{transfer}.img", quarters("RGB", P3_PATCHES), 9, transfer)
        with pytest.raises(image_files.UnreadableImage, match=rf"hdr{transfer}\.img.*HDR.*{name}"):
            image_files.open_image(path)


def test_nclx_avif_in_a_webdataset_tar_is_converted_as_a_file_is(tmp_path):
    """`shard index` decodes tar members from bytes: the AVIF's nclx box is read from them too."""
    from ot_dist.data.external import decode_image

    path = nclx_avif(tmp_path / "p3.avif", quarters("RGB", P3_PATCHES), 12, 13)
    from_file = np.asarray(image_files.open_image(path))
    assert np.array_equal(np.asarray(decode_image(path.read_bytes(), "tar member", (255, 255, 255))), from_file)
    with Image.open(path) as raw:
        assert np.abs(np.asarray(raw.convert("RGB"), dtype=int) - from_file).max() > 20  # converted, not as decoded


def test_heic_is_read_with_the_extra(built):
    if not built["info"]["heic"]:
        pytest.skip("pillow-heif is not installed (pip install ot-dist[heic])")
    assert "iphone.heic" in built["samples"]


def as_if_pillow_heif_was_not_registered(monkeypatch) -> None:
    """Pillow's registries as in a fresh process (until the test ends): pillow-heif registers when first asked."""
    for extension, kind in list(Image.registered_extensions().items()):
        if kind == "HEIF":
            monkeypatch.delitem(Image.EXTENSION, extension)
    monkeypatch.delitem(Image.OPEN, "HEIF", raising=False)
    monkeypatch.setattr(Image, "ID", [kind for kind in Image.ID if kind != "HEIF"])


def test_heic_and_mpo_files_are_images_on_the_first_scan_of_a_process(tmp_path, monkeypatch):
    """A fresh `ot-dist shard build` lists the folder before anything opened a HEIC: pillow-heif's extensions must
    be registered before Pillow's list is read, or an iPhone's photos are `not an image`. MPO files (3D cameras)
    are JPEGs with a second picture: Pillow opens them through its JPEG opener, the first picture is the photo. A
    link to a missing file is listed as not used, not passed over."""
    from PIL import Image

    from ot_dist.data.concepts import classify_files

    if not image_files.heif_available():
        pytest.skip("pillow-heif is not installed (pip install ot-dist[heic])")
    folder = tmp_path / "phone"
    folder.mkdir()
    Image.new("RGB", (16, 16), (90, 120, 220)).save(folder / "IMG_0001.HEIC")
    Image.new("RGB", (16, 16), (200, 30, 30)).save(folder / "DSCF0001.MPO", "MPO", save_all=True,
                                                   append_images=[Image.new("RGB", (16, 16))])
    for stem in ("IMG_0001", "DSCF0001"):
        (folder / f"{stem}.txt").write_text("a photo")
    as_if_pillow_heif_was_not_registered(monkeypatch)
    ((label, concept),) = make_config(folder, tmp_path / "s").data.concept_list()
    images, unused = classify_files(label, concept)
    assert [p.name for p in images] == ["DSCF0001.MPO", "IMG_0001.HEIC"] and unused == []
    (folder / "on-the-nas.jpg").symlink_to(tmp_path / "unmounted" / "on-the-nas.jpg")  # named, not passed over
    assert classify_files(label, concept)[1] == [(Path("on-the-nas.jpg"), "a link to a missing file")]
    first = image_files.open_image(folder / "DSCF0001.MPO").getpixel((8, 8))  # the first picture, not the black one
    assert np.abs(np.subtract(first, (200, 30, 30))).max() <= 4, first


def test_bomb_over_max_bad_fraction_exits_3_naming_it(built, tmp_path):
    """The CLI (its own process, as a user runs it, forked from the preloaded test server: tests/forked_ranks.py): a
    bomb among a few images is more than the default 1 %."""
    folder = tmp_path / "few"
    folder.mkdir()
    for name in ("bomb.png", "bomb.txt", "scan.tiff", "scan.txt", "notes.pdf"):
        (folder / name).write_bytes((built["root"] / "photos" / name).read_bytes())
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                                      "data": {"path": str(folder)}, "resolution": 64}))
    run = run_ranks("-m", "ot_dist", "shard", "build", config, "--out", tmp_path / "set", nproc=1, cwd=tmp_path,
                    env={"PYTHONPATH": str(REPO)}, timeout=300)
    assert run.returncode == 3, run.stderr
    assert "bomb.png" in run.stderr and "data.max_image_pixels" in run.stderr and "data.max_bad_fraction" in run.stderr
    assert "Traceback" not in run.stderr
    # With the bomb allowed for by the fraction, the build goes on and its report names the unused file.
    run = run_ranks("-m", "ot_dist", "shard", "build", config, "--out", tmp_path / "set", "--set",
                    "data.max_bad_fraction=0.5", nproc=1, cwd=tmp_path, env={"PYTHONPATH": str(REPO)}, timeout=300)
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


def test_two_ranks_train_on_the_camera_folder(built, tiny_models, tmp_path):
    """`ot-dist train` under torchrun (2 gloo ranks, DDP) on the camera folder itself, as docs/data.md says: the run
    builds the shard set, names the bomb as an unreadable image (within data.max_bad_fraction), warns about the tiny
    image and lists the unused files, then both ranks train the same number of batches, each global batch from one
    bucket, every readable image at most once per epoch and the bomb never."""
    from conftest import base_config
    from test_strategies import ENV, write_config


    raw = base_config(tiny_models["sd1"], built["root"] / "photos", tmp_path / "out", batch_size=2, strategy="ddp",
                      learning_rate=1e-5, log_every_steps=1,
                      **{"data.bucket_step": 16, "data.max_bad_fraction": 0.1, "data.image_background": "#204080",
                         "data.image_format": "png"})  # the module's build settings
    done = run_ranks(str(REPO / "tests" / "helpers" / "train_recording_batches.py"), "train",
                     str(write_config(tmp_path / "train.yaml", raw)), env={**ENV, "BATCH_REPORT_DIR": str(tmp_path)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out, samples = done.stdout, len(built["samples"])  # 21 readable images, 23 with pillow-heif's 2 HEICs
    assert f"1 of {samples + 1} images unreadable" in out
    assert re.search(r"image \S+/photos/bomb\.png is 20000x20000 = 400000000 pixels, over data\.max_image_pixels", out)
    assert "tiny.png (8x8 for a 64x64 bucket)" in out
    assert "2 files not used: notes.pdf (not an image), orphan.txt (a caption without its image)" in out
    assert f"total: {samples} samples/epoch, 5 steps/epoch" in out and "step 5/5 epoch 1/1" in out
    assert "done: 5 steps" in out and (tmp_path / "out" / "model.safetensors").exists()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 5  # equal steps per rank
    for mine, theirs in zip(*ranks):  # a global batch is one bucket: both halves have its size
        assert mine["shape"] == theirs["shape"] and mine["shape"][:2] == [2, 3], (mine, theirs)
    trained = [i for rank in ranks for batch in rank for i in batch["sample_id"]]
    assert len(trained) == len(set(trained)) == 20  # 3 of the 1:1 bucket dropped (1 without HEIC) this epoch
    # The run's own set holds what the module's build stored (same files, same settings): its indices name them.
    names = {entry["index"]: name for name, entry in built["samples"].items()}
    assert read_manifest(tmp_path / "out-shards")["samples"] == built["manifest"]["samples"]
    by_shape = {}
    for batch in ranks[0] + ranks[1]:
        by_shape.setdefault(tuple(batch["shape"][2:]), set()).update(names[i] for i in batch["sample_id"])
    assert by_shape[(96, 48)] == {f"orient{o}.jpg" for o in (5, 6, 7, 8)}  # upright portraits: trained tall
    assert by_shape[(48, 96)] == {f"orient{o}.jpg" for o in (1, 2, 3, 4)}
    assert "bomb.png" not in set().union(*by_shape.values()) and len(by_shape[(64, 64)]) == 12
