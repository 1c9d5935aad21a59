"""`ot-dist shard index`: a webdataset tar set written by webdataset.ShardWriter with its own member names (jpg /
webp / png images, txt / json captions, img2dataset's json width and height) is indexed as it is, trains with
aspect buckets, and resumes exactly once on another world size; unreadable and incomplete samples are named."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image, ImageFile

from ot_dist.cli import main
from ot_dist.config.load import validate
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import read_manifest
from tests.test_data_shards import ids, readers, take

# 40 square, 13 wide (1:2), 8 tall (1.75:1)
SIZES = [(16, 16)] * 40 + [(32, 16)] * 13 + [(16, 28)] * 8


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


def write_tars(folder, sizes=SIZES, extras=True):
    """webdataset.ShardWriter's own layout: `%09d` keys, images as jpg (with img2dataset's json), webp (txt only)
    or png; and (extras) a sample without a caption, an unreadable image, and a photo stored on its side."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    with wds.ShardWriter(str(folder / "wds-%04d.tar"), maxcount=16, verbose=0) as writer:
        for i, (w, h) in enumerate(sizes):
            img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
            sample = {"__key__": f"{i:09d}"}
            if i % 3 == 0:  # img2dataset: jpg + json with caption, width, height (no txt)
                sample |= {"jpg": encoded(img, "JPEG", quality=95),
                           "json": json.dumps({"caption": f"photo {i}", "width": w, "height": h}).encode()}
            elif i % 3 == 1:
                sample |= {"webp": encoded(img, "WEBP", lossless=True), "txt": f"picture {i}\nalt {i}".encode()}
            else:
                sample |= {"png": encoded(img, "PNG"), "txt": f"drawing {i}".encode()}
            writer.write(sample)
        if extras:
            writer.write({"__key__": "nocaption", "jpg": encoded(Image.new("RGB", (16, 16)), "JPEG")})
            writer.write({"__key__": "broken", "jpg": b"\xff\xd8 not a jpeg", "txt": b"broken"})
            exif = Image.Exif()
            exif[0x0112] = 6  # rotate 90: stored 32x16 (wide), upright 16x32 (tall)
            writer.write({"__key__": "sideways", "jpg": encoded(Image.new("RGB", (32, 16), (255, 0, 0)), "JPEG",
                                                               exif=exif.tobytes()), "txt": b"sideways"})
    return folder


def data_config(shards, **overrides):
    raw = {"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
           "data": {"shards": str(shards), "bucket_step": 8, "max_bad_fraction": 0.05},
           "resolution": 16, "batch_size": 2, "seed": 3, **overrides}
    return validate(raw)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    root = tmp_path_factory.mktemp("external")
    tars = write_tars(root / "tars")
    assert main(["shard", "index", str(tars / "wds-*.tar"), "--out", str(root / "set"), "--resolution", "16",
                 "--bucket-step", "8", "--max-bad-fraction", "0.05"]) == 0
    return root


