"""What must hold when things go wrong: crashes mid-save, hostile files, NaN losses, SIGTERM to the
command, a rank killed under a restart budget; and the folder rules (marker, latest, keep_last)."""

from __future__ import annotations

import json
import os
import shutil
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forked_ranks import ForkedCommand, run_ranks, start_command
import torch
import yaml
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.layout import MARKER, checkpoints_dir, is_committed, latest_checkpoint, resolve_resume
from ot_dist.checkpoint.shards import SavedShards, gather_full_from_files
from ot_dist.checkpoint.training_state import read_trainer_state
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError, InputFileError, TrainingHalted
from ot_dist.tracking.base import Tracker
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def quiet(*_args, **_kwargs):
    pass


# -- the folder rules ---------------------------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, keep_last=None) -> Path:
    partial = layout.partial_dir(root, step)
    partial.mkdir(parents=True)
    (partial / "rank-00000.safetensors").write_bytes(b"x" * step)
    return layout.commit(partial, root, step, keep_last)


def test_commit_marker_latest_and_keep_last(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step, keep_last=2)
    assert [p.name for p in layout.committed_checkpoints(root)] == ["step-00000004", "step-00000006"]
    assert (root / "latest").read_text().strip() == "step-00000006"
    # a folder without its marker, or whose files do not match the marker, does not count
    layout.partial_dir(root, 8).mkdir()
    (root / "step-00000010").mkdir()
    assert latest_checkpoint(root).name == "step-00000006"
    (root / "step-00000006" / "rank-00000.safetensors").write_bytes(b"short")
    assert not is_committed(root / "step-00000006")
    assert latest_checkpoint(root).name == "step-00000004"
    with pytest.raises(InputFileError, match="incomplete"):
        resolve_resume(str(root / "step-00000006"), tmp_path)
    # a crash between the rename and moving `latest` leaves the pointer one behind: the newest committed wins
    fake_checkpoint(root, 12, keep_last=None)
    (root / "latest").write_text("step-00000004\n")
    assert resolve_resume("auto", tmp_path).name == "step-00000012"
    assert not layout.partial_dir(root, 8).exists()  # debris is swept at the next commit
    assert resolve_resume("auto", tmp_path / "elsewhere") is None  # auto with nothing saved: start fresh


def test_committing_a_step_again_never_leaves_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    """A run resumed from an earlier checkpoint commits the same step again. The old folder of that step is big:
    a kill while it is deleted must not leave a `step-N` (the one `latest` names) with files missing."""
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 2)
    fake_checkpoint(root, 4)
    removing = shutil.rmtree

    def killed_while_deleting(path, *args, **kwargs):  # the marker goes first, then the process dies
        if Path(path).is_dir() and (Path(path) / MARKER).exists():
            (Path(path) / MARKER).unlink()
            raise KeyboardInterrupt("killed")
        return removing(path, *args, **kwargs)

    partial = layout.partial_dir(root, 4)
    partial.mkdir()
    (partial / "rank-00000.safetensors").write_bytes(b"y" * 4)
    monkeypatch.setattr(layout.shutil, "rmtree", killed_while_deleting)
    try:
        layout.commit(partial, root, 4, keep_last=None)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert layout.damaged_after(root, latest_checkpoint(root)) == []
    assert latest_checkpoint(root).name == "step-00000004"
    assert (root / "step-00000004" / "rank-00000.safetensors").read_bytes() == b"y" * 4  # the new one
    fake_checkpoint(root, 6)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000004", "step-00000006"]


