"""data.image_format auto (issue 25's figures, docs/data.md): a source JPEG / PNG / WebP that needs no resize,
rotation or colour conversion is stored as its own bytes, the reader loading exactly the pixels a PNG build stores;
other JPEG sources become JPEG quality 95, the rest PNG; explicit formats re-encode every image."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import build_shard_set
from tests.test_data_shards import config

QUIET = {"log": lambda *_: None}


def noise(width, height, seed, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 255, (height, width, channels), dtype=np.uint8), mode)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """At resolution 64, step 16: 64x64 and 96x48 sizes need no resize; 80x80 and 100x50 do."""
    folder = tmp_path_factory.mktemp("formats") / "imgs"
    folder.mkdir()
    noise(64, 64, 0).save(folder / "jpeg-as-is.jpg", quality=90)
    noise(96, 48, 1).save(folder / "wide-as-is.webp", quality=80)
    noise(64, 64, 2).save(folder / "png-as-is.png")
    noise(80, 80, 3).save(folder / "jpeg-resized.jpg", quality=90)
    noise(100, 50, 4).save(folder / "png-resized.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the upright pixels differ from the stored ones
    noise(64, 64, 5).save(folder / "jpeg-rotated.jpg", quality=90, exif=exif.tobytes())
    # Camera and Android Ultra HDR photos: a JPEG with a second picture after it (a preview, a gain map), which
    # Pillow opens as MPO; a JPEG source all the same.
    for name, size in (("mpo-as-is.jpg", 64), ("mpo-resized.jpg", 80)):
        noise(size, size, 7).save(folder / name, "MPO", quality=90, save_all=True, append_images=[noise(16, 16, 8)])
        assert Image.open(folder / name).format == "MPO"
    translucent = noise(64, 64, 6, "RGBA")
    translucent.save(folder / "png-alpha.png")  # composited on the background: not the file's pixels
    for path in folder.iterdir():
        path.with_suffix(".txt").write_text(path.stem)
    return folder


def members(shards, cfg) -> dict[str, dict[str, bytes]]:
    """source file name -> member suffix -> bytes."""
    dataset = ShardDataset(shards, cfg)
    out = {}
    for i, sample in enumerate(dataset.samples):
        path = shards / dataset.manifest["shards"][sample["shard"]]["file"]
        name = dataset.metadata(i)["source"].rsplit("/", 1)[1]
        out[name] = {suffix: dataset.member_bytes(path, sample["key"], suffix, *where)
                     for suffix, where in sample["members"].items() if suffix not in ("txt", "json")}
    return out


def test_auto_keeps_source_bytes_where_nothing_changes_and_loads_the_pixels_a_png_build_stores(folder, tmp_path):
    auto = config({"path": str(folder), "bucket_step": 16}, resolution=64)
    assert auto.data.image_format == "auto"  # the default
    build_shard_set(auto, tmp_path / "auto", **QUIET)
    stored = members(tmp_path / "auto", auto)
    for name in ("jpeg-as-is.jpg", "wide-as-is.webp", "png-as-is.png", "mpo-as-is.jpg"):
        suffix = "64." + name.rsplit(".", 1)[1]
        assert stored[name] == {suffix: (folder / name).read_bytes()}, name  # the file's own bytes
    assert set(stored["mpo-resized.jpg"]) == {"64.jpg"}  # a JPEG source: JPEG q95, not PNG
    assert set(stored["jpeg-resized.jpg"]) == {"64.jpg"} and stored["jpeg-resized.jpg"]["64.jpg"] != \
        (folder / "jpeg-resized.jpg").read_bytes()
    assert Image.open(io.BytesIO(stored["jpeg-resized.jpg"]["64.jpg"])).size == (64, 64)
    assert set(stored["png-resized.png"]) == {"64.png"}
    assert set(stored["jpeg-rotated.jpg"]) == {"64.jpg"}  # re-encoded upright
    assert stored["jpeg-rotated.jpg"]["64.jpg"] != (folder / "jpeg-rotated.jpg").read_bytes()
    assert stored["png-alpha.png"]["64.png"] != (folder / "png-alpha.png").read_bytes()
    # the kept and the losslessly re-encoded samples load exactly the pixels of a build that re-encodes all as PNG
    png = config({"path": str(folder), "bucket_step": 16, "image_format": "png"}, resolution=64)
    build_shard_set(png, tmp_path / "png", **QUIET)
    assert all(set(m) == {"64.png"} for m in members(tmp_path / "png", png).values())
    a, b = ShardDataset(tmp_path / "auto", auto), ShardDataset(tmp_path / "png", png)
    names = [a.metadata(i)["source"].rsplit("/", 1)[1] for i in range(len(a))]
    assert names == [b.metadata(i)["source"].rsplit("/", 1)[1] for i in range(len(b))]
    for i, name in enumerate(names):
        same = torch.equal(a.load(i, epoch=0)["pixels"], b.load(i, epoch=0)["pixels"])
        assert same == (name not in ("jpeg-resized.jpg", "jpeg-rotated.jpg", "mpo-resized.jpg")), name  # JPEG q95


@pytest.mark.parametrize("image_format", ["png", "webp", "jpg"])
def test_an_explicit_format_re_encodes_every_image(folder, tmp_path, image_format):
    cfg = config({"path": str(folder), "bucket_step": 16, "image_format": image_format}, resolution=64)
    build_shard_set(cfg, tmp_path / "set", **QUIET)
    for name, stored in members(tmp_path / "set", cfg).items():
        assert set(stored) == {f"64.{image_format}"}, name
        if image_format != "png" or name != "png-as-is.png":
            assert stored[f"64.{image_format}"] != (folder / name).read_bytes(), name
