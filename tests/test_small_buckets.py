"""Small buckets (issue 18): with data.small_buckets move (the default) buckets that cannot fill a global batch move
into the nearest bucket that can, and the buckets' remainders train together every epoch, so almost every image
trains every epoch while every global batch stays one bucket and one resolution; drop keeps the earlier behaviour.
The 2-rank run of the issue's case is in tests/test_concepts.py::test_two_rank_launch (one launch for both)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.data.buckets import ASPECTS, aspect_name
from ot_dist.data.plan import SampleTable, plan_epoch, steps_per_epoch, untrained_fraction
from ot_dist.data.reader import ShardDataset, ShardReader
from ot_dist.data.shards import build_shard_set
from ot_dist.data.small_buckets import move_small_buckets, moved_samples
from ot_dist.data.training_data import planned_table, report_for
from ot_dist.errors import InputFileError

# Issue 18's user: 20 images from 256x256 to 1200x400, portrait and landscape, trained at 512 px (step 64).
ISSUE_SIZES = [(256, 256), (300, 300), (512, 512), (1024, 1024), (400, 700), (384, 768), (350, 700), (400, 800),
               (600, 480), (640, 480), (720, 480), (800, 457), (800, 400), (1000, 400), (1200, 400), (900, 300),
               (480, 600), (480, 720), (300, 900), (640, 360)]


def write_images(folder, sizes, scale=1):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(sizes):
        w, h = max(8, w // scale), max(8, h // scale)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
        (folder / f"{i:02d}.txt").write_text(f"img {i}")
    return folder


def issue_config(folder, **overrides):
    raw = {"model": {"family": "sdxl", "path": "m"}, "method": "lora", "output_dir": "o",
           "data": {"path": str(folder), "shards": str(folder) + "-shards"}, "resolution": 512, "batch_size": 2,
           **overrides}
    return validate(raw)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_issue_case_trains_every_image_every_epoch_on_two_ranks(tmp_path, batch_size):
    """The plan 2 ranks follow: every global batch full and of one bucket (so both ranks take batch_size samples of
    one size per step), all 20 images in every epoch, where drop trains few of them."""
    config = issue_config(write_images(tmp_path / "imgs", ISSUE_SIZES), batch_size=batch_size)
    global_batch = 2 * batch_size
    table = planned_table(config, world_size=2)
    assert moved_samples(table)  # there were buckets too small to fill a global batch
    assert all(n >= global_batch for n in table.epoch_sizes().values())
    for epoch in range(3):
        plan = plan_epoch(table, global_batch, [512], config.seed, epoch, pool=True)
        assert len(plan) == steps_per_epoch(table, global_batch, pool=True) == 20 // global_batch
        assert all(len(batch.samples) == global_batch for batch in plan)
        trained = {i for batch in plan for i in batch.samples}
        assert len(trained) >= 0.95 * 20
    dropped = planned_table(issue_config(tmp_path / "imgs", batch_size=batch_size,
                                         **{"data": {"path": str(tmp_path / "imgs"), "small_buckets": "drop"}}), 2)
    old = {i for batch in plan_epoch(dropped, global_batch, [512], config.seed, 0) for i in batch.samples}
    assert len(old) < 16  # what the issue saw: most images never trained


def test_a_small_bucket_moves_to_the_nearest_that_fills_and_the_report_names_its_images():
    one, wide, wider, tall = (ASPECTS.index(a) for a in (1.0, 0.5, 0.4, 2.0))
    # 8 squares, 3 at 1:2, 2 at 1:2.5, 1 at 2:1; global batch 4
    buckets = (one,) * 8 + (wide,) * 3 + (wider,) * 2 + (tall,)
    table = SampleTable(buckets, (0,) * len(buckets), ((1.0, "repeats"),), ("c",))
    moved = move_small_buckets(table, 4)
    # 2:1 (1 image) is the smallest: with no tall neighbour that fills a batch with it, the nearest that does is 1:1;
    # then 1:2.5 (2) joins 1:2 (3), together 5: a wide crop instead of a square one
    assert moved.buckets == (one,) * 8 + (wide,) * 5 + (one,)
    assert moved_samples(moved) == {11: (wider, wide), 12: (wider, wide), 13: (tall, one)}
    assert untrained_fraction(moved, 4, pool=True) == 2 / 14  # 14 samples: 3 global batches, 2 wait
    assert untrained_fraction(table, 4) == 6 / 14  # drop: 1:2, 1:2.5 and 2:1 never train


def test_moved_images_are_cropped_to_their_new_bucket_and_reported(tmp_path):
    from test_data_shards import make_images

    folder = make_images(tmp_path / "imgs", [(64, 64)] * 7 + [(128, 64)], masks=True)
    config = validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                       "data": {"path": str(folder), "bucket_step": 16}, "resolution": 64, "batch_size": 4})
    build_shard_set(config, tmp_path / "set", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "set", config)
    reader = ShardReader(dataset, dataset.table(config.data), 4, 1, small_buckets="move")
    batches = list(reader.epoch_batches(0))
    assert len(batches) == reader.steps_per_epoch == 2
    assert sorted(i for b in batches for i in b["sample_id"].tolist()) == list(range(8))
    for batch in batches:
        assert batch["pixels"].shape[-2:] == batch["mask"].shape[-2:] == (64, 64)
    wide = next(i for i, s in enumerate(dataset.samples) if s["bucket"] == ASPECTS.index(0.5))
    # the 128x64 image was stored at 96x48 for its own bucket; in 1:1 it is scaled to cover 64x64 (128x64) and cropped
    moved = dataset.load(wide, 0, 64, bucket=ASPECTS.index(1.0))
    assert moved["pixels"].shape[-2:] == (64, 64) and tuple(moved["target_size"].tolist()) == (64, 64)
    assert moved["mask"].shape[-2:] == (64, 64)
    report = report_for(config.model_copy(update={}), tmp_path / "set", world_size=1)
    assert any(line.strip().startswith(f"moved {aspect_name(ASPECTS.index(0.5))} -> 1:1 64x64") and "0007.png" in line
               for line in report), report
    assert report[-1].strip() == "total: 8 samples/epoch, 2 steps/epoch, 0 dropped per epoch (0.0%), 1 moved"
    # only the main process, which logs the report, reads the moved images' metadata to name them
    from types import SimpleNamespace

    from ot_dist.data.training_data import main_process_report

    assert main_process_report(dataset, reader, SimpleNamespace(is_main=True, world_size=1)) == report
    dataset.metadata = lambda i: pytest.fail("a rank that logs nothing read a sample's metadata")
    assert main_process_report(dataset, reader, SimpleNamespace(is_main=False, world_size=1)) == []


def test_too_many_untrained_images_stop_before_training_unless_accepted(tiny_models, tmp_path):
    """Under move only the samples that fill no global batch stay out: 3 squares with a global batch of 2 leave 1
    (33 %) per epoch, over the 20 % default: exit 3 with the report, before training; accepted, it trains."""
    from conftest import base_config
    from test_data_shards import make_images

    from ot_dist.train.trainer import Trainer

    raw = base_config(tiny_models["sd1"], make_images(tmp_path / "imgs", [(64, 64)] * 3), tmp_path / "out",
                      batch_size=2, max_steps=1)
    with pytest.raises(InputFileError, match=r"data.max_untrained_fraction: 33% of the samples per epoch fill no "
                                             r"global batch") as err:
        Trainer(validate(raw), log=lambda *_: None)
    assert err.value.exit_code == 3 and "bucket report" in str(err.value)
    raw["data"]["max_untrained_fraction"] = 0.34
    raw["output_dir"] = str(tmp_path / "out2")
    assert Trainer(validate(raw), log=lambda *_: None).train().steps == 1


def test_cached_latents_read_a_micro_batch_with_a_moved_image_as_pixels(tiny_models, tmp_path):
    from conftest import base_config
    from test_data_shards import make_images

    from ot_dist.train.trainer import Trainer

    raw = base_config(tiny_models["sd1"], make_images(tmp_path / "imgs", [(64, 64)] * 7 + [(128, 64)]),
                      tmp_path / "out", batch_size=4, epochs=2, **{"data.cache_latents": True, "data.bucket_step": 16})
    trainer = Trainer(validate(raw), log=lambda *_: None)
    kinds = [("pixels" in b, len(b["sample_id"])) for b in trainer.epoch_batches(0)]
    assert sorted(kinds) == [(False, 4), (True, 4)]  # the batch with the moved image is read as pixels
    assert trainer.train().steps == 4
    _ = torch