def test_shard_index_reads_sizes_from_headers_names_the_unusable_and_loads_buckets(indexed, capsys):
    root = indexed
    manifest = read_manifest(root / "set")
    assert manifest["sample_count"] == len(SIZES) + 1 and manifest["layout"]["kind"] == "webdataset"
    assert len(manifest["shards"]) == 4 and all(s["file"].startswith("../tars/wds-") for s in manifest["shards"])
    (bad,) = manifest["unreadable_images"]
    assert bad["file"].endswith("wds-0003.tar:broken") and "could not be read" in bad["error"]
    (unused,) = manifest["unused_files"]
    assert unused["file"].endswith(":nocaption") and "no caption member (txt|caption|json)" in unused["reason"]
    by_aspect = {b["aspect"]: b["samples"] for b in manifest["buckets"]}
    # (at 16 px and step 8 the nearest rounded sizes are 1:1.75's and 1.75:1's); the sideways photo upright: tall
    assert by_aspect == {"1:1": 40, "1:1.75 (wide)": 13, "1.75:1 (tall)": 8 + 1}
    dataset = ShardDataset(root / "set", data_config(root / "set"))
    assert dataset.index.width[0] == 16 and not dataset.index.width.flags.writeable
    for i, (w, h) in enumerate(SIZES):
        if i % 7:
            continue
        sample = dataset.load(i, epoch=0)
        bucket = manifest["buckets"][[b["bucket"] for b in manifest["buckets"]].index(dataset.samples[i]["bucket"])]
        assert list(sample["pixels"].shape[1:]) == bucket["sizes"]["16"]  # scaled to cover, cropped, at load
        assert sample["original_size"].tolist() == [h, w]
        assert sample["caption"] in ({f"photo {i}"} if i % 3 == 0 else {f"picture {i}", f"alt {i}"} if i % 3 == 1
                                     else {f"drawing {i}"})
    sideways = next(i for i, s in enumerate(dataset.samples) if s["key"] == "sideways")
    loaded = dataset.load(sideways, 0)
    tall = next(b for b in manifest["buckets"] if b["aspect"] == "1.75:1 (tall)")
    assert loaded["original_size"].tolist() == [32, 16] and list(loaded["pixels"].shape[1:]) == tall["sizes"]["16"]
    assert dataset.metadata(sideways)["source"].endswith("wds-0003.tar:sideways")
    # over 3 worker processes (tars split between them): the same index
    assert main(["shard", "index", str(root / "tars" / "wds-{0000..0003}.tar"), "--out", str(root / "three"),
                 "--resolution", "16", "--bucket-step", "8", "--max-bad-fraction", "0.05", "--workers", "3"]) == 0
    for column in (root / "set" / "index").iterdir():
        assert column.read_bytes() == (root / "three" / "index" / column.name).read_bytes(), column.name
    three = read_manifest(root / "three")
    assert three["shards"] == manifest["shards"] and three["unreadable_images"] == manifest["unreadable_images"]
    # with a training config: its resolution, bucket step and bad-image limit, and the bucket report for 2 processes
    config = root / "train.yaml"
    config.write_text(yaml.safe_dump(data_config(root / "set").model_dump(mode="json")))
    capsys.readouterr()
    assert main(["shard", "index", str(root / "tars" / "*.tar"), "--out", str(root / "configured"), "--config",
                 str(config), "--set", "data.max_bad_fraction=0.05", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "bucket report: global batch 4 on 2 process(es), resolutions 16" in out and "1:1.75 (wide)" in out
    assert f"train from it with data.shards: {root / 'configured'}" in out
    assert (root / "configured" / "index" / "bucket.npy").read_bytes() == (root / "set" / "index" / "bucket.npy").read_bytes()
    # a resolution the index was not made at: the images are scaled at load, so it trains
    assert list(ShardDataset(root / "set", data_config(root / "set", resolution=32)).load(0, 0)["pixels"].shape) == [3, 32, 32]


def test_shard_index_refuses_compressed_tars_missing_files_and_too_many_unreadable(tmp_path, capsys):
    def refused(*args) -> str:
        assert main(["shard", "index", *args, "--out", str(tmp_path / "o"), "--resolution", "16",
                     "--bucket-step", "8"]) == 3
        return capsys.readouterr().err

    (tmp_path / "a.tar.gz").write_bytes(b"x")
    assert "a.tar.gz is compressed: a compressed tar cannot be read by offset; decompress it" in refused(
        str(tmp_path / "a.tar.gz"))
    assert f"{tmp_path}/nothing-*.tar: no tar file matches" in refused(str(tmp_path / "nothing-*.tar"))
    tars = write_tars(tmp_path / "few", sizes=[(16, 16)] * 4)
    err = refused(str(tars / "wds-0000.tar"))
    assert "wds-0000.tar:broken could not be read: not an image Pillow reads (1 of 6 samples unreadable" in err
    assert not (tmp_path / "o" / "manifest.json").exists()
    # data.max_image_pixels holds for sizes from the json member (sample 0) and from image headers (sample 1)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data_config(tmp_path / "o", data={"max_image_pixels": 200, "bucket_step": 8,
                                                                       "shards": str(tmp_path / "o")}).model_dump(mode="json")))
    err = refused(str(tars / "wds-0000.tar"), "--config", str(config))
    for key in ("000000000", "000000001"):
        assert f"wds-0000.tar:{key} is 16x16 = 256 pixels, over data.max_image_pixels 200" in err


