"""Checkpoints and resume with real processes: stop anywhere (a SIGTERM, as on preemption), continue
exactly; continue on another number of processes; export from a checkpoint.

Every run is tests/helpers/resume_run.py: 16 samples, global batch 8 (2 steps per epoch), 3 epochs, 6
steps, AdamW, EMA, a checkpoint every 2 steps. A stopped run is SIGTERMed by rank 0 after step 2: the
ranks agree to finish step 3 (the middle of epoch 1), save, and exit 0; the resumed run finishes epoch 1
and runs epoch 2. (Few large steps: a step's fixed cost, ZeRO-3's hooks above all, is paid half as often.)

The SD 1.x runs of the strategies are on conftest.py's small_sd1 (a 2-level UNet with every sharding unit kind; ZeRO's
on one_level_sd1, a 1-level UNet: no units, a cost per parameter):
what they compare (losses, every saved tensor, the samples seen) does not depend on the depth, and what a 2-rank
launch pays per module (FSDP units, ZeRO-3's hooks and gathers, the checkpoint's tensors) does."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.checkpoint.export_command import export_checkpoint
from ot_dist.checkpoint.layout import MARKER, checkpoints_dir, latest_checkpoint
from ot_dist.checkpoint.shards import SavedShards, gather_full_from_files
from ot_dist.checkpoint.training_state import read_trainer_state

REPO = Path(__file__).resolve().parents[1]
STEPS, STOP_AFTER = 6, 2  # the signal lands after step 2; step 3 (lagged step guard: 4) is finished and saved
GLOBAL_BATCH = 8  # 2 steps an epoch: step 3 is mid-epoch 1, step 4 its end; the resumed run crosses into epoch 2


def stopped_at(stopped: dict) -> int:
    """The step a run signalled after STOP_AFTER finished and saved: the next one, or with the lagged step guard
    (checkpoint.step_guard, e.g. fsdp's fused AdamW, Prodigy) the one after (the stop flag is read a step later)."""
    return STOP_AFTER + 1 + stopped["lag"]


def run_config(model: Path, shapes_data, out: Path, strategy: str, processes: int, family: str = "sd1",
               **overrides) -> tuple[Path, Path]:
    """The run's config file (written) and result file."""
    raw = base_config(
        model, shapes_data, out, family=family, batch_size=GLOBAL_BATCH // processes, epochs=3, max_steps=STEPS,
        strategy=strategy,
        **{"optimizer.name": "ADAMW", "ema.enabled": True, "ema.decay": 0.9, "ema.update_step_interval": 1,
           "checkpoint.every_n_steps": 2}, **overrides,
    )
    config, result = out.with_suffix(".json"), out.with_suffix(".result.json")
    config.write_text(json.dumps(raw))
    return config, result


def launch(processes: int, *args: str) -> None:
    """One launch of tests/helpers/resume_run.py (`processes` ranks, or one process)."""
    done = run_ranks(REPO / "tests" / "helpers" / "resume_run.py", *args, nproc=processes, timeout=600)
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]


def run(model: Path, shapes_data, out: Path, strategy: str, processes: int, *args: str, family: str = "sd1",
        **overrides) -> dict:
    config, result = run_config(model, shapes_data, out, strategy, processes, family=family, **overrides)
    launch(processes, str(config), str(result), *args)
    return json.loads(result.read_text())


def final_state(out: Path) -> dict[str, torch.Tensor]:
    """Weights, EMA and Adam moments of the newest checkpoint, as full tensors."""
    folder = latest_checkpoint(checkpoints_dir(out))
    shapes = read_trainer_state(folder)["shapes"]
    saved = SavedShards(folder)
    state = {}
    for kind, key in (("w", ""), ("ema", ""), ("opt", "exp_avg"), ("opt", "exp_avg_sq")):
        for name, value in gather_full_from_files(saved, shapes, kind, key).items():
            state[f"{kind}/{key}/{name}"] = value
    return state


_runs: dict[str, tuple[Path, dict, Path, dict]] = {}


def straight_and_stopped(strategy, model: Path, shapes_data, tmp_path_factory) -> tuple[Path, dict, Path, dict]:
    """A strategy's uninterrupted run and the run SIGTERMed after step STOP_AFTER (2 processes; single: 1), both in
    one launch (one process start-up), shared by the tests: (straight out, result, stopped out, result)."""
    if strategy not in _runs:
        root = tmp_path_factory.mktemp(f"runs-{strategy}")
        processes = 1 if strategy == "single" else 2
        straight_config, straight_result = run_config(model, shapes_data, root / "straight", strategy, processes)
        stopped_config, stopped_result = run_config(model, shapes_data, root / "stopped", strategy, processes)
        launch(processes, str(straight_config), str(straight_result), "--then", str(stopped_config),
               str(stopped_result), "--signal-after-step", str(STOP_AFTER))
        _runs[strategy] = (root / "straight", json.loads(straight_result.read_text()),
                           root / "stopped", json.loads(stopped_result.read_text()))
    return _runs[strategy]


