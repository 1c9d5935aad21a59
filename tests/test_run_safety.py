"""Nothing lost, nothing silent (issue 19): an earlier run is never started over, keep_last prunes only its own
run, signals to `ot-dist launch` (a zero launch, which builds no DeepSpeed shm op, and a Kubernetes pod's command)
stop the workers with a checkpoint, a damaged latest checkpoint is named, exports of a moved run stay beside it, a
bad output_dir is found before any model loads, and every .safetensors written honours the umask."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forked_ranks import run_ranks
import yaml
from conftest import base_config

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.export_command import export_checkpoint
from ot_dist.checkpoint.layout import checkpoints_dir, latest_checkpoint
from ot_dist.checkpoint.run_folder import check_before_start, check_writable, read_run_id
from ot_dist.checkpoint.training_state import read_trainer_state
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.file_modes import share_with_umask
from ot_dist.tracking.base import Tracker
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def quiet(*_args, **_kwargs):
    pass


def settings(**extra) -> dict:
    return dict(max_steps=4, **{"checkpoint.every_n_steps": 2, "checkpoint.keep_last": None, **extra})


@pytest.fixture(scope="module")
def finished_run(tiny_models, shapes_data, tmp_path_factory) -> Path:
    """A finished 4-step full finetune (checkpoints at steps 2 and 4, exports), trained under umask 022.
    Tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("finished") / "out"
    previous = os.umask(0o022)
    try:
        Trainer(validate(base_config(tiny_models["sd1"], shapes_data, out, **settings())), log=quiet).train()
    finally:
        os.umask(previous)
    return out


def copy_run(finished_run: Path, target: Path) -> Path:
    shutil.copytree(finished_run, target)
    return target


# -- 1. an earlier run is never started over ------------------------------------------------------------


def test_starting_over_a_finished_run_is_refused_and_overwrite_moves_it_aside(finished_run, tiny_models,
                                                                               shapes_data, tmp_path):
    out = copy_run(finished_run, tmp_path / "out")
    raw = base_config(tiny_models["sd1"], shapes_data, out, **settings())
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    done = run_ranks("-m", "ot_dist", "train", config, nproc=1, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"output_dir {out.resolve()} already holds a run" in done.stderr
    assert "--resume auto" in done.stderr and "--overwrite" in done.stderr and "another output_dir" in done.stderr
    assert "Traceback" not in done.stderr and "bucket report" not in done.stdout  # refused before anything loads
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing touched
    old_id = read_run_id(out)
    # --overwrite moves the whole earlier run aside (nothing deleted), then trains a new run
    trainer = Trainer(validate(raw), log=quiet, overwrite=True)
    (moved,) = tmp_path.glob("out.old-*")
    assert sorted(p.relative_to(moved) for p in moved.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(out) for p in before)
    assert read_run_id(moved) == old_id and read_run_id(out) not in (None, old_id)
    assert trainer.run.run_id == read_run_id(out) and trainer.run.moved_to == moved
    with pytest.raises(ConfigError, match="--overwrite starts a new run and --resume auto continues"):
        Trainer(validate(raw), log=quiet, overwrite=True, resume="auto")


def test_a_run_stopped_by_bad_input_does_not_block_the_corrected_command(tiny_models, shapes_data, tmp_path):
    """The checks after the folder is prepared (a mistyped model.path, unreadable images) stop a run that leaves
    only run.json: nothing to lose, so the corrected command starts, without --overwrite."""
    out = tmp_path / "out"
    with pytest.raises(InputFileError, match="model.path: .* does not exist"):
        Trainer(validate(base_config(tmp_path / "mistyped", shapes_data, out, **settings())), log=quiet)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["run.json"]
    assert check_before_start(out, None, False) == (None, False)
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step-00000002").mkdir()
    with pytest.raises(ConfigError, match="already holds a run"):  # anything more is a run's work
        check_before_start(out, None, False)


def test_keep_last_prunes_only_checkpoints_of_the_current_run(tmp_path):
    root = tmp_path / "checkpoints"

    def commit(step, run_id, keep_last):
        partial = layout.partial_dir(root, step)
        partial.mkdir(parents=True)
        (partial / "rank-00000.safetensors").write_bytes(b"x" * step)
        layout.commit(partial, root, step, keep_last, run_id=run_id)

    for step in (2, 4, 6):
        commit(step, "earlier", None)
    for step in (8, 10, 12):
        commit(step, "current", 2)
    names = [p.name for p in layout.committed_checkpoints(root)]
    assert names == ["step-00000002", "step-00000004", "step-00000006", "step-00000010", "step-00000012"]
    assert layout.run_of(root / "step-00000012") == "current" and layout.run_of(root / "step-00000002") == "earlier"


def test_checkpoints_carry_the_run_id_and_a_resume_keeps_it(finished_run, tiny_models, shapes_data, tmp_path):
    out = copy_run(finished_run, tmp_path / "out")
    run_id = read_run_id(out)
    assert run_id and all(layout.run_of(p) == run_id == read_trainer_state(p)["run_id"]
                          for p in layout.committed_checkpoints(checkpoints_dir(out)))
    trainer = Trainer(validate(base_config(tiny_models["sd1"], shapes_data, out, **settings())), log=quiet,
                      resume="auto")
    assert trainer.run.run_id == run_id and trainer.position.step == 4


def test_resuming_a_finished_run_leaves_its_committed_checkpoint_as_it_was(finished_run, tiny_models, shapes_data,
                                                                           tmp_path):
    """`--resume auto` on a finished run trains no step: its last checkpoint already holds that state, so it is not
    written and committed again in place (a kill during that would have put the finished run's checkpoint at risk)."""
    out = copy_run(finished_run, tmp_path / "out")
    last = checkpoints_dir(out) / "step-00000004"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in last.iterdir()}
    result = Trainer(validate(base_config(tiny_models["sd1"], shapes_data, out, **settings())), log=quiet,
                     resume="auto").train()
    assert result.steps == 4 and result.checkpoint == last
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in last.iterdir()} == before
    assert (out / "model.safetensors").is_file()  # the exports are written (again) as at the end of training


