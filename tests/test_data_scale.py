"""Data at the scale of large finetunes (issue 25): shard builds over several worker processes (byte-identical
to one, a dead worker leaves no set that looks complete), webdataset's own reader on the shards, the index of
external webdataset tars, and the compact per-sample index."""

from __future__ import annotations

import os

import pytest

from ot_dist.data import sample_encoder
from ot_dist.data.shards import MANIFEST, build_shard_set, is_current, read_manifest, source_fingerprint
from ot_dist.errors import InputFileError
from tests.test_data_shards import MIXED, config, make_images


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.tar"))}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    folder = make_images(root / "imgs", MIXED, masks=True)
    return root, config({"path": str(folder), "bucket_step": 16, "shard_size_mb": 0.02}, resolution="48,64")


def test_a_build_over_workers_is_byte_identical_to_one_process_and_webdataset_reads_it(source):
    import webdataset as wds

    root, cfg = source
    one = build_shard_set(cfg, root / "one", log=lambda *_: None)
    three = build_shard_set(cfg, root / "three", log=lambda *_: None, workers=3)
    assert len(one["shards"]) > 2 and shard_bytes(root / "one") == shard_bytes(root / "three")
    assert (root / "one" / MANIFEST).read_text() == (root / "three" / MANIFEST).read_text()
    # webdataset's own reader: every sample with its images, masks, caption and metadata, in the build order
    urls = [str(root / "three" / s["file"]) for s in three["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("pil"))
    assert [s["__key__"] for s in samples] == [r["key"] for r in one["samples"]]
    assert all({"48.png", "64.png", "48.mask.png", "64.mask.png", "txt", "json"} <= set(s) for s in samples)
    assert all(s["64.png"].size[::-1] == tuple(s["json"]["resolutions"]["64"]["resized_size"]) for s in samples)


class DiesAtFifth(sample_encoder.SampleEncoder):
    def __call__(self, job):
        if job[0] == 5:
            os._exit(9)  # a killed worker: no exception, no cleanup
        return super().__call__(job)


def test_a_worker_dying_mid_build_fails_it_and_leaves_no_set_that_looks_complete(source, monkeypatch):
    root, cfg = source
    out = root / "crash"
    build_shard_set(cfg, out, log=lambda *_: None)  # a complete set that the interrupted rebuild replaces
    assert is_current(out, source_fingerprint(cfg))
    monkeypatch.setattr(sample_encoder, "SampleEncoder", DiesAtFifth)
    with pytest.raises(RuntimeError, match="worker process died"):
        build_shard_set(cfg, out, log=lambda *_: None, workers=2)
    assert not (out / MANIFEST).exists() and not is_current(out, source_fingerprint(cfg))
    with pytest.raises(InputFileError, match="has no manifest.json"):
        read_manifest(out)
