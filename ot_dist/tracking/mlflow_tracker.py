"""MLflow tracking that never holds up a training step.

The training thread hands values to an outbox and returns at once. A background thread creates the
run and sends the outbox in batches (`MlflowClient.log_batch`); when the server cannot be reached
it keeps everything and tries again with a growing pause, so a server that comes back gets the
whole history. At the end it makes one more attempt, and has `shutdown_timeout` seconds to deliver
the rest to a server that answers; whatever is still undelivered then goes to a local store (or a
JSON file), and a warning names it: a dead server never holds up the end of a run.

MLflow itself is imported only here, and only in the process that tracks (rank 0)."""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from pathlib import Path

from ot_dist.tracking.base import Tracker
from ot_dist.tracking.outbox import Contents, Outbox, Point

FLUSH_SECONDS = 1.0  # how often the sender looks for new values
MAX_RETRY_PAUSE = 10.0  # the longest pause between attempts while the server is away
# MLflow's HTTP client retries each request up to 7 times with backoff (minutes in all) and waits
# 120 s for an answer; our sender retries by itself, so one quick attempt per request is enough.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


def refused(err: Exception) -> bool:
    """A 4xx answer (bad value, unknown run, no permission): sending it again cannot help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    status = err.get_http_status_code()
    return 400 <= status < 500 and status not in (408, 429)


def describe(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


class MlflowTracker(Tracker):
    def __init__(self, uri: str, experiment: str, run_name: str | None, run_id: str | None = None,
                 step_offset: int = 0, artifact_location: str | None = None, fallback_uri: str | None = None,
                 fallback_artifacts: str | None = None, fallback_file: Path | None = None,
                 shutdown_timeout: float = 30.0):
        """`artifact_location`: for a new experiment (None: the server's default); the fallback store
        keeps its artifacts in `fallback_artifacts` (a local store's default would be ./mlruns)."""
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)  # a user's own setting wins
        # Import MLflow here, before training starts: imported by the sender thread, its seconds of
        # GIL-bound work would slow the first training steps instead.
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.step_offset = step_offset
        self.artifact_location = artifact_location
        self.fallback_uri, self.fallback_artifacts, self.fallback_file = fallback_uri, fallback_artifacts, fallback_file
        self.shutdown_timeout = shutdown_timeout
        self._run_id = run_id
        self._started = False  # the run exists (created, or marked running again on resume)
        self._status = "FINISHED"  # the run's final status, set at close
        self.outbox = Outbox()
        self.error: str | None = None  # the last failure, while it lasts
        self.refusal: str | None = None  # the server refused to create or continue the run
        self._notices: queue.SimpleQueue[str] = queue.SimpleQueue()  # for the training thread to print
        self._wake, self._closing = threading.Event(), threading.Event()
        self._deadline = float("inf")
        self._closed = False
        self._fallback_client = None
        self._thread = threading.Thread(target=self._send_loop, name="ot_dist-mlflow", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)

    # -- the training thread's side: never waits for the network ---------------------------------
    @property
    def run_id(self) -> str | None:
        """The MLflow run (None until the run exists). A resumed run passes it back in."""
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float | None = None) -> None:
        timestamp = int((wall_time if wall_time is not None else time.time()) * 1000)
        step += self.step_offset
        self.outbox.add_metrics([Point(key, float(value), timestamp, step) for key, value in metrics.items()])

    def log_params(self, params: dict[str, str]) -> None:
        self.outbox.add_params(params)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.outbox.add_tags(tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.outbox.add_artifact(artifact_file, text)

    def log_artifact(self, local_path: str | Path, artifact_dir: str) -> None:
        self.outbox.add_file(f"{artifact_dir}/{Path(local_path).name}", str(local_path))

    def take_notices(self) -> list[str]:
        notices = []
        while not self._notices.empty():
            notices.append(self._notices.get())
        return notices

    def close(self, status: str = "FINISHED") -> list[str]:
        """Deliver what is left (bounded wait) and end the run; returns warnings for the user."""
        if self._closed:
            return []
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._status = status
        self._deadline = time.monotonic() + self.shutdown_timeout
        self._closing.set()
        self._wake.set()
        # The sender makes one last attempt and stops sending at the deadline; a request in flight
        # then gets a little longer (it is bounded by MLFLOW_HTTP_REQUEST_TIMEOUT).
        self._thread.join(self.shutdown_timeout + 5)
        left = self.outbox.take_all()
        warnings = self.take_notices()
        if left:
            reason = self.refusal or self.error or "not delivered in time"
            warnings.append(
                f"MLflow: {left.summary()} could not be sent to {self.uri} ({reason}); they are in "
                f"{self._write_fallback(left, status)}"
            )
        return warnings

    def _close_at_exit(self) -> None:
        # The training loop died before closing: keep what was logged, mark the run failed.
        for warning in self.close("FAILED"):
            print(f"warning: {warning}", flush=True)

    # -- the sender thread --------------------------------------------------------------------
    def _send_loop(self) -> None:
        import logging

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # no "creating tables" chatter in the training log
        pause, client = 0.0, None
        while True:
            closing = self._closing.is_set()
            try:
                client = client or self._client(self.uri)
                self._ensure_run(client)
                self._send_pending(client, self._run_id, self.outbox, self._deadline if closing else None)
                if closing:
                    client.set_terminated(self._run_id, self._status)
                    return
                if self.error is not None:
                    self._notices.put(f"MLflow: {self.uri} answers again; the kept values were sent")
                self.error, pause = None, 0.0
                self._wake.wait(FLUSH_SECONDS)
                self._wake.clear()
            except Exception as err:  # noqa: BLE001 - no failure on the tracking side may end training
                if refused(err):  # to create, continue or end the run: retrying cannot help
                    self.refusal = describe(err)
                    self._notices.put(f"MLflow: {self.uri} refused the run: {self.refusal}")
                    return
                if self.error is None:
                    self._notices.put(
                        f"MLflow: cannot reach {self.uri} ({describe(err)}); training continues, values are kept "
                        "and sent when it answers"
                    )
                self.error = describe(err)
                if closing:  # that was the last attempt: the run ends now, not when the server is back
                    return
                self._prepare_fallback()
                pause = min(max(2 * pause, 1.0), MAX_RETRY_PAUSE)
                self._closing.wait(pause)  # close() cuts the pause short

    @staticmethod
    def _client(uri: str):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=uri)

    def _ensure_run(self, client) -> None:
        if self._started:
            return
        if self._run_id is not None:  # resume: the run exists; it runs again
            client.update_run(self._run_id, status="RUNNING")
        else:
            self._run_id = self._create_run(client, self.artifact_location)
        self._started = True

    def _create_run(self, client, artifact_location: str | None) -> str:
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(self.experiment, artifact_location=artifact_location)
        return client.create_run(experiment_id, run_name=self.run_name).info.run_id

    def _send_pending(self, client, run_id: str, outbox: Outbox, deadline: float | None = None) -> None:
        """Send until the outbox is empty (or the deadline passed: then TimeoutError); a refused
        batch is set aside, any other failure raises."""
        from mlflow.entities import Metric, Param, RunTag

        while True:
            batch = outbox.next_batch()
            if not batch:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"not all delivered within mlflow.shutdown_timeout_seconds ({self.shutdown_timeout:g})")
            try:
                if batch.metrics or batch.params or batch.tags:
                    client.log_batch(
                        run_id,
                        metrics=[Metric(p.key, p.value, p.timestamp_ms, p.step) for p in batch.metrics],
                        params=[Param(k, v) for k, v in batch.params.items()],
                        tags=[RunTag(k, v) for k, v in batch.tags.items()],
                        synchronous=True,
                    )
                for artifact_file, text in batch.artifacts.items():
                    client.log_text(run_id, text, artifact_file)
                for artifact_file, local_path in batch.files.items():
                    client.log_artifact(run_id, local_path, artifact_file.rpartition("/")[0] or None)
            except Exception as err:  # noqa: BLE001
                if not refused(err):
                    raise
                self._notices.put(f"MLflow: {self.uri} refused {batch.summary()}: {describe(err)}")
                outbox.remove(batch, rejected=True)
                continue
            outbox.remove(batch)

    # -- the fallback ---------------------------------------------------------------------------
    def _prepare_fallback(self) -> None:
        """Open (and if new, create) the local store while training runs, not at the end: creating a
        store runs MLflow's schema migrations, seconds of work."""
        if self._fallback_client is None and self.fallback_uri and self.fallback_uri != self.uri:
            try:
                self._fallback_client = self._client(self.fallback_uri)
            except Exception:  # noqa: BLE001 - the end tries again, then falls back to a file
                pass

    def _write_fallback(self, left: Contents, status: str) -> str:
        """Put what was not delivered where the user can get it: a local MLflow store (a run of its
        own, tagged with where it was meant to go), else a JSON file."""
        about = {"ot_dist.unsent_to": self.uri, "ot_dist.unsent_run_id": self._run_id or "(not created)"}
        if self.fallback_uri and self.fallback_uri != self.uri:
            try:
                client = self._fallback_client or self._client(self.fallback_uri)
                local = Outbox()
                local.pending = Contents(left.metrics, left.params, {**left.tags, **about}, left.artifacts, left.files)
                run_id = self._create_run(client, self.fallback_artifacts)
                self._send_pending(client, run_id, local)
                client.set_terminated(run_id, status)
                refused_here = local.take_all()
                if not refused_here:
                    return (f"the local store {self.fallback_uri}, run {run_id} "
                            f"(browse: mlflow ui --backend-store-uri {self.fallback_uri})")
                left = refused_here
            except Exception as err:  # noqa: BLE001 - the plain file below still works
                about["ot_dist.local_store_error"] = describe(err)
        self.fallback_file.parent.mkdir(parents=True, exist_ok=True)
        left.write_json(self.fallback_file, about)
        return str(self.fallback_file)
