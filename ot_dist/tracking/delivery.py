"""Delivering an outbox's records to MLflow, in order, one request at a time, noting after each
request how far it got (FILE.sent): used by the sender process while a run trains and by
`python -m ot_dist.tracking.replay` afterwards. This is where MLflow is imported."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ot_dist.tracking.outbox import Entry, read_sent, refused_path, requests, run_note_path, summary, write_sent


class RunRefused(Exception):
    """The server refused to create or continue the run: nothing can be sent to it."""


def refused(err: Exception) -> bool:
    """A 4xx answer (bad value, unknown run, no permission): sending it again cannot help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    status = err.get_http_status_code()
    return 400 <= status < 500 and status not in (408, 429)


def bad_value(err: Exception) -> bool:
    """MLflow's answer to a request with an invalid value in it (as opposed to no permission or no such run)."""
    return getattr(err, "error_code", None) == "INVALID_PARAMETER_VALUE"


def describe(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


# MLflow 3 opens an experiment without this tag in its GenAI view (Evaluations / Traces); this value
# is the "machine learning / model training" kind (mlflow.utils.mlflow_tags, the UI's ExperimentKind).
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


def artifacts_next_to(uri: str) -> str | None:
    """Artifacts of a new experiment in a local SQLite store go next to its file (MLflow's default
    would be ./mlruns in whatever directory the process runs in)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def stepped_image_name(run_id: str, key: str, step: int, timestamp_ms: int) -> str:
    """The name (without suffix) MlflowClient.log_image(key=, step=) gives an image under images/, which the UI's
    image view parses for key and step (mlflow/tracking/client.py, MLflow 3.17), but with a uuid derived from the
    image's run, key, step and time instead of a random one: a request sent again (after an outage cut it short, or
    a replay) writes the same files again instead of a second copy of the image."""
    import uuid

    name_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"ot_dist:{run_id}/{key}/{step}/{timestamp_ms}")
    return f"{key.replace('/', '~')}+step+{step}+timestamp+{timestamp_ms}+{name_uuid}"


def log_stepped_image(client, run_id: str, record: dict) -> None:
    """What MlflowClient.log_image(run_id, image, key=, step=, timestamp=) writes (the full image as PNG, a small
    WebP the UI shows, the run's mlflow.loggedImages tag), from the PNG file the run wrote; done here, in the
    sender, so that the training process only appends the file's path."""
    import shutil
    import tempfile

    from mlflow.tracking.multimedia import compress_image_size
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_IMAGES
    from PIL import Image

    name = stepped_image_name(run_id, record["key"], record["step"], record["timestamp_ms"])
    with Image.open(record["path"]) as image, tempfile.TemporaryDirectory() as tmp:
        full, small = Path(tmp) / f"{name}.png", Path(tmp) / f"{name}+compressed.webp"
        shutil.copyfile(record["path"], full)  # the run's PNG as it is (log_image would encode it again)
        compress_image_size(image).save(small)
        client.log_artifact(run_id, str(full), "images")
        client.log_artifact(run_id, str(small), "images")
    client.set_tag(run_id, MLFLOW_LOGGED_IMAGES, True)


class Delivery:
    def __init__(self, path: Path, uri: str, notify=print):
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # no "creating tables" chatter in the training log
        self.path, self.uri, self.notify = path, uri, notify
        self.client = MlflowClient(tracking_uri=uri)
        state = read_sent(path)
        same_target = state.get("uri") == uri  # a replay elsewhere starts from the beginning
        self.run_id: str | None = state.get("run_id") if same_target else None
        self.offset: int = state.get("offset", 0) if same_target else 0
        self.ended = False  # the run's end was delivered
        # this delivery created the run (a resumed run's params, sent only to a new run, then go too)
        self.new_run = bool(state.get("new_run")) if same_target else False
        self.refused_count = 0

    def warm_up(self) -> None:
        """Open the store now (a new SQLite store runs its schema migrations: seconds), so that the
        first values do not wait for it; against a server, one request that tells whether it answers."""
        self.client.search_experiments(max_results=1)

    def deliver(self, entries: list[Entry], deadline: float | None = None) -> None:
        """Send the entries (those after `offset`) in order; a request the server refuses is set
        aside in FILE.refused; any other failure raises, and the next call resumes where it stopped."""
        for batch in requests([e for e in entries if e[0] > self.offset]):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("not all delivered within mlflow.shutdown_timeout_seconds")
            try:
                self._send([record for _, record in batch])
            except Exception as err:  # noqa: BLE001
                if not refused(err):
                    raise
                if batch[0][1]["kind"] == "run":
                    raise RunRefused(describe(err)) from err
                if len(batch) > 1 and bad_value(err):
                    self._send_one_by_one(batch)
                else:
                    self._set_aside(batch, err)
            self.offset = batch[-1][0]
            write_sent(self.path, self.uri, self.run_id, self.offset, self.new_run)

    def _send_one_by_one(self, batch: list[Entry]) -> None:
        """A batch refused for a bad value (a name MLflow rejects, a param whose value changed): MLflow refuses
        the whole request, so each record goes alone and only the bad ones are set aside, not the other steps'
        values that happened to share the request."""
        for entry in batch:
            try:
                self._send([entry[1]])
            except Exception as err:  # noqa: BLE001
                if not refused(err):
                    raise  # the server went away: the next attempt resumes after the last record sent
                self._set_aside([entry], err)
            self.offset = entry[0]
            write_sent(self.path, self.uri, self.run_id, self.offset, self.new_run)

    def end_run(self, status: str) -> None:
        """End a run whose outbox has no end (its training process died)."""
        if self.run_id is not None and not self.ended:
            self.client.set_terminated(self.run_id, status)
            self.ended = True

    def _send(self, records: list[dict]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        first = records[0]
        kind = first["kind"]
        if kind == "run":
            self._open_run(first)
        elif kind == "text":
            self.client.log_text(self.run_id, first["text"], first["file"])
        elif kind == "file":
            self.client.log_artifact(self.run_id, first["path"], first["dir"])
        elif kind == "image":
            log_stepped_image(self.client, self.run_id, first)
        elif kind == "end":
            self.client.set_terminated(self.run_id, first["status"])
            self.ended = True
        else:
            metrics, params, tags = [], [], []
            for record in records:
                if record.get("new_run_only") and not self.new_run:
                    continue  # a continued run has them (and MLflow refuses a param whose value changed)
                values = record["values"]
                if record["kind"] == "metrics":
                    metrics += [Metric(k, v, record["timestamp_ms"], record["step"]) for k, v in values.items()]
                elif record["kind"] == "params":
                    params += [Param(k, v) for k, v in values.items()]
                else:
                    tags += [RunTag(k, v) for k, v in values.items()]
            if metrics or params or tags:
                self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags, synchronous=True)

    def _open_run(self, header: dict) -> None:
        if self.run_id is not None:
            return
        meant_here = header["uri"] == self.uri
        continued = header.get("run_id")
        if continued and meant_here:  # a resumed run (or the caller's): it exists, and runs again
            try:
                self.client.update_run(continued, status="RUNNING")
                self.run_id = continued
                return
            except Exception as err:  # noqa: BLE001
                if getattr(err, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                    raise
                # not in this store (the run was tracked elsewhere before the resume): a new run gets the rest
                self.notify(f"MLflow: the run {continued} to continue is not in {self.uri}; the values go to a new "
                            "run of the experiment")
        experiment = self.client.get_experiment_by_name(header["experiment"])
        if experiment is not None:
            experiment_id = experiment.experiment_id
            if EXPERIMENT_KIND_TAG not in experiment.tags:  # a kind the user chose is kept
                self.client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
        else:
            location = header.get("artifact_location") if meant_here else artifacts_next_to(self.uri)
            experiment_id = self.client.create_experiment(header["experiment"], artifact_location=location,
                                                          tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
        run = self.client.create_run(experiment_id, run_name=header.get("run_name"))
        self.run_id, self.new_run = run.info.run_id, True
        if continued:
            self.client.set_tag(self.run_id, "ot_dist.continues_run", continued)
        if meant_here:
            run_note_path(self.path).write_text(self.run_id + "\n")
        if not meant_here:
            self.client.set_tag(self.run_id, "ot_dist.replayed_from", str(self.path))

    def _set_aside(self, batch: list[Entry], err: Exception) -> None:
        with open(refused_path(self.path), "a", encoding="utf-8") as f:
            for _, record in batch:
                f.write(json.dumps({**record, "refused": describe(err)}) + "\n")
        self.refused_count += len(batch)
        self.notify(f"MLflow: {self.uri} refused {summary([r for _, r in batch])}: {describe(err)}; they are kept "
                    f"in {refused_path(self.path)}")
