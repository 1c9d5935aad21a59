"""MLflow tracking as a user meets it: against a real `mlflow server` (started here on 127.0.0.1),
with one process and with 2 ranks; a resumed run continuing the same MLflow run; a server that is
down or goes away mid-run, and the replay of what it missed; a training process that dies; the
embedded default store; progress on screen; secrets kept out."""

from __future__ import annotations

import getpass
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import base_config
from forked_ranks import run_ranks

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.optim.schedulers import lr_factor
from ot_dist.ports import free_port
from ot_dist.tracking import start_sender, start_tracking, tracking_uri
from ot_dist.tracking.base import Tracker, metric_name
from ot_dist.tracking.mlflow_tracker import MlflowTracker
from ot_dist.tracking.progress import Progress
from ot_dist.tracking.replay import main as replay_main
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
STEPS = 6
SECRET = "s3cret-never-logged-7781"
# LINEAR to 0.1 after a 2-step warmup, two groups with their own learning rates: every step's lr differs
# (0, 0.5, 1, 0.775, 0.55, 0.325 of each group's).
SETTINGS = {"epochs": 2, "max_steps": STEPS, "log_every_steps": 4, "scheduler.name": "LINEAR", "scheduler.warmup_steps": 2,
            "scheduler.min_factor": 0.1,
            "text_encoder.train": True, "text_encoder.learning_rate": 1e-4, "mlflow.enabled": True}


