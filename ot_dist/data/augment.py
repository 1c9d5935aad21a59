"""Image augmentation per concept (OneTrainer's image options): random horizontal flip, rotation, and brightness /
contrast / saturation / hue jitter, applied to the cropped bucket image (and its mask, for the geometric ones; and
its reference image, for every one) as it is read. Drawn from a generator keyed by (seed, epoch, sample id): the same on every rank and world size, new every
epoch. A latent cache holds a concept's augmentation as `image_variations` versions of each image (variations.py);
with one version an augmenting concept cannot use it (the config refuses it)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageEnhance


# The concept options (ConceptConfig fields) that change what an image looks like; 0 = off.
AUGMENTATION_FIELDS = ("flip_probability", "rotation_degrees", "brightness", "contrast", "saturation", "hue")


def has_augmentation(concept) -> bool:
    return any(getattr(concept, field) for field in AUGMENTATION_FIELDS)


def augment(image: Image.Image, mask: Image.Image | None, concept, gen: torch.Generator):
    """(image, mask) after the concept's augmentation; the same objects when it has none. Every draw is made whether
    or not its option is on, so switching one option on does not change the draws of the others."""
    image, mask, _ = augment_with_reference(image, mask, None, concept, gen)
    return image, mask


def augment_with_reference(image: Image.Image, mask: Image.Image | None, reference: Image.Image | None, concept,
                           gen: torch.Generator):
    """(image, mask, reference): `augment`, with an edit model's reference image (cropped like the image) given the
    very same flip, rotation and colour factors, so the pair keeps the relation the caption describes (diffusers'
    Kontext script flips both or neither; SimpleTuner's reference_strict transforms the reference as the edit). The
    image's draws are those of `augment`: adding references changes no image."""
    image, mask, references = augment_with_references(image, mask, [] if reference is None else [reference], concept,
                                                      gen)
    return image, mask, references[0] if references else None


def augment_with_references(image: Image.Image, mask: Image.Image | None, references: list, concept,
                            gen: torch.Generator):
    """(image, mask, references): `augment_with_reference` for several reference images (FLUX.2, Qwen-Image-Edit-2509),
    every one given the image's flip, rotation and colour factors. The draws do not depend on how many there are."""
    if concept is None or not has_augmentation(concept):
        return image, mask, references
    u = torch.rand(6, generator=gen).tolist()
    image, mask = _geometric(image, mask, image.size, concept, u)
    references = [_colour(_geometric(r, None, r.size, concept, u)[0], concept, u) for r in references]
    return _colour(image, concept, u), mask, references


def _colour(image: Image.Image, concept, u: list[float]) -> Image.Image:
    for factor, enhancer, draw in ((concept.brightness, ImageEnhance.Brightness, u[2]),
                                   (concept.contrast, ImageEnhance.Contrast, u[3]),
                                   (concept.saturation, ImageEnhance.Color, u[4])):
        if factor:  # a strength of 1 or more: the factors below 0 are 0, as mgds clamps them (max(0, factor))
            image = enhancer(image).enhance(max(0.0, 1 + (2 * draw - 1) * factor))
    if concept.hue:
        image = shift_hue(image, (2 * u[5] - 1) * concept.hue)
    return image


def augment_mask(mask: Image.Image | None, size: tuple[int, int], concept, gen: torch.Generator) -> Image.Image | None:
    """The mask `augment` gives beside an image of `size` (width, height) with the same generator, without the image:
    a cached latent's version holds the augmented image, its mask is augmented as it is read."""
    if concept is None or not has_augmentation(concept):
        return mask
    return _geometric(None, mask, size, concept, torch.rand(6, generator=gen).tolist())[1]


def _geometric(image: Image.Image | None, mask: Image.Image | None, size: tuple[int, int], concept, u: list[float]):
    """The flip and the rotation, of the image (when given) and its mask."""
    if u[0] < concept.flip_probability:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if image is not None else None
        mask = mask.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if mask is not None else None
    if concept.rotation_degrees:
        angle = (2 * u[1] - 1) * concept.rotation_degrees
        # Same size, corners filled from the mirrored image would invent content; black corners are what
        # OneTrainer's rotation leaves too, and the mask marks them as not trained.
        image = image.rotate(angle, resample=Image.Resampling.BICUBIC) if image is not None else None
        mask = (mask if mask is not None else Image.new("L", size, 255)).rotate(angle, Image.Resampling.BILINEAR)
    return image, mask


def shift_hue(image: Image.Image, turn: float) -> Image.Image:
    """Rotate every pixel's hue by `turn` of a full circle (-0.5 .. 0.5), saturation and value kept: the HSV
    rotation of torchvision's adjust_hue (what OneTrainer applies), in floating point and rounded to 8 bits once.
    (Pillow's 8-bit HSV round trip moved colours by up to 11 levels, 6 with no turn at all.)"""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    high, low = rgb.max(axis=-1), rgb.min(axis=-1)
    chroma = high - low  # the turn keeps each pixel's largest and smallest channel
    span = np.where(chroma > 0, chroma, 1)  # a grey pixel has no hue and stays grey
    sixths = np.where(high == r, (g - b) / span, np.where(high == g, 2 + (b - r) / span, 4 + (r - g) / span))
    sixths = (sixths + 6 * turn) % 6  # the hue in sixths of a turn: 0 red, 2 green, 4 blue
    # each channel's share of the chroma along the colour circle (the HSV hexcone)
    shares = (np.abs(sixths - 3) - 1, 2 - np.abs(sixths - 2), 2 - np.abs(sixths - 4))
    out = np.stack([low + chroma * np.clip(share, 0, 1) for share in shares], axis=-1)
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8), "RGB")
