"""Tars in object storage: `ot-dist shard index` over URLs and training from them, by byte range through fsspec.

A local HTTP server with Range support runs in a thread of the test (it counts each request and the bytes it sends,
and fails a request on demand: 503, a dropped connection, 404, 403); fsspec's `memory://` filesystem stands in for
the other stores (S3, GCS: the same fsspec calls)."""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from ot_dist.cli import main
from ot_dist.data import remote
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import read_manifest
from ot_dist.errors import InputFileError
from tests.test_data_shards import ids, readers, take
from tests.test_external_tars import data_config, encoded, write_tars

INDEX = ["--resolution", "16", "--bucket-step", "8", "--max-bad-fraction", "0.05"]


class Store(http.server.ThreadingHTTPServer):
    """Serves a folder with HEAD and single `Range: bytes=a-b` GETs; `log` holds (method, path, range, bytes sent);
    `failures[path]` the answers to give instead, one per request (an int status, or "reset": close the socket)."""

    daemon_threads = True

    def __init__(self, root):
        self.root, self.log, self.failures, self.lock = root, [], {}, threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"

    def ranges(self) -> list[tuple[str, int, int]]:
        """(file name, start, end) of each ranged GET, sorted."""
        return sorted((p.rsplit("/", 1)[1], r[0], r[1]) for m, p, r, _ in self.log if m == "GET" and r)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, head: bool):
        store: Store = self.server
        with store.lock:
            failure = (store.failures.get(self.path) or [None]).pop(0) if store.failures.get(self.path) else None
        if failure == "reset":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if failure is not None:
            self.send_response(failure)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        file = store.root / self.path.lstrip("/")
        if not file.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data, wanted = file.read_bytes(), self.headers.get("Range")
        if wanted:
            start, _, end = wanted.removeprefix("bytes=").partition("-")
            start, end = int(start), min(int(end) + 1 if end else len(data), len(data))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            body = data[start:end]
        else:
            self.send_response(200)
            body, start, end = data, None, None
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        sent = 0 if head else len(body)
        with store.lock:  # logged before the body goes out: the client may check the log as soon as it has read it
            store.log.append(("HEAD" if head else "GET", self.path, (start, end) if wanted else None, sent))
        if not head:
            self.wfile.write(body)

    def do_GET(self):
        self._answer(head=False)

    def do_HEAD(self):
        self._answer(head=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The test tars on disk (indexed locally) and the same files served over HTTP (indexed by URL)."""
    root = tmp_path_factory.mktemp("remote")
    write_tars(root / "tars")
    store = Store(root)
    thread = threading.Thread(target=store.serve_forever, daemon=True)
    thread.start()
    assert main(["shard", "index", str(root / "tars" / "wds-*.tar"), "--out", str(root / "local"), *INDEX]) == 0
    assert main(["shard", "index", store.url("tars/wds-{0000..0003}.tar"), "--out", str(root / "url"), *INDEX]) == 0
    yield root, store
    store.shutdown()
    store.server_close()


REAL_FIRST_WAIT_S = remote.FIRST_WAIT_S  # before quick_retries shortens it for the tests that only count tries


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(remote, "FIRST_WAIT_S", 0.01)


def spans_of(dataset, sample_ids) -> list[tuple[str, int, int]]:
    """(tar file name, start, end) of each sample's members, sorted: what one ranged read per sample asks for."""
    spans = [dataset.samples.span(i) for i in sample_ids]
    return sorted((str(url).rsplit("/", 1)[1], start, start + span) for url, start, span in spans)


def test_the_index_built_from_urls_is_the_local_one_but_for_the_urls_and_moves_alone(served, tmp_path):
    root, store = served
    for column in (root / "local" / "index").iterdir():
        assert column.read_bytes() == (root / "url" / "index" / column.name).read_bytes(), column.name
    local, url = (json.loads((root / name / "manifest.json").read_text()) for name in ("local", "url"))
    assert [s["file"] for s in url["shards"]] == [store.url(f"tars/wds-{n:04d}.tar") for n in range(4)]  # as given
    assert [s["file"] for s in local["shards"]] == [f"../tars/wds-{n:04d}.tar" for n in range(4)]
    assert url["unreadable_images"][0]["file"] == store.url("tars/wds-0003.tar") + ":broken"
    for manifest in (local, url):
        manifest["shards"] = [{**s, "file": None} for s in manifest["shards"]]
        manifest["unreadable_images"] = [{**b, "file": b["file"].rsplit(":", 1)[1],
                                          "error": b["error"].split(" could not be read")[1]}
                                         for b in manifest["unreadable_images"]]
        manifest["unused_files"] = [{**u, "file": u["file"].rsplit(":", 1)[1]} for u in manifest["unused_files"]]
        del manifest["concepts"][0]["path"], manifest["concepts"][0]["name"], manifest["built_from"]["tars"]
    assert local == url
    # the index folder moved without its tars (they are in the store): it trains, the same samples
    shutil.copytree(root / "url", tmp_path / "moved")
    moved, here = (ShardDataset(d, data_config(d)) for d in (tmp_path / "moved", root / "local"))
    for i in (0, 20, 60):
        a, b = moved.load(i, epoch=1), here.load(i, epoch=1)
        assert torch.equal(a["pixels"], b["pixels"]) and a["caption"] == b["caption"]


def test_indexing_a_url_reads_header_ranges_not_the_whole_tar(tmp_path):
    """A tar of large images: `shard index` reads each image's header (64 KB) and the tar headers, not the pixels."""
    import webdataset as wds

    (tmp_path / "big").mkdir()
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(tmp_path / "big" / "b.tar")) as writer:
        for i in range(3):  # ~480 KB of noise each, incompressible
            pixels = rng.integers(0, 255, (400, 400, 3), dtype=np.uint8)
            writer.write({"__key__": f"{i:03d}", "png": encoded(Image.fromarray(pixels), "PNG"), "txt": b"noise"})
    store = Store(tmp_path)
    threading.Thread(target=store.serve_forever, daemon=True).start()
    try:
        assert main(["shard", "index", store.url("big/b.tar"), "--out", str(tmp_path / "set"), *INDEX]) == 0
    finally:
        store.shutdown()
        store.server_close()
    size = (tmp_path / "big" / "b.tar").stat().st_size
    gets = [entry for entry in store.log if entry[0] == "GET"]
    assert all(entry[2] is not None for entry in gets), gets  # every GET is a ranged read
    assert sum(entry[3] for entry in gets) < 0.4 * size, (sum(entry[3] for entry in gets), size)
    assert read_manifest(tmp_path / "set")["sample_count"] == 3