def test_shard_index_takes_sizes_upright_from_the_image_and_reads_every_caption_before_training(tmp_path, capsys,
                                                                                                 monkeypatch):
    """img2dataset with `resize_mode no` + `skip_reencode` keeps a phone photo's own bytes (EXIF orientation 6) and
    writes the stored size (OpenCV's, orientation not applied) as the json width / height: the index takes the
    upright size from the image, as the loader decodes it. A TIFF (Pillow's opener already reports it upright) is not
    turned twice, a PNG's header is read without decoding its pixels. A json caption without the --caption-field,
    a caption that is not UTF-8, an empty image and a sample with two image members (`twice.jpg`, `twice.JPG`) are
    named by `shard index`, not found in every sample after the model has loaded."""
    import webdataset as wds

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 32x16, shown 16x32
    photo = encoded(Image.new("RGB", (32, 16), (200, 30, 30)), "JPEG", exif=exif.tobytes())
    samples = [{"__key__": "portrait", "jpg": photo,  # json as Windows tools write it: with a UTF-8 BOM
                "json": b'\xef\xbb\xbf{"caption": "a portrait", "width": 32, "height": 16}'},
               {"__key__": "scan", "tiff": encoded(Image.new("RGB", (32, 16)), "TIFF", exif=exif.tobytes()),
                "txt": b"a scan"},
               {"__key__": "screenshot", "png": encoded(Image.new("RGB", (32, 16)), "PNG", exif=exif.tobytes()),
                "txt": b"a png"},
               {"__key__": "drawing", "png": encoded(Image.new("RGB", (16, 32)), "PNG"), "txt": b"no exif"},
               {"__key__": "laion", "jpg": photo, "json": b'{"TEXT": "the field is TEXT", "width": 32, "height": 16}'},
               {"__key__": "latin1", "jpg": photo, "txt": "café".encode("latin-1")},
               {"__key__": "empty", "jpg": b"", "json": b'{"caption": "no pixels", "width": 32, "height": 16}'},
               {"__key__": "twice", "jpg": photo, "JPG": photo, "txt": b"which one?"}]  # webdataset stops here
    (tmp_path / "tars").mkdir()
    with wds.TarWriter(str(tmp_path / "tars" / "t.tar")) as writer:
        for sample in samples:
            writer.write(sample)
    index = ["shard", "index", str(tmp_path / "tars" / "t.tar"), "--resolution", "16", "--bucket-step", "8",
             "--image-ext", "jpg,tiff,png"]
    assert main([*index, "--out", str(tmp_path / "refused")]) == 3
    err = capsys.readouterr().err
    assert "t.tar:laion: its json member has no 'caption' text (the caption field; ot-dist shard index " \
           "--caption-field)" in err and "t.tar:latin1: caption member txt is not readable" in err
    assert "t.tar:empty could not be read" in err and "(4 of 8 samples unreadable" in err
    assert "t.tar:twice has a member more than once: twice.JPG, twice.jpg (suffixes compared lower-case" in err
    monkeypatch.setattr("ot_dist.data.unreadable.NAMED", 1)  # millions named in one line help nobody: the first few
    assert main([*index, "--out", str(tmp_path / "refused")]) == 3
    err = capsys.readouterr().err
    assert "t.tar:laion" in err and "; ... 3 more (4 of 8 samples unreadable" in err and "t.tar:latin1" not in err
    monkeypatch.undo()

    def no_pixels(image):
        raise AssertionError(f"shard index decoded the pixels of a {image.format}")

    with monkeypatch.context() as patched:
        patched.setattr(ImageFile.ImageFile, "load", no_pixels)
        assert main([*index, "--out", str(tmp_path / "set"), "--max-bad-fraction", "0.6"]) == 0
    manifest = read_manifest(tmp_path / "set")
    assert [b["file"].rsplit(":", 1)[1] for b in manifest["unreadable_images"]] == ["laion", "latin1", "empty", "twice"]
    dataset = ShardDataset(tmp_path / "set", data_config(tmp_path / "set"))
    keys = [s["key"] for s in dataset.samples]
    assert keys == ["portrait", "scan", "screenshot", "drawing"]
    assert [(int(dataset.index.width[i]), int(dataset.index.height[i])) for i in range(4)] == [(16, 32)] * 4
    portrait = dataset.load(0, epoch=0)
    assert portrait["original_size"].tolist() == [32, 16] and portrait["caption"] == "a portrait"
    assert portrait["pixels"].shape[1] > portrait["pixels"].shape[2]  # trained tall, as the photo is shown


def test_a_tar_made_by_macos_tar_loads_the_samples_webdataset_reads(tmp_path):
    """macOS's tar stores an AppleDouble member `._<name>` (the file's extended attributes) before each member, with
    PAX records: webdataset skips those names (no key) and groups the rest by key; the index did too, but loading a
    sample refused it as "members of ['', key] ... the shard changed since it was indexed"."""
    import tarfile

    import webdataset as wds

    apple_double = b"\0\x05\x16\x07\0\x02\0\0Mac OS X        " + bytes(64)
    with tarfile.open(tmp_path / "mac.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(3):
            image = encoded(Image.new("RGB", (16, 16), (80 * i, 0, 0)), "PNG")
            for suffix, data in (("png", image), ("txt", f"caption {i}".encode())):
                for name, payload in ((f"._{i:04d}.{suffix}", apple_double), (f"{i:04d}.{suffix}", data)):
                    info = tarfile.TarInfo(name)
                    info.size, info.pax_headers = len(payload), {"LIBARCHIVE.xattr.com.apple.quarantine": "MDA4MQ"}
                    tar.addfile(info, io.BytesIO(payload))
    assert main(["shard", "index", str(tmp_path / "mac.tar"), "--out", str(tmp_path / "set"), "--resolution", "16",
                 "--bucket-step", "8"]) == 0
    theirs = [(s["__key__"], s["txt"], np.asarray(s["png"])) for s in
              wds.WebDataset(str(tmp_path / "mac.tar"), shardshuffle=False, empty_check=False).decode("pil")]
    dataset = ShardDataset(tmp_path / "set", data_config(tmp_path / "set"))
    ours = [(dataset.samples[i]["key"], dataset.load(i, epoch=0)["caption"],
             np.asarray(dataset._image(dataset.samples[i], 16))) for i in range(len(dataset))]
    assert [(k, c) for k, c, _ in ours] == [(k, c) for k, c, _ in theirs] == [(f"{i:04d}", f"caption {i}")
                                                                              for i in range(3)]
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(ours, theirs))


