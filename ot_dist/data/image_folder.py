"""A folder of images with same-name caption files, resized and cropped to one square resolution.

This is the foundation's data source; the sharded bucket pipeline replaces the internals later but
keeps the batch layout: pixels in [-1, 1], captions, sample ids, and SDXL's size/crop conditioning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ot_dist.config.schema import DataConfig
from ot_dist.errors import InputFileError
from ot_dist.randomness import generator

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


@dataclass(frozen=True)
class SampleFile:
    sample_id: int
    image: Path
    caption: str


class ImageFolderDataset:
    def __init__(self, config: DataConfig, resolution: int, seed: int):
        self.config = config
        self.resolution = resolution
        self.seed = seed
        self.samples = scan_folder(config)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int, epoch: int) -> dict:
        sample = self.samples[index]
        try:
            with Image.open(sample.image) as img:
                img = img.convert("RGB")
                original = (img.height, img.width)
                pixels, crop = self._resize_crop(img, sample.sample_id, epoch)
        except (OSError, UnidentifiedImageError, ValueError) as err:
            raise InputFileError(f"data: image {sample.image} could not be decoded: {err}") from None
        return {
            "pixels": pixels,
            "caption": sample.caption,
            "sample_id": sample.sample_id,
            "original_size": torch.tensor(original, dtype=torch.float32),
            "crop_top_left": torch.tensor(crop, dtype=torch.float32),
            "target_size": torch.tensor((self.resolution, self.resolution), dtype=torch.float32),
        }

    def _resize_crop(self, img: Image.Image, sample_id: int, epoch: int):
        size = self.resolution
        scale = size / min(img.width, img.height)
        width, height = max(size, round(img.width * scale)), max(size, round(img.height * scale))
        img = img.resize((width, height), Image.Resampling.BICUBIC)
        if self.config.crop == "random":
            g = generator(self.seed, epoch, sample_id, "crop")
            top = int(torch.randint(0, height - size + 1, (1,), generator=g))
            left = int(torch.randint(0, width - size + 1, (1,), generator=g))
        else:
            top, left = (height - size) // 2, (width - size) // 2
        img = img.crop((left, top, left + size, top + size))
        array = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous(), (top, left)


def scan_folder(config: DataConfig) -> list[SampleFile]:
    root = Path(config.path)
    if not root.is_dir():
        raise InputFileError(f"data.path: {root} is not a folder")
    pattern = "**/*" if config.include_subdirectories else "*"
    images = sorted(p for p in root.glob(pattern) if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not images:
        raise InputFileError(f"data.path: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {root}")
    samples = []
    for sample_id, image in enumerate(images):
        verify_image(image)
        caption_file = image.with_suffix(config.caption_extension)
        if not caption_file.is_file():
            raise InputFileError(
                f"data: {image} has no caption file {caption_file.name} (data.caption_extension={config.caption_extension})"
            )
        try:
            caption = caption_file.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError as err:
            raise InputFileError(f"data: caption {caption_file} is not UTF-8 text: {err}") from None
        samples.append(SampleFile(sample_id=sample_id, image=image, caption=caption))
    return samples


def verify_image(path: Path) -> None:
    """Decode the image once up front, so a broken file fails before training, naming the file."""
    try:
        with Image.open(path) as img:
            img.load()
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise InputFileError(f"data: image {path} could not be decoded: {err}") from None


def collate(samples: list[dict]) -> dict:
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("pixels", "original_size", "crop_top_left", "target_size")}
    batch["caption"] = [s["caption"] for s in samples]
    batch["sample_id"] = torch.tensor([s["sample_id"] for s in samples])
    return batch


def epoch_batches(dataset: ImageFolderDataset, batch_size: int, epoch: int, seed: int, rank: int = 0, world_size: int = 1):
    """This rank's micro batches of one epoch. The shuffle is keyed by (seed, epoch); each global
    batch (batch_size x world_size consecutive samples of it) is split into one slice per rank, so
    N ranks with batch b see exactly the samples 1 process with batch N*b sees. The last partial
    global batch is dropped, so every rank runs the same number of steps."""
    order = torch.randperm(len(dataset), generator=generator(seed, epoch, "shuffle")).tolist()
    global_batch = batch_size * world_size
    for start in range(0, len(order) - global_batch + 1, global_batch):
        mine = order[start + rank * batch_size : start + (rank + 1) * batch_size]
        yield collate([dataset.load(i, epoch) for i in mine])
