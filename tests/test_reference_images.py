"""Reference images (an edit model's conditioning images, concepts' reference_path): pairing by relative path and
its errors before any shard is written, the member each sample carries in its shard, one geometry and one
augmentation for the pair, the fingerprint, and part builds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import base_config
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.data.concepts import scan_folders
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import build_shard_set, source_fingerprint
from ot_dist.errors import InputFileError


def quiet(*_):
    pass


def paired_folder(root: Path, count: int = 4, size=(80, 64), partner=lambda img: Image.eval(img, lambda v: 255 - v),
                  reference_suffix: str = ".png") -> tuple[Path, Path]:
    """`count` noise images (a different picture every pixel, so any misalignment shows) with captions, and their
    partners under references/ (default: the inverted image, so a partner read from the image's own member shows)."""
    images, references = root / "images", root / "references"
    images.mkdir(parents=True)
    references.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        img.save(images / f"{i:02d}.png")
        (images / f"{i:02d}.txt").write_text(f"edit {i}")
        partner(img).save(references / f"{i:02d}{reference_suffix}")
    return images, references


def config_for(images: Path, references: Path | None, out: Path, data: dict | None = None, **concept):
    raw = base_config("unused", images, out, family="flux")
    raw["data"] = {"concepts": [{"path": str(images), **({"reference_path": str(references)} if references else {}),
                                 **concept}], "shards": str(out) + "-shards", "crop": "random", **(data or {})}
    return validate(raw)


def test_a_missing_or_ambiguous_partner_is_named_before_any_shard(tmp_path):
    images, references = paired_folder(tmp_path)
    (references / "01.png").unlink()
    Image.new("RGB", (80, 64)).save(references / "02.jpg")  # 02.png is there too: same extension wins
    Image.new("RGB", (80, 64)).save(references / "03.jpg")
    Image.new("RGB", (80, 64)).save(references / "03.webp")
    (references / "03.png").unlink()  # 03: two candidates, neither with the image's extension
    config = config_for(images, references, tmp_path / "o")
    with pytest.raises(InputFileError) as err:
        build_shard_set(config, tmp_path / "shards", log=quiet)
    message = str(err.value)
    assert "concepts[0].reference_path" in message or "reference_path" in message
    assert "1 of 4 images have no reference image" in message and "01.png" in message
    assert "03.png (03.jpg, 03.webp)" in message and "02.png" not in message
    assert not list((tmp_path / "shards").glob("shard-*.tar"))  # nothing was written


def test_partners_pair_by_relative_path_in_subfolders_with_any_extension(tmp_path):
    images, references = paired_folder(tmp_path, count=2, reference_suffix=".jpg")
    (images / "sub").mkdir()
    (references / "sub").mkdir()
    Image.new("RGB", (80, 64), "red").save(images / "sub" / "00.png")
    (images / "sub" / "00.txt").write_text("edit sub")
    Image.new("RGB", (80, 64), "blue").save(references / "sub" / "00.webp")
    config = config_for(images, references, tmp_path / "o", include_subdirectories=True)
    partners = {s.image.relative_to(images).as_posix(): s.reference.relative_to(references).as_posix()
                for s in scan_folders(config.data, quiet).samples}
    assert partners == {"00.png": "00.jpg", "01.png": "01.jpg", "sub/00.png": "sub/00.webp"}


def test_each_sample_carries_its_reference_with_the_images_geometry_and_flip(tmp_path):
    """The partner is the inverted image: after the random crop of a non-square image and a flip drawn per epoch,
    reference pixels = -image pixels wherever the crop and flip agree (JPEG-free PNGs: exactly)."""
    images, references = paired_folder(tmp_path)
    config = config_for(images, references, tmp_path / "o", flip_probability=0.5)
    build_shard_set(config, tmp_path / "shards", log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    assert dataset.has_references and dataset.with_references(present=False) == []
    members = dataset.samples[0]["members"]
    assert "64.reference.png" in members and "64.png" in members
    flips = set()
    for epoch in range(6):
        for i in range(len(dataset)):
            sample = dataset.load(i, epoch)
            assert sample["reference_pixels"].shape == sample["pixels"].shape
            np.testing.assert_allclose(sample["reference_pixels"].numpy(), -sample["pixels"].numpy(), atol=1.5 / 127.5)
            first = dataset.load(i, 0)["pixels"]
            flips.add(bool((sample["pixels"] - first).abs().max() > 0))
    assert flips == {True, False}  # the crop / flip changed between epochs, and the pair moved together


def test_a_sample_moved_to_another_bucket_moves_its_reference_alike(tmp_path):
    """data.small_buckets move: a sample read in a bucket of another size is scaled to cover it, its reference too."""
    from ot_dist.data.buckets import ASPECTS, bucket_size

    images, references = paired_folder(tmp_path)
    config = config_for(images, references, tmp_path / "o", data={"bucket_step": 16})
    build_shard_set(config, tmp_path / "shards", log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    other = next(b for b in range(len(ASPECTS)) if dataset.moved(0, b, 64))  # a bucket of another size
    sample = dataset.load(0, 0, 64, bucket=other)
    assert sample["pixels"].shape[-2:] == bucket_size(other, 64, dataset.step)
    # bicubic scaling of the inverted image is the inverted scaling, to the rounding of each side
    np.testing.assert_allclose(sample["reference_pixels"].numpy(), -sample["pixels"].numpy(), atol=2.5 / 127.5)


def test_every_augmentation_reaches_the_reference_alike(tmp_path):
    """An identical partner stays identical through flip, rotation and every colour jitter."""
    images, references = paired_folder(tmp_path, partner=lambda img: img)
    config = config_for(images, references, tmp_path / "o", flip_probability=0.5, rotation_degrees=20,
                        brightness=0.3, contrast=0.3, saturation=0.3, hue=0.2)
    build_shard_set(config, tmp_path / "shards", log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    for epoch in range(3):
        for i in range(len(dataset)):
            sample = dataset.load(i, epoch)
            assert np.array_equal(sample["reference_pixels"].numpy(), sample["pixels"].numpy())


def test_a_reference_of_another_shape_is_refused_and_a_scaled_one_warned(tmp_path):
    images, references = paired_folder(tmp_path, count=2)
    Image.new("RGB", (40, 32), "red").save(references / "00.png")  # half size: scaled, with a warning
    Image.new("RGB", (64, 64), "red").save(references / "01.png")  # square beside 80x64: refused
    config = config_for(images, references, tmp_path / "o")
    with pytest.raises(InputFileError, match="01.png.*another shape"):
        build_shard_set(config, tmp_path / "shards", log=quiet)
    Image.new("RGB", (80, 64), "red").save(references / "01.png")
    lines = []
    build_shard_set(config, tmp_path / "shards", log=lines.append)
    assert any("the reference is scaled to the image" in line and "00.png" in line for line in lines)


def test_the_fingerprint_follows_the_reference_files(tmp_path):
    images, references = paired_folder(tmp_path, count=2)
    config = config_for(images, references, tmp_path / "o")
    before = source_fingerprint(config)
    assert before != source_fingerprint(config_for(images, None, tmp_path / "o"))
    Image.new("RGB", (80, 64), "green").save(references / "01.png")
    assert source_fingerprint(config) != before


def test_a_set_built_in_parts_keeps_the_references(tmp_path):
    from ot_dist.data.shard_parts import build_part, merge_parts

    images, references = paired_folder(tmp_path)
    config = config_for(images, references, tmp_path / "o")
    for part in range(2):
        build_part(config, tmp_path / "shards", (part, 2), log=quiet)
    merge_parts(config, tmp_path / "shards", 2, log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    assert dataset.with_references() == list(range(4))
    assert "reference_pixels" in dataset.load(3, 0)
