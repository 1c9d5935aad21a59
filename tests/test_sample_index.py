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


READ_UNDER_A_LIMIT = """
import json, os, resource, sys
from ot_dist.config.load import validate
from ot_dist.data.reader import ShardDataset, ShardReader
shards, limit, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # a hard limit too: the process cannot raise it
cfg = validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                "data": {"shards": shards, "bucket_step": 8}, "resolution": 16, "batch_size": 2, "seed": 3})
dataset = ShardDataset(shards, cfg)
reader = ShardReader(dataset, dataset.table(), 2, 1, 0, 1, workers=workers, max_bad_fraction=1.0, log=lambda *_: None)
captions = [caption for batch in reader.epoch_batches(0) for caption in batch["caption"]]
print(json.dumps({"captions": captions, "skipped": reader.skipped, "open_shards": len(dataset.samples.files._fds)}))
"""


# loader workers hand their batches' tensors over by descriptor (torch's file_descriptor sharing): a higher limit
@pytest.mark.parametrize("workers, shards, limit", [(0, 60, 40), (2, 100, 80)])
def test_a_set_of_more_shards_than_the_process_may_open_reads_every_sample(tmp_path, workers, shards, limit):
    """An epoch reads the shards in a shuffled order: each process keeps a bounded number of descriptors open (the
    least recently read closed first), within a quarter of its open-file limit, so a set of more one-sample shards
    than `ulimit -n` allows (a hard limit: the process cannot raise it) reads every sample, none skipped."""
    from forked_ranks import run_ranks

    folder = make_images(tmp_path / "imgs", [(16, 16)] * shards)
    cfg = config({"path": str(folder), "bucket_step": 8, "shard_size_mb": 0.0005}, resolution=16)
    build_shard_set(cfg, tmp_path / "set", log=lambda *_: None)
    assert len(read_manifest(tmp_path / "set")["shards"]) == shards
    script = tmp_path / "read.py"
    script.write_text(READ_UNDER_A_LIMIT)
    done = run_ranks(script, tmp_path / "set", limit, workers, nproc=1, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["captions"]) == sorted(f"img {i}" for i in range(shards)) and result["skipped"] == 0
    assert workers or 0 < result["open_shards"] <= limit // 4  # (workers read in processes of their own)


def test_the_descriptor_cache_closes_the_least_recently_read(small_set):
    _, folder, _ = small_set
    files = sample_index.ShardFiles(max_open=2)
    shards = sorted(folder.glob("*.tar"))[:3]
    first = [files.read(path, 0, 512, "test") for path in shards]
    assert list(files._fds) == shards[1:]  # the first one read was closed for the third
    assert files.read(shards[1], 0, 512, "test") == first[1] and list(files._fds) == [shards[2], shards[1]]
    assert files.read(shards[0], 0, 512, "test") == first[0] and list(files._fds) == [shards[1], shards[0]]
    reader = files.reader(shards[2], "test")  # a function, never a descriptor the cache may close under it
    files.read(shards[1], 0, 1, "test")
    assert reader(0, 512) == first[2]
    files.close()


def test_running_out_of_descriptors_is_the_machines_limit_not_a_bad_sample(small_set, monkeypatch):
    """EMFILE: the cache gives its descriptors back and tries once more; failing again, the error names the limit and
    is not an InputFileError (which the reader counts as an unreadable sample and skips)."""
    import errno

    from ot_dist.errors import OpenFileLimit

    _, folder, _ = small_set
    first, second = sorted(folder.glob("*.tar"))[:2]
    files = sample_index.ShardFiles(max_open=8)
    files.read(first, 0, 1, "test")
    real_open, calls = os.open, []

    def open_once_refused(path, flags):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags)

    monkeypatch.setattr(sample_index.os, "open", open_once_refused)
    assert files.read(second, 0, 512, "test") and list(files._fds) == [second]  # the cache was given back first
    monkeypatch.setattr(sample_index.os, "open", lambda *_: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many")))
    with pytest.raises(OpenFileLimit, match="soft limit") as refused:
        files.read(first, 0, 1, "test")
    assert not isinstance(refused.value, InputFileError)
    files.close()


def test_a_shard_replaced_while_the_run_reads_it_stops_the_run(small_set, tmp_path):
    """A shard opened again after the descriptor cache closed it is checked to be the file first opened: one rebuilt
    in place (another run of the same data) holds other samples at the offsets of this run's index."""
    import shutil

    from ot_dist.errors import ShardSetChanged

    _, folder, _ = small_set
    shards = sorted(folder.glob("*.tar"))[:2]
    copies = [tmp_path / shard.name for shard in shards]
    for shard, copy in zip(shards, copies):
        shutil.copy(shard, copy)
    files = sample_index.ShardFiles(max_open=1)
    first = files.read(copies[0], 0, 512, "test")
    files.read(copies[1], 0, 512, "test")  # closes the first
    assert files.read(copies[0], 0, 512, "test") == first  # the same file, opened again
    files.read(copies[1], 0, 512, "test")
    replaced = copies[0].with_suffix(".new")
    replaced.write_bytes(copies[1].read_bytes())
    os.replace(replaced, copies[0])  # rebuilt in place
    with pytest.raises(ShardSetChanged, match="replaced while this run read it"):
        files.read(copies[0], 0, 512, "test")
    files.close()
