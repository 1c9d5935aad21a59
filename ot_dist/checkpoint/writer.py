"""Writing and committing one checkpoint, at once or in a background thread.

The commit protocol is the same both ways: rank 0 makes the partial folder; every rank writes its files into it;
the ranks agree that every one of them succeeded; rank 0 commits (marker, rename, `latest`, prune); the ranks wait
for the commit. A rank that fails to write (disk full, permissions) still takes part in the agreement, so nobody
waits forever for it, nothing is committed, and every rank raises the same error naming the ranks that failed.

In the background (`checkpoint.write_in_background`), the step's host copies (checkpoint/staging.py) are written by
a thread while training goes on. Its collectives run on a process group of their own (gloo, made once at start by
every rank), so they never interleave with training's collectives on the default group, whatever step each thread
is at. One write is in flight at a time: the next save, the end of training and a failure first wait for it; a
write's error is raised there, at the same point on every rank (the ranks agreed on it)."""

from __future__ import annotations

import datetime
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.shards import rank_stem, write_rank_state
from ot_dist.checkpoint.staging import CopiesDone
from ot_dist.errors import InputFileError, UserError


@dataclass
class RankFiles:
    """One rank's files of the checkpoint of `step`, as host copies taken at that step."""

    step: int
    rank: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    trainer_json: str | None  # rank 0's trainer.json
    copies_done: CopiesDone


class Ranks:
    """The collectives of the commit protocol, on `group` (None: the default group) or, in one process, none."""

    def __init__(self, distributed: bool, world_size: int, group=None):
        self.distributed, self.world_size, self.group = distributed, world_size, group

    def failed(self, rank: int, failed_here: bool) -> list[int]:
        """The ranks that report a failure (every rank calls this at the same point and gets the same list)."""
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[rank] = int(failed_here)
        if self.distributed:
            dist.all_reduce(flags, group=self.group)
        return [r for r, f in enumerate(flags.tolist()) if f]


def write_and_commit(files: RankFiles, root: Path, keep_last: int | None, run_id: str | None, ranks: Ranks) -> Path:
    """The whole protocol for this rank; returns the committed folder or raises on every rank."""
    partial, error = layout.partial_dir(root, files.step), None
    try:
        if files.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
            except OSError as err:
                error = err
        _agree(ranks, files, error, partial, "written")  # the folder exists before anyone writes into it
        try:
            files.copies_done.wait()
            write_rank_state(partial, files.rank, files.tensors, files.meta)
            if files.trainer_json is not None:
                (partial / layout.TRAINER_FILE).write_text(files.trainer_json)
        except Exception as err:  # noqa: BLE001 - any failure must still reach the agreement below
            error = err
    finally:
        files.tensors = {}  # the host copies are on disk (or lost): free them before the commit
        files.copies_done.release()
    _agree(ranks, files, error, partial, "written")
    if files.rank == 0:
        try:
            check_every_rank_wrote_here(partial, ranks.world_size)
            layout.commit(partial, root, files.step, keep_last, run_id=run_id)
        except Exception as err:  # noqa: BLE001
            error = err
    _agree(ranks, files, error, partial, "committed")  # nobody goes on (or exits) before the commit
    return root / layout.final_name(files.step)


def check_every_rank_wrote_here(partial: Path, world_size: int) -> None:
    """Before rank 0 commits: every rank's files are in the folder as rank 0 sees it. Where output_dir is a folder of
    each node's own (no shared filesystem) and another node finds a partial folder of that step left there, every
    rank writes without an error, and the marker would list rank 0's node's files alone: a committed checkpoint that
    cannot be resumed, after which keep_last deletes the older good ones."""
    missing = [rank for rank in range(world_size) if not all(
        (partial / f"{rank_stem(rank)}{suffix}").is_file() for suffix in (".safetensors", ".json"))]
    if missing:
        ranks = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise InputFileError(
            f"the main process does not see the files of rank(s) {ranks} in {partial}, although they wrote them: "
            "output_dir must be one folder every node writes into (a shared filesystem: NFS, a ReadWriteMany volume)")


def _agree(ranks: Ranks, files: RankFiles, error: BaseException | None, partial: Path, what: str) -> None:
    failed = ranks.failed(files.rank, error is not None)
    if not failed:
        return
    where = "rank" + ("s " if len(failed) > 1 else " ") + ", ".join(map(str, failed))
    why = f": {error}" if error is not None else " (that rank's log says why)"
    message = (f"checkpoint of step {files.step} could not be {what} on {where} in {partial}{why}; nothing was "
               "committed, the previous checkpoint is still the latest")
    if error is not None and not isinstance(error, (OSError, UserError)):
        raise RuntimeError(message) from error  # a defect, not the disk: keep its traceback
    raise InputFileError(message) from error


class BackgroundWriter:
    """One checkpoint write at a time, in a thread, with its collectives on a gloo group of its own."""

    def __init__(self, runtime, timeout_minutes: float):
        group = None
        if runtime.distributed:  # every rank makes it, at the same point (Checkpointer's construction)
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
        self.ranks = Ranks(runtime.distributed, runtime.world_size, group)
        self.device = runtime.device
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, work) -> None:
        """Run `work(ranks)` in the background once the previous write is done (its error is raised here)."""
        self.wait()

        def run():
            try:
                if self.device.type == "cuda":
                    # A thread starts on GPU 0: without this, waiting on the copies' event and freeing pinned memory
                    # would make a CUDA context there on every rank of a node (GPU 0's memory, and a failed save
                    # where GPUs are exclusive to one process).
                    torch.cuda.set_device(self.device)
                work(self.ranks)
            except BaseException as err:  # noqa: BLE001 - handed to the main thread by wait()
                self._error = err

        # Not a daemon: an interpreter that exits normally lets a commit in flight finish.
        self._thread = threading.Thread(target=run, name="ot_dist-checkpoint-writer")
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the write in flight is committed; raises what made it fail."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
