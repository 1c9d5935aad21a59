"""Concepts: folders of images with their captions and optional masks, scanned into a sample list.

Errors name the file and the config key of the concept, so a user can fix the data before any
shard is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ot_dist.config.schema import ConceptConfig, DataConfig
from ot_dist.errors import InputFileError

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
MASK_SUFFIX = "-masklabel.png"


@dataclass(frozen=True)
class SourceSample:
    concept: int  # index into the concept list
    image: Path
    caption: str  # one or more captions, one per line; the prefix is already applied
    mask: Path | None
    size: tuple[int, int]  # (width, height) of the image file


def concept_name(concept: ConceptConfig) -> str:
    return concept.name or Path(concept.path).name


def scan_concepts(data: DataConfig) -> list[SourceSample]:
    """Every image of every concept, in a stable order (concept, then path)."""
    samples: list[SourceSample] = []
    for index, (label, concept) in enumerate(data.concept_list()):
        samples += [
            SourceSample(index, image, read_caption(concept, image), mask_of(image), image_size(image))
            for image in list_images(label, concept)
        ]
    return samples


def list_images(label: str, concept: ConceptConfig) -> list[Path]:
    root = Path(concept.path)
    if not root.is_dir():
        raise InputFileError(f"{label}: {root.resolve()} is not a folder")
    pattern = "**/*" if concept.include_subdirectories else "*"
    images = sorted(
        p for p in root.glob(pattern)
        if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.endswith(MASK_SUFFIX) and p.is_file()
    )
    if not images:
        raise InputFileError(f"{label}: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {root.resolve()}")
    return images


def mask_of(image: Path) -> Path | None:
    mask = image.with_name(image.stem + MASK_SUFFIX)
    return mask if mask.is_file() else None


def read_caption(concept: ConceptConfig, image: Path) -> str:
    if concept.caption_source == "filename":
        captions = [image.stem]
    elif concept.caption_source == "text":
        captions = [concept.caption_text or ""]
    else:
        caption_file = image.with_suffix(concept.caption_extension)
        if not caption_file.is_file():
            raise InputFileError(
                f"data: {image} has no caption file {caption_file.name} (caption_source txt, "
                f"caption_extension {concept.caption_extension})"
            )
        try:
            text = caption_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise InputFileError(f"data: caption {caption_file} is not UTF-8 text: {err}") from None
        captions = [line.strip() for line in text.splitlines() if line.strip()] or [""]
    return "\n".join(concept.caption_prefix + c for c in captions)


def image_size(path: Path) -> tuple[int, int]:
    """Decode the image once up front, so a broken file fails before any shard is written, naming it."""
    try:
        with Image.open(path) as img:
            img.load()
            return img.size
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise InputFileError(f"data: image {path} could not be decoded: {err}") from None