def test_each_sample_is_one_ranged_read_of_its_span_and_two_ranks_read_only_their_own(served):
    root, store = served
    dataset = ShardDataset(root / "url", data_config(root / "url"))
    store.log.clear()
    loaded = dataset.load(5, epoch=0)
    assert loaded["caption"] and store.ranges() == spans_of(dataset, [5])  # one request: its span
    # 2 ranks, 2 loader workers each (forked, fetching ahead): each rank's requests are exactly its samples' spans
    ranks = readers(dataset, world_size=2, batch_size=2, workers=2)
    for reader in ranks:
        store.log.clear()
        mine = [i for batch in ids(take(reader, epoch=0)) for i in batch]
        assert store.ranges() == spans_of(dataset, mine)
        assert sum(entry[3] for entry in store.log) == sum(int(dataset.index.span[i]) for i in mine)
    # in-process (no loader workers): the same batches as from the tars on disk
    local = ShardDataset(root / "local", data_config(root / "local"))
    (url_reader,), (disk_reader,) = readers(dataset, 1, 2), readers(local, 1, 2)
    for a, b in zip(take(url_reader, 0, count=5), take(disk_reader, 0, count=5)):
        assert torch.equal(a["pixels"], b["pixels"]) and a["caption"] == b["caption"]


def test_loader_reads_ahead_a_bounded_number_of_micro_batches_with_bounded_concurrency(served, monkeypatch):
    """data.remote_read_ahead 1, data.remote_concurrency 2: while micro batch 0 is handed out, batch 1's spans are
    being read (2 at a time at most) and batch 2's not yet."""
    import time

    root, _ = served
    raw = {"data": {"shards": str(root / "url"), "bucket_step": 8, "max_bad_fraction": 0.05, "remote_read_ahead": 1,
                    "remote_concurrency": 2}}
    dataset = ShardDataset(root / "url", data_config(root / "url", **raw))
    planned = ids(take(readers(dataset, 1, 4)[0], 0, count=3))
    lock, calls, state = threading.Lock(), [], {"now": 0, "peak": 0}
    read = remote.RemoteStore.read

    def slow_read(self, url, offset, size, where):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            calls.append((url.rsplit("/", 1)[1], offset))
        until = time.monotonic() + 0.5
        while state["now"] < 2 and time.monotonic() < until:  # a partner read would start now, were one allowed
            time.sleep(0.005)
        time.sleep(0.02)
        try:
            return read(self, url, offset, size, where)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(remote.RemoteStore, "read", slow_read)
    batches = readers(dataset, 1, 4)[0].epoch_batches(0)
    first = next(batches)
    expected = [(name, start) for name, start, _ in spans_of(dataset, planned[0] + planned[1])]
    deadline = time.monotonic() + 30
    while len(calls) < len(expected) and time.monotonic() < deadline:  # batch 1's reads start, two at a time
        time.sleep(0.02)
    time.sleep(0.2)  # time for a read of batch 2 to start, were it not bounded: it waits for the next take
    assert first["sample_id"].tolist() == planned[0]
    assert sorted(calls) == expected
    assert state["peak"] == 2
    batches.close()