def test_heic_members_index_and_load_through_pillow_heif(tmp_path, monkeypatch):
    """`--image-ext heic`: pillow-heif registers its opener when first asked, so `shard index` and the loader ask
    (before, every HEIC member was `not an image Pillow reads` in a process that had not opened one yet)."""
    import webdataset as wds

    from ot_dist.data.images import heif_available
    from tests.test_images import as_if_pillow_heif_was_not_registered

    if not heif_available():
        pytest.skip("pillow-heif is not installed (pip install ot-dist[heic])")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 32x16, shown 16x32
    (tmp_path / "tars").mkdir()
    with wds.TarWriter(str(tmp_path / "tars" / "t.tar")) as writer:
        writer.write({"__key__": "iphone", "heic": encoded(Image.new("RGB", (32, 16), (90, 120, 220)), "HEIF",
                                                           quality=95, exif=exif.tobytes()), "txt": b"a phone photo"})
    as_if_pillow_heif_was_not_registered(monkeypatch)
    assert main(["shard", "index", str(tmp_path / "tars" / "t.tar"), "--out", str(tmp_path / "set"), "--resolution",
                 "16", "--bucket-step", "8", "--image-ext", "jpg,heic"]) == 0
    as_if_pillow_heif_was_not_registered(monkeypatch)  # a loader process of its own
    dataset = ShardDataset(tmp_path / "set", data_config(tmp_path / "set"))
    loaded = dataset.load(0, epoch=0)
    assert loaded["original_size"].tolist() == [32, 16] and loaded["caption"] == "a phone photo"
    colour = (loaded["pixels"].mean((1, 2)) + 1) * 127.5
    assert (colour - torch.tensor([90, 120, 220])).abs().max() <= 6, colour


def test_a_resume_on_another_world_size_is_exactly_once_on_an_indexed_tar_set(indexed):
    """The in-process 2-rank readers (2 loader workers each, sharing the memory-mapped index) stopped after 4
    global batches and resumed on 1 process with the same global batch: the rest of the epoch, each sample once."""
    dataset = ShardDataset(indexed / "set", data_config(indexed / "set"))
    uninterrupted = [take(r, epoch=0) for r in readers(dataset, world_size=2, batch_size=2, workers=2)]
    steps = len(uninterrupted[0])
    first = readers(dataset, world_size=2, batch_size=2, workers=2)
    head = [take(r, epoch=0, count=4) for r in first]
    state = first[0].state_dict()
    assert {k: state[k] for k in ("epoch", "step", "global_batch")} == {"epoch": 0, "step": 4, "global_batch": 4}
    assert state["plan"] == first[1].state_dict()["plan"]  # the same plan on every rank
    for rank, batches in enumerate(head):
        for got, want in zip(batches, uninterrupted[rank]):
            assert torch.equal(got["sample_id"], want["sample_id"]) and torch.equal(got["pixels"], want["pixels"])
    (single,) = readers(dataset, world_size=1, batch_size=4)
    single.load_state_dict(state)
    rest = ids(take(single, epoch=0))
    assert rest == [a + b for a, b in zip(ids(uninterrupted[0])[4:], ids(uninterrupted[1])[4:])]
    done = [i for b in ids(head[0]) + ids(head[1]) + rest for i in b]
    assert len(rest) == steps - 4 and len(done) == len(set(done)) == 4 * steps >= 56  # 61 samples, 1 bucket of 1


def test_a_shardwriter_set_trains_two_steps_through_shard_index_with_buckets(indexed, tiny_models, tmp_path):
    from conftest import base_config

    from ot_dist.train.trainer import Trainer

    raw = base_config(tiny_models["sd1"], "unused", tmp_path / "run", batch_size=2, max_steps=2, resolution=64)
    raw["data"] = {"shards": str(indexed / "set")}
    lines = []
    result = Trainer(validate(raw), log=lines.append).train()
    assert result.steps == 2
    report = "\n".join(lines)
    assert "bucket 1:1.75 (wide)" in report and "bucket 1:1 " in report and "bucket 1.75:1 (tall)" in report
