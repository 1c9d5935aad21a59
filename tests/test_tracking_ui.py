"""What the MLflow UI shows of a run beyond its values: sample images per step (the image view), system metrics,
and the experiment MLFLOW_EXPERIMENT_NAME picks. Cheap: a SQLite store in tmp_path, read back with MlflowClient."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ot_dist.tracking.delivery import Delivery
from ot_dist.tracking.mlflow_tracker import MlflowTracker
from ot_dist.tracking.outbox import OutboxWriter, read_records, read_sent
from ot_dist.tracking.replay import replay

# MlflowClient.log_image(key=, step=)'s file names under images/, which the UI's image view parses
STEPPED = re.compile(r"^images/(?P<key>[^+]+)\+step\+(?P<step>\d+)\+timestamp\+\d+\+[0-9a-f-]{36}"
                     r"(?P<kind>\.png|\+compressed\.webp)$")


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def stepped_images(uri: str, run_id: str) -> list[tuple[str, int, str]]:
    """(key, step, .png or +compressed.webp) of every file in the run's images/, sorted; a name that is not in
    log_image's layout fails."""
    found = []
    for artifact in client(uri).list_artifacts(run_id, "images"):
        match = STEPPED.match(artifact.path)
        assert match, artifact.path
        found.append((match["key"], int(match["step"]), match["kind"]))
    return sorted(found)


def write_png(path: Path, seed: int, size=(96, 64)) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def image_outbox(tmp_path: Path, uri: str) -> Path:
    """An outbox of a run that sampled two prompts at steps 3 and 8, as MlflowTracker.log_image writes it."""
    outbox = tmp_path / "outbox.jsonl"
    writer = OutboxWriter(outbox)
    writer.add({"kind": "run", "uri": uri, "experiment": "images", "run_name": "samples", "run_id": None,
                "artifact_location": None})
    for step in (3, 8):
        writer.add({"kind": "metrics", "step": step, "timestamp_ms": 1000 * step, "values": {"loss": 1 / step}})
        for i in range(2):
            path = write_png(tmp_path / f"{step}-{i}.png", seed=10 * step + i)
            writer.add({"kind": "image", "path": str(path), "key": f"samples/{i}-a cat", "step": step,
                        "timestamp_ms": 1000 * step + i})
    writer.add({"kind": "end", "status": "FINISHED"})
    writer.close()
    return outbox


EXPECTED = [(f"samples~{i}-a cat", step, kind) for i in range(2) for step in (3, 8)
            for kind in ("+compressed.webp", ".png")]


