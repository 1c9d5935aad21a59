"""The compact sample index (sample_index.py, tar_members.py): 28 bytes a sample in memory-mapped columns, the
samples as dicts read back from the tar headers, old and damaged indexes refused naming the file, tar headers
with long names (PAX, GNU) read by offset."""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest

from ot_dist.data import sample_index
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shard_cache import set_status
from ot_dist.data.shards import MANIFEST, build_shard_set, read_manifest
from ot_dist.data.tar_members import samples_of
from ot_dist.errors import InputFileError
from tests.test_data_shards import config, make_images


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    folder = make_images(root / "imgs", [(16, 16)] * 6 + [(32, 16)] * 5, masks=True)
    (folder / "0003-masklabel.png").unlink()
    cfg = config({"path": str(folder), "bucket_step": 8, "shard_size_mb": 0.005}, resolution=16)
    built = build_shard_set(cfg, root / "set", log=lambda *_: None)
    return cfg, root / "set", built


def test_the_index_is_memory_mapped_columns_of_28_bytes_a_sample_and_shows_the_samples_the_build_wrote(small_set):
    cfg, folder, built = small_set
    manifest = json.loads((folder / MANIFEST).read_text())
    assert "samples" not in manifest and manifest["sample_count"] == 11 and len(manifest["shards"]) > 2
    assert sample_index.bytes_per_sample() == manifest["index"]["bytes_per_sample"] == 28  # issue 25: <= 64
    dataset = ShardDataset(folder, cfg)
    for name in sample_index.COLUMNS:
        column = dataset.index.column(name)
        assert isinstance(column, np.memmap) and len(column) == 11  # pages of the page cache, shared by processes
    # the samples read back from the tar headers are the records the build wrote (keys, members' offsets, masks)
    assert read_manifest(folder)["samples"] == built["samples"] and len(built["samples"]) == 11
    assert [s["mask"] for s in dataset.samples] == [s["mask"] for s in built["samples"]]
    assert sum(not s["mask"] for s in dataset.samples) == 1 == len(dataset.without_masks())
    # a spawned loader worker gets the folder, not the arrays nor open descriptors, and reads the same
    dataset.load(0, 0)
    copy = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset.index)) < 500 and copy.samples.files._fds == {}
    assert copy.captions(4) == dataset.captions(4) and copy.samples[7] == built["samples"][7]


def test_an_earlier_manifest_and_a_damaged_index_are_refused_naming_the_file(small_set, tmp_path):
    cfg, folder, _ = small_set
    old = tmp_path / "old"
    old.mkdir()
    (old / MANIFEST).write_text(json.dumps({"format": "ot_dist.shards/1", "samples": []}))
    with pytest.raises(InputFileError, match=f"{old / MANIFEST} was written by an earlier ot_dist.*"
                                             f"ot-dist shard build CONFIG --out {old}"):
        read_manifest(old)
    assert set_status(old)[0] == "unknown"  # `ot-dist shard list`: another version's set
    short = tmp_path / "short"
    os.system(f"cp -r {folder} {short}")
    np.save(short / "index" / "bucket.npy", np.zeros(5, dtype="u1"))
    with pytest.raises(InputFileError, match=f"{short / 'index' / 'bucket.npy'} holds \\(5,\\) uint8, the manifest 11"):
        ShardDataset(short, cfg).table()
    (short / "index" / "shard.npy").unlink()
    with pytest.raises(InputFileError, match=f"{short / 'index' / 'shard.npy'} is missing"):
        ShardDataset(short, cfg).samples[0]["shard"]


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_members_are_read_by_offset_also_with_long_and_non_ascii_names(tmp_path, tar_format):
    path = tmp_path / "t.tar"
    names = ["a/" + "x" * 150 + "/0001", "dir.v2/0002", "bäume_0003"] if tar_format != tarfile.USTAR_FORMAT \
        else ["dir.v2/0002", "plain_0003"]
    with tarfile.open(path, "w", format=tar_format) as tar:
        tar.addfile(_dir("folder"))
        for n, key in enumerate(names):
            for suffix, data in (("jpg", b"J" * (700 + n)), ("txt", f"caption {n}".encode())):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        want = {}
        for m in tar:
            if m.isfile():
                key, suffix = m.name.rsplit(".", 1)
                want.setdefault(key, {})[suffix] = [m.offset_data, m.size]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = list(samples_of(fd, "t.tar"))
    finally:
        os.close(fd)
    assert [s.key for s in got] == names and {s.key: s.members for s in got} == want
    assert all(s.end == s.members["txt"][0] + s.members["txt"][1] for s in got)


def _dir(name):
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info