def test_resuming_an_earlier_checkpoint_moves_the_later_history_aside_for_auto_and_keep_last(
        finished_run, tiny_models, shapes_data, tmp_path, monkeypatch):
    """A user goes back to step 2 of a 4-step run and retrains with another learning rate, to step 3. The old step-4
    is moved to abandoned/ (not deleted) before training: a later `--resume auto` (a pod's, a restart's) continues the
    retrained step 3, not the abandoned step 4, and keep_last prunes only the chosen line."""
    from ot_dist.cli import resume_choice

    out = copy_run(finished_run, tmp_path / "out")
    chosen, old = checkpoints_dir(out) / "step-00000002", checkpoints_dir(out) / "step-00000004"
    old_files = sorted(p.name for p in old.iterdir())
    raw = base_config(tiny_models["sd1"], shapes_data, out,
                      **{**settings(learning_rate=5e-4, **{"checkpoint.keep_last": 2}), "max_steps": 3})
    lines, tags = [], {}

    class Recording(Tracker):  # the MLflow run resumed keeps steps 3-4's points: the run is tagged with the rewind
        def set_tags(self, values):
            tags.update(values)

    monkeypatch.setattr("ot_dist.train.trainer.start_tracking", lambda *a, **k: Recording())
    result = Trainer(validate(raw), log=lines.append, resume=str(chosen)).train()
    assert result.first_step == 2 and result.checkpoint.name == "step-00000003"
    assert tags["ot_dist.rewound"].startswith("to step 2, the later history moved to ") and "MLflow keeps" in tags[
        "ot_dist.rewound"]
    assert [p.name for p in layout.committed_checkpoints(checkpoints_dir(out))] == ["step-00000002", "step-00000003"]
    (moved,) = (out / "abandoned").glob("*-resumed-from-step-2/checkpoints/step-00000004")
    assert layout.is_committed(moved) and sorted(p.name for p in moved.iterdir()) == old_files
    assert any("moved the later history aside (nothing deleted)" in line and "checkpoints/step-00000004" in line
               for line in lines)
    assert latest_checkpoint(checkpoints_dir(out)).name == "step-00000003"
    assert check_before_start(out, "auto", False)[0].name == "step-00000003"
    # a torchrun restart of a group started with --resume step-2 continues the retrained line, not step 2 again
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = type("Args", (), {"resume": str(chosen)})()
    assert resume_choice(args, str(out)) == "auto"
    assert resume_choice(args, str(tmp_path / "empty")) == str(chosen)  # nothing saved since: PATH still holds