def straight_run(strategy, model: Path, shapes_data, tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run of a strategy."""
    straight_out, straight, _, _ = straight_and_stopped(strategy, model, shapes_data, tmp_path_factory)
    return straight_out, straight


def stopped_run(strategy, model: Path, shapes_data, tmp_path_factory, out: Path) -> dict:
    """The run SIGTERMed after step STOP_AFTER, copied to `out` (its output_dir) to be resumed there."""
    _, _, first, result = straight_and_stopped(strategy, model, shapes_data, tmp_path_factory)
    shutil.copytree(first, out)
    return result


# ZeRO's runs (flat partitions, no sharding units, each parameter hooked, gathered and saved: a cost per parameter) on
# the 1-level UNet (conftest.py one_level_sd1): what they compare, bit for bit, does not depend on the depth. single's
# and fsdp's (shared with the tests below; FSDP saves and resumes units of every kind) stay on small_sd1.
ONE_LEVEL = ("zero2", "zero3")


@pytest.mark.parametrize("strategy", ["single", "fsdp", "zero2", "zero3"])
def test_stop_and_resume_continues_exactly(strategy, small_sd1, one_level_sd1, shapes_data, tmp_path, tmp_path_factory):
    model = one_level_sd1 if strategy in ONE_LEVEL else small_sd1
    straight_out, straight = straight_run(strategy, model, shapes_data, tmp_path_factory)
    processes = 1 if strategy == "single" else 2
    out = tmp_path / "out"
    stopped = stopped_run(strategy, model, shapes_data, tmp_path_factory, out)
    # SIGTERM: the step under way is finished, saved and the process exits 0 (run() checks the exit code)
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == stopped_at(stopped)
    assert latest_checkpoint(checkpoints_dir(out)).name == f"step-{stopped_at(stopped):08d}"
    resumed = run(model, shapes_data, out, strategy, processes, "--resume", "auto")
    assert resumed["first_step"] == stopped_at(stopped) and resumed["steps"] == STEPS  # no step repeated or left out
    assert resumed["losses"] == straight["losses"][stopped_at(stopped):]  # bit for bit
    want, got = final_state(straight_out), final_state(out)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)  # bit for bit, as the losses
    # each epoch's samples, split between the two runs, were all seen exactly once
    for epoch in ("0", "1", "2"):
        ids = stopped["seen"].get(epoch, []) + resumed["seen"].get(epoch, [])
        assert sorted(ids) == list(range(16)), epoch


def test_flux_under_fsdp_stops_and_resumes_exactly(family_models, shapes_data, tmp_path):
    """A Flux transformer sharded block by block: SIGTERM after step STOP_AFTER, resume, and the rest of the run is the
    uninterrupted run's, losses and final state (weights, EMA, Adam moments) bit for bit."""
    straight_out, stopped_out = tmp_path / "straight", tmp_path / "stopped"
    straight_config, straight_result = run_config(family_models["flux"], shapes_data, straight_out, "fsdp", 2, family="flux")
    stopped_config, stopped_result = run_config(family_models["flux"], shapes_data, stopped_out, "fsdp", 2, family="flux")
    launch(2, str(straight_config), str(straight_result), "--then", str(stopped_config), str(stopped_result),
           "--signal-after-step", str(STOP_AFTER))
    straight, stopped = json.loads(straight_result.read_text()), json.loads(stopped_result.read_text())
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == stopped_at(stopped)
    resumed = run(family_models["flux"], shapes_data, stopped_out, "fsdp", 2, "--resume", "auto", family="flux")
    assert resumed["first_step"] == stopped_at(stopped) and resumed["losses"] == straight["losses"][stopped_at(stopped):]
    want, got = final_state(straight_out), final_state(stopped_out)
    assert want.keys() == got.keys() and any(k.startswith("w//transformer.single_transformer_blocks") for k in want)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_stable_cascade_under_fsdp_stops_and_resumes_exactly(family_models, shapes_data, tmp_path):
    """Stable Cascade's prior, full finetune, sharded block by block: one launch runs the uninterrupted run and the
    one SIGTERMed after step STOP_AFTER, a second launch resumes the stopped one; the rest of the run is the uninterrupted
    run's, losses and final state (weights, EMA, Adam moments) bit for bit."""
    straight_out, stopped_out = tmp_path / "straight", tmp_path / "stopped"
    settings = {"family": "stable_cascade", "resolution": 128}
    straight_config, straight_result = run_config(family_models["stable_cascade"], shapes_data, straight_out, "fsdp", 2, **settings)
    stopped_config, stopped_result = run_config(family_models["stable_cascade"], shapes_data, stopped_out, "fsdp", 2, **settings)
    launch(2, str(straight_config), str(straight_result), "--then", str(stopped_config), str(stopped_result),
           "--signal-after-step", str(STOP_AFTER))
    straight, stopped = json.loads(straight_result.read_text()), json.loads(stopped_result.read_text())
    assert straight["steps"] == STEPS and straight["stopped_by"] != "SIGTERM"
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == stopped_at(stopped)
    assert stopped["losses"] == straight["losses"][:stopped_at(stopped)]
    launch(2, str(stopped_config), str(stopped_result), "--resume", "auto")
    resumed = json.loads(stopped_result.read_text())
    assert resumed["first_step"] == stopped_at(stopped) and resumed["losses"] == straight["losses"][stopped_at(stopped):]
    want, got = final_state(straight_out), final_state(stopped_out)
    assert want.keys() == got.keys() and any(k.startswith("w//prior.down_blocks") for k in want)
    assert any(k.startswith("opt/exp_avg/prior.") for k in want) and any(k.startswith("ema//prior.") for k in want)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("before, after", [(("fsdp", 2), ("single", 1)), (("single", 1), ("fsdp", 2))])
def test_resume_on_another_number_of_processes(before, after, small_sd1, shapes_data, tmp_path, tmp_path_factory):
    """The same global batch (8) on 2 processes x 4 or 1 x 8: the state is resharded, the data position kept."""
    _, straight = straight_run(before[0], small_sd1, shapes_data, tmp_path_factory)
    out = tmp_path / "out"
    stopped = stopped_run(before[0], small_sd1, shapes_data, tmp_path_factory, out)
    resumed = run(small_sd1, shapes_data, out, *after, "--resume", "auto")
    assert (stopped["steps"], resumed["first_step"], resumed["steps"]) == (stopped_at(stopped), stopped_at(stopped), STEPS)
    for epoch in ("0", "1", "2"):
        ids = stopped["seen"].get(epoch, []) + resumed["seen"].get(epoch, [])
        assert sorted(ids) == list(range(16)), epoch
    # Resharded weights, moments and EMA continue the run: the losses follow the uninterrupted run's up to the
    # float noise of another layout (a lost or misplaced moment would change them at the 1e-2 level).
    differences = [abs(a - b) for a, b in zip(resumed["losses"], straight["losses"][stopped_at(stopped):], strict=True)]
    assert max(differences) <= 1e-4, differences
    # ... and so do the final weights, EMA and Adam moments, element by element.
    straight_out, _ = straight_run(before[0], small_sd1, shapes_data, tmp_path_factory)
    want, got = final_state(straight_out), final_state(out)
    assert want.keys() == got.keys() and {k.split("/")[0] for k in want} == {"w", "ema", "opt"}
    for kind in {k.rsplit("/", 1)[0] for k in want}:  # w/, ema/, opt/exp_avg, opt/exp_avg_sq
        keys = [k for k in want if k.rsplit("/", 1)[0] == kind]
        scale = max(want[k].abs().max().item() for k in keys)
        diff = max((want[k] - got[k]).abs().max().item() for k in keys)
        assert diff <= 1e-4 * scale, f"{kind}: {diff:.3g} against values up to {scale:.3g}"


def test_export_from_a_checkpoint_writes_what_training_wrote(small_sd1, shapes_data, tmp_path_factory, tmp_path):
    straight_out, _ = straight_run("fsdp", small_sd1, shapes_data, tmp_path_factory)
    folder = latest_checkpoint(checkpoints_dir(straight_out))  # saved at the end, by 2 fsdp ranks
    # the command as `python -m ot_dist export` runs it, forked from the preloaded server (a fresh interpreter would
    # add seconds of imports and prove nothing about the export)
    done = run_ranks("-m", "ot_dist", "export", folder, "--out", tmp_path, nproc=1, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    export_checkpoint(str(folder), None, True, str(tmp_path), log=lambda *_: None)  # --ema, in this process
    for suffix in ("", "_ema"):
        for file in (f"model{suffix}/unet/diffusion_pytorch_model.safetensors", f"model{suffix}.safetensors"):
            want, got = load_file(straight_out / file), load_file(tmp_path / file)
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), file
    bad = run_ranks("-m", "ot_dist", "export", folder, "--format", "lora", nproc=1, timeout=300)
    assert bad.returncode == 2 and "--format lora" in bad.stderr and "diffusers, single-file" in bad.stderr
    assert (folder / MARKER).exists()


def train_in_process(raw: dict, stop_after: int | None = None, resume: str | None = None):
    """One run in this process; `stop_after`: SIGTERM to itself once that optimizer step is done (a preemption)."""
    import signal

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    trainer = Trainer(validate(raw), log=lambda *_: None, resume=resume)
    if stop_after is not None:
        done = [trainer.position.step]

        def after_step(*_):
            done[0] += 1
            if done[0] == stop_after:
                os.kill(os.getpid(), signal.SIGTERM)

        trainer.optimizer.register_step_post_hook(after_step)
    return trainer.train()


def assert_resumes_as_straight(raw, tmp_path, files: tuple[str, ...], stop_after: int = 2) -> None:
    """A run stopped by SIGTERM after optimizer step `stop_after` and resumed gives the uninterrupted run's losses
    from there and its `files`, bit for bit."""
    straight = train_in_process(raw(tmp_path / "straight"))
    stopped = train_in_process(raw(tmp_path / "stopped"), stop_after=stop_after)
    assert stopped.stopped_by == "SIGTERM" and stopped.steps == stop_after + 1  # the step after the signal ends it
    resumed = train_in_process(raw(tmp_path / "stopped"), resume="auto")
    assert resumed.first_step == stop_after + 1 and resumed.losses == straight.losses[stop_after + 1:]
    for path in files:
        want, got = load_file(tmp_path / "straight" / path), load_file(tmp_path / "stopped" / path)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), path