class MlflowServer:
    """`mlflow server` on a free local port with its own SQLite store; can be stopped and restarted."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.root / "server.log", "a")
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job worker pool
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}", "--artifacts-destination",
             str(self.root / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("mlflow server did not start: " + (self.root / "server.log").read_text()[-3000:])

    def stop(self) -> None:
        if self.process is None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(15)
        self.process = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def history(uri, run_id, key) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client(uri).get_metric_history(run_id, key))


def expected_lr(config, group_lr: float, step: int) -> float:
    return group_lr * lr_factor(config.scheduler, step - 1, STEPS)


def train(raw, **kwargs):
    lines = []
    trainer = Trainer(validate(raw), log=lines.append, **kwargs)
    result = trainer.train()
    return trainer, result, lines


@pytest.fixture(scope="module")
def first_run(server, one_level_sd1, shapes_data, tmp_path_factory):
    """One process, batch 4, tracked on the server, with MLflow credentials in the environment. On the 1-level UNet
    (conftest.py one_level_sd1), as the runs compared with it (the resumed one, the 2 fsdp ranks): what they check is
    what is logged, per step and per rank, not the UNet's depth."""
    raw = base_config(one_level_sd1, shapes_data, tmp_path_factory.mktemp("first") / "out", batch_size=4,
                      **SETTINGS, **{"mlflow.tracking_uri": server.uri, "mlflow.experiment": "tracking-test"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_USERNAME", "trainer")
        env.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
        return train(raw)


def test_one_process_logs_every_step_to_the_server(server, first_run):
    trainer, result, lines = first_run
    config, run_id = trainer.config, trainer.tracker.run_id
    run = client(server.uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    loss = history(server.uri, run_id, "loss")
    assert [s for s, _ in loss] == list(range(1, STEPS + 1))
    assert [v for _, v in loss] == pytest.approx(result.losses, rel=1e-7)
    for group, group_lr in (("unet", 3e-4), ("text_encoder", 1e-4)):
        lrs = history(server.uri, run_id, f"lr/{group}")
        assert lrs == [(s, pytest.approx(expected_lr(config, group_lr, s), rel=1e-6)) for s in range(1, STEPS + 1)]
    assert len({v for _, v in history(server.uri, run_id, "lr/unet")}) == STEPS  # warmup then decay: all differ
    norms = history(server.uri, run_id, "grad_norm")
    assert [s for s, _ in norms] == list(range(1, STEPS + 1)) and all(0 < v < 1e3 for _, v in norms)
    assert history(server.uri, run_id, "epoch") == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2)]  # 4 steps/epoch
    assert [s for s, _ in history(server.uri, run_id, "samples_per_s")] == [4, 6]  # one per log window
    assert all(0 < v < 100 for _, v in history(server.uri, run_id, "memory/rss_gb"))
    assert "d_lr/unet" not in run.data.metrics  # ADAMW estimates no d
    # the resolved config as params and as an artifact; tags; exports
    assert run.data.params["learning_rate"] == "0.0003" and run.data.params["scheduler.name"] == "LINEAR"
    assert run.data.params["mlflow.tracking_uri"] == server.uri
    # only the chosen optimizer's options: no "null" params of other optimizers (issue 22)
    optimizer_params = {k: v for k, v in run.data.params.items() if k.startswith("optimizer.")}
    assert optimizer_params["optimizer.name"] == "ADAMW" and "null" not in optimizer_params.values()
    assert "optimizer.eps" in optimizer_params and "optimizer.d0" not in optimizer_params
    # MLflow 3 opens the experiment in its training view; "Source" and "Created by" are filled (read by REST)
    experiment = rest(server.uri, "experiments/get", experiment_id=run.info.experiment_id)["experiment"]
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
    rest_tags = {t["key"]: t["value"] for t in rest(server.uri, "runs/get", run_id=run_id)["run"]["data"]["tags"]}
    assert rest_tags["mlflow.source.name"].startswith("ot-dist") and rest_tags["mlflow.source.type"] == "LOCAL"
    assert rest_tags["mlflow.user"] == getpass.getuser()
    tags = run.data.tags
    assert (tags["strategy"], tags["world_size"], tags["model_family"], tags["method"]) == ("single", "1", "sd1", "full")
    assert len(tags["git_commit"].removesuffix("-dirty")) == 40
    assert tags["exported"].split() == [str(p) for p in result.exported]
    artifacts = {a.path for a in client(server.uri).list_artifacts(run_id)}
    assert {"config.yaml", "exported_paths.txt", "bucket_report.txt"} <= artifacts
    assert "bucket" in download_text(server.uri, run_id, "bucket_report.txt")  # the report printed at start
    logged_config = download_text(server.uri, run_id, "config.yaml")
    assert validate(yaml.safe_load(logged_config)) == config
    # the secret given through MLflow's environment variables is nowhere in what was logged
    logged = [logged_config, download_text(server.uri, run_id, "exported_paths.txt"), *run.data.params.values(),
              *run.data.tags.values()]
    assert not any(SECRET in text for text in logged)
    # plain progress lines (the test's output is no terminal), one per window
    progress = [line for line in lines if re.match(r"step \d+/\d+ ", line)]  # the progress lines, not "step guard: ..."
    assert progress[0].startswith("step 4/6 epoch 1/2 loss ") and "lr/unet=" in progress[0]
    assert "samples/s eta " in progress[0] and progress[1].startswith("step 6/6 ")


def rest(uri, endpoint, **query) -> dict:
    """A GET of MLflow's REST API, as the UI makes it."""
    import urllib.parse

    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}", timeout=30) as answer:
        return json.loads(answer.read())


def download_text(uri, run_id, path) -> str:
    from mlflow.artifacts import download_artifacts

    return Path(download_artifacts(run_id=run_id, artifact_path=path, tracking_uri=uri)).read_text()


def test_a_resumed_run_continues_the_same_mlflow_run(server, first_run, one_level_sd1, shapes_data, tmp_path):
    first, first_result, _ = first_run
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "out", batch_size=4, **SETTINGS,
                      **{"mlflow.tracking_uri": server.uri, "mlflow.experiment": "tracking-test"})
    raw.update(max_steps=STEPS + 3, epochs=3)
    # from the checkpoint the first run saved at its end (step 6): the run id is part of its state
    resumed, result, _ = train(raw, resume=str(Path(first.config.output_dir) / "checkpoints"))
    assert result.first_step == STEPS
    assert resumed.tracker.run_id == first.tracker.run_id
    loss = history(server.uri, first.tracker.run_id, "loss")
    assert [s for s, _ in loss] == list(range(1, STEPS + 4))  # contiguous: 1..6 then 7..9
    assert [v for _, v in loss] == pytest.approx(first_result.losses + result.losses, rel=1e-7)
    run = client(server.uri).get_run(first.tracker.run_id)
    assert run.info.status == "FINISHED"
    assert "config-resumed-at-step-6.yaml" in {a.path for a in client(server.uri).list_artifacts(run.info.run_id)}


