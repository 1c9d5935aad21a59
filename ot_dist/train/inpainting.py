"""The inpainting condition of a training step: which pixels to repaint and the image without them.

Conventions are those of diffusers' inpainting pipelines (StableDiffusion(XL)InpaintPipeline,
FluxFillPipeline), so a finetuned model sees at inference exactly what it trained on: mask 1 (white) =
repaint; the mask is binarised at 0.5; the masked image is `image * (mask < 0.5)` (pixels in [-1, 1], so
the repainted area becomes 0). How mask and masked-image latent meet the noisy latent is the family's
(`Family.inpainting_condition`: SD's UNets take the mask scaled to latent size, Flux.1 Fill's transformer
the pixel mask folded into channels).

A sample's mask is its `-masklabel.png` (white = the area to learn, so also the area to repaint). A
sample without one gets a random mask from a generator keyed by (seed, epoch, sample id), like its
noise: the same on any rank, in any batch.
"""

from __future__ import annotations

import math

import torch

from ot_dist.errors import ConfigError
from ot_dist.randomness import generator

# Shares of the random masks: the whole image (keeps plain text-to-image working, as the original SD
# inpainting training did with a quarter of its masks), else a rectangle or brush strokes evenly.
WHOLE_IMAGE_SHARE = 0.25
RECTANGLE_SHARE = 0.375


def check_inpainting_setup(config, model) -> None:
    """Before training: an inpainting or depth-conditioned model (detected after loading) needs the images every
    step."""
    if model.inpainting and config.data.cache_latents:
        raise ConfigError("data.cache_latents: model.path is an inpainting model, which encodes each step's masked "
                          "image with the VAE; turn cache_latents off")
    if model.depth_conditioned and config.data.cache_latents:
        raise ConfigError("data.cache_latents: model.path is a depth-conditioned model, which computes each step's "
                          "depth map from the images; turn cache_latents off")


def inpainting_masks(batch: dict, seed: int, epoch: int) -> torch.Tensor:
    """(B, 1, H, W) binary repaint masks at pixel size: each sample's own mask, else a random one."""
    height, width = batch["pixels"].shape[-2:]
    given = batch.get("mask_given")
    masks = []
    for row, sample_id in enumerate(batch["sample_id"].tolist()):
        if given is not None and bool(given[row]):
            masks.append((batch["mask"][row] >= 0.5).float())  # diffusers' binarize
        else:
            masks.append(random_mask(height, width, generator(seed, epoch, sample_id, "inpainting_mask")))
    return torch.stack(masks)


def masked_pixels(pixels: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The image with the area to repaint blanked (0 in [-1, 1]), as the inpainting pipelines build it."""
    return pixels * (masks < 0.5).to(pixels)


def random_mask(height: int, width: int, g: torch.Generator) -> torch.Tensor:
    """(1, H, W): the whole image, one rectangle, or 1-3 brush strokes."""
    kind = float(torch.rand(1, generator=g))
    if kind < WHOLE_IMAGE_SHARE:
        return torch.ones(1, height, width)
    if kind < WHOLE_IMAGE_SHARE + RECTANGLE_SHARE:
        return _rectangle(height, width, g)
    return _strokes(height, width, g)


def _uniform(g: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(1, generator=g))


def _rectangle(height: int, width: int, g: torch.Generator) -> torch.Tensor:
    h = max(1, round(height * _uniform(g, 0.2, 0.8)))
    w = max(1, round(width * _uniform(g, 0.2, 0.8)))
    top, left = round((height - h) * _uniform(g, 0, 1)), round((width - w) * _uniform(g, 0, 1))
    mask = torch.zeros(1, height, width)
    mask[:, top:top + h, left:left + w] = 1
    return mask


def _strokes(height: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Thick polylines: each stroke a few segments with random turns, like a user's brush."""
    side = min(height, width)
    ys = torch.arange(height, dtype=torch.float32)[:, None]
    xs = torch.arange(width, dtype=torch.float32)[None, :]
    mask = torch.zeros(height, width, dtype=torch.bool)
    for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
        y, x = _uniform(g, 0, height), _uniform(g, 0, width)
        radius = side * _uniform(g, 0.03, 0.1)
        angle = _uniform(g, 0, 2 * math.pi)
        for _ in range(int(torch.randint(2, 6, (1,), generator=g))):
            angle += _uniform(g, -1.5, 1.5)
            length = side * _uniform(g, 0.1, 0.4)
            y2 = min(max(y + length * math.sin(angle), 0.0), height - 1.0)
            x2 = min(max(x + length * math.cos(angle), 0.0), width - 1.0)
            mask |= _segment_distance(ys, xs, (y, x), (y2, x2)) <= radius
            y, x = y2, x2
    return mask.float()[None]


def _segment_distance(ys: torch.Tensor, xs: torch.Tensor, start: tuple[float, float], end: tuple[float, float]):
    """Distance of every pixel centre to the segment start-end."""
    dy, dx = end[0] - start[0], end[1] - start[1]
    t = ((ys - start[0]) * dy + (xs - start[1]) * dx) / max(dy * dy + dx * dx, 1e-6)
    t = t.clamp(0, 1)
    return torch.hypot(ys - (start[0] + t * dy), xs - (start[1] + t * dx))
