"""Decisions every rank must take together at an optimizer step: stop (a signal arrived), save (the
checkpoint clock ran out), or not apply the step (a non-finite loss).

Signals reach ranks at different moments (or only some ranks), clocks differ and a NaN may appear on
one rank only; acting on local knowledge would make ranks disagree about which collective comes next
and hang. So each step the ranks combine three flags with one MAX all-reduce and all act on the same
answer. Two ways to read it (docs/performance.md, "The step guard"):

- `StepGuard` (blocking): the flags are read on the host before the optimizer step, one host sync per step.
- `LaggedStepGuard`: the combined non-finite flag stays on the device and the optimizer skips the update
  there (`found_inf`, as torch's fused optimizers take it from GradScaler); the flags reach the host through
  a non-blocking copy that is read at the next step's check. Stop and time-based saves act one step later,
  and the host learns of a skipped step one step later, before the next update is applied.
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
    """The blocking guard: this step's verdict, read on the host before its optimizer step."""

    lagged = False

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

    def skip_flag(self) -> torch.Tensor | None:
        return None  # nothing to skip on the device: a non-finite step never reaches the optimizer

    def settle(self) -> Verdict | None:
        return None  # nothing pending

    def is_host_tensor(self, tensor: torch.Tensor) -> bool:
        return False


class LaggedStepGuard(StepGuard):
    """No host sync in the step: `check(loss)` at step k returns the verdict of step k-1 and starts step k's.

    Step k's flags (stop asked here, save due on rank 0, this rank's loss non-finite) are combined with one MAX
    all-reduce issued with async_op; `skip_flag()` waits for it (on NCCL: the compute stream waits, the host
    does not) and returns the combined non-finite flag as a 0-dim float32 device tensor, the `found_inf` the
    optimizer skips the update with. The combined flags are then copied to host memory (pinned, non_blocking,
    an event recorded after the copy on CUDA); the next `check` waits for that event, recorded a step earlier
    (the device has passed it while the host queued this step's forward and backward), and reads the copy.
    Every rank reads the same combined values at the same step, so all act alike, one step later.
    A time-based save that comes due is dropped when a checkpoint was saved after the flags were made (by the
    step interval, or by the previous due: the clock is checked again before that save lands), so one due
    never gives two saves in a row; the save itself is a collective, so every rank sees the same.
    `settle()` reads the last step's verdict when no further check follows (the end of training)."""

    lagged = True

    def __init__(self, runtime, signals: StopSignals, save_every_minutes: float | None, last_save_time):
        super().__init__(runtime, signals, save_every_minutes, last_save_time)
        self._flags: torch.Tensor | None = None  # this step's combined flags (device), once reduced
        self._work = None  # the all-reduce under way
        self._host: torch.Tensor | None = None  # the copy on the host (pinned on CUDA), read at the next check
        self._event = None  # recorded after the device -> host copy (CUDA)
        self._copied = False
        self._save_mark = None  # last_save_time() when this step's flags were made

    def check(self, loss: torch.Tensor) -> Verdict:
        earlier = self.settle() or Verdict(False, False, False)
        device = loss.device
        due = (self.runtime.is_main and self.save_every_seconds is not None
               and time.monotonic() - self.last_save_time() >= self.save_every_seconds)
        local = torch.tensor([float(self.signals.received is not None), float(due)])
        if device.type == "cuda":
            local = local.pin_memory().to(device=device, non_blocking=True)
        else:
            local = local.to(device=device, non_blocking=True)
        nonfinite = (~torch.isfinite(loss.detach().float())).float().reshape(1)
        flags = torch.cat([local, nonfinite])
        self._work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True) if self.runtime.distributed else None
        self._flags, self._copied, self._save_mark = flags, False, self.last_save_time()
        return earlier

    def skip_flag(self) -> torch.Tensor | None:
        """This step's combined non-finite flag on the device (1.0: some rank's loss is NaN / inf), for the
        optimizer's `found_inf`."""
        if self._flags is None:
            return None
        self._complete()
        return self._flags[2]

    def _complete(self) -> None:
        """Wait for the all-reduce (stream-ordered on NCCL) and queue the copy of its result to the host."""
        if self._copied:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        flags = self._flags
        if self._host is None:
            self._host = torch.empty(3, pin_memory=flags.device.type == "cuda")
        self._host.copy_(flags, non_blocking=True)
        if flags.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._copied = True

    def settle(self) -> Verdict | None:
        """The verdict of the last checked step (None when there is none pending); it is consumed."""
        if self._flags is None:
            return None
        self._complete()
        if self._event is not None:
            self._event.synchronize()  # recorded a step ago: the device is past it, the queue stays full
            self._event = None
        stop, save_due, nonfinite = (bool(v) for v in self._host.tolist())  # host memory: no device sync
        self._flags = None
        return Verdict(stop, save_due and self.last_save_time() == self._save_mark, nonfinite)

    def is_host_tensor(self, tensor: torch.Tensor) -> bool:
        """The flags' host copy (pinned host memory on a GPU run), for counting host syncs."""
        return tensor is self._host
