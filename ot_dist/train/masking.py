"""Masked training: the per-element loss weights from each sample's mask, and the check that every
sample has a mask when that is required.

The data layer carries `batch["mask"]` (B, 1, H, W, float in [0, 1], white = 1) through the same
resize and crop as the pixels; here it is scaled to latent resolution by area averaging, so a
latent element's weight is the share of its 8x8 pixels that are to be learned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ot_dist.config.loss import MaskedTrainingConfig
from ot_dist.errors import InputFileError
from ot_dist.randomness import generator


def trains_unmasked(sample_id: int, probability: float, seed: int, epoch: int) -> bool:
    """Whether this sample ignores its mask this epoch: its own draw, the same on any rank or batch."""
    return bool(torch.rand(1, generator=generator(seed, epoch, sample_id, "mask")) < probability)


def mask_weights(batch: dict, latent_size: tuple[int, int], options: MaskedTrainingConfig, seed: int,
                 epoch: int) -> torch.Tensor | None:
    """Loss weights (B, 1, h, w): the mask clamped to [unmasked_weight, 1] as OneTrainer's masked_losses does
    (equal to mask + (1 - mask) x unmasked_weight for a binary mask; a soft edge keeps its own value above
    unmasked_weight), all ones for a sample drawn to train unmasked. None when masked training is off or no
    sample of the data set has a mask."""
    if not options.enabled or "mask" not in batch:
        return None
    mask = F.interpolate(batch["mask"].float(), size=tuple(latent_size), mode="area")
    unmasked = torch.tensor([trains_unmasked(i, options.unmasked_probability, seed, epoch)
                             for i in batch["sample_id"].tolist()])
    mask = torch.where(unmasked[:, None, None, None], torch.ones_like(mask), mask)
    return torch.clamp(mask, options.unmasked_weight, 1.0)


def check_masks(dataset, options: MaskedTrainingConfig, log=print) -> None:
    """Under masked training, samples without a mask are an error naming them (missing_mask: error)
    or train on the whole image (missing_mask: unmasked)."""
    if not options.enabled:
        return
    missing = dataset.without_masks()
    if not missing:
        return
    if options.missing_mask == "unmasked":
        log(f"masked_training: {len(missing)} of {len(dataset)} samples have no mask; they train on the whole image")
        return
    shown = []
    for i in missing[:5]:
        source = dataset.metadata(i).get("source") or "?"
        shown.append(f"sample {dataset.samples[i]['key']} (image {source})")
    more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
    raise InputFileError(
        f"masked_training: {len(missing)} of {len(dataset)} samples have no mask (`<image name>-masklabel.png` beside "
        f"the image): {'; '.join(shown)}{more}. Add the masks, or set masked_training.missing_mask: unmasked to train "
        "them on the whole image"
    )
