"""Opening an image file as a user sees it: upright, sRGB, 8-bit RGB, transparency on a background.

One job: a file from a camera, a phone or the web becomes the pixels the shard builder stores.
- EXIF orientation (1-8) is applied (`ImageOps.exif_transpose`), so the size is the upright size.
- Every format Pillow reads (PNG, JPEG, WebP, BMP, AVIF, TIFF, GIF, ...); animated GIF / WebP give their first
  frame; HEIC / HEIF through pillow-heif (the `[heic]` extra) when it is installed.
- Colour: an embedded ICC profile (Display P3, Adobe RGB, a CMYK press profile) is converted to sRGB with
  LittleCMS, relative colorimetric (a colour sRGB can show comes out as that colour, the paper or media white as
  sRGB white; out-of-gamut colours are clipped), without black point compensation; CMYK without a profile by
  Pillow's conversion; 16-bit greyscale (`I;16`, `I`) scaled to 8 bits (Pillow's own conversion clips everything
  above 255 to white); alpha (RGBA, LA, PA, palette or RGB transparency, 16-bit ones included) composited on
  `data.image_background`.
- An AVIF / HEIC without an ICC profile whose colour is given by its nclx box (ITU-T H.273 code points) and has
  primaries other than sRGB's (Display P3, BT.2020, ...) is converted to sRGB in linear light (see `nclx.py`); an
  HDR one (PQ, HLG transfer) raises `UnreadableImage`: it has no faithful SDR reading.
  The result carries no ICC profile (nor any other `info`): its pixels are sRGB.
- The pixel limit (`data.max_image_pixels`) is checked from the header before anything is decoded; an image
  over it, or one that does not decode, raises `UnreadableImage` naming the file.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms, ImageColor, ImageOps, UnidentifiedImageError

from ot_dist.data.nclx import avif_nclx, nclx_to_srgb
from ot_dist.errors import InputFileError

DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS  # Pillow's own limit (89,478,485 px), read before anyone changes it
HEIF_EXTENSIONS = {".heic", ".heif", ".hif"}
_SRGB = ImageCms.createProfile("sRGB")
_PROFILE_MODES = {"RGB": "RGB", "CMYK": "CMYK", "GRAY": "L"}


class UnreadableImage(InputFileError):
    """An image that cannot be used as a sample: broken, empty, over the pixel limit."""


def heif_available() -> bool:
    """Register pillow-heif's opener once if it is installed."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


def image_extensions() -> set[str]:
    """Extensions Pillow can open here (with pillow-heif registered when installed)."""
    heif = heif_available()  # registers .heic / .heif first: listed before, a fresh process's first scan missed them
    # MPO (cameras' and Android Ultra HDR photos: a JPEG with more pictures after it) is opened by the JPEG opener,
    # so it has no opener of its own in Image.OPEN; Image.open gives its first picture.
    extensions = {ext.lower() for ext, fmt in Image.registered_extensions().items()
                  if fmt in Image.OPEN or fmt == "MPO"}
    return extensions if heif else extensions - HEIF_EXTENSIONS


def parse_colour(value: str) -> tuple[int, int, int]:
    """A colour as Pillow names it: `white`, `#808080`, `rgb(127,127,127)`."""
    return ImageColor.getrgb(value)[:3]


