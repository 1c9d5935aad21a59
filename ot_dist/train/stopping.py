"""Decisions every rank must take together at an optimizer step: stop (a signal arrived), save (the
checkpoint clock ran out), or not apply the step (a non-finite loss).

Signals reach ranks at different moments (or only some ranks), clocks differ and a NaN may appear on
one rank only; acting on local knowledge would make ranks disagree about which collective comes next
and hang. So each step the ranks combine three flags with one MAX all-reduce, read with one host
sync, and all act on the same answer.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class StopSignals:
    """While active, SIGTERM and SIGINT only record that a stop was asked for (preemption: finish the step,
    save, exit 0). A second SIGINT interrupts at once, as Ctrl-C twice should."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
                # Python's handlers make blocking system calls fail with EINTR; a collective's socket read
                # failing that way aborts the process in gloo. Restart them instead: the flag is enough.
                signal.siginterrupt(sig, False)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass(frozen=True)
class Verdict:
    stop: bool  # a signal reached some rank: save and leave after this step
    save_due: bool  # the time-based checkpoint interval passed (rank 0's clock)
    nonfinite: bool  # some rank's loss is NaN or infinite: this step must not be applied


class StepGuard:
    def __init__(self, runtime, signals: StopSignals, save_every_minutes: float | None, last_save_time):
        self.runtime, self.signals = runtime, signals
        self.save_every_seconds = None if save_every_minutes is None else save_every_minutes * 60
        self.last_save_time = last_save_time  # a callable: the checkpointer's monotonic time of its last save

    def check(self, loss: torch.Tensor) -> Verdict:
        due = (self.runtime.is_main and self.save_every_seconds is not None
               and time.monotonic() - self.last_save_time() >= self.save_every_seconds)
        flags = torch.stack([
            torch.tensor(float(self.signals.received is not None), device=loss.device),
            torch.tensor(float(due), device=loss.device),
            (~torch.isfinite(loss.detach().float())).float(),
        ])
        if self.runtime.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, save_due, nonfinite = (bool(v) for v in flags.tolist())  # the step's one host sync
        return Verdict(stop, save_due, nonfinite)