def test_two_ranks_log_once_and_only_rank_0_tracks(server, first_run, one_level_sd1, shapes_data, tmp_path):
    """fsdp, batch 2 on each of 2 ranks = batch 4 in one process: the same losses and gradient norms."""
    first, first_result, _ = first_run
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "out", batch_size=2, strategy="fsdp", **SETTINGS,
                      **{"mlflow.tracking_uri": server.uri, "mlflow.experiment": "two-ranks"})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    # Each rank in a fresh interpreter (what it imports is asserted: the fork server's libraries import parts of
    # MLflow), with torchrun's environment but not its agent, whose own interpreter (~3 CPU s of imports) this test
    # does not need (tests/forked_ranks.py run_ranks, fork=False).
    done = run_ranks(REPO / "tests" / "helpers" / "train_reporting_imports.py", "train", config, fork=False,
                     env={**ENV, "IMPORT_REPORT_DIR": str(tmp_path)}, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"tracks": True, "mlflow_imported": False}
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"tracks": False, "mlflow_imported": False}
    experiment = client(server.uri).get_experiment_by_name("two-ranks")
    (run,) = client(server.uri).search_runs([experiment.experiment_id])
    assert run.data.tags["world_size"] == "2" and run.data.tags["strategy"] == "fsdp"
    loss = history(server.uri, run.info.run_id, "loss")
    assert [v for _, v in loss] == pytest.approx(first_result.losses, rel=1e-4)  # averaged over the ranks
    reference_norms = [v for s, v in history(server.uri, first.tracker.run_id, "grad_norm") if s <= STEPS]
    norms = history(server.uri, run.info.run_id, "grad_norm")
    assert [s for s, _ in norms] == list(range(1, STEPS + 1))
    assert [v for _, v in norms] == pytest.approx(reference_norms, rel=1e-4)  # the global norm of sharded grads