def test_samples_appear_per_step_in_the_image_view_layout(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outbox = image_outbox(tmp_path, uri)
    delivery = Delivery(outbox, uri)
    delivery.deliver(read_records(outbox, 0))
    run_id = delivery.run_id
    assert stepped_images(uri, run_id) == sorted(EXPECTED)
    assert client(uri).get_run(run_id).data.tags["mlflow.loggedImages"] == "True"  # the UI shows its image view
    # the full image is the run's file as it is; the small one fits MLflow's preview size
    (full,) = [a.path for a in client(uri).list_artifacts(run_id, "images") if "+step+8+" in a.path
               and "samples~1" in a.path and a.path.endswith(".png")]
    assert Path(client(uri).download_artifacts(run_id, full, str(tmp_path / "down"))).read_bytes() == \
        (tmp_path / "8-1.png").read_bytes()
    # the same layout as MLflow's own log_image of this version (what its UI reads)
    client(uri).log_image(run_id, Image.new("RGB", (40, 30)), key="reference/mlflow", step=5)
    assert [(k, s) for k, s, _ in stepped_images(uri, run_id) if k.startswith("reference")] == \
        [("reference~mlflow", 5)] * 2


def test_an_image_cut_short_by_an_outage_is_logged_once_when_sent_again(tmp_path):
    """The server goes away between the full image and its small copy: the sender's next attempt (or a replay)
    sends the image again, and the run still has one image per key and step."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outbox = image_outbox(tmp_path, uri)
    delivery = Delivery(outbox, uri)
    upload, calls = delivery.client.log_artifact, []

    def server_goes_away_on_the_second_upload(run_id, local_path, artifact_path=None):
        calls.append(local_path)
        if len(calls) == 2:
            raise ConnectionError("the server went away")
        return upload(run_id, local_path, artifact_path)

    delivery.client.log_artifact = server_goes_away_on_the_second_upload
    with pytest.raises(ConnectionError):
        delivery.deliver(read_records(outbox, 0))
    run_id = delivery.run_id
    assert stepped_images(uri, run_id) == [("samples~0-a cat", 3, ".png")]  # half of the first image arrived
    assert read_sent(outbox)["offset"] < outbox.stat().st_size
    _, replayed_into, sent = replay(outbox)
    assert replayed_into == run_id and sent == "1 metric points, 4 images"  # from the cut image on
    assert stepped_images(uri, run_id) == sorted(EXPECTED)  # each once
    assert [(m.step, m.value) for m in client(uri).get_metric_history(run_id, "loss")] == [(3, 1 / 3), (8, 1 / 8)]
    assert client(uri).get_run(run_id).info.status == "FINISHED"


def test_the_tracker_logs_a_sample_by_path_at_its_step(tmp_path):
    """The training process only appends the path (a large image costs the step nothing); a resumed run's offset
    applies as to its values."""

    class NoSender:
        uri, run_id = "sqlite:///unused.db", None

        def close(self, seconds):
            return False

    tracker = MlflowTracker(NoSender.uri, "e", "r", tmp_path / "outbox.jsonl", step_offset=100, sender=NoSender())
    png = write_png(tmp_path / "0-a cat?.png", seed=1)
    tracker.log_image(png, "samples/0-a cat?", step=5)
    tracker.close_failed()
    (_, record), = [e for e in read_records(tmp_path / "outbox.jsonl", 0) if e[1]["kind"] == "image"]
    assert record["path"] == str(png.resolve()) and record["step"] == 105
    assert record["key"] == "samples/0-a cat_"  # what MLflow's key check takes
    assert abs(record["timestamp_ms"] / 1000 - time.time()) < 60


def wait_for(condition, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_system_metrics_are_logged_by_the_sender_when_enabled_and_not_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # MLflow's own setting, honoured
    runs = {}
    for enabled in (True, False):
        uri = f"sqlite:///{tmp_path / f'{enabled}.db'}"
        runs[enabled] = uri, MlflowTracker(uri, "system", str(enabled), tmp_path / f"{enabled}.jsonl",
                                           system_metrics=enabled)
    for uri, tracker in runs.values():
        tracker.log_metrics({"loss": 0.5}, step=1)

    def system_keys(enabled: bool) -> set[str]:
        uri, tracker = runs[enabled]
        return {k for k in client(uri).get_run(tracker.run_id).data.metrics if k.startswith("system/")}

    wait_for(lambda: all(t.run_id is not None and t.all_sent() for _, t in runs.values()))
    wait_for(lambda: "system/cpu_utilization_percentage" in system_keys(True))
    time.sleep(1.0)  # five sampling intervals: the disabled run would have samples by now
    for _, tracker in runs.values():
        assert not any("could not be sent" in w for w in tracker.close())
    assert {"system/system_memory_usage_megabytes", "system/disk_usage_percentage"} <= system_keys(True)
    uri, tracker = runs[True]
    steps = [m.step for m in client(uri).get_metric_history(tracker.run_id, "system/cpu_utilization_percentage")]
    assert steps == list(range(len(steps))) and len(steps) >= 2  # one step per sample, as MLflow numbers them
    assert system_keys(False) == set()


def test_system_metrics_sampled_while_the_server_is_away_are_sent_when_it_is_back(tmp_path, monkeypatch):
    from ot_dist.tracking.system_metrics import SystemMetrics

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.05")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = client(uri).create_run(client(uri).create_experiment("system")).info.run_id
    system = SystemMetrics(run_id, uri, resumed=False, notify=print)
    wait_for(lambda: len(system.queued) >= 3)
    system.stop()

    class Away:
        def log_batch(self, *args, **kwargs):
            raise ConnectionError("the server went away")

    with pytest.raises(ConnectionError):
        system.deliver(Away(), run_id)
    kept = len(system.queued)
    assert kept >= 3
    system.deliver(client(uri), run_id)
    steps = [m.step for m in client(uri).get_metric_history(run_id, "system/cpu_utilization_percentage")]
    assert sorted(steps) == list(range(kept)) and not system.queued


def test_system_metrics_follow_the_config_else_mlflows_variable_else_on(tmp_path, monkeypatch):
    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.errors import ConfigError
    from ot_dist.tracking import system_metrics_enabled

    def enabled(**settings) -> bool:
        return system_metrics_enabled(validate(base_config(tmp_path, tmp_path, tmp_path / "out", **settings)))

    monkeypatch.delenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", raising=False)
    assert enabled()
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    assert not enabled() and enabled(**{"mlflow.system_metrics": True})
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "1")
    assert enabled() and not enabled(**{"mlflow.system_metrics": False})
    import mlflow

    monkeypatch.delenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING")
    mlflow.disable_system_metrics_logging()  # what a script calls before Trainer(...): it sets the variable
    assert not enabled()
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "yes")
    with pytest.raises(ConfigError, match="MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING='yes'"):
        enabled()


def test_mlflow_experiment_name_picks_the_experiment_unless_the_config_sets_one(tmp_path, monkeypatch):
    from conftest import base_config

    from ot_dist.config.load import load_config, validate
    from ot_dist.tracking import start_tracking

    class NoSender:
        uri, run_id = "sqlite:///unused.db", None

        def __init__(self, outbox):
            self.outbox = outbox

        def close(self, seconds):
            return False

    def tracked_in(config) -> tuple[str, str]:
        """(the experiment in the outbox's run record, the mlflow.experiment param)"""
        outbox = tmp_path / f"{len(list(tmp_path.glob('*.jsonl')))}.jsonl"
        tracker = start_tracking(config, True, 1, sender=NoSender(outbox))
        tracker.close_failed()
        records = [r for _, r in read_records(outbox, 0)]
        params = {k: v for r in records if r["kind"] == "params" for k, v in r["values"].items()}
        return records[0]["experiment"], params["mlflow.experiment"]

    raw = base_config(tmp_path, tmp_path, tmp_path / "out", **{"mlflow.enabled": True})
    (tmp_path / "config.yaml").write_text(yaml_text(raw))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert tracked_in(validate(raw)) == ("ot_dist", "ot_dist")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-the-environment")
    assert tracked_in(validate(raw)) == ("from-the-environment", "from-the-environment")
    assert tracked_in(load_config(tmp_path / "config.yaml")) == ("from-the-environment", "from-the-environment")
    # set explicitly (--set, the YAML), even to the default: the config wins
    assert tracked_in(load_config(tmp_path / "config.yaml", ["mlflow.experiment=sd15"])) == ("sd15", "sd15")
    raw["mlflow"]["experiment"] = "ot_dist"
    assert tracked_in(validate(raw)) == ("ot_dist", "ot_dist")


def yaml_text(raw: dict) -> str:
    import yaml

    return yaml.safe_dump(raw)
