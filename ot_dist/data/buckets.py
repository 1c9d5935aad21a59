"""Aspect-ratio buckets with OneTrainer's aspects, sizes and assignment (mgds AspectBucketing).

A bucket is an aspect ratio from a fixed list (1:1 up to 1:4, both orientations). At a training
resolution R its size is the rectangle of that aspect with about R x R pixels, sides rounded to
multiples of `step` (the family's: 8 for SD 1.x / 2.x, 64 for the others, as OneTrainer quantizes).
An image goes to the bucket whose *rounded* size has the nearest height / width (linear difference),
as OneTrainer assigns; `log_ratio` (data.bucket_assignment) keeps ot_dist's earlier rule, the nearest
ideal aspect in log ratio; `square` puts every image in the 1:1 bucket (OneTrainer's aspect_ratio_bucketing false,
mgds SingleAspectCalculation: scaled to cover the square, then cropped, centred or at random as data.crop says).

Unlike OneTrainer, which assigns per drawn resolution, the bucket of an image is one aspect for every
resolution (assigned at the largest): that is what lets a multi-resolution run draw the resolution per
step while every global batch still holds one bucket. With one resolution the two agree.
"""

from __future__ import annotations

import math

from PIL import Image

# height / width of each bucket, from the tallest to the widest (OneTrainer's list, both orientations).
_SIDES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)
ASPECTS: tuple[float, ...] = tuple(sorted({s for s in _SIDES} | {1 / s for s in _SIDES}, reverse=True))
SQUARE = ASPECTS.index(1.0)


def bucket_of(width: int, height: int, resolution: int, step: int, assignment: str = "rounded_aspect") -> int:
    """The index in ASPECTS of the image's bucket: the one whose size at `resolution` (sides multiples of
    `step`) has the height / width nearest the image's (rounded_aspect, OneTrainer's), or whose ideal aspect
    is nearest in log ratio (log_ratio), or the square one whatever the image's aspect (square). Between buckets of
    equally near rounded sizes (at a coarse step several aspects round to one size, 1:1 and 1.25:1 both to 64x64 at
    64 px) the nearest ideal aspect wins."""
    if assignment == "square":
        return SQUARE
    ratio = math.log(height / width)
    by_ideal = [abs(math.log(a) - ratio) for a in ASPECTS]
    if assignment == "log_ratio":
        return min(range(len(ASPECTS)), key=lambda i: by_ideal[i])
    if assignment != "rounded_aspect":
        raise ValueError(f"data.bucket_assignment: unknown {assignment!r}")
    aspect = height / width
    rounded = [h / w for h, w in (bucket_size(i, resolution, step) for i in range(len(ASPECTS)))]
    return min(range(len(ASPECTS)), key=lambda i: (abs(rounded[i] - aspect), by_ideal[i]))


def bucket_size(bucket: int, resolution: int, step: int) -> tuple[int, int]:
    """(height, width) of a bucket at a resolution: about resolution^2 pixels, sides multiples of step (OneTrainer:
    h / sqrt(h w) x R rounded to the step)."""
    aspect = ASPECTS[bucket]
    height = max(step, round(resolution * math.sqrt(aspect) / step) * step)
    width = max(step, round(resolution / math.sqrt(aspect) / step) * step)
    return height, width


def merged_buckets(resolutions: list[int], step: int) -> dict[int, int]:
    """Bucket -> the bucket it trains in. Aspects whose sizes coincide at every training resolution (at 512 px and a
    step of 64, 2:1 and 1.75:1 are both 704x384) are one bucket: kept apart, each would fill fewer global batches and
    drop more samples. The representative is the aspect nearest the shared size's own aspect."""
    sizes = {b: tuple(bucket_size(b, r, step) for r in resolutions) for b in range(len(ASPECTS))}
    merged = {}
    for b, size in sizes.items():
        same = [o for o, s in sizes.items() if s == size]
        height, width = size[-1]
        merged[b] = min(same, key=lambda o: (abs(math.log(ASPECTS[o]) - math.log(height / width)), o))
    return merged


def config_bucket_of(config, width: int, height: int) -> int:
    """bucket_of with the config's resolution (the largest), bucket step and assignment."""
    data = config.data
    return bucket_of(width, height, max(config.resolutions()), data.bucket_step, data.bucket_assignment)


def aspect_name(bucket: int) -> str:
    aspect = ASPECTS[bucket]
    return f"1:{1 / aspect:g} (wide)" if aspect < 1 else f"{aspect:g}:1 (tall)" if aspect > 1 else "1:1"


def resize_to_cover(img: Image.Image, size: tuple[int, int], resample=Image.Resampling.BICUBIC) -> Image.Image:
    """Scale (keeping the aspect) to the smallest size covering `size` = (height, width); the crop to
    the exact bucket happens when reading, so a random crop can differ per epoch."""
    return img.resize(cover_size(img.width, img.height, size), resample)


def cover_size(image_width: int, image_height: int, size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) resize_to_cover gives an image of that size for `size` = (height, width)."""
    height, width = size
    scale = max(width / image_width, height / image_height)
    return max(width, round(image_width * scale)), max(height, round(image_height * scale))