def test_a_closed_port_costs_nothing_but_a_warning(small_sd1, shapes_data, tmp_path):
    """20 steps against a port where nothing listens: exit 0, promptly, a warning naming the outbox
    file; its replay command puts every point in a local store afterwards. Both commands run as their own processes,
    forked from the preloaded test server (tests/forked_ranks.py), not as new interpreters (8-9 CPU s of imports)."""
    port = free_port()
    out = tmp_path / "out"
    raw = base_config(small_sd1, shapes_data, out, batch_size=1, epochs=2, max_steps=20, log_every_steps=5,
                      **{"mlflow.enabled": True, "mlflow.tracking_uri": f"http://127.0.0.1:{port}"})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    start = time.monotonic()
    done = run_ranks("-m", "ot_dist", "train", config, nproc=1, env=ENV, timeout=600, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"warning: MLflow: cannot reach http://127.0.0.1:{port}" in done.stdout
    assert elapsed < 120, f"{elapsed:.0f} s: waiting on the dead server?"  # a hang check: MLflow alone retries for minutes
    (outbox,) = (out / "mlflow-outbox").glob("*.jsonl")
    assert f"could not be sent to http://127.0.0.1:{port}" in done.stdout and f"they are kept in {outbox}" in done.stdout
    replay_command = f"python -m ot_dist.tracking.replay {outbox}"
    assert replay_command in done.stdout
    # recoverable: the warning's command, sent to a local store instead of the dead server
    local = f"sqlite:///{tmp_path / 'recovered' / 'mlflow.db'}"
    replayed = run_ranks(*replay_command.split()[1:], "--tracking-uri", local, nproc=1, env=ENV, timeout=300,
                         cwd=tmp_path)
    assert replayed.returncode == 0, (replayed.stdout + replayed.stderr)[-4000:]
    (run,) = client(local).search_runs([client(local).get_experiment_by_name("ot_dist").experiment_id])
    assert f"run {run.info.run_id}" in replayed.stdout and run.info.status == "FINISHED"
    assert run.data.tags["ot_dist.replayed_from"] == str(outbox)
    loss = history(local, run.info.run_id, "loss")
    assert [s for s, _ in loss] == list(range(1, 21))
    final = float(done.stdout.split("final loss ")[1].split()[0])
    assert loss[-1][1] == pytest.approx(final, abs=1e-4)
    assert len(history(local, run.info.run_id, "lr/unet")) == 20 and run.data.params["max_steps"] == "20"
    assert {"config.yaml", "bucket_report.txt", "exported_paths.txt"} <= {
        a.path for a in client(local).list_artifacts(run.info.run_id)}
    assert list((tmp_path / "recovered" / "mlartifacts").rglob("config.yaml"))  # next to the store,
    assert not (tmp_path / "mlruns").exists()  # not in the working directory
    assert not outbox.exists()  # delivered: gone


class Outage:
    """The server's address as the trackers see it: a TCP relay in front of the server. `down()` refuses new
    connections and cuts the open ones, which is what a client sees of a server that went away; `up()` serves on
    the same port again. (Stopping and restarting `mlflow server` itself costs 6-7 s of CPU and shows the client
    nothing more: its store is on disk.)"""

    def __init__(self, server: MlflowServer):
        self.server_address = ("127.0.0.1", server.port)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.connections: list[socket.socket] = []

    def up(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the port of a moment ago
        with self.lock:
            self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self.lock:
            listener, self.listener, connections, self.connections = self.listener, None, self.connections, []
        for sock in (listener, *connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() / recv()
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # down()
                return
            upstream = socket.create_connection(self.server_address)
            with self.lock:
                if self.listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self.connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

    @staticmethod
    def _relay(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):  # one side ended (or down()): the connection ends for both
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_a_server_outage_values_kept_are_sent_when_it_is_back_and_what_a_closed_run_missed_is_replayed(server,
                                                                                                       tmp_path):
    """One outage of the server for two runs: "comes-back" keeps logging and is still open when the server is back:
    everything arrives. "replayed" closes while the server is down: its outbox stays, the warning names it and the
    replay command, which sends what was missed into the same run. (The outage: the Outage relay goes down.)"""
    outage = Outage(server)
    outage.up()
    kept = tmp_path / "kept.jsonl"
    comes_back = MlflowTracker(outage.uri, "comes-back", "comes-back", kept, shutdown_timeout=60)
    outbox = tmp_path / "outbox.jsonl"
    tracker = MlflowTracker(outage.uri, "replayed", "replayed", outbox, shutdown_timeout=5)
    comes_back.log_metrics({"loss": 1.0}, step=1)
    tracker.log_metrics({"loss": 1.0}, step=1)
    wait_for(lambda: comes_back.all_sent() and comes_back.run_id is not None)
    wait_for(lambda: tracker.all_sent() and tracker.run_id is not None)
    outage.down()
    try:
        comes_back.log_metrics({"loss": 2.0}, step=2)
        comes_back.log_metrics({"loss": 3.0}, step=3)
        tracker.log_metrics({"loss": 2.0}, step=2)
        tracker.log_text("after the server went away\n", "note.txt")
        wait_for(lambda: comes_back.error is not None)
        warnings = tracker.close()  # one last attempt, then the outbox stays
    finally:
        outage.up()

    kept_warnings = comes_back.close()
    assert not any("could not be sent" in w for w in kept_warnings), kept_warnings
    assert history(server.uri, comes_back.run_id, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert client(server.uri).get_run(comes_back.run_id).info.status == "FINISHED"
    assert not kept.exists()  # all delivered

    (warning,) = [w for w in warnings if "could not be sent" in w]
    assert warning.startswith(f"MLflow: 1 metric points, 1 artifacts could not be sent to {outage.uri}")
    assert f"they are kept in {outbox}" in warning and f"python -m ot_dist.tracking.replay {outbox}" in warning
    assert client(server.uri).get_run(tracker.run_id).info.status == "RUNNING"
    # the command in this process (its fresh-process run: test_a_closed_port_costs_nothing_but_a_warning)
    assert replay_main([str(outbox)]) == 0
    assert history(server.uri, tracker.run_id, "loss") == [(1, 1.0), (2, 2.0)]  # the same run, nothing twice
    assert client(server.uri).get_run(tracker.run_id).info.status == "FINISHED"
    assert download_text(server.uri, tracker.run_id, "note.txt") == "after the server went away\n"
    assert not outbox.exists()
    outage.down()


def test_a_run_whose_process_dies_still_reaches_the_server(server, tmp_path):
    """The training process crashes without closing: it does not wait at exit; its sender delivers
    what was logged on its own and ends the run as failed."""
    outbox = tmp_path / "outbox.jsonl"
    crash = (f"from pathlib import Path\nfrom ot_dist.tracking.mlflow_tracker import MlflowTracker\n"
             f"tracker = MlflowTracker({server.uri!r}, 'crashed', 'crashed', Path({str(outbox)!r}))\n"
             "tracker.log_metrics({'loss': 1.5}, step=1)\nraise RuntimeError('the training loop died')\n")
    done = subprocess.run([sys.executable, "-c", crash], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "the training loop died" in done.stderr
    wait_for(lambda: not outbox.exists(), timeout=120)  # delivered, then removed
    (run,) = client(server.uri).search_runs([client(server.uri).get_experiment_by_name("crashed").experiment_id])
    assert run.info.status == "FAILED"
    assert history(server.uri, run.info.run_id, "loss") == [(1, 1.5)]


def wait_for(condition, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_without_settings_runs_are_tracked_in_a_local_store(small_sd1, shapes_data, tmp_path, monkeypatch):
    """(With Prodigy, whose d x lr is logged too.)"""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    raw = base_config(small_sd1, shapes_data, tmp_path / "out", max_steps=2, learning_rate=1.0,
                      **{"optimizer.name": "PRODIGY", "scheduler.name": "CONSTANT", "scheduler.warmup_steps": 0})
    del raw["mlflow"]  # the defaults, as a user's config has them
    trainer, result, _ = train(raw)
    uri = f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    local = client(uri)
    run = local.get_run(trainer.tracker.run_id)
    assert run.data.tags["mlflow.runName"] == "out"  # the output folder's name
    assert [m.value for m in local.get_metric_history(run.info.run_id, "loss")] == pytest.approx(result.losses)
    d_lr = history(uri, run.info.run_id, "d_lr/unet")
    assert d_lr[0] == (1, pytest.approx(1e-6))  # Prodigy's first step: d0 x lr
    assert [s for s, _ in d_lr] == [1, 2] and d_lr[1][1] >= d_lr[0][1]
    assert local.list_artifacts(run.info.run_id)  # the config went next to it
    assert (tmp_path / "out" / "mlartifacts").is_dir()


def test_credentials_never_go_in_a_uri(tiny_models, shapes_data, tmp_path, monkeypatch):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, **{"mlflow.tracking_uri": "https://me:pw-8812@mlflow.example"})
    with pytest.raises(ConfigError, match=r"mlflow.tracking_uri: the URI contains credentials") as err:
        validate(raw)
    assert "pw-8812" not in str(err.value)
    raw["mlflow"] = {"enabled": True}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://me:pw-8812@mlflow.example")
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI: the URI contains credentials"):
        tracking_uri(validate(raw))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example")
    assert tracking_uri(validate(raw)) == "https://mlflow.example"
    raw["mlflow"]["tracking_uri"] = "http://other:5000"  # set in the config: the config wins, as in MLflow
    assert tracking_uri(validate(raw)) == "http://other:5000"


def test_only_the_main_rank_gets_a_tracker(tiny_models, shapes_data, tmp_path):
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path, **{"mlflow.enabled": True}))
    assert start_sender(config, is_main=False) is None
    assert type(start_tracking(config, is_main=False, world_size=2)) is Tracker  # does nothing, imports nothing


def test_a_terminal_gets_a_progress_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen, lines = Terminal(), []
    progress = Progress(total_steps=10, epochs=2, log=lines.append, stream=screen)
    for step in range(1, 6):
        progress.step(step)
    progress.window(5, 0, 0.1234, {"lr/unet": 2e-4, "d_lr/unet": 3e-4}, samples_per_s=12.5)
    progress.close()
    shown = screen.getvalue()
    assert "epoch 1/2" in shown and "5/10" in shown and "loss 0.1234" in shown
    assert "lr/unet=0.0002" in shown and "d*lr/unet=0.0003" in shown and "12.50 samples/s" in shown
    assert "<" in shown  # tqdm's elapsed<remaining: the ETA
    assert not lines  # no plain lines on a terminal



def test_metric_names_pass_mlflows_own_check():
    """Concept names become metric keys after `validation/loss/`: whatever the name, MLflow takes the key (its
    characters and its path check: no empty part, no part of dots alone), and plain names are kept."""
    from mlflow.utils.validation import _validate_metric_name

    awkward = ["faces/", "/faces", "a//b", "..", ".", "a/./b", "", "Style: Anime", "café", "x" * 3]
    for name in awkward:
        _validate_metric_name(f"validation/loss/{metric_name(name)}")  # raises MlflowException if refused
    assert [metric_name(n) for n in ("faces", "close-up v1.5", "styles/anime")] == ["faces", "close-up v1.5",
                                                                                     "styles/anime"]


def test_a_refused_value_costs_only_its_own_record(server, tmp_path):
    """MLflow refuses a whole log_batch for one bad value; the steps and params that shared the request with it
    still arrive, and only the bad record is kept in FILE.refused."""
    from ot_dist.tracking.delivery import Delivery
    from ot_dist.tracking.outbox import OutboxWriter, read_records, refused_path

    outbox = tmp_path / "outbox.jsonl"
    writer = OutboxWriter(outbox)
    writer.add({"kind": "run", "uri": server.uri, "experiment": "refusals", "run_name": "one-bad", "run_id": None,
                "artifact_location": None})
    writer.add({"kind": "metrics", "step": 1, "timestamp_ms": 1000, "values": {"loss": 0.5}})
    writer.add_values("params", {"seed": "1"})
    writer.add({"kind": "metrics", "step": 2, "timestamp_ms": 2000, "values": {"validation/loss/faces/": 0.1}})
    writer.add({"kind": "metrics", "step": 2, "timestamp_ms": 2000, "values": {"loss": 0.25}})
    writer.close()
    notices = []
    delivery = Delivery(outbox, server.uri, notify=notices.append)
    delivery.deliver(read_records(outbox, 0))
    assert history(server.uri, delivery.run_id, "loss") == [(1, 0.5), (2, 0.25)]
    assert client(server.uri).get_run(delivery.run_id).data.params == {"seed": "1"}
    (kept,) = [json.loads(line) for line in refused_path(outbox).read_text().splitlines()]
    assert kept["values"] == {"validation/loss/faces/": 0.1} and "faces" in kept["refused"]
    assert len(notices) == 1 and "1 metric points" in notices[0]


class Recording(Tracker):
    def __init__(self):
        self.closed_as: list[str] = []

    def close(self, status="FINISHED"):
        self.closed_as.append(status)
        return []

    def close_failed(self):
        self.closed_as.append("FAILED (close_failed)")


def test_a_run_stopped_by_a_signal_ends_killed(tiny_models, shapes_data, tmp_path, monkeypatch):
    """MLflow's statuses: a run a signal stopped (preemption: saved, exit 0, to be resumed) is KILLED, not
    FINISHED; `search_runs(filter_string="attributes.status = 'FINISHED'")` finds only completed runs."""
    recording = Recording()
    monkeypatch.setattr("ot_dist.train.trainer.start_tracking", lambda *args, **kwargs: recording)
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", batch_size=1, max_steps=4)
    trainer = Trainer(validate(raw), log=lambda *_: None)
    trainer.optimizer.register_step_post_hook(lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    result = trainer.train()
    assert result.stopped_by == "SIGTERM" and result.steps < 4  # stopped early, saved
    assert recording.closed_as == ["KILLED"]


class OutboxOnly:
    """A sender that sends nothing: the test delivers the outbox itself, in this process."""

    def __init__(self, uri: str, outbox: Path):
        self.uri, self.outbox, self.run_id, self.sent, self.outcome = uri, outbox, None, 0, None
        self.notices = queue.SimpleQueue()

    def close(self, seconds):
        return True


def test_a_run_the_caller_created_in_mlflow_run_id_is_the_one_tracked(server, tiny_models, shapes_data, tmp_path,
                                                                       monkeypatch):
    """`mlflow run` (MLflow Projects) and job schedulers create the run and pass it in MLFLOW_RUN_ID, as MLflow's own
    start_run takes it: the values, params and config go there (not to a second run of the `ot_dist` experiment),
    and the run keeps its source tags."""
    from ot_dist.tracking.delivery import Delivery
    from ot_dist.tracking.outbox import read_records

    experiment_id = client(server.uri).create_experiment("a-project")
    callers = client(server.uri).create_run(experiment_id, tags={"mlflow.source.name": "https://git.example/project",
                                                                 "mlflow.source.type": "PROJECT"}).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", callers)
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "out",
                                  **{"mlflow.enabled": True, "mlflow.tracking_uri": server.uri}))
    outbox = tmp_path / "outbox.jsonl"
    tracker = start_tracking(config, is_main=True, world_size=1, sender=OutboxOnly(server.uri, outbox))
    assert tracker.run_id == callers  # what a checkpoint keeps for a resume
    tracker.log_metrics({"loss": 0.5}, step=1)
    tracker.close()
    Delivery(outbox, server.uri).deliver(read_records(outbox, 0))
    run = client(server.uri).get_run(callers)
    assert run.info.status == "FINISHED" and history(server.uri, callers, "loss") == [(1, 0.5)]
    assert run.data.params["learning_rate"] == "0.0003" and run.data.tags["method"] == "full"
    assert run.data.tags["mlflow.source.name"] == "https://git.example/project"
    assert "config.yaml" in {a.path for a in client(server.uri).list_artifacts(callers)}
    assert client(server.uri).get_experiment_by_name("ot_dist") is None  # no second run elsewhere


def test_a_resumed_run_missing_from_the_store_continues_in_a_new_run_with_its_params(server, tiny_models,
                                                                                     shapes_data, tmp_path):
    """A resume continues its MLflow run without sending its params again (MLflow refuses a changed value, and
    a resume may raise max_steps); a run that is not in the store (tracked in another one before the resume)
    is no reason to track nothing: a new run gets the values, with the params, tagged with the run it continues."""
    from ot_dist.tracking.delivery import Delivery
    from ot_dist.tracking.outbox import read_records, refused_path

    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=6,
                      **{"mlflow.enabled": True, "mlflow.tracking_uri": server.uri, "mlflow.experiment": "resumes"})
    first = start_tracking(validate(raw), True, 1, sender=OutboxOnly(server.uri, tmp_path / "first.jsonl"))
    first.close()
    delivery = Delivery(first.outbox.path, server.uri)
    delivery.deliver(read_records(first.outbox.path, 0))
    existing = delivery.run_id
    raw["max_steps"] = 9
    missing = "0123456789abcdef0123456789abcdef"
    for run_id, outbox in ((existing, tmp_path / "resumed.jsonl"), (missing, tmp_path / "elsewhere.jsonl")):
        tracker = start_tracking(validate(raw), True, 1, run_id=run_id, resumed_at_step=6,
                                 sender=OutboxOnly(server.uri, outbox))
        tracker.log_metrics({"loss": 0.5}, step=7)
        tracker.close()
        notices = []
        delivery = Delivery(outbox, server.uri, notify=notices.append)
        delivery.deliver(read_records(outbox, 0))
        assert not refused_path(outbox).exists(), refused_path(outbox).read_text()
        run = client(server.uri).get_run(delivery.run_id)
        assert history(server.uri, delivery.run_id, "loss") == [(7, 0.5)] and run.info.status == "FINISHED"
    assert client(server.uri).get_run(existing).data.params["max_steps"] == "6"  # kept: not sent again
    assert run.data.params["max_steps"] == "9" and run.data.tags["ot_dist.continues_run"] == missing
    assert notices == [f"MLflow: the run {missing} to continue is not in {server.uri}; the values go to a new run "
                       "of the experiment"]
