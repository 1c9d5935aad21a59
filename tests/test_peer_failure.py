"""A rank that fails ends the other ranks within seconds (ot_dist/parallel/peer_failure.py). Under NCCL the others
would wait in their next collective until distributed.timeout_minutes; a CPU cannot show NCCL, so the surviving rank
here is blocked the way NCCL blocks it: in a C++ call that releases the GIL and waits for a peer that never answers
(a store wait, or a sleep). gloo itself would notice the dead peer at once, which is why it is not the stand-in."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ot_dist.ports import free_port

REPO = Path(__file__).resolve().parents[1]
POLL, GRACE = 0.25, 1.0

RANK_SCRIPT = """
import datetime, sys, time
import torch.distributed as dist
from ot_dist.parallel import peer_failure
from ot_dist.parallel.runtime import exit_process, start_runtime
peer_failure.POLL_SECONDS, peer_failure.GRACE_SECONDS = {poll}, {grace}  # shorter than a user's: the test's time
POLL = peer_failure.POLL_SECONDS
runtime = start_runtime(30)  # the collective timeout the survivors would otherwise wait out: 30 minutes
failing, rank = int(sys.argv[1]), runtime.rank
if failing == rank:
    print(f"ot-dist: error: rank {rank}: a damaged sample", file=sys.stderr, flush=True)
    exit_process(3)
if failing < 0:  # a normal end: the store's host (rank 0) ends first, the other keeps working a while
    time.sleep(0 if rank == 0 else 2 * POLL)
    print(f"rank {rank} done", flush=True)
    exit_process(0)
from ot_dist.forced_exit import before_forced_exit
before_forced_exit.append(lambda: print("run closed as failed", flush=True))  # what the tracker registers
import threading  # a checkpoint written in the background, committing after the notice and its grace
threading.Thread(target=lambda: (time.sleep(POLL + {grace} + 2), print("committed", flush=True))).start()
if rank == 0:  # the store's host: a C++ wait that releases the GIL and never ends
    dist.distributed_c10d._get_default_store().wait(["never set"], datetime.timedelta(minutes=30))
else:
    time.sleep(1800)
