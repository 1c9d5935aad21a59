"""The sender: a process of its own that delivers a run's outbox (outbox.py) to MLflow.

The training process (rank 0) starts it before the model loads, so that importing MLflow and
opening the store (seconds of CPU) happen on another core while the model loads; the training
process itself never imports MLflow and only appends lines to the outbox. The sender reads the
file every FLUSH_SECONDS and sends what is new in batches; while the server cannot be reached it
tries again with a growing pause, so a server that comes back gets the whole history.

Its pipes: stdin gets `close SECONDS` (send the rest within SECONDS, then stop) or end of file (the
training process is gone: the same with this process's own timeout); stdout gets events as JSON
lines: {"run_id"}, {"sent": offset}, {"error": text} (the server stopped answering), {"back"} (it
answers again), {"notice": text}, and last {"done": null} (everything delivered, the outbox removed) or {"done": reason}."""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

from ot_dist.tracking.outbox import read_records, remove_delivered

FLUSH_SECONDS = 1.0  # how often the sender looks for new values
MAX_RETRY_PAUSE = 10.0  # the longest pause between attempts while the server is away


EVENTS = sys.stdout  # main() gives the pipe to the training process to events alone


def emit(**event) -> None:
    try:
        print(json.dumps(event), file=EVENTS, flush=True)
    except (OSError, ValueError):  # the training process is gone; the outbox file keeps everything
        pass


def check_reachable(uri: str) -> None:
    """Raise ConnectionError when nothing accepts a connection at an http(s) URI's host and port (one
    quick attempt, through the standard library). A URI reached through a proxy is left to MLflow."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if parts.scheme in urllib.request.getproxies_environment() and not urllib.request.proxy_bypass_environment(
            parts.hostname):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as err:
        raise ConnectionError(f"nothing answers at {parts.hostname}:{port}: {err}") from err


def read_commands() -> queue.SimpleQueue:
    commands: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            name, _, value = line.partition(" ")
            if name == "close":
                commands.put(float(value))
        commands.put(None)  # end of file

    threading.Thread(target=read, daemon=True).start()
    return commands


class Sender:
    def __init__(self, path: Path, uri: str, timeout_without_trainer: float, system_metrics: bool = False):
        self.path, self.uri = path, uri
        self.system_metrics = system_metrics  # sample MLflow's system metrics once the run exists
        self.system = None  # the SystemMetrics sampling them
        self.timeout_without_trainer = timeout_without_trainer
        self.delivery = None
        self.pending: list = []  # entries read from the outbox, not yet delivered
        self.read_offset = 0
        self.error: str | None = None  # the last failure, while it lasts
        self.refusal: str | None = None  # the server refused the run: nothing more is sent
        self.trainer_gone = False
        self.commands = read_commands()

    def run(self) -> None:
        deadline, pause = None, 0.0
        while True:
            closing = deadline is not None
            try:
                if self.refusal is None:
                    self._send(deadline)
                pause = 0.0
            except TimeoutError as err:
                return self._finish(str(err))
            except Exception as err:  # noqa: BLE001 - nothing on the tracking side may end training
                self._failed(err)
                if closing:  # that was the last attempt: the run ends now, not when the server is back
                    return self._finish(self.error)
                pause = min(max(2 * pause, 1.0), MAX_RETRY_PAUSE)
            if closing:
                return self._finish(self.refusal)
            deadline = self._wait(pause or FLUSH_SECONDS)

    def _send(self, deadline: float | None) -> None:
        from ot_dist.tracking.delivery import Delivery

        if self.delivery is None:
            check_reachable(self.uri)  # before importing MLflow: a dead server then costs nothing
            delivery = Delivery(self.path, self.uri, notify=lambda text: emit(notice=text))
            delivery.warm_up()
            self.delivery, self.read_offset = delivery, delivery.offset
        new = read_records(self.path, self.read_offset)
        if new:
            self.pending += new
            self.read_offset = new[-1][0]
        known_run, sent = self.delivery.run_id, self.delivery.offset
        try:
            self.delivery.deliver(self.pending, deadline)
        finally:
            self.pending = [e for e in self.pending if e[0] > self.delivery.offset]
            if self.delivery.run_id != known_run:
                emit(run_id=self.delivery.run_id)
            if self.delivery.offset != sent:
                emit(sent=self.delivery.offset)
        self._system_metrics(closing=deadline is not None)
        if self.error is not None:
            emit(back=True, notice=f"MLflow: {self.uri} answers again; the kept values were sent")
            self.error = None

    def _system_metrics(self, closing: bool) -> None:
        """Start sampling once the run exists (not for a run that already ended: a replay's), send what was sampled;
        at the close, the sampling stops and the last samples go."""
        from ot_dist.tracking.system_metrics import SystemMetrics

        run_id = self.delivery.run_id
        if self.system is None and self.system_metrics and run_id is not None and not self.delivery.ended \
                and not closing:
            self.system = SystemMetrics(run_id, self.uri, resumed=not self.delivery.new_run,
                                        notify=lambda text: emit(notice=text))
        if self.system is not None:
            if closing:
                self.system.stop()
            try:
                self.system.deliver(self.delivery.client, run_id)
            except Exception as err:  # noqa: BLE001
                from ot_dist.tracking.delivery import describe, refused

                if not refused(err):
                    raise  # the server went away: they are sent when it is back
                self.system.stop()  # sending them again cannot help: none are sampled any more
                self.system, self.system_metrics = None, False
                emit(notice=f"MLflow: {self.uri} refused the system metrics, they are not logged: {describe(err)}")

    def _failed(self, err: Exception) -> None:
        from ot_dist.tracking.delivery import RunRefused, describe

        if isinstance(err, RunRefused):
            self.refusal = str(err)
            emit(notice=f"MLflow: {self.uri} refused the run: {self.refusal}")
            return
        if self.error is None:
            emit(error=describe(err), notice=f"MLflow: cannot reach {self.uri} ({describe(err)}); training continues, "
                 "values are kept and sent when it answers")
        self.error = describe(err)

    def _wait(self, seconds: float) -> float | None:
        """Until the next attempt; a close (or the training process's end) cuts it short."""
        try:
            command = self.commands.get(timeout=seconds)
        except queue.Empty:
            return None
        if command is None:
            self.trainer_gone = True
            return time.monotonic() + self.timeout_without_trainer
        return time.monotonic() + command

    def _finish(self, reason: str | None) -> None:
        delivered = self.delivery is not None and not self.pending and not read_records(self.path, self.read_offset)
        if delivered and not self.delivery.ended and self.trainer_gone:
            try:  # the training process died before it could end the run
                self.delivery.end_run("FAILED")
            except Exception as err:  # noqa: BLE001
                reason, delivered = str(err), False
        if delivered and self.delivery.ended:
            remove_delivered(self.path)
            emit(done=None)
        else:
            emit(done=reason or "not delivered")


def main(argv: list[str]) -> None:
    # Ctrl-C stops the training process; this one still gets the run's last values out (bounded).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global EVENTS
    EVENTS = os.fdopen(os.dup(1), "w")
    # What MLflow prints ("View run ... at ...") goes nowhere: not into the events, and no failure
    # when the training process is gone.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    path, uri, timeout, *options = argv
    Sender(Path(path), uri, float(timeout), system_metrics="--system-metrics" in options).run()
    # Done, and the training process may be waiting on this: skip MLflow's exit handlers (a second).
    try:
        EVENTS.flush()
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