def test_a_kill_while_an_earlier_resume_moves_the_later_history_aside_never_breaks_auto(tmp_path, monkeypatch):
    """`--resume step-4` while step-6 and step-8 exist moves them (and later snapshots) aside before training. A kill
    at every point of that move leaves `--resume auto` continuing from the old newest (step 8) or the chosen one
    (step 4), never anything between nor a refusal, with nothing deleted; running the resume again finishes it."""
    from ot_dist.checkpoint.rewind import ABANDONED, abandon_later_history

    def history(out: Path) -> Path:
        root = checkpoints_dir(out)
        for step in (2, 4, 6, 8):
            fake_checkpoint(root, step)
            (out / "snapshots" / f"step-{step}").mkdir(parents=True)
        return root / "step-00000004"

    def everything(out: Path) -> list[str]:
        return sorted(p.name for p in out.rglob("step-*"))

    replacing, kills = os.replace, 0
    while True:
        out = tmp_path / f"kill-{kills}"
        chosen = history(out)
        before = everything(out)
        calls = 0

        def killed_at_the_nth(src, dst, *args, **kwargs):
            nonlocal calls
            calls += 1
            if calls > kills:
                raise KeyboardInterrupt("killed")
            return replacing(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", killed_at_the_nth)
        try:
            abandon_later_history(out, chosen, log=quiet)
            finished = True
        except KeyboardInterrupt:
            finished = False
        monkeypatch.undo()
        assert everything(out) == before  # moved, never deleted
        assert resolve_resume("auto", out).name in ("step-00000004", "step-00000008"), kills
        abandon_later_history(out, chosen, log=quiet)  # the same --resume again completes the move
        assert resolve_resume("auto", out) == chosen
        assert (checkpoints_dir(out) / "latest").read_text().strip() == "step-00000004"
        assert sorted(p.name for p in out.glob(f"{ABANDONED}/*/*/step-*")) == [
            "step-00000006", "step-00000008", "step-6", "step-8"]
        if finished:
            break
        kills += 1
    assert kills >= 5  # 2 snapshots, 2 checkpoints and `latest` were each interrupted once


def test_only_rank_0_moves_the_later_history_and_between_the_barriers(tmp_path, monkeypatch):
    """With several ranks, every rank resolves the checkpoint first (first barrier), rank 0 alone moves the later
    history aside, and the others read the folder only after the second barrier."""
    from ot_dist.checkpoint import run_folder

    out = tmp_path / "out"
    for step in (2, 4, 6):
        fake_checkpoint(checkpoints_dir(out), step)
    (out / run_folder.RUN_FILE).write_text(json.dumps({"run_id": "r", "started_at": 0}))
    events = []

    class Rank:
        distributed = False  # each "rank" resolves on its own here (run_folder.agreed_start shares rank 0's answer)

        def __init__(self, is_main):
            self.is_main = is_main

        def barrier(self):
            events.append("barrier")

    monkeypatch.setattr(run_folder, "abandon_later_history", lambda *a, **k: events.append("move"))
    monkeypatch.setattr(run_folder, "lock_output_dir", lambda out: None)
    chosen = str(checkpoints_dir(out) / "step-00000004")
    run_folder.prepare_run_folder(out, chosen, False, Rank(is_main=False), log=quiet)
    assert events == ["barrier", "barrier"]
    events.clear()
    run_folder.prepare_run_folder(out, chosen, False, Rank(is_main=True), log=quiet)
    assert events == ["barrier", "move", "barrier"]
    events.clear()
    run_folder.prepare_run_folder(out, "auto", False, Rank(is_main=True), log=quiet)
    assert events == ["barrier", "barrier"]  # `auto` is the newest: nothing later to move


def test_a_crash_before_the_commit_keeps_the_previous_checkpoint(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1,
                      **{"optimizer.name": "ADAMW", "ema.enabled": True})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    # one trial per crash point: each crashes at a fixed point of the save (no timing), the later ones over the
    # partial folders the earlier ones left, and the final save sweeps all of them (10 trials repeated the same three)
    done = run_ranks(REPO / "tests" / "helpers" / "crash_before_commit.py", tmp_path / "config.json",
                     tmp_path / "result.json", "3", nproc=1, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["trials"]) == 3
    for trial in result["trials"]:
        assert trial["exit"] == 86, trial  # it did crash, at the injected point
        assert trial["latest"] == trial["pointer"] == result["good"] == "step-00000001", trial
        assert trial["loaded_step"] == 1 and trial["weights_restored"], trial
        assert trial["partial"], trial  # the crashed attempt is left behind, unread
        # each crash point produced its state; "before-rename" leaves a complete marker in the unrenamed folder
        expected = {"before-marker": "absent", "torn-marker": "torn", "before-rename": "complete"}[trial["point"]]
        assert trial["marker_left"] == expected, trial
    assert result["latest_after"] == result["after"] == "step-00000500" and result["partial_after"] == []


# -- hostile or damaged files -------------------------------------------------------------------------


class Payload:
    """Unpickling this runs code: it creates the file named `path`."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path(self.path).touch, ())


@pytest.mark.parametrize("victim", ["rank-00000.safetensors", "trainer.json", "rank-00000.json"])
def test_a_pickle_in_a_checkpoint_is_refused_and_never_runs(victim, tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1)
    Trainer(validate(raw), log=quiet).train()
    folder = latest_checkpoint(checkpoints_dir(tmp_path / "out"))
    ran = tmp_path / "payload-ran"
    (folder / victim).write_bytes(pickle.dumps(Payload(ran)))
    marker = json.loads((folder / MARKER).read_text())  # the attacker also fixes up the marker
    marker["files"][victim] = (folder / victim).stat().st_size
    (folder / MARKER).write_text(json.dumps(marker))
    assert is_committed(folder)
    with pytest.raises(InputFileError, match=victim.replace(".", r"\.")):
        Trainer(validate(raw), log=quiet, resume=str(folder))
    assert not ran.exists()


# -- non-finite losses --------------------------------------------------------------------------------


def poison_third_step(trainer: Trainer) -> None:
    calls, original = [0], trainer.loss

    def loss(batch, epoch):
        calls[0] += 1
        value = original(batch, epoch)
        return value * float("nan") if calls[0] == 3 else value

    trainer.loss = loss


def test_a_nan_loss_stops_with_the_good_weights_kept(tiny_models, shapes_data, tmp_path, monkeypatch):
    closed_as = []  # the tracked run's end: FAILED, as MLflow ends a run that an error stops

    class Recording(Tracker):
        def close(self, status="FINISHED"):
            closed_as.append(status)
            return []

        def close_failed(self):  # what train() calls on any error (a no-op once closed)
            closed_as.append("close_failed")

    monkeypatch.setattr("ot_dist.train.trainer.start_tracking", lambda *args, **kwargs: Recording())
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=6, **{"optimizer.name": "ADAMW"})
    trainer = Trainer(validate(raw), log=quiet)
    poison_third_step(trainer)
    after_two = {}
    trainer.optimizer.register_step_post_hook(lambda *_: after_two.update(
        {n: p.detach().clone() for n, p in trainer.strategy.trained_parameters().items()}) if not after_two else None)
    second = []
    trainer.optimizer.register_step_post_hook(lambda *_: second.append(1))
    trainer.optimizer.register_step_post_hook(lambda *_: after_two.update(
        {n: p.detach().clone() for n, p in trainer.strategy.trained_parameters().items()}) if len(second) == 2 else None)
    with pytest.raises(TrainingHalted, match="step 3") as halted:
        trainer.train()
    assert halted.value.exit_code == 4 and len(second) == 2  # the poisoned step was not applied
    assert closed_as == ["FAILED", "close_failed"]
    folder = latest_checkpoint(checkpoints_dir(tmp_path / "out"))
    state = read_trainer_state(folder)
    assert state["step"] == 2 and state["reason"] == "non-finite loss"
    saved = gather_full_from_files(SavedShards(folder), state["shapes"])
    assert all(torch.equal(saved[n], after_two[n]) for n in saved)
    assert all(torch.isfinite(v).all() for v in saved.values())


def test_skip_step_drops_the_nan_step_and_goes_on(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=3,
                      **{"optimizer.name": "ADAMW", "checkpoint.on_nonfinite_loss": "skip_step"})
    trainer = Trainer(validate(raw), log=quiet)
    poison_third_step(trainer)
    result = trainer.train()
    assert result.skipped_steps == 1 and result.steps == 3 and len(result.losses) == 3
    assert all(torch.isfinite(p).all() for p in trainer.strategy.trained_parameters().values())
    with pytest.raises(ConfigError, match="checkpoint.on_nonfinite_loss: skip_step with strategy zero2 needs checkpoint.step_guard: lagged"):
        validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "z", strategy="zero2",
                             **{"checkpoint.on_nonfinite_loss": "skip_step"}))


# -- signals and dead ranks, through the real commands -------------------------------------------------


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def wait_for_checkpoint(root: Path, process: subprocess.Popen | ForkedCommand, at_least: int,
                        timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = latest_checkpoint(root) if root.is_dir() else None
        if found and int(found.name.split("-")[1]) >= at_least:
            return int(found.name.split("-")[1])
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def test_sigterm_to_the_train_command_commits_and_exits_0(tiny_models, shapes_data, tmp_path):
    """`python -m ot_dist train`, forked from the preloaded test server (tests/forked_ranks.py: the command's own
    signal handling, without a fresh interpreter's 8-9 s of imports), SIGTERMed after its second step's checkpoint."""
    out = tmp_path / "out"
    raw = base_config(tiny_models["sd1"], shapes_data, out, batch_size=1, epochs=20, max_steps=200,
                      **{"checkpoint.every_n_steps": 2})
    config = write_config(tmp_path / "config.yaml", raw)
    command = [sys.executable, "-m", "ot_dist", "train", str(config)]
    process = start_command(*command[1:], env=ENV)
    wait_for_checkpoint(checkpoints_dir(out), process, 2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout
    folder = latest_checkpoint(checkpoints_dir(out))
    state = read_trainer_state(folder)
    assert state["reason"] == "stop requested by SIGTERM"
    resumed = run_ranks(*command[1:], "--resume", "auto", "--set", f"max_steps={state['step'] + 2}", nproc=1,
                        timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"done: {state['step'] + 2} steps" in resumed.stdout  # continued from the saved step, none repeated


def rank_pid(config: Path, rank: int) -> int | None:
    """The worker process of `rank` training `config` (read from /proc: cmdline and environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = b"\0" + (entry / "environ").read_bytes()
        except OSError:
            continue
        if str(config).encode() in cmdline and b" train" in cmdline.replace(b"\0", b" ") and f"\0RANK={rank}\0".encode() in environ:
            return int(entry.name)
    return None


def launch(config: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ot_dist", "launch", str(config), "--nproc-per-node", "2", "--strategy", "ddp", *extra]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(small_sd1, shapes_data, tmp_path):
    """On the 2-level SD 1.x UNet (small_sd1): what is under test is the launcher's restart and the resume, not the
    model; its steps, checkpoints and exports cost less than the 4-level one's."""
    settings = dict(batch_size=2, epochs=4, max_steps=16, **{"checkpoint.every_n_steps": 2, "optimizer.name": "ADAMW"})
    reference = tmp_path / "reference"
    # the uninterrupted reference: the same 2 ddp ranks, forked (what is under test is the launcher's restart below)
    # it saves no checkpoints (what the killed run resumes from must not change what it trains)
    config = write_config(tmp_path / "reference.yaml", base_config(small_sd1, shapes_data, reference, strategy="ddp",
                                                                   **{**settings, "checkpoint.every_n_steps": None}))
    done = run_ranks("-m", "ot_dist", "train", config, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "killed"
    config = write_config(tmp_path / "killed.yaml", base_config(small_sd1, shapes_data, out, **settings))
    process = launch(config, "--max-restarts", "1")
    wait_for_checkpoint(checkpoints_dir(out), process, 2)
    victim = rank_pid(config, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "checkpoint: resumed from" in stdout + stderr  # the restarted group continued
    assert read_trainer_state(latest_checkpoint(checkpoints_dir(out)))["step"] == 16
    file = "model/unet/diffusion_pytorch_model.safetensors"
    want, got = load_file(reference / file), load_file(out / file)
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6


def test_checkpoints_at_cycle_lows_and_epoch_ends(tiny_models, shapes_data, tmp_path):
    """16 steps, 4 per epoch (16 samples, batch 4), 2 hard-restart cycles: a low after step 8 (16 is the
    end); every 3rd epoch ends after step 12; no step or time interval; keep everything."""
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", batch_size=4, epochs=4,
                      **{"scheduler.name": "COSINE_WITH_HARD_RESTARTS", "scheduler.cycles": 2,
                         "scheduler.warmup_steps": 0, "checkpoint.at_cycle_lows": True, "checkpoint.every_n_epochs": 3,
                         "checkpoint.keep_last": None, "checkpoint.every_n_minutes": None})
    Trainer(validate(raw), log=quiet).train()
    saved = {int(p.name.split("-")[1]): read_trainer_state(p)["reason"]
             for p in layout.committed_checkpoints(checkpoints_dir(tmp_path / "out"))}
    assert saved == {8: "cycle low", 12: "epoch end", 16: "end of training"}


def test_a_resume_that_cannot_be_honoured_names_the_difference(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1)
    Trainer(validate(raw), log=quiet).train()
    for change, message in (
        ({"method": "lora"}, "method is lora, the checkpoint was trained with full"),
        ({"optimizer.name": "SGD"}, "optimizer.name is SGD"),
        ({"text_encoder.train": True}, "the trained parameters differ"),
        ({"batch_size": 2}, "global batch of 4, this run has 2"),
    ):
        other = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1, **change)
        with pytest.raises(InputFileError, match=message):
            Trainer(validate(other), log=quiet, resume="auto")


def test_a_lora_resumes_only_at_its_alpha(tiny_models, shapes_data, tmp_path):
    """The adapters resume as saved: another lora.alpha would scale the change training made by new / saved alpha
    (the model jumps at the resume; OneTrainer keeps the saved alpha). Refused, naming it; the same alpha resumes."""
    lora = {"method": "lora", "lora.rank": 4, "lora.alpha": 2.0}
    Trainer(validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=1, **lora)),
            log=quiet).train()
    other = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=2, **{**lora, "lora.alpha": 8.0})
    with pytest.raises(InputFileError, match=r"lora.alpha is 8.0, the checkpoint was trained with 2.0.*scaled by 4"):
        Trainer(validate(other), log=quiet, resume="auto")
    same = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", max_steps=2, **lora)
    assert Trainer(validate(same), log=quiet, resume="auto").train().steps == 2
