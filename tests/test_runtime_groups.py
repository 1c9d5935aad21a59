"""A process group the caller made before calling ot_dist (a notebook, Ray, a launcher of its own: init_method tcp://,
explicit rank and world size, no torchrun variables): ot_dist trains with that group's rank and size, DeepSpeed gets
the LOCAL_RANK it reads, and the group is left to its maker when the run ends (parallel/runtime.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import base_config
from forked_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_two_rank_group_of_the_callers_trains_as_two_ranks_and_is_kept(one_level_sd1, shapes_data, tmp_path):
    """16 images, batch 2 on each of 2 ranks: 4 steps an epoch. Taken for one process each, the ranks would run 8."""
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "out", method="lora", strategy="ddp", batch_size=2,
                      epochs=1)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    done = run_ranks(REPO / "tests" / "helpers" / "own_group_train.py", tmp_path / "config.json", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in seen) == [0, 1]
    assert all(s["steps"] == 4 and s["group_kept"] for s in seen), seen
    assert "on 2 process(es)" in next(s["report"] for s in seen if s["rank"] == 0)


def test_deepspeed_starts_in_a_one_rank_group_made_without_local_rank(one_level_sd1, shapes_data, tmp_path,
                                                                      monkeypatch):
    import torch.distributed as dist

    from ot_dist.config.load import validate
    from ot_dist.ports import free_port
    from ot_dist.train.trainer import train

    for name in TORCHRUN_VARIABLES:  # set first, so that the test's end restores them as they were (ot_dist writes
        monkeypatch.setenv(name, "")  # LOCAL_RANK)
        monkeypatch.delenv(name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        raw = base_config(one_level_sd1, shapes_data, tmp_path / "out", method="lora", strategy="zero2",
                          batch_size=2, max_steps=1)
        assert train(validate(raw), log=lambda *_: None).steps == 1
        assert dist.is_initialized()  # the caller's group outlives the run
        assert os.environ["LOCAL_RANK"] == "0"  # where DeepSpeed's engine reads it
    finally:
        dist.destroy_process_group()


def test_a_trainer_refused_while_being_built_ends_the_group_it_started(one_level_sd1, shapes_data, tmp_path,
                                                                      monkeypatch):
    """Trainer(config) for fsdp in one process starts a 1-rank group for itself; when its construction is refused
    (here: the model folder is gone) nobody holds it to end that group, so it ends it itself."""
    import torch.distributed as dist

    from ot_dist.config.load import validate
    from ot_dist.errors import InputFileError
    from ot_dist.ports import free_port
    from ot_dist.train.trainer import Trainer

    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    config = validate(base_config(one_level_sd1, shapes_data, tmp_path / "run", strategy="fsdp", max_steps=1))
    config.model.path = str(tmp_path / "gone")  # removed after the config was checked
    with pytest.raises(InputFileError):
        Trainer(config, log=lambda *_: None)
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend, refused", [("nccl", True), ("cpu:gloo,cuda:nccl", False), ("gloo", False)])
def test_a_callers_gpu_group_must_carry_cpu_tensors(monkeypatch, backend, refused):
    """A group made by the caller (Ray Train, a notebook) with plain NCCL cannot carry the CPU tensors ot_dist
    reduces: refused at start, naming the backend to use, instead of failing at the first checkpoint or export. A CPU
    stands in for the GPU and the group."""
    import torch
    import torch.distributed as dist

    from ot_dist.errors import ConfigError
    from ot_dist.parallel import runtime

    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(runtime, "this_rank_device", lambda local_rank: torch.device("cuda", local_rank))
    monkeypatch.setenv("LOCAL_RANK", "1")
    if refused:
        with pytest.raises(ConfigError, match="cpu:gloo,cuda:nccl"):
            runtime.runtime_of_existing_group(needs_group=False)
    else:
        assert runtime.runtime_of_existing_group(needs_group=False).device == torch.device("cuda", 1)


def test_an_export_that_fails_on_the_main_process_stops_every_rank(one_level_sd1, shapes_data, tmp_path):
    """The other ranks wait while the main process writes the export; when its write fails they hear of it at once
    instead of waiting out the process group's timeout (here 2 minutes, the launch's limit 90 s)."""
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "run", strategy="ddp", max_steps=1,
                      **{"distributed.timeout_minutes": 2})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    done = run_ranks(Path(__file__).parent / "helpers" / "export_failure_ranks.py", tmp_path / "config.json", tmp_path,
                     timeout=90)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "OSError: [Errno 28] No space left on device"
    assert (tmp_path / "rank1.txt").read_text().startswith("InputFileError: the export to")