def open_image(path: Path, max_pixels: int | None = DEFAULT_MAX_PIXELS,
               background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """The upright sRGB RGB pixels of `path`. Raises UnreadableImage (naming the file) when it cannot be used."""
    with _opened(path, max_pixels) as img:
        note_nclx(img)
        try:
            return to_srgb_rgb(ImageOps.exif_transpose(img), background)
        except (OSError, ValueError, SyntaxError, EOFError) as err:  # truncated data shows up while decoding
            raise UnreadableImage(f"data: image {path} could not be decoded: {err}") from None


def open_mask(path: Path) -> Image.Image:
    """A mask (drawn on the image as displayed): its own EXIF orientation applied, as 8-bit L."""
    with _opened(path, DEFAULT_MAX_PIXELS) as mask:
        try:
            mask = ImageOps.exif_transpose(mask)
            return _to_8bit(mask).convert("L") if _is_wide_int(mask) else mask.convert("L")
        except (OSError, ValueError, SyntaxError, EOFError) as err:
            raise InputFileError(f"data: mask {Path(path).resolve()} could not be decoded: {err}") from None


class _opened:
    """Image.open with our pixel limit instead of Pillow's global one, and its errors named."""

    def __init__(self, path: Path, max_pixels: int | None):
        self.path, self.max_pixels = Path(path), max_pixels

    def __enter__(self) -> Image.Image:
        if self.path.suffix.lower() in HEIF_EXTENSIONS and not heif_available():
            raise UnreadableImage(f"data: image {self.path} is HEIC / HEIF: install ot-dist[heic] (pillow-heif)")
        limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # we check below, against data.max_image_pixels
        try:
            self.img = Image.open(self.path)
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
            raise UnreadableImage(f"data: image {self.path} could not be decoded: {err}") from None
        finally:
            Image.MAX_IMAGE_PIXELS = limit
        width, height = self.img.size
        if self.max_pixels is not None and width * height > self.max_pixels:
            self.img.close()
            raise UnreadableImage(f"data: image {self.path} is {width}x{height} = {width * height} pixels, over "
                                  f"data.max_image_pixels {self.max_pixels} (a decompression bomb, or raise the limit)")
        return self.img

    def __exit__(self, *exc) -> None:
        self.img.close()


def note_nclx(img: Image.Image) -> None:
    """An AVIF's nclx colour box into `info["nclx_profile"]`, as pillow-heif puts a HEIC's (Pillow does not read it).

    Called on the freshly opened file, before anything decodes (the bytes are read again from its start)."""
    if img.format != "AVIF" or "icc_profile" in img.info or img.fp is None:
        return
    position = img.fp.tell()
    img.fp.seek(0)
    try:
        nclx = avif_nclx(img.fp.read())
    finally:
        img.fp.seek(position)
    if nclx is not None:
        img.info["nclx_profile"] = nclx


def _is_wide_int(img: Image.Image) -> bool:
    return img.mode == "I" or img.mode.startswith("I;16")


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit greyscale (I;16*, or I as Pillow opens 16-bit PNGs) -> L, 0..65535 scaled to 0..255."""
    values = np.asarray(img.convert("I"), dtype=np.int64)
    return Image.fromarray(np.clip((values + 128) // 257, 0, 255).astype(np.uint8), "L")


def _alpha(img: Image.Image) -> Image.Image | None:
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return img.convert("RGBA").getchannel("A")
    key = img.info.get("transparency")
    if key is None:
        return None
    # A 16-bit PNG's transparent colour (tRNS) is a 16-bit value, which Pillow's RGBA conversion compares with
    # 8-bit pixels (never equal: the transparent area came out opaque): 16-bit greyscale compares the 16-bit values,
    # 16-bit RGB (opened as 8 bits, the high bytes) the high bytes of the key.
    if _is_wide_int(img) and isinstance(key, int):
        return Image.fromarray(np.where(np.asarray(img.convert("I")) == key, 0, 255).astype(np.uint8), "L")
    if img.mode == "RGB" and isinstance(key, tuple) and max(key) > 255:
        return Image.fromarray(np.where((np.asarray(img) == [v >> 8 for v in key]).all(-1), 0, 255).astype(np.uint8))
    if img.mode in ("P", "L", "RGB", "1"):
        return img.convert("RGBA").getchannel("A")
    return None


def to_srgb_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Any decoded image -> 8-bit sRGB RGB, alpha composited on `background`."""
    img.load()
    icc = img.info.get("icc_profile")
    alpha = _alpha(img)
    if _is_wide_int(img):
        img = _to_8bit(img)
    rgb = _convert_profile(img, icc) if icc else None
    if rgb is None:
        rgb = img.convert("RGB")  # CMYK, YCbCr, L, P ... by Pillow's conversions (sRGB assumed)
        if not icc and img.info.get("nclx_profile"):  # an ICC profile, even one ignored, wins over nclx (as in browsers)
            rgb = nclx_to_srgb(rgb, img.info["nclx_profile"])
    if alpha is not None:
        rgb = Image.composite(rgb, Image.new("RGB", rgb.size, background), alpha)
    # Only pixels: no ICC profile (LittleCMS' sRGB, whose header holds the time it was made, or the source's own
    # profile when it was not applied) nor transparency may follow them into the shards, where Pillow's PNG writer
    # would store them: a viewer would convert the sRGB pixels again, and no two builds would be byte-identical.
    rgb.info.clear()
    return rgb


def _convert_profile(img: Image.Image, icc: bytes) -> Image.Image | None:
    """The image through its ICC profile into sRGB, or None when the profile does not fit the pixels."""
    try:
        source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
    except (ImageCms.PyCMSError, OSError, TypeError, ValueError):
        return None  # an unreadable profile: the pixels are taken as sRGB
    mode = _PROFILE_MODES.get(source.profile.xcolor_space.strip())
    if mode is None:
        return None
    if img.mode != mode:
        if mode == "CMYK" or img.mode == "CMYK" or (mode == "L" and img.mode not in ("LA", "La", "1")):
            # a CMYK profile on RGB pixels (or the reverse), a grey one on colour pixels: a broken file, whose
            # profile viewers ignore; trust the pixels (a grey profile would turn them grey)
            return None
        img = img.convert(mode)
    try:
        # Relative colorimetric, not ImageCms' default perceptual: LittleCMS forces black point compensation on a
        # perceptual transform into its (v4) sRGB profile, which darkens every CMYK colour towards the ink black.
        return ImageCms.profileToProfile(img, source, _SRGB, renderingIntent=ImageCms.Intent.RELATIVE_COLORIMETRIC,
                                         outputMode="RGB")
    except ImageCms.PyCMSError:
        return None
