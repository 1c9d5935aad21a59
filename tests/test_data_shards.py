"""Shard sets and their reader: build from concept folders of several aspect ratios, the manifest,
the bucket report for 1 and 2 processes, one bucket per global batch, equal steps on every rank,
exact resume (also on another world size), masks aligned with images, no pickle, clear errors."""

from __future__ import annotations

import pickle
import tarfile

import numpy as np
import pytest
from forked_ranks import run_ranks
import torch
import yaml
from PIL import Image

from ot_dist.cli import main
from ot_dist.config.load import validate
from ot_dist.data.plan import bucket_rows
from ot_dist.data.reader import ShardDataset, ShardReader
from ot_dist.data.shards import build_shard_set, read_manifest
from ot_dist.data.training_data import ensure_shards, report_for
from ot_dist.errors import InputFileError
from ot_dist.parallel.runtime import Runtime


def make_images(folder, sizes, seed=0, masks=False):
    """Noise images of the given (width, height) sizes with `img N` captions (and masks if asked)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(f"img {i}\n")
        if masks:
            Image.fromarray(rng.integers(0, 2, (h, w), dtype=np.uint8) * 255).save(folder / f"{i:04d}-masklabel.png")
    return folder


def config(data, **overrides):
    raw = {"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o", "data": data,
           "resolution": 64, "batch_size": 2, "seed": 3, **overrides}
    return validate(raw)


# 12 square, 7 wide (1:2), 3 tall (1.75:1): at resolution 64 with step 16, buckets 64x64, 96x48, 48x80
MIXED = [(64, 64)] * 12 + [(128, 64)] * 7 + [(64, 112)] * 3


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    folder = make_images(root / "imgs", MIXED)
    cfg = config({"path": str(folder), "shards": str(root / "shards"), "bucket_step": 16, "shard_size_mb": 0.02},
                 resolution="48,64")
    build_shard_set(cfg, root / "shards", log=lambda *_: None)
    return cfg, root / "shards"


def test_build_writes_bucketed_webdataset_shards_and_a_manifest(mixed):
    import webdataset as wds

    cfg, shards = mixed
    manifest = read_manifest(shards)
    assert manifest["resolutions"] == [48, 64] and len(manifest["shards"]) > 2
    by_aspect = {b["aspect"]: b["samples"] for b in manifest["buckets"]}
    assert by_aspect == {"1:1": 12, "1:2 (wide)": 7, "1.75:1 (tall)": 3}
    sizes = {b["aspect"]: b["sizes"]["64"] for b in manifest["buckets"]}
    assert sizes == {"1:1": [64, 64], "1:2 (wide)": [48, 96], "1.75:1 (tall)": [80, 48]}
    assert sum(s["samples"] for s in manifest["shards"]) == len(MIXED) == len(manifest["samples"])
    per_bucket = {}
    for shard in manifest["shards"]:
        for bucket, n in shard["buckets"].items():
            per_bucket[int(bucket)] = per_bucket.get(int(bucket), 0) + n
    assert per_bucket == {b["bucket"]: b["samples"] for b in manifest["buckets"]}
    # Plain webdataset reads the shards: every sample has its images per resolution, caption and metadata.
    urls = [str(shards / s["file"]) for s in manifest["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert len(samples) == len(MIXED)
    assert all({"48.png", "64.png", "txt", "json"} <= set(s) for s in samples)
    # The reader crops to the bucket at the requested resolution.
    dataset = ShardDataset(shards, cfg)
    wide = next(i for i, s in enumerate(dataset.samples) if s["bucket"] == manifest["buckets"][-1]["bucket"])
    for resolution in (48, 64):
        sample = dataset.load(wide, epoch=0, resolution=resolution)
        assert list(sample["pixels"].shape[1:]) == manifest["buckets"][-1]["sizes"][str(resolution)]
        assert sample["caption"].startswith("img ") and sample["pixels"].abs().max() <= 1


def test_bucket_report_for_one_and_two_processes(mixed, tmp_path, capsys):
    cfg, shards = mixed
    cfg = cfg.model_copy(deep=True)
    cfg.data.small_buckets = "drop"  # the remainders dropped, small buckets never trained (tests/test_concepts.py: move)
    table = ShardDataset(shards, cfg).table()
    one = {r.samples: (r.batches, r.dropped) for r in bucket_rows(table, global_batch=2)}
    two = {r.samples: (r.batches, r.dropped) for r in bucket_rows(table, global_batch=4)}
    assert one == {12: (6, 0), 7: (3, 1), 3: (1, 1)}
    assert two == {12: (3, 0), 7: (1, 3), 3: (0, 3)}
    report = report_for(cfg, shards, world_size=2)
    assert "global batch 4 on 2 process(es)" in report[0]
    tall = next(line for line in report if "1.75:1" in line)
    assert "NEVER TRAINED" in tall and not any("NEVER" in line for line in report[1:-1] if line is not tall)
    assert report[-1].strip() == ("total: 22 samples/epoch, 4 steps/epoch, 6 dropped per epoch (27.3%); "
                                  "never trained: 1.75:1 (tall)")
    assert report_for(cfg, shards, world_size=1)[-1].strip().startswith("total: 22 samples/epoch, 10 steps/epoch, 2 dropped")
    # The CLI builds and prints the same report.
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["shard", "build", str(path), "--out", str(tmp_path / "set"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "NEVER TRAINED" in out and "6 dropped per epoch" in out and (tmp_path / "set" / "manifest.json").is_file()


# The acceptance set: 117 samples (80 square, 25 wide, 12 tall) in 5 shards.
ACCEPTANCE = [(16, 16)] * 80 + [(32, 16)] * 25 + [(16, 28)] * 12


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    folder = make_images(root / "imgs", ACCEPTANCE, seed=1)
    cfg = config({"path": str(folder), "bucket_step": 8, "shard_size_mb": 0.03}, resolution=16)
    build_shard_set(cfg, root / "shards", log=lambda *_: None)
    return cfg, ShardDataset(root / "shards", cfg)


def readers(dataset, world_size, batch_size, workers=0):
    table = dataset.table()
    return [ShardReader(dataset, table, batch_size, 1, rank, world_size, workers) for rank in range(world_size)]


def take(reader, epoch, count=None):
    out = []
    for batch in reader.epoch_batches(epoch):
        out.append(batch)
        if count is not None and len(out) == count:
            break
    return out


def ids(batches):
    return [b["sample_id"].tolist() for b in batches]


def test_every_rank_same_steps_every_sample_once_one_bucket_per_global_batch(acceptance):
    _, dataset = acceptance
    # several shards (how many depends on the bytes per sample, which carry the source path: longer under xdist)
    assert len(dataset.manifest["shards"]) > 2 and len(dataset) == 117
    ranks = readers(dataset, world_size=2, batch_size=2, workers=2)
    # 80 -> 20 global batches of 4, 25 -> 6 (1 dropped), 12 -> 3: 29 steps, 116 trainable samples
    per_rank = [take(r, epoch=0) for r in ranks]
    assert [len(b) for b in per_rank] == [29, 29] == [r.steps_per_epoch for r in ranks]
    seen = [i for batches in per_rank for b in ids(batches) for i in b]
    planned = [i for gb in ranks[0].plan(0) for i in gb.samples]
    assert len(seen) == len(set(seen)) == 116 and sorted(seen) == sorted(planned)
    for a, b in zip(*per_rank):  # both halves of a global batch come from the same bucket
        assert torch.equal(a["target_size"][0], b["target_size"][0])
        assert len({tuple(t.tolist()) for t in torch.cat([a["target_size"], b["target_size"]])}) == 1
    # Deterministic for a seed, reshuffled per epoch.
    again = readers(dataset, world_size=2, batch_size=2)
    assert ids(take(again[0], epoch=0)) == ids(per_rank[0])
    assert ids(take(again[1], epoch=1)) != ids(per_rank[1])


def test_resume_mid_epoch_also_on_another_world_size(acceptance):
    _, dataset = acceptance
    uninterrupted = [take(r, epoch=0) for r in readers(dataset, world_size=2, batch_size=2, workers=2)]
    first = readers(dataset, world_size=2, batch_size=2, workers=2)
    head = [take(r, epoch=0, count=7) for r in first]
    state = first[0].state_dict()
    assert state == first[1].state_dict()
    assert {k: state[k] for k in ("epoch", "step", "global_batch", "samples", "steps_per_epoch")} == {
        "epoch": 0, "step": 7, "global_batch": 4, "samples": 117, "steps_per_epoch": 29}
    resumed = readers(dataset, world_size=2, batch_size=2, workers=2)
    for rank, reader in enumerate(resumed):
        reader.load_state_dict(state)
        rest = take(reader, epoch=0)
        assert len(rest) == 29 - 7
        for got, want in zip(head[rank] + rest, uninterrupted[rank]):
            assert torch.equal(got["sample_id"], want["sample_id"]) and torch.equal(got["pixels"], want["pixels"])
    # One process with the same global batch continues with exactly the remaining samples.
    (single,) = readers(dataset, world_size=1, batch_size=4)
    single.load_state_dict(state)
    rest = ids(take(single, epoch=0))
    expected = [a + b for a, b in zip(ids(uninterrupted[0])[7:], ids(uninterrupted[1])[7:])]
    assert rest == expected
    done = [i for b in ids(head[0]) + ids(head[1]) for i in b] + [i for b in rest for i in b]
    assert len(done) == len(set(done)) == 116
    with pytest.raises(InputFileError, match="global batch of 4"):
        readers(dataset, world_size=1, batch_size=2)[0].load_state_dict(state)


def test_a_position_in_an_epoch_planned_from_other_data_is_refused_or_left_for_the_next_epoch(acceptance):
    """Samples removed (or added, re-bucketed, another seed) since the checkpoint: the saved epoch's plan is another,
    and its saved global batch there would train samples twice and skip others. Refused, naming both; with
    data.resume_with_changed_data next_epoch the reader goes on from the next epoch's start. A position at an epoch's
    start, and the same data on another world size, resume as they are."""
    import dataclasses

    _, dataset = acceptance
    (first,) = readers(dataset, world_size=1, batch_size=4)
    take(first, epoch=0, count=7)
    state = first.state_dict()
    table = dataset.table()
    fewer = dataclasses.replace(table, buckets=np.asarray(table.buckets)[:-5], concepts=np.asarray(table.concepts)[:-5])
    changed = ShardReader(dataset, fewer, 4, 1, 0, 1)
    with pytest.raises(InputFileError, match=r"global batch 7 of epoch 0.*117 samples, 29 steps an epoch then, "
                                             r"112 samples, 28 steps an epoch now.*resume_with_changed_data"):
        changed.load_state_dict(state)
    logged = []
    moving_on = ShardReader(dataset, fewer, 4, 1, 0, 1, log=logged.append, changed_plan="next_epoch")
    moving_on.load_state_dict(state)
    assert (moving_on.epoch, moving_on.step, moving_on.resume_position(1)) == (1, 0, 0) and "epoch 1" in logged[0]
    ShardReader(dataset, fewer, 4, 1, 0, 1).load_state_dict({**state, "step": 0})  # nothing of the epoch trained yet
    same = readers(dataset, world_size=2, batch_size=2)[1]
    same.load_state_dict(state)
    assert same.resume_position(0) == 7


def test_loader_workers_leave_the_global_random_stream_alone(acceptance):
    """The global generator's stream (dropout, anything drawing from it) is the same with and without loader
    workers, so a run resumed mid-epoch (a new loader) continues it as the uninterrupted run does."""
    _, dataset = acceptance
    torch.manual_seed(7)
    take(readers(dataset, world_size=1, batch_size=4, workers=2)[0], epoch=0, count=3)
    with_workers = torch.rand(4)
    torch.manual_seed(7)
    take(readers(dataset, world_size=1, batch_size=4)[0], epoch=0, count=3)
    assert torch.equal(torch.rand(4), with_workers)


def test_resume_mid_epoch_in_two_gloo_processes(acceptance, tmp_path):
    """The same stop-after-7-batches and resume, each rank its own process (2 loader workers each)."""
    import json
    import os
    from pathlib import Path


    cfg, dataset = acceptance
    repo = Path(__file__).resolve().parents[1]
    raw = cfg.model_dump(mode="json")
    done = run_ranks(str(repo / "tests" / "helpers" / "reader_resume.py"), str(dataset.dir), json.dumps(raw), str(tmp_path),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        assert got["state"] == ranks[0]["state"] and {k: got["state"][k] for k in ("epoch", "step", "global_batch")} == {
            "epoch": 0, "step": 7, "global_batch": 4}
        assert got["head"] + got["rest"] == got["uninterrupted"] and len(got["uninterrupted"]) == 29
    seen = [i for got in ranks for b in got["head"] + got["rest"] for i in b]
    assert len(seen) == len(set(seen)) == 116
    # and the processes read what the in-process readers read
    assert ranks[0]["uninterrupted"] == ids(take(readers(dataset, world_size=2, batch_size=2)[0], epoch=0))


def test_pathological_buckets_equal_steps_for_two_epochs_and_report_the_drops(tmp_path):
    # One large bucket and one image in each of 9 other aspects (1:1.25 ... 4:1).
    sizes = [(16, 16)] * 41 + [(16, 20), (16, 24), (16, 28), (16, 32), (16, 40), (20, 16), (24, 16), (32, 16), (64, 16)]
    # log_ratio: at 16 px several aspects round to one size, and OneTrainer's rule would merge their buckets
    cfg = config({"path": str(make_images(tmp_path / "imgs", sizes)), "bucket_step": 8, "bucket_assignment": "log_ratio",
                  "small_buckets": "drop"}, resolution=16)
    build_shard_set(cfg, tmp_path / "set", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "set", cfg)
    ranks = readers(dataset, world_size=2, batch_size=2)
    for epoch in (0, 1):
        steps = [len(take(r, epoch)) for r in ranks]
        assert steps == [11, 11]
    report = report_for(cfg, tmp_path / "set", world_size=2)
    # At 16 px the 10 aspects have 5 distinct sizes: 1.25:1, 1.5:1 and 1:1.25 ... 1:2 train as 16x16 (45 samples,
    # 11 global batches), 2:1 / 2.5:1 / 3:1 as 8x24; the 4 buckets left with 1 or 2 images never train.
    assert sum("NEVER TRAINED" in line for line in report) == 4
    assert report[-1].strip().startswith("total: 50 samples/epoch, 11 steps/epoch, 6 dropped per epoch")


def test_pathological_buckets_train_two_ranks_for_two_epochs(small_sd1, tmp_path):
    """The same distribution scaled to 64 px, trained by 2 gloo processes for 2 epochs through the
    trainer: no hang, 10 steps per epoch on every rank, and the start report names the 9 dropped buckets."""

    from conftest import base_config
    from test_strategies import write_config


    sizes = [(64, 64)] * 41 + [(64, 80), (64, 96), (64, 112), (64, 128), (64, 160), (80, 64), (96, 64), (128, 64),
                               (256, 64)]
    data = make_images(tmp_path / "imgs", sizes)
    raw = base_config(small_sd1, data, tmp_path / "out", batch_size=2, epochs=2, strategy="ddp",
                      learning_rate=1e-5,
                      **{"data.bucket_step": 32, "data.bucket_assignment": "log_ratio", "log_every_steps": 1,
                         "data.small_buckets": "drop"})
    done = run_ranks("-m", "ot_dist", "train", str(write_config(tmp_path / "c.yaml", raw)))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.count("NEVER TRAINED") == 4, done.stdout  # buckets of equal size merged, as at 16 px
    assert "total: 50 samples/epoch, 11 steps/epoch, 6 dropped per epoch" in done.stdout
    assert "step 22/22 epoch 2/2" in done.stdout


def test_masks_stay_aligned_through_resize_and_random_crop(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):  # a white rectangle on black, its mask the same rectangle
        w, h = (150, 64) if i % 2 else (64, 100)
        canvas = np.zeros((h, w), dtype=np.uint8)
        top, left = rng.integers(0, h // 2), rng.integers(0, w // 2)
        canvas[top:top + h // 3, left:left + w // 3] = 255
        Image.fromarray(np.stack([canvas] * 3, -1)).save(folder / f"{i}.png")
        Image.fromarray(canvas).save(folder / f"{i}-masklabel.png")
        (folder / f"{i}.txt").write_text("x")
    (folder / "6.png").write_bytes((folder / "0.png").read_bytes())  # one image without a mask
    (folder / "6.txt").write_text("x")
    cfg = config({"path": str(folder), "bucket_step": 16, "crop": "random"}, resolution="48,64")
    build_shard_set(cfg, tmp_path / "shards", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "shards", cfg)
    crops = set()
    for index, record in enumerate(dataset.samples):
        for resolution in (48, 64):
            for epoch in (0, 1):
                sample = dataset.load(index, epoch, resolution)
                assert sample["mask"].shape[1:] == sample["pixels"].shape[1:]
                if not record["mask"]:
                    assert torch.equal(sample["mask"], torch.ones_like(sample["mask"]))
                    continue
                crops.add(tuple(sample["crop_top_left"].tolist()))
                white, masked = sample["pixels"].mean(0) > 0, sample["mask"][0] > 0.5
                assert (white == masked).float().mean() > 0.97
    assert len(crops) > 2  # the crops moved, and the masks moved with them


def test_pickle_members_are_refused_and_never_run(mixed, tmp_path):
    cfg, shards = mixed
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import webdataset as wds

    evil = tmp_path / "evil.tar"
    with wds.TarWriter(str(evil), encoder=False) as writer:
        writer.write({"__key__": "k", "pth": pickle.dumps(Payload()), "pyd": pickle.dumps(Payload())})
    dataset = ShardDataset(shards, cfg)
    dataset.manifest["shards"].append({"file": str(evil)})
    with tarfile.open(evil) as tar:
        members = {m.name.split(".", 1)[1]: [m.offset_data, m.size] for m in tar}
    sample = {"key": "k", "shard": len(dataset.manifest["shards"]) - 1, "members": members}
    for suffix in ("pth", "pyd"):
        with pytest.raises(InputFileError, match=f"member k.{suffix} refused"):
            dataset._read(sample, suffix)
    assert not marker.exists()


def test_concepts_captions_balancing_and_subfolders(tmp_path):
    a = make_images(tmp_path / "a", [(64, 64)] * 4)
    b = make_images(tmp_path / "b", [(64, 64)] * 2 + [(128, 64)] * 2, seed=1)
    c = make_images(tmp_path / "c", [(64, 64)] * 4, seed=2)
    make_images(tmp_path / "c" / "sub", [(64, 64)] * 2, seed=3)
    concepts = [
        {"path": str(a), "caption_prefix": "photo of "},
        {"path": str(b), "caption_source": "filename", "balancing": 2},
        {"path": str(c), "caption_source": "text", "caption_text": "fixed", "include_subdirectories": True,
         "balancing": 3, "balancing_strategy": "samples"},
    ]
    cfg = config({"concepts": concepts, "bucket_step": 16})
    build_shard_set(cfg, tmp_path / "shards", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "shards", cfg)
    captions = {}
    for i, record in enumerate(dataset.samples):
        captions.setdefault(record["concept"], set()).add(dataset.load(i, 0)["caption"])
    assert captions[0] == {f"photo of img {i}" for i in range(4)}
    assert captions[1] == {"0000", "0001", "0002", "0003"} and captions[2] == {"fixed"}
    assert len(dataset.manifest["samples"]) == 4 + 4 + 6
    # square: 4 (a) + 2 x 2 (b repeated twice) + 3 of c's 6; wide: 2 x 2 (b)
    assert sorted(dataset.table(cfg.data).epoch_sizes().values()) == [4, 11]
    (reader,) = readers(dataset, world_size=1, batch_size=1)
    drawn = [i for b in ids(take(reader, 0)) for i in b]
    assert len(drawn) == 15 and len(set(drawn)) == 15  # repeats get their own sample ids


@pytest.mark.parametrize("problem", ["corrupt image", "missing caption", "empty folder"])
def test_bad_input_exits_3_naming_the_file(tmp_path, capsys, problem):
    folder = make_images(tmp_path / "imgs", [(64, 64)] * 3)
    if problem == "corrupt image":
        (folder / "0001.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
        expected = ["0001.png", "could not be decoded"]
    elif problem == "missing caption":
        (folder / "0002.txt").unlink()
        expected = ["0002.png", "no caption file 0002.txt"]
    else:
        for path in folder.iterdir():
            path.unlink()
        expected = ["data.path", "no images", str(folder)]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                                    "data": {"path": str(folder)}}))
    assert main(["shard", "build", str(path), "--out", str(tmp_path / "set")]) == 3
    err = capsys.readouterr().err
    assert all(e in err for e in expected) and "Traceback" not in err


def test_ranks_wait_for_a_build_longer_than_the_process_groups_timeout(tmp_path):
    """The main process builds the shard set (or merges its parts: hours) while the other ranks wait, and the
    process group's timeout (distributed.timeout_minutes) is minutes: the ranks wait in a group of their own that
    waits as long as a build may. Here the group times out after 2 s and the build takes 6 s."""
    import json
    from pathlib import Path

    folder = make_images(tmp_path / "imgs", [(64, 64)] * 4)
    raw = {"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o", "resolution": 64,
           "batch_size": 2, "data": {"path": str(folder), "shards": str(tmp_path / "set")}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    helper = Path(__file__).parent / "helpers" / "shard_wait_ranks.py"
    done = run_ranks(helper, tmp_path / "config.json", tmp_path, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [str(tmp_path / "set")] * 2
    assert len(read_manifest(tmp_path / "set")["samples"]) == 4


def test_stale_shard_set_is_rebuilt_at_train_start(tmp_path):
    folder = make_images(tmp_path / "imgs", [(64, 64)] * 4)
    cfg = config({"path": str(folder), "shards": str(tmp_path / "set")})
    logged = []
    ensure_shards(cfg, Runtime(), logged.append)
    ensure_shards(cfg, Runtime(), logged.append)
    assert sum("building" in line for line in logged) == 1  # current: reused
    (folder / "0001.txt").write_text("a new caption\n")
    ensure_shards(cfg, Runtime(), logged.append)
    assert sum("building" in line for line in logged) == 2
    dataset = ShardDataset(tmp_path / "set", cfg)
    assert "a new caption" in {dataset.load(i, 0)["caption"] for i in range(4)}
    with pytest.raises(InputFileError, match="built for resolutions"):
        ShardDataset(tmp_path / "set", config({"path": str(folder)}, resolution=128))


def test_two_ranks_train_from_shards_like_one_process(small_sd1, shapes_data, tmp_path):
    """Two aspect buckets and two resolutions through the trainer: 2 gloo ranks (batch 2 each, cached
    latents: one chunk, computed by rank 0) end with the weights of 1 process with batch 4 reading images,
    and the bucket report is logged at train start."""
    import shutil

    from conftest import base_config
    from test_strategies import assert_matches, exported_weights, exported_weights_of_base, write_config

    from ot_dist.train.trainer import Trainer

    data = tmp_path / "data"
    shutil.copytree(shapes_data, data)  # 16 squares (64 px) + 6 wide images (1:2)
    for i in range(6):
        Image.open(data / f"{i:04d}.png").resize((128, 64)).save(data / f"wide{i}.png")
        (data / f"wide{i}.txt").write_text((data / f"{i:04d}.txt").read_text())
    settings = {"max_steps": 4, "learning_rate": 1e-5, "resolution": "64,128", "text_encoder.train": True}
    reference = base_config(small_sd1, data, tmp_path / "one", batch_size=4, **settings)
    lines = []
    result = Trainer(validate(reference), log=lines.append).train()
    assert result.steps == 4 and any("1:2 (wide)" in line and "2 pooled" in line for line in lines)
    raw = base_config(small_sd1, data, tmp_path / "two", batch_size=2, strategy="ddp", **settings,
                      **{"data.cache_latents": True})
    config = write_config(tmp_path / "two.yaml", raw)
    done = run_ranks("-m", "ot_dist", "train", str(config))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "bucket report: global batch 4 on 2 process(es), resolutions 64, 128" in done.stdout
    assert "total: 22 samples/epoch, 5 steps/epoch, 2 dropped per epoch" in done.stdout
    (cache,) = (tmp_path / "two-shards").glob("latents-*")
    assert sorted(p.name for p in cache.glob("chunk-*.tar")) == ["chunk-000000.tar"]  # 22 samples: one chunk
    got = exported_weights(tmp_path / "two", "full")
    assert_matches(exported_weights(tmp_path / "one", "full"), got)
    base = exported_weights_of_base(small_sd1, "full", got)
    assert max((base[k] - got[k]).abs().max().item() for k in base) > 2e-5  # it trained: the match can fail


def test_cached_latents_and_text_train_like_images_and_a_stale_cache_is_refused(tiny_models, shapes_data, tmp_path):
    import json

    from conftest import base_config
    from test_strategies import assert_matches, exported_weights

    from ot_dist.train.trainer import Trainer

    settings = {"max_steps": 3, "learning_rate": 1e-5}
    Trainer(validate(base_config(tiny_models["sdxl"], shapes_data, tmp_path / "images", family="sdxl", **settings)),
            log=print).train()
    cached = validate(base_config(tiny_models["sdxl"], shapes_data, tmp_path / "cached", family="sdxl", **settings,
                                  **{"data.cache_latents": True, "data.cache_text": True}))
    lines = []
    trainer = Trainer(cached, log=lines.append)
    batch = trainer.tokenize(next(iter(trainer.epoch_batches(0))))
    assert "pixels" not in batch and "token_ids" not in batch and batch["latent_mean"].shape[:2] == (4, 4)
    assert batch["text_hidden"].shape[0] == 4 and batch["text_pooled"].shape[0] == 4
    trainer.train()
    assert_matches(exported_weights(tmp_path / "images", "full"), exported_weights(tmp_path / "cached", "full"))
    assert sum("data: caching" in line for line in lines) == 2
    # Reused by the next run (a new run over the same output_dir); refused when it does not match the model.
    lines.clear()
    Trainer(cached, log=lines.append, overwrite=True)
    assert not any("caching" in line for line in lines)
    (cache,) = (tmp_path / "cached-shards").glob("latents-*")
    manifest = json.loads((cache / "manifest.json").read_text())
    (cache / "manifest.json").write_text(json.dumps({**manifest, "model_key": "another vae"}))
    with pytest.raises(InputFileError, match="cache_latents: the cache .* is stale: its model_key"):
        Trainer(cached, log=lines.append, overwrite=True)


def test_text_cache_needs_frozen_text_encoders():
    from ot_dist.errors import ConfigError

    with pytest.raises(ConfigError, match="data.cache_text"):
        config({"path": "d", "cache_text": True}, **{"text_encoder": {"train": True}})


def test_corrupt_members_are_skipped_counted_and_stop_the_run_above_the_limit(tmp_path):
    cfg = config({"path": str(make_images(tmp_path / "imgs", [(8, 8)] * 1000)), "bucket_step": 8,
                  "image_format": "jpg"}, resolution=8)
    build_shard_set(cfg, tmp_path / "set", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "set", cfg)
    broken = [dataset.samples[i] for i in (5, 500, 998)]
    for sample in broken:  # overwrite the JPEG bytes inside the tar
        offset, size = sample["members"]["8.jpg"]
        with open(tmp_path / "set" / dataset.manifest["shards"][sample["shard"]]["file"], "r+b") as f:
            f.seek(offset)
            f.write(b"\0" * size)
    logged = []
    reader = ShardReader(ShardDataset(tmp_path / "set", cfg), dataset.table(), 10, 1, log=logged.append)
    seen = [i for b in take(reader, 0) for i in b["sample_id"].tolist()]
    assert len(seen) == 997 and reader.skipped == 3
    assert all(any(s["key"] in line for line in logged) for s in broken)
    strict = ShardReader(ShardDataset(tmp_path / "set", cfg), dataset.table(), 10, 1, max_bad_fraction=0.002,
                         log=logged.append)
    with pytest.raises(InputFileError, match="3 unreadable samples on rank 0 in epoch 0"):
        take(strict, 0)


def test_a_truncated_shard_skips_the_samples_it_lost(tmp_path):
    cfg = config({"path": str(make_images(tmp_path / "imgs", [(16, 16)] * 20)), "bucket_step": 8}, resolution=16)
    build_shard_set(cfg, tmp_path / "set", log=lambda *_: None)
    shard = tmp_path / "set" / "shard-000000.tar"
    dataset = ShardDataset(tmp_path / "set", cfg)
    cut = dataset.samples[-1]["members"]["16.png"][0]  # the last sample's image and what follows are lost
    shard.write_bytes(shard.read_bytes()[:cut])
    logged = []
    reader = ShardReader(ShardDataset(tmp_path / "set", cfg), dataset.table(), 4, 1, max_bad_fraction=0.1,
                         log=logged.append)
    seen = [i for b in take(reader, 0) for i in b["sample_id"].tolist()]
    assert sorted(seen) == list(range(19)) and reader.skipped == 1
    assert dataset.samples[-1]["key"] in logged[0] and "truncated" in logged[0]


def test_buckets_of_one_size_train_as_one(tmp_path):
    """Issue 18's case: at 512 px and step 64, 2:1 and 1.75:1 are both 384x704; kept apart, neither filled a global
    batch of 4 and 80 % of the 20 images never trained. As one bucket they train."""
    from ot_dist.data.buckets import ASPECTS, bucket_size, merged_buckets
    from ot_dist.data.plan import SampleTable, bucket_rows, untrained_fraction

    merged = merged_buckets([512], 64)
    two, one_75 = ASPECTS.index(2.0), ASPECTS.index(1.75)
    assert bucket_size(two, 512, 64) == bucket_size(one_75, 512, 64) == (704, 384)
    assert merged[two] == merged[one_75]
    assert all(bucket_size(b, 512, 64) == bucket_size(m, 512, 64) for b, m in merged.items())
    assert len(set(merged.values())) < len(ASPECTS)
    # 20 images: 2 of 2:1 and 2 of 1.75:1 beside 16 spread over aspects of their own
    raw = [two, two, one_75, one_75] + [ASPECTS.index(a) for a in (1.0,) * 4 + (0.5,) * 4 + (1 / 1.75,) * 4
                                      + (1.25,) * 2 + (1 / 3,) * 2]
    separate = SampleTable(tuple(raw), (0,) * len(raw), ((1.0, "repeats"),), ("c",))
    together = SampleTable(tuple(merged[b] for b in raw), (0,) * len(raw), ((1.0, "repeats"),), ("c",))
    assert untrained_fraction(together, 4) < untrained_fraction(separate, 4)
    assert {r.samples for r in bucket_rows(together, 4) if r.bucket == merged[two]} == {4}


def test_a_run_that_would_not_train_most_images_stops_before_training(tiny_models, tmp_path):
    from conftest import base_config

    from ot_dist.train.trainer import Trainer

    # 2 square images and 6 of 6 other aspects: with a global batch of 2, 6 of 8 never train (small_buckets drop)
    sizes = [(64, 64)] * 2 + [(64, 128), (128, 64), (64, 256), (256, 64), (64, 96), (96, 64)]
    data = make_images(tmp_path / "imgs", sizes)
    raw = base_config(tiny_models["sd1"], data, tmp_path / "out", batch_size=2, max_steps=1,
                      **{"data.bucket_step": 8, "data.small_buckets": "drop"})  # 7 aspects keep 7 sizes
    with pytest.raises(InputFileError, match=r"data.max_untrained_fraction: 75% .*never train") as err:
        Trainer(validate(raw), log=lambda *_: None)
    assert "NEVER TRAINED" in str(err.value) and "data.small_buckets: move" in str(err.value)  # report and fixes
    raw["data"]["max_untrained_fraction"] = 0.8  # accepted: it trains
    raw["output_dir"] = str(tmp_path / "out2")
    assert Trainer(validate(raw), log=lambda *_: None).train().steps == 1


def test_square_crops_every_image_to_the_resolutions_square(tmp_path):
    """data.bucket_assignment: square: one bucket, every sample read at each resolution as that square, cropped from
    the image scaled to cover it (a wide image loses its sides, a tall one its top and bottom)."""
    folder = make_images(tmp_path / "imgs", MIXED)
    cfg = config({"path": str(folder), "shards": str(tmp_path / "shards"), "bucket_step": 16,
                  "bucket_assignment": "square"}, resolution="48,64")
    build_shard_set(cfg, tmp_path / "shards", log=lambda *_: None)
    manifest = read_manifest(tmp_path / "shards")
    assert [(b["aspect"], b["samples"], b["sizes"]) for b in manifest["buckets"]] == [
        ("1:1", len(MIXED), {"48": [48, 48], "64": [64, 64]})]
    dataset = ShardDataset(tmp_path / "shards", cfg)
    for index in range(len(MIXED)):
        for resolution in (48, 64):
            assert list(dataset.load(index, epoch=0, resolution=resolution)["pixels"].shape[1:]) == [resolution] * 2