def test_a_transient_failure_is_retried_and_a_permanent_one_names_the_url_and_sample(served, tmp_path):
    root, store = served
    # 5 tries (the default's 10 wait up to 80 s): what is asserted is that the configured count is honoured
    dataset = ShardDataset(root / "url", data_config(root / "url", data={"shards": str(root / "url"), "bucket_step": 8,
                                                                         "max_bad_fraction": 0.05, "remote_retries": 5}))
    first = store.url("tars/wds-0000.tar").split("/", 3)[3]
    path = "/" + first
    store.failures[path] = [503, "reset"]  # a 503, then a dropped connection: the third try reads it
    store.log.clear()
    assert dataset.load(1, epoch=0)["caption"]
    assert len(store.ranges()) == 1 and not store.failures[path]
    store.failures[path] = [503] * 5  # data.remote_retries (5) tries, all failing: named, unreadable
    with pytest.raises(InputFileError, match=r"^shard http://127.0.0.1:\d+/tars/wds-0000.tar sample #2: could "
                                             r"not be read after 5 tries: HTTP 503 Service Unavailable$"):
        dataset.load(2, epoch=0)
    # a tar gone from the store: each of its samples is unreadable, named by URL and key; counted, not fatal
    moved = tmp_path / "set"
    shutil.copytree(root / "url", moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["shards"][0]["file"] = store.url("tars/gone.tar")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    gone = ShardDataset(moved, data_config(moved, data={"shards": str(moved), "bucket_step": 8,
                                                         "max_bad_fraction": 1.0}))
    with pytest.raises(InputFileError, match=r"^shard http://127.0.0.1:\d+/tars/gone.tar sample #0: not found"):
        gone.load(0, epoch=0)
    (reader,) = readers(gone, 1, 2)
    reader.max_bad_fraction, logged = 1.0, []
    reader.log = logged.append
    take(reader, 0, count=3)
    assert any(f"{store.url('tars/gone.tar')} sample #" in line and ": not found" in line for line in logged), logged
    # 403: the credentials are wrong for every sample; the run stops instead of skipping them all
    store.failures[path] = [403]
    (reader,) = readers(ShardDataset(root / "url", data_config(root / "url")), 1, 2)
    with pytest.raises(remote.RemoteAccessDenied, match=r"wds-0000.tar sample #\d+: access denied: HTTP 403 Forbidden"):
        take(reader, 0)
    store.failures.clear()


def test_the_generic_fsspec_path_through_memory_urls(served):
    """`memory://` (fsspec's in-process filesystem) stands for the stores ot_dist does not install (s3fs, gcsfs): the
    same calls (url_to_fs, glob, size, cat_file with start / end)."""
    import fsspec

    root, _ = served
    memory = fsspec.filesystem("memory")
    for tar in sorted((root / "tars").glob("*.tar")):
        memory.pipe(f"/wds/{tar.name}", tar.read_bytes())
    try:
        assert main(["shard", "index", "memory://wds/*.tar", "--out", str(root / "memory"), *INDEX]) == 0
        for column in (root / "local" / "index").iterdir():
            assert column.read_bytes() == (root / "memory" / "index" / column.name).read_bytes(), column.name
        # a glob's tars as the store lists them (fsspec's unstrip_protocol: memory paths start with /)
        assert read_manifest(root / "memory")["shards"][0]["file"] == "memory:///wds/wds-0000.tar"
        dataset, local = (ShardDataset(root / d, data_config(root / d)) for d in ("memory", "local"))
        (a,), (b,) = readers(dataset, 1, 2, workers=2), readers(local, 1, 2)
        for x, y in zip(take(a, 0), take(b, 0)):
            assert torch.equal(x["pixels"], y["pixels"]) and x["caption"] == y["caption"]
    finally:
        memory.rm("/wds", recursive=True)


def test_pipe_urls_missing_store_packages_and_credentials_in_the_config_are_refused(served, capsys):
    from ot_dist.config.load import validate

    root, _ = served
    pipe = "pipe:aws s3 cp s3://b/x.tar -"
    assert main(["shard", "index", pipe, "--out", str(root / "o"), *INDEX]) == 2
    err = capsys.readouterr().err
    assert "a pipe: URL streams the tar" in err and "s3://bucket/path/x.tar" in err
    assert main(["shard", "index", "s3://bucket/laion/{00000..00002}.tar", "--out", str(root / "o"), *INDEX]) == 2
    assert "shard s3://bucket/laion/00000.tar: reading s3:// URLs needs the s3fs package: pip install " \
           "'ot_dist[s3]'" in capsys.readouterr().err
    assert main(["shard", "index", "gs://b/x.tar", "--out", str(root / "o"), "--storage-option", "token=abc", *INDEX]) == 2
    assert "data.storage_options: token holds a credential" in capsys.readouterr().err
    with pytest.raises(Exception, match="storage_options: client_kwargs.aws_secret_access_key holds a credential"):
        validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o", "data": {
            "shards": "s", "storage_options": {"endpoint_url": "https://minio:9000",
                                               "client_kwargs": {"aws_secret_access_key": "x"}}}})
    config = validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o", "data": {
        "shards": "s", "storage_options": {"endpoint_url": "https://minio:9000", "token": "anon"}}})
    assert config.data.storage_options["endpoint_url"] == "https://minio:9000"


