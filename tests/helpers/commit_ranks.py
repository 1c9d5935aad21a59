"""The checkpoint commit protocol (ot_dist/checkpoint/writer.py) on real gloo ranks, without a model.

    commit_ranks.py ROOT RESULT_PREFIX

Each rank writes RESULT_PREFIX-<rank>.json with, per case, the error it raised (or null) and what the checkpoint
folder holds afterwards. Cases, in order, in ROOT/<case>/checkpoints:
  background_ok       a background write while the main thread runs collectives on the default group
  rank1_fails         rank 1 cannot write (disk full), written at once
  rank1_fails_background   the same in the background: raised by wait() on every rank
  rank0_cannot_mkdir  rank 0 cannot make the partial folder (the checkpoints path is a file)
  not_shared          each rank's output folder its own (no shared filesystem), rank 1's holding a partial folder of
                      that step left from before: every rank writes, and rank 0 sees only its own files"""

import errno
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ot_dist.checkpoint import layout, writer
from ot_dist.checkpoint.staging import HostCopies
from ot_dist.parallel.runtime import start_runtime

ORIGINAL_WRITE = writer.write_rank_state


def files(step: int, rank: int) -> writer.RankFiles:
    copies = HostCopies(independent=True)
    tensors = {"w/0": copies(torch.full((1000,), float(step * 10 + rank)))}
    return writer.RankFiles(step, rank, tensors, {"owned": []}, "{}" if rank == 0 else None, copies.ready())


def state_of(root: Path) -> dict:
    return {"latest": (root / layout.LATEST).read_text().strip() if (root / layout.LATEST).exists() else None,
            "committed": sorted(p.name for p in layout.committed_checkpoints(root)) if root.is_dir() else []}


def failing_on(rank: int):
    def write(folder, r, tensors, meta):
        if r == rank:
            raise OSError(errno.ENOSPC, "No space left on device")
        return ORIGINAL_WRITE(folder, r, tensors, meta)
    return write


def main() -> None:
    base, prefix = Path(sys.argv[1]), sys.argv[2]
    runtime = start_runtime(5, needs_group=True)
    rank = runtime.rank
    background = writer.BackgroundWriter(runtime, 5)
    at_once = writer.Ranks(True, runtime.world_size)
    out = {}

    root = base / "background_ok" / "checkpoints"
    gate = threading.Event()  # the writer holds its files until the main thread ran its collectives
    def held_write(*args):
        assert gate.wait(60), "the main thread never got past start(): the write was not in the background"
        return ORIGINAL_WRITE(*args)
    writer.write_rank_state = held_write
    background.start(lambda ranks: writer.write_and_commit(files(1, rank), root, 3, "run", ranks))
    busy_during = 0
    for _ in range(20):  # training's collectives on the default group, while the writer uses its own group
        value = torch.ones(1)
        dist.all_reduce(value)
        busy_during += int(background.busy and value.item() == runtime.world_size)
    gate.set()
    background.wait()
    writer.write_rank_state = ORIGINAL_WRITE
    out["background_ok"] = {"error": None, "collectives_while_writing": busy_during, **state_of(root)}

    for case, in_background in (("rank1_fails", False), ("rank1_fails_background", True)):
        root = base / case / "checkpoints"
        writer.write_and_commit(files(1, rank), root, 3, "run", at_once)  # the checkpoint the failure must keep
        writer.write_rank_state = failing_on(1)
        error = None
        try:
            if in_background:
                background.start(lambda ranks: writer.write_and_commit(files(2, rank), root, 3, "run", ranks))
                background.wait()
            else:
                writer.write_and_commit(files(2, rank), root, 3, "run", at_once)
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"
        writer.write_rank_state = ORIGINAL_WRITE
        out[case] = {"error": error, **state_of(root)}

    root = base / "rank0_cannot_mkdir" / "checkpoints"
    if rank == 0:
        root.parent.mkdir(parents=True)
        root.write_text("not a folder")
    dist.barrier()
    try:
        writer.write_and_commit(files(1, rank), root, 3, "run", at_once)
        out["rank0_cannot_mkdir"] = {"error": None}
    except Exception as err:  # noqa: BLE001
        out["rank0_cannot_mkdir"] = {"error": f"{type(err).__name__}: {err}"}

    root = base / "not_shared" / f"node{rank}" / "checkpoints"
    if rank == 0:
        writer.write_and_commit(files(1, rank), root, 3, "run", writer.Ranks(False, 1))  # node 0's own last one
    else:
        layout.partial_dir(root, 2).mkdir(parents=True)  # left there by an earlier run on this node
    dist.barrier()
    try:
        writer.write_and_commit(files(2, rank), root, 3, "run", at_once)
        out["not_shared"] = {"error": None, **state_of(root)}
    except Exception as err:  # noqa: BLE001
        out["not_shared"] = {"error": f"{type(err).__name__}: {err}", **state_of(root)}

    Path(f"{prefix}-{rank}.json").write_text(json.dumps(out))
    runtime.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