@pytest.mark.parametrize("optimizer", ["PRODIGY", "ADAMW_8BIT", "ADAFACTOR", "CAME_8BIT"])
def test_every_kind_of_optimizer_state_resumes_exactly(optimizer, tiny_models, shapes_data, tmp_path):
    """Prodigy's d and slice_p statistics, bitsandbytes' 8-bit blocks, Adafactor's factored rows and CAME_8BIT's
    8-bit first moments with factored rows go through a checkpoint: stopped after step 3 and resumed, the run's
    losses are the uninterrupted run's, bit for bit."""
    def raw(out):
        return base_config(tiny_models["sd1"], shapes_data, out, method="lora", batch_size=2, max_steps=6,
                           **{"optimizer.name": optimizer, "learning_rate": 1.0 if optimizer == "PRODIGY" else 1e-3,
                              "lora.rank": 4, **({"scheduler.name": "ADAFACTOR", "optimizer.relative_step": True, "optimizer.scale_parameter": True}
                                 if optimizer == "ADAFACTOR" else {}),
                              # the tiny LoRA's matrices are small: quantise them (8-bit blocks of 64)
                              **({"optimizer.min_8bit_size": 64, "optimizer.quant_block_size": 64}
                                 if optimizer == "CAME_8BIT" else {})})
    straight = train_in_process(raw(tmp_path / "straight"))
    stopped = train_in_process(raw(tmp_path / "stopped"), stop_after=3)
    lag = 1 if optimizer == "PRODIGY" else 0  # Prodigy skips a non-finite step on the device: the lagged step guard
    assert stopped.stopped_by == "SIGTERM" and stopped.steps == 4 + lag
    resumed = train_in_process(raw(tmp_path / "stopped"), resume="auto")
    assert resumed.first_step == 4 + lag and resumed.losses == straight.losses[4 + lag:]
    if optimizer == "CAME_8BIT":  # the 8-bit moments were saved, as layout-bound state with their block scales
        meta = json.loads(next(latest_checkpoint(checkpoints_dir(tmp_path / "stopped")).rglob("rank-00000.json")).read_text())
        kinds = [e for owned in meta["owned"] for e in owned["state"].items()]
        assert ("exp_avg_8bit", {"kind": "opaque", "dtensor": False, "on_param_device": True}) in kinds
        assert {kind["kind"] for key, kind in kinds if key == "exp_avg_absmax"} == {"opaque"}


def test_layout_bound_state_is_refused_at_another_layout_naming_the_entry(tiny_models, shapes_data, tmp_path):
    """8-bit moments come in blocks with per-block scales: they cannot be cut into another rank layout. Resuming a
    one-process 8-bit checkpoint on 2 zero2 ranks stops before training and names the entry."""
    # a full finetune: the UNet's tensors are past min_8bit_size (a tiny LoRA's would keep 32-bit state)
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", batch_size=4, max_steps=6,
                      **{"optimizer.name": "ADAMW_8BIT", "learning_rate": 1e-4})
    train_in_process(raw, stop_after=2)
    two = {**raw, "batch_size": 2, "strategy": "zero2"}
    config, result = tmp_path / "two.json", tmp_path / "two.result.json"
    config.write_text(json.dumps(two))
    done = run_ranks(REPO / "tests" / "helpers" / "resume_run.py", config, result, "--resume", "auto", timeout=600)
    assert done.returncode != 0 and not result.exists()
    assert "state1" in done.stderr or "state2" in done.stderr or "qmap" in done.stderr, done.stderr[-3000:]
