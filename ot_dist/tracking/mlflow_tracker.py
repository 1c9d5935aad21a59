"""MLflow tracking that costs the training process (almost) nothing.

The training process appends what it logs to an outbox file (outbox.py: one JSON line per call)
and returns at once. A sender process (sender.py), started before the model loads, imports MLflow,
opens the store and delivers the outbox in batches; the training process never imports MLflow.
At the end the sender has `shutdown_timeout` seconds to deliver the rest to a server that answers;
a server that does not answer gets one last attempt. What is still undelivered then stays in the
outbox file, and a warning names it and the command that sends it later: a dead server never holds
up the end of a run, and nothing logged is lost."""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from ot_dist.forced_exit import before_forced_exit
from ot_dist.tracking.base import Tracker, metric_name
from ot_dist.tracking.outbox import OUTBOX_FOLDER, OutboxWriter, read_records, read_sent, refused_path, summary

# MLflow's HTTP client retries each request up to 7 times with backoff (minutes in all) and waits
# 120 s for an answer; the sender retries by itself, so one quick attempt per request is enough.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where `ot_dist` is importable from


class SenderProcess:
    """The sender process of one outbox, and what it reports (read by a thread of ours that only
    waits on the pipe)."""

    def __init__(self, outbox: Path, uri: str, shutdown_timeout: float, system_metrics: bool = False):
        """`system_metrics`: the sender also samples and logs MLflow's system metrics (system/...)."""
        self.outbox, self.uri = outbox, uri
        env = {**HTTP_DEFAULTS, **os.environ}  # a user's own setting wins
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ot_dist.tracking.sender", str(outbox), uri, str(shutdown_timeout),
             *(["--system-metrics"] if system_metrics else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )
        self.run_id: str | None = None
        self.sent = 0  # outbox bytes delivered
        self.error: str | None = None  # the last failure, while it lasts
        self.notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.done = threading.Event()
        self.outcome: str | None = None  # None: all delivered; else why not
        threading.Thread(target=self._read_events, name="ot_dist-mlflow-events", daemon=True).start()

    def _read_events(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if "run_id" in event:
                self.run_id = event["run_id"]
            if "sent" in event:
                self.sent = event["sent"]
            if "error" in event:
                self.error = event["error"]
            if "back" in event:
                self.error = None
            if "notice" in event:
                self.notices.put(event["notice"])
            if "done" in event:
                self.outcome = event["done"]
                self.done.set()
        if not self.done.is_set():
            self.outcome = "the sender process ended unexpectedly"
            self.done.set()

    def close(self, seconds: float | None) -> bool:
        """Tell the sender to finish within `seconds` (None: it finishes on its own after this process
        ends) and, unless None, wait for it; True when it finished."""
        try:
            if seconds is not None:
                self.process.stdin.write(f"close {seconds}\n")
            self.process.stdin.close()
        except OSError:
            pass
        if seconds is None:
            return False
        # A request in flight at the deadline gets a little longer (bounded by MLFLOW_HTTP_REQUEST_TIMEOUT).
        if self.done.wait(seconds + 5):
            return True  # the process exits on its own
        self.process.kill()
        self.process.wait(5)
        return False


def outbox_path(output_dir: Path) -> Path:
    return output_dir / OUTBOX_FOLDER / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


class MlflowTracker(Tracker):
    def __init__(self, uri: str, experiment: str, run_name: str | None, outbox: Path, run_id: str | None = None,
                 step_offset: int = 0, artifact_location: str | None = None, shutdown_timeout: float = 30.0,
                 sender: SenderProcess | None = None, system_metrics: bool = False):
        """`artifact_location`: for a new experiment (None: the server's default). `sender`: one started
        earlier for `outbox` (its imports then overlap the model load), else it starts now (with MLflow's system
        metrics when `system_metrics`)."""
        self.uri, self.step_offset, self.shutdown_timeout = uri, step_offset, shutdown_timeout
        self.outbox = OutboxWriter(outbox)
        self.outbox.add({"kind": "run", "uri": uri, "experiment": experiment, "run_name": run_name, "run_id": run_id,
                         "artifact_location": artifact_location})
        self.sender = sender or SenderProcess(outbox, uri, shutdown_timeout, system_metrics)
        self._resumed_run_id = run_id
        self._closed = False
        atexit.register(self.close_failed)
        before_forced_exit.append(self.close_failed)  # another rank failed and this one is ended (peer_failure.py)

    # -- the training thread's side: appends a line, never waits for the network -----------------
    @property
    def run_id(self) -> str | None:
        """The MLflow run (None until the sender created it). A resumed run passes it back in."""
        return self.sender.run_id or self._resumed_run_id

    @property
    def error(self) -> str | None:
        """Why the server cannot be reached, while it cannot."""
        return self.sender.error

    def all_sent(self) -> bool:
        return self.sender.sent >= self.outbox.size

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float | None = None) -> None:
        timestamp = int((wall_time if wall_time is not None else time.time()) * 1000)
        self.outbox.add({"kind": "metrics", "step": step + self.step_offset, "timestamp_ms": timestamp,
                         "values": {key: float(value) for key, value in metrics.items()}})

    def log_params(self, params: dict[str, str], new_run_only: bool = False) -> None:
        self.outbox.add_values("params", params, new_run_only)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.outbox.add_values("tags", tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.outbox.add({"kind": "text", "file": artifact_file, "text": text})

    def log_artifact(self, local_path, artifact_dir: str) -> None:
        """A file the run wrote (a sample image): sent by path, so it must stay where it is."""
        self.outbox.add({"kind": "file", "path": str(Path(local_path).resolve()), "dir": artifact_dir})

    def log_image(self, local_path, key: str, step: int) -> None:
        """Only the file's path goes in the outbox: the sender makes the UI's small copy and uploads both, so a large
        image costs the step nothing."""
        self.outbox.add({"kind": "image", "path": str(Path(local_path).resolve()), "key": metric_name(key),
                         "step": step + self.step_offset, "timestamp_ms": int(time.time() * 1000)})

    def take_notices(self) -> list[str]:
        notices = []
        while not self.sender.notices.empty():
            notices.append(self.sender.notices.get())
        return notices

    def _no_exit_hooks(self) -> None:
        atexit.unregister(self.close_failed)
        if self.close_failed in before_forced_exit:
            before_forced_exit.remove(self.close_failed)

    def close(self, status: str = "FINISHED") -> list[str]:
        """Deliver what is left (bounded wait) and end the run; returns warnings for the user."""
        if self._closed:
            return []
        self._closed = True
        self._no_exit_hooks()
        self.outbox.add({"kind": "end", "status": status})
        self.outbox.close()
        finished = self.sender.close(self.shutdown_timeout)
        warnings = self.take_notices()
        if not finished or self.sender.outcome is not None:
            warnings.append(self._undelivered(self.sender.outcome if finished else "the sender did not finish in time"))
        elif refused_path(self.outbox.path).exists():
            warnings.append(f"MLflow: {self.uri} refused some values; they are kept in {refused_path(self.outbox.path)}")
        return warnings

    def _undelivered(self, reason: str) -> str:
        left = read_records(self.outbox.path, read_sent(self.outbox.path).get("offset", 0))
        path = self.outbox.path
        return (f"MLflow: {summary([r for _, r in left])} could not be sent to {self.uri} ({reason}); they are kept in "
                f"{path}; send them later with: python -m ot_dist.tracking.replay {path} "
                "(add --tracking-uri URI to send them elsewhere, e.g. a local store)")

    def close_failed(self) -> None:
        # The training loop raised, or the process exits without closing: end the run as failed. The sender
        # delivers the rest by itself (bounded by its timeout); this process does not wait for it.
        if self._closed:
            return
        self._closed = True
        self._no_exit_hooks()
        self.outbox.add({"kind": "end", "status": "FAILED"})
        self.outbox.close()
        self.sender.close(None)