def test_training_from_the_http_index_equals_training_from_the_tars_on_disk(served, tiny_models, tmp_path):
    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    root, store = served
    losses = []
    for name in ("local", "url"):
        raw = base_config(tiny_models["sd1"], "unused", tmp_path / name, batch_size=2, max_steps=2, resolution=64)
        raw["data"] = {"shards": str(root / name), "loader_workers": 1 if name == "url" else 0}
        store.log.clear()
        losses.append(Trainer(validate(raw), log=lambda line: None).train().losses)
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert store.ranges() and all(r is not None for m, _, r, _ in store.log if m == "GET")


def test_the_default_tries_ride_out_a_store_unavailable_for_half_a_minute(monkeypatch):
    """An object store that answers 503 for a while (S3's SlowDown, a gateway restarting) is waited out, not turned into
    skipped samples: with the default data.remote_retries and the shortest jitter, the waits before the last try add
    up to more than 30 s; a store failing through every try is reported after that many."""
    waits = []
    monkeypatch.setattr(remote, "FIRST_WAIT_S", REAL_FIRST_WAIT_S)
    monkeypatch.setattr(remote.time, "sleep", waits.append)
    monkeypatch.setattr(remote.random, "uniform", lambda low, high: low)  # the shortest wait jitter allows
    defaults = data_config("shards").data
    store = remote.RemoteStore(defaults.storage_options, defaults.remote_retries)
    failures = iter([ConnectionResetError(104, "Connection reset by peer")] * (defaults.remote_retries - 1))

    def read(fs, path):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return b"tar bytes"

    assert store._call(read, "memory://bucket/x.tar", "shard memory://bucket/x.tar") == b"tar bytes"
    assert len(waits) == defaults.remote_retries - 1 and sum(waits) > 30
    with pytest.raises(InputFileError, match=f"could not be read after {defaults.remote_retries} tries"):
        store._call(lambda fs, path: (_ for _ in ()).throw(ConnectionResetError(104, "reset")), "memory://bucket/x.tar",
                    "shard memory://bucket/x.tar")
