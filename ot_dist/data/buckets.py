"""Aspect-ratio buckets, as OneTrainer makes them.

A bucket is an aspect ratio from a fixed list (1:1 up to 1:4, both orientations). At a training
resolution R its size is the rectangle of that aspect with about R x R pixels, sides rounded to
multiples of `step`. Because the bucket of an image is its aspect, not a size, it is the same at
every resolution; that is what lets a multi-resolution run draw the resolution per step while
every global batch still holds one bucket.
"""

from __future__ import annotations

import math

from PIL import Image

# height / width of each bucket, from the tallest to the widest (OneTrainer's list, both orientations).
_SIDES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)
ASPECTS: tuple[float, ...] = tuple(sorted({s for s in _SIDES} | {1 / s for s in _SIDES}, reverse=True))


def bucket_of(width: int, height: int) -> int:
    """The index in ASPECTS of the aspect nearest to the image's (in log ratio)."""
    ratio = math.log(height / width)
    return min(range(len(ASPECTS)), key=lambda i: abs(math.log(ASPECTS[i]) - ratio))


def bucket_size(bucket: int, resolution: int, step: int) -> tuple[int, int]:
    """(height, width) of a bucket at a resolution: about resolution^2 pixels, sides multiples of step."""
    aspect = ASPECTS[bucket]
    height = max(step, round(resolution * math.sqrt(aspect) / step) * step)
    width = max(step, round(resolution / math.sqrt(aspect) / step) * step)
    return height, width


def aspect_name(bucket: int) -> str:
    aspect = ASPECTS[bucket]
    return f"1:{1 / aspect:g} (wide)" if aspect < 1 else f"{aspect:g}:1 (tall)" if aspect > 1 else "1:1"


def resize_to_cover(img: Image.Image, size: tuple[int, int], resample=Image.Resampling.BICUBIC) -> Image.Image:
    """Scale (keeping the aspect) to the smallest size covering `size` = (height, width); the crop to
    the exact bucket happens when reading, so a random crop can differ per epoch."""
    height, width = size
    scale = max(width / img.width, height / img.height)
    new = (max(width, round(img.width * scale)), max(height, round(img.height * scale)))
    return img.resize(new, resample)