def test_a_restarted_group_of_an_overwrite_run_continues_it(tmp_path, monkeypatch):
    """`ot-dist train --overwrite` restarted by torchrun: the first attempt moved the old run aside, the restart
    continues the new one (`auto`) instead of failing on `--overwrite` + `--resume auto`."""
    from ot_dist.cli import overwrite_choice, resume_choice

    args = type("Args", (), {"resume": None, "overwrite": True})()
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert (resume_choice(args, str(tmp_path)), overwrite_choice(args)) == (None, True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resume, overwrite = resume_choice(args, str(tmp_path)), overwrite_choice(args)
    assert (resume, overwrite) == ("auto", False)
    check_before_start(tmp_path, resume, overwrite)  # refused ("give one of them") when the restart kept --overwrite


LOCK_HOLDER = """
import fcntl, sys, time
file = open(sys.argv[1], "a+")
fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises when another process holds it
file.truncate(0)
file.write("pid 4242 on node-7, since 2026-11-26 20:00:00")
file.flush()
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_second_run_in_a_folder_in_use_is_refused_before_loading(finished_run, tiny_models, shapes_data, tmp_path):
    """Two `--resume auto` at once in one output_dir both trained and wrote the same checkpoint folders, until one
    died at a later save on the other's files. The folder's lock (held by the running run's rank 0, released by the
    kernel however that process ends) refuses the second one."""
    out = copy_run(finished_run, tmp_path / "out")
    lock = out / ".ot_dist.lock"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(lock), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        raw = base_config(tiny_models["sd1"], shapes_data, out, **settings())
        with pytest.raises(ConfigError, match=f"output_dir {out.resolve()} is in use by another run \\(pid 4242 on "
                                              "node-7"):
            Trainer(validate(raw), log=quiet, resume="auto")
    finally:
        holder.kill()
        holder.wait()
    Trainer(validate(raw), log=quiet, resume="auto").train()  # the holder is gone: the folder is free again
    released = subprocess.run([sys.executable, "-c", LOCK_HOLDER, str(lock), "0"], capture_output=True, text=True)
    assert released.returncode == 0, released.stderr  # and a finished run holds it no longer


# -- 3. a damaged latest checkpoint is named ------------------------------------------------------------


def test_a_damaged_latest_checkpoint_is_named_and_skipped_only_when_allowed(finished_run, tiny_models,
                                                                             shapes_data, tmp_path):
    out = copy_run(finished_run, tmp_path / "out")
    damaged = checkpoints_dir(out) / "step-00000004"
    shard = damaged / "rank-00000.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    raw = base_config(tiny_models["sd1"], shapes_data, out, **settings())
    with pytest.raises(InputFileError, match=r"latest checkpoint .*step-00000004 is damaged: rank-00000\.safetensors "
                                             r"is \d+ bytes, the COMMITTED marker lists \d+") as refused:
        Trainer(validate(raw), log=quiet, resume="auto")
    assert refused.value.exit_code == 3 and "step-00000002" in str(refused.value)
    assert "checkpoint.resume_past_damaged: true" in str(refused.value)
    lines = []
    allowed = base_config(tiny_models["sd1"], shapes_data, out, **settings(**{"checkpoint.resume_past_damaged": True}))
    trainer = Trainer(validate(allowed), log=lines.append, resume="auto")
    assert trainer.position.step == 2
    assert any(line.startswith("warning: --resume auto: the latest checkpoint") and "step-00000004" in line
               for line in lines)
    # `ot-dist export RUN` names the damaged checkpoint too, and names the step it exports
    with pytest.raises(InputFileError, match="step-00000004 is damaged"):
        export_checkpoint(str(out), ["single-file"], False, str(tmp_path / "x"), log=quiet)
    said = []
    export_checkpoint(str(checkpoints_dir(out) / "step-00000002"), ["single-file"], False, str(tmp_path / "x"),
                      log=said.append)
    assert said[0] == f"exporting step 2 from {(checkpoints_dir(out) / 'step-00000002').resolve()}"


# -- 4. exports of a moved run stay beside it -----------------------------------------------------------


def test_export_of_a_moved_run_writes_beside_the_checkpoint(finished_run, tmp_path):
    moved = copy_run(finished_run, tmp_path / "moved")
    recorded = Path(read_trainer_state(latest_checkpoint(checkpoints_dir(moved)))["config"]["output_dir"])
    assert recorded == finished_run
    before = sorted(p for p in recorded.rglob("*"))
    said = []
    exported = export_checkpoint(str(moved), ["single-file"], False, None, log=said.append)
    assert exported == [moved.resolve() / "exports" / "step-00000004" / "model.safetensors"]
    assert exported[0].is_file() and said[0].startswith("exporting step 4 from ")
    assert sorted(p for p in recorded.rglob("*")) == before  # nothing written into the recorded output_dir


def test_export_to_an_unwritable_out_or_of_no_checkpoint_is_named_before_the_model_loads(finished_run, tmp_path,
                                                                                          monkeypatch):
    import ot_dist.models.loading

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the bad input was found")

    monkeypatch.setattr(ot_dist.models.loading, "load_model", no_loading)
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(InputFileError, match=f"--out {tmp_path / 'taken' / 'x'} cannot be created: "
                                             f"{tmp_path / 'taken'} is not a folder"):
        export_checkpoint(str(finished_run), None, False, str(tmp_path / "taken" / "x"), log=quiet)
    with pytest.raises(InputFileError, match=f"^export {tmp_path}: not a committed checkpoint"):  # no --resume here
        export_checkpoint(str(tmp_path), None, False, None, log=quiet)


# -- 5. a bad output_dir is found before any model loads ------------------------------------------------


def test_an_output_dir_that_is_a_file_stops_before_loading_naming_the_resolved_path(tiny_models, shapes_data,
                                                                                      tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    raw = base_config(tiny_models["sd1"], shapes_data, "taken/run", max_steps=1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    done = run_ranks("-m", "ot_dist", "train", "config.yaml", nproc=1, cwd=tmp_path, timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    assert f"output_dir {tmp_path / 'taken' / 'run'} cannot be created: {tmp_path / 'taken'} is not a folder" \
        in done.stderr
    assert "Traceback" not in done.stderr and "bucket report" not in done.stdout
    with pytest.raises(InputFileError, match=f"output_dir {tmp_path / 'taken'} is not a folder"):
        check_writable(tmp_path / "taken")


# -- 7. .safetensors honour the umask -------------------------------------------------------------------


def test_every_safetensors_written_honours_the_umask(finished_run, tmp_path):
    written = list(finished_run.rglob("*.safetensors"))
    kinds = {p.relative_to(finished_run).parts[0] for p in written}
    assert {"checkpoints", "model", "model.safetensors"} <= kinds
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o644)}  # umask 022, as trained
    previous = os.umask(0o027)
    try:
        copy = shutil.copytree(finished_run / "model", tmp_path / "model")
        for p in copy.rglob("*"):
            if p.is_file():
                p.chmod(0o600)
        share_with_umask(copy)
    finally:
        os.umask(previous)
    assert {oct(p.stat().st_mode & 0o777) for p in copy.rglob("*") if p.is_file()} == {oct(0o640)}


# -- 2. signals to `ot-dist launch` reach the workers ---------------------------------------------------


def workers_of(config: Path, only_ranks: bool = False) -> list[int]:
    """The processes training `config` (the agent and the ranks; `only_ranks`: the ranks), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            rank = b"\0LOCAL_RANK=" in b"\0" + (entry / "environ").read_bytes()
        except OSError:
            continue
        if str(config).encode() in cmdline and b" train " in cmdline and state != "Z" and (rank or not only_ranks):
            found.append(int(entry.name))
    return found


def wait_for_checkpoint(root: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if root.is_dir() and latest_checkpoint(root) is not None:
            return
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def stop_and_check(process: subprocess.Popen, sig: int, out: Path, config_marker: Path) -> str:
    wait_for_checkpoint(checkpoints_dir(out), process)
    assert len(workers_of(config_marker, only_ranks=True)) == 2
    process.send_signal(sig)
    output = process.communicate(timeout=300)[0]
    name = signal.Signals(sig).name
    assert process.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-4000:]
    assert output.count(f"ot-dist launch: stopped by {name}") == 1, output[-4000:]
    assert workers_of(config_marker) == []  # no worker left behind
    state = read_trainer_state(latest_checkpoint(checkpoints_dir(out)))
    assert state["reason"] == f"stop requested by {name}" and state["step"] < 200
    return output


def test_sigint_to_a_zero_launch_saves_and_exits_0_in_one_line_and_builds_no_shm_op(small_sd1, shapes_data, tmp_path):
    """`ot-dist launch --strategy zero2` (accelerate's DeepSpeed path), SIGINT as from Ctrl-C. The same launch starts in
    an empty torch extensions folder, as a pod's emptyDir HOME gives: DeepSpeed compiled its deepspeed_shm_comm op
    (~1 min) there on every zero launch; ZeRO training never calls it, so it is not built (parallel/deepspeed.py
    skip_shared_memory_op_build). One launch for both: each costs ~20 CPU s of interpreter starts and imports."""
    out = tmp_path / "out"
    raw = base_config(small_sd1, shapes_data, out, method="lora", batch_size=1, epochs=50, max_steps=200,
                      **{"lora.rank": 4, "checkpoint.every_n_steps": 2})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    extensions = tmp_path / "torch_extensions"  # empty, like a new pod's
    process = subprocess.Popen([sys.executable, "-m", "ot_dist", "launch", str(config), "--nproc-per-node", "2",
                                "--strategy", "zero2"], env={**ENV, "TORCH_EXTENSIONS_DIR": str(extensions)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = stop_and_check(process, signal.SIGINT, out, config)
    finally:
        process.kill()
    assert output.count("stopped by SIGINT after step") == 1  # the trainer's line, once (not also the CLI's)
    assert "strategy zero2" in output
    assert not list(extensions.rglob("*shm_comm*")) and "shm_comm built" not in output


def test_sigterm_to_a_rendered_kubernetes_pod_command_saves_and_exits_0(small_sd1, shapes_data, tmp_path):
    """The pod command of `ot-dist k8s configs/demo.yaml --nodes 1 --gpus-per-node 2` (ot-dist launch, 2 fsdp
    workers, --resume auto), started as the kubelet would, gets SIGTERM as on preemption."""
    from test_k8s import pod_process, render

    rendered = render(REPO / "configs" / "demo.yaml", tmp_path / "manifests", 1, 2, "indexed-job",
                      "--set", "max_steps=200", "--set", "epochs=100", "--set", "checkpoint.every_n_steps=2")
    workspace = tmp_path / "workspace"
    # the demo's model path holds small_sd1: what a pod's command does with a signal does not depend on the UNet
    shutil.copytree(small_sd1, workspace / "demo_out" / "tiny-sd1")
    shutil.copytree(shapes_data, workspace / "demo_out" / "shapes")
    config_dir = tmp_path / "configmap"
    config_dir.mkdir()
    for file, text in rendered["configmap.yaml"]["data"].items():
        config_dir.joinpath(file).write_text(text)
    volumes = {"/workspace": workspace, "/etc/ot-dist": config_dir}
    for mount in ("/tmp", "/home/ot-dist"):
        volumes[mount] = tmp_path / mount.replace("/", "-")
        volumes[mount].mkdir()
    from ot_dist.ports import free_port

    command, env, cwd = pod_process(rendered, 0, volumes, f"127.0.0.1:{free_port()}")
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stop_and_check(process, signal.SIGTERM, workspace / "demo_out" / "run", config_dir / "train.yaml")
    finally:
        process.kill()


# -- 9 / 11: small ones ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node: must be at least 1, got 0"),
    (["--nproc-per-node", "-1"], "--nproc-per-node: must be at least 1, got -1"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank: must be in 0 .. 1"),
])
def test_impossible_process_counts_are_refused_by_name(flags, message, tiny_models, shapes_data, tmp_path, capsys):
    from ot_dist.cli import main

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", strategy="ddp")))
    assert main(["launch", str(config), *flags, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_schedule_into_a_closed_pipe_writes_the_plot_without_a_traceback(tiny_models, shapes_data, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(base_config(tiny_models["sd1"], shapes_data, tmp_path / "out")))
    process = subprocess.Popen([sys.executable, "-m", "ot_dist", "schedule", str(config), "--steps", "20000",
                                "--plot", str(tmp_path / "lr.png")], env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.readline()  # `| head -1`
    process.stdout.close()
    stderr = process.communicate(timeout=300)[1].decode()
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr[-3000:]
    assert process.returncode in (0, 141) and (tmp_path / "lr.png").stat().st_size > 0
