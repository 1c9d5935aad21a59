"""A rank that fails ends the others within seconds, not after the collective timeout.

Under NCCL a rank that raised (an out-of-memory error on one GPU's large bucket, a damaged sample only it reads) and
exited leaves the other ranks waiting in their next collective: NCCL does not notice a peer that is gone, so each of
them waits distributed.timeout_minutes (30 by default) before its watchdog ends it. On a 64-GPU job that is 32 GPU-hours
spent waiting, and on Kubernetes the restart waits as long. (gloo notices at once: its sockets close.)

So each rank of a process group ot_dist started keeps a connection of its own to the rendezvous store (the one
torchrun's agent or rank 0 hosts, at MASTER_ADDR:MASTER_PORT) and a daemon thread that looks there every POLL_SECONDS
for a failure notice. A failing rank writes `rank:code` there as soon as its error is caught
(runtime.announce_failure: the trainer, before its cleanup; `exit_process` with a non-zero code). The others, seeing
it, give their own error path GRACE_SECONDS to end them (under gloo they fail at once and print their own reason),
then print which rank failed and exit with its code: the thread calls os._exit, which ends the process even while its
main thread is blocked in a collective (the collective and synchronising calls release the GIL). torchrun then ends or
restarts the group as for any failed worker.

Each restart attempt (TORCHELASTIC_RESTART_COUNT), and each group a process starts in it (a second run in the same
processes), has its own key: a failure that made torchrun restart the group does not end the restarted one. A
process whose store is gone (rank 0 hosted it and ended) stops looking: that is how every run with a store in rank 0
ends, so it is no sign of failure. A rank killed by a signal (SIGKILL, the kernel's
out-of-memory killer) writes nothing; torchrun ends its node's ranks, and the other nodes' wait until the timeout as
before."""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

from ot_dist.forced_exit import run_before_forced_exit

POLL_SECONDS = 2.0  # one small request per rank to the store per poll: 512 ranks make ~256 a second
GRACE_SECONDS = 10.0  # time a rank's own error path gets to end it (and say why) before the notice does
_CONNECT_TIMEOUT = datetime.timedelta(seconds=60)


def failure_key(group: int = 0) -> str:
    """The key of this restart attempt's `group`-th process group (counted per process: every rank starts its groups
    in the same order, one per run, so a second run in the same processes is not ended by the first one's failure)."""
    return f"ot_dist/peer_failure/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/group_{group}"


class PeerFailureWatch:
    """This rank's side: announce its own failure, end on another's."""

    def __init__(self, store, rank: int, world_size: int, group: int = 0):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.key = failure_key(group)
        self.ending = threading.Event()  # set when this process ends on its own: its notice, if any, is its own
        self.thread = threading.Thread(target=self._watch, name="ot_dist-peer-failure", daemon=True)

    def start(self) -> PeerFailureWatch:
        self.thread.start()
        return self

    def announce(self, code: int) -> None:
        """Called by a rank about to exit with `code` (non-zero): the others end too."""
        self.ending.set()
        try:
            # Set only where no rank has (the first failure is the one the others report); its answer comes once the
            # store holds the notice.
            self.store.compare_set(self.key, "", f"{self.rank}:{code}")
        except Exception:  # noqa: BLE001 - the store is gone: nothing more can be told, the exit goes on
            return
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and self.rank == 0:
            time.sleep(POLL_SECONDS + 1.0)  # the store lives in this process: the others' next poll must find it

    def stop(self) -> None:
        """A normal end (or the group's own end): stop looking."""
        self.ending.set()

    def _watch(self) -> None:
        while not self.ending.wait(POLL_SECONDS):
            try:
                if not self.store.check([self.key]):
                    continue
                failed_rank, code = (int(part) for part in self.store.get(self.key).decode().split(":"))
            except Exception:  # noqa: BLE001 - the store is gone (its host ended) or unreadable: stop looking
                return
            if failed_rank == self.rank or self.ending.wait(GRACE_SECONDS):
                return  # this rank's own notice, or it ended by its own path meanwhile
            print(f"ot-dist: rank {failed_rank} of {self.world_size} failed (exit code {code}; its error is in its "
                  f"output); rank {self.rank} ends too rather than wait for it in a collective until "
                  "distributed.timeout_minutes", file=sys.stderr, flush=True)
            run_before_forced_exit()
            finish_writes()
            try:
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            os._exit(code)


def finish_writes() -> None:
    """Wait for this process's non-daemon threads, as a normal interpreter exit does: a checkpoint written in the
    background commits on a gloo group of its own (checkpoint/writer.py), which still works while the main thread
    waits in the training collective."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and thread is not threading.main_thread() and not thread.daemon:
            thread.join()


_groups_started = 0


def start_watch(rank: int, world_size: int) -> PeerFailureWatch | None:
    """A watch over the group torchrun (or another env:// launcher) described, on a connection of its own to the
    rendezvous store; None where that store cannot be reached (then only the collective timeout ends the others)."""
    import torch.distributed as dist

    global _groups_started
    group = _groups_started  # counted whether or not this rank reaches the store: the ranks' counts stay equal
    _groups_started += 1
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=_CONNECT_TIMEOUT, wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no env:// store (a file store, another launcher): the timeout remains
        return None
    return PeerFailureWatch(store, rank, world_size, group).start()
