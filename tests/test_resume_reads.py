"""A resume at scale: O(world size) reads of the checkpoint's rank metadata over the whole job, and one checkpoint
for every rank, whatever each rank's view of the shared checkpoints folder.

The rank files are a small synthetic state (tests/helpers/shard_reads.py: fsdp-like row shards, ZeRO-like flat
partitions, ddp's rank-0-only files) loaded by 1-4 gloo ranks through shards.for_this_rank; every loaded value is
compared with the saved one, and each rank's reads of rank-*.json are counted. Before: every rank read every rank's
file, N x N at N ranks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from forked_ranks import run_ranks

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.shards import SavedShards, for_this_rank, rank_stem
from ot_dist.errors import InputFileError
from ot_dist.parallel.runtime import Runtime

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "tests" / "helpers"


def _helper():
    spec = importlib.util.spec_from_file_location("shard_reads", HELPERS / "shard_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shard_reads = _helper()


def load_launch(folder: Path, layout_name: str, processes: int, tmp_path: Path) -> list[dict]:
    """Every rank's {reads, wrong, rank_meta, error} after loading `folder` at `processes` ranks."""
    result = tmp_path / f"loaded-{processes}.json"
    done = run_ranks(HELPERS / "shard_reads.py", folder, layout_name, result, nproc=processes, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


def names(world_size: int) -> list[str]:
    return [f"{rank_stem(r)}.json" for r in range(world_size)]


@pytest.mark.parametrize("layout_name, processes", [("fsdp", 3), ("zero", 4)])
def test_a_resume_at_the_saved_layout_reads_each_rank_file_once(layout_name, processes, tmp_path):
    folder = tmp_path / "ckpt"
    shard_reads.save(folder, layout_name, processes)
    ranks = load_launch(folder, layout_name, processes, tmp_path)
    assert [r["error"] for r in ranks] == [None] * processes, ranks
    assert [r["wrong"] for r in ranks] == [[]] * processes
    # its own file and nothing else: N reads in all (every rank read all N files before: N x N)
    assert [r["reads"] for r in ranks] == [[name] for name in names(processes)]
    assert all(r["rank_meta"] for r in ranks)  # its own RNG states are there to restore


@pytest.mark.parametrize("layout_name, saved, processes", [("fsdp", 2, 3), ("fsdp", 3, 2), ("zero", 3, 4), ("ddp", 3, 3)])
def test_resharding_and_replicas_read_the_rank_files_once_on_rank_0(layout_name, saved, processes, tmp_path):
    """Another world size, or ddp (only rank 0's file holds the weights): the values are resharded exactly, rank 0
    alone reads every rank file (once each), every other rank at most its own: O(N) reads in all."""
    folder = tmp_path / "ckpt"
    shard_reads.save(folder, layout_name, saved)
    ranks = load_launch(folder, layout_name, processes, tmp_path)
    assert [r["error"] for r in ranks] == [None] * processes, ranks
    assert [r["wrong"] for r in ranks] == [[]] * processes
    assert sorted(ranks[0]["reads"]) == names(saved) and len(ranks[0]["reads"]) == saved
    for rank, r in enumerate(ranks[1:], start=1):
        assert r["reads"] in ([], [f"{rank_stem(rank)}.json"]), (rank, r["reads"])
    assert sum(len(r["reads"]) for r in ranks) <= saved + processes


def test_a_damaged_rank_file_is_named_on_every_rank(tmp_path):
    """Rank 1's file torn: rank 1 cannot use it, rank 0 reads them all and names it; every rank raises that error
    (none waits forever for the others)."""
    folder = tmp_path / "ckpt"
    shard_reads.save(folder, "fsdp", 3)
    (folder / "rank-00001.json").write_text('{"rank": 1, "owned": [')
    ranks = load_launch(folder, "fsdp", 3, tmp_path)
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1 and "rank-00001.json is not readable JSON" in errors.pop(), ranks


def test_one_process_without_a_group(tmp_path):
    """No process group (single, `ot-dist export`): the same rules in one process; SavedShards(folder) reads all."""
    same, other = tmp_path / "same", tmp_path / "other"
    shard_reads.save(same, "fsdp", 1)
    shard_reads.save(other, "fsdp", 2)
    runtime = Runtime()
    assert shard_reads.load_here(same, "fsdp", runtime) == {"reads": ["rank-00000.json"], "wrong": [],
                                                            "rank_meta": True, "error": None}
    resharded = shard_reads.load_here(other, "fsdp", runtime)
    assert resharded["wrong"] == [] and sorted(resharded["reads"]) == names(2) and len(resharded["reads"]) == 2
    assert len(SavedShards(other).meta) == 2
    # a hand-edited file is named, not a KeyError from inside the load
    (other / "rank-00001.json").write_text(json.dumps({"rank": 1, "owned": [{"fragments": [["x", 0, 0]]}]}))
    ownership, _, _ = shard_reads.rank_setup("fsdp", 1, 0, filled=False)
    with pytest.raises(InputFileError, match="rank-00001.json is not an ot_dist rank file"):
        for_this_rank(other, ownership, runtime)


# -- --resume auto: one checkpoint for every rank ------------------------------------------------------


def fake_checkpoint(root: Path, step: int) -> None:
    partial = layout.partial_dir(root, step)
    partial.mkdir(parents=True)
    (partial / "rank-00000.safetensors").write_bytes(b"x" * step)
    layout.commit(partial, root, step, None)


def test_resume_auto_takes_rank_0s_checkpoint_on_every_rank(tmp_path):
    """Rank 1 lists an older newest checkpoint (its node's cache), or was given another --resume by a torchrun
    restart's per-rank choice: every rank resumes from rank 0's. A rank that cannot see rank 0's checkpoint at all
    stops every rank, naming both; rank 0's refusal stops every rank."""
    for scenario in ("stale_listing", "restart_choice", "late", "unseen", "damaged"):  # resume_agreement.py's
        root = layout.checkpoints_dir(tmp_path / scenario)
        for step in (2, 4):
            fake_checkpoint(root, step)
        if scenario == "damaged":
            (root / layout.final_name(6)).mkdir()  # no marker: damaged after its commit
    result = tmp_path / "agreement.json"
    done = run_ranks(HELPERS / "resume_agreement.py", tmp_path, result, nproc=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(result.read_text())
    for scenario in ("stale_listing", "restart_choice", "late"):
        assert [r["folder"] for r in found[scenario]] == ["step-00000004"] * 2, (scenario, found[scenario])
    unseen = [r["error"] for r in found["unseen"]]
    assert unseen[0] == unseen[1] and unseen[0].startswith("InputFileError"), found["unseen"]
    assert "rank 1 does not see" in unseen[0] and "step-00000004" in unseen[0] and "step-00000002" in unseen[0]
    damaged = [r["error"] for r in found["damaged"]]
    assert damaged[0] == damaged[1] and "step-00000006" in damaged[0] and "damaged" in damaged[0], found["damaged"]