print("the wait ended by itself", flush=True)
"""


def launch(failing: int) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    for key in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(key, None)
    script = RANK_SCRIPT.replace("{poll}", str(POLL)).replace("{grace}", str(GRACE))
    return [subprocess.Popen([sys.executable, "-c", script, str(failing)],
                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]


def ended(ranks: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    done = []
    try:
        for process in ranks:
            stdout, stderr = process.communicate(timeout=120)  # far less than the 30-minute collective timeout
            done.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    finally:
        for process in ranks:
            process.kill()
    return done


def test_the_ranks_waiting_on_a_failed_rank_end_with_its_exit_code_and_name_it():
    start = time.monotonic()
    launches = {failing: launch(failing) for failing in (1, 0)}  # a rank that is not the store's host fails; the host
    for failing, processes in launches.items():
        ranks = ended(processes)
        elapsed = time.monotonic() - start
        failed, survivor = ranks[failing], ranks[1 - failing]
        assert failed.returncode == 3 and "a damaged sample" in failed.stderr, failed.stderr[-2000:]
        assert survivor.returncode == 3, (failing, survivor.returncode, survivor.stderr[-2000:])
        assert f"rank {failing} of 2 failed (exit code 3" in survivor.stderr
        assert "the wait ended by itself" not in survivor.stdout
        # what it registered to do before a forced exit ran, and its non-daemon threads ended before it did
        assert sorted(survivor.stdout.splitlines()) == ["committed", "run closed as failed"], survivor.stdout
        # start-up, a poll, the grace its own error path gets, and no collective timeout
        assert elapsed < 60, elapsed


def test_a_normal_end_of_the_stores_host_ends_no_other_rank():
    ranks = ended(launch(-1))
    for rank, done in enumerate(ranks):
        assert done.returncode == 0, (rank, done.stderr[-2000:])
        assert done.stdout == f"rank {rank} done\n"
    assert "ends too" not in ranks[1].stderr


WATCH_SCRIPT = """
import os, sys, time
import torch.distributed as dist
from ot_dist.parallel import peer_failure
peer_failure.POLL_SECONDS, peer_failure.GRACE_SECONDS = {poll}, {grace}
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
store.set("ot_dist/peer_failure/attempt_0/group_1", "1:3")  # the failure that made torchrun restart the group
store.set("ot_dist/peer_failure/attempt_1/group_0", "1:4")  # this attempt's first run in these processes failed
os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
watch = peer_failure.PeerFailureWatch(store, rank=0, world_size=2, group=1).start()  # the second run's group
time.sleep(peer_failure.POLL_SECONDS + peer_failure.GRACE_SECONDS + 1)
print("the restarted group ran on", flush=True)
store.set("ot_dist/peer_failure/attempt_1/group_1", "1:5")  # a failure of this group
time.sleep(60)
print("not ended", flush=True)
"""


def test_a_restarted_group_or_a_later_run_ends_on_its_own_failures_only():
    script = WATCH_SCRIPT.replace("{poll}", str(POLL)).replace("{grace}", str(GRACE))
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout == "the restarted group ran on\n", done.stderr[-2000:]
    assert done.returncode == 5 and "rank 1 of 2 failed (exit code 5" in done.stderr


class RecordingWatch:
    def __init__(self, order: list):
        self.order = order

    def announce(self, code: int) -> None:
        self.order.append(("announced", code))


def test_a_failing_trainer_announces_before_its_cleanup_waits_on_anyone(monkeypatch, tiny_models, shapes_data,
                                                                        tmp_path):
    """The announcement comes first: the cleanup after a failed step (committing a checkpoint written in the
    background, closing the tracker) can itself wait on the other ranks."""
    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.errors import InputFileError
    from ot_dist.parallel import runtime
    from ot_dist.train.trainer import Trainer

    order = []
    monkeypatch.setattr(runtime, "_peer_watch", RecordingWatch(order))
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1))
    trainer = Trainer(config, log=lambda *_: None)

    def failing_step():
        raise InputFileError("a damaged sample")

    monkeypatch.setattr(trainer, "_train", failing_step)
    monkeypatch.setattr(trainer, "_commit_written_checkpoint", lambda: order.append("cleanup"))
    with pytest.raises(InputFileError):
        trainer.train()
    assert order == [("announced", 3), "cleanup"]

    order.clear()

    def failing_build(*args):
        raise MemoryError("out of memory on this rank")

    monkeypatch.setattr(Trainer, "_build", failing_build)
    with pytest.raises(MemoryError):
        Trainer(config, log=lambda *_: None)
    assert order == [("announced", 1)]


def test_the_tracker_ends_its_run_as_failed_before_a_forced_exit(tmp_path):
    """os._exit runs no atexit handler: the MLflow run of a rank ended by another's failure is closed as FAILED by the
    hook the tracker registers, and a tracker that closed registers nothing any more."""
    from ot_dist.forced_exit import before_forced_exit, run_before_forced_exit
    from ot_dist.tracking.mlflow_tracker import MlflowTracker
    from ot_dist.tracking.outbox import read_records

    class NoSender:
        uri, run_id = "sqlite:///unused.db", None

        def close(self, seconds):
            return False

    outbox = tmp_path / "outbox.jsonl"
    tracker = MlflowTracker(NoSender.uri, "e", "r", outbox, sender=NoSender())
    assert tracker.close_failed in before_forced_exit
    run_before_forced_exit()
    assert [record for _, record in read_records(outbox, 0) if record["kind"] == "end"] == [
        {"kind": "end", "status": "FAILED"}]
    assert tracker.close_failed not in before_forced_exit
