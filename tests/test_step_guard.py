"""The step guard without a host sync per step (issue 21; ot_dist/train/stopping.py, device_skip.py).

The lagged guard keeps a non-finite loss off the weights on the device (the optimizer's `found_inf`) and reads
stop / save / non-finite flags one step later; the blocking guard (the fallback) reads them before each step.
Single process here; 2 gloo ranks under ddp and fsdp in the second half, and under zero1/2/3 at the end
(tests/helpers/guard_ranks.py; ot_dist/parallel/zero_skip.py). On conftest's small_sd1, the 2-rank launches on its
one_level_sd1: what is asserted (host syncs, skipped steps, bit-identical weights, agreed stops and saves) does not
depend on the UNet's depth."""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks

from ot_dist.checkpoint.layout import checkpoints_dir, latest_checkpoint
from ot_dist.checkpoint.shards import SavedShards, gather_full_from_files
from ot_dist.checkpoint.training_state import read_trainer_state
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError, TrainingHalted
from ot_dist.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from host_syncs import count_trainer_syncs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
FUSED = {"optimizer.name": "ADAMW", "optimizer.fused": True}  # torch's fused AdamW runs on the CPU too


def quiet(*_args, **_kwargs):
    pass


def poison(trainer: Trainer, optimizer_step: int, accumulation: int = 1) -> None:
    """The loss of `optimizer_step` (1-based) is NaN (every micro step of it)."""
    calls, original = [0], trainer.loss

    def loss(batch, epoch):
        calls[0] += 1
        value = original(batch, epoch)
        return value * float("nan") if (calls[0] - 1) // accumulation + 1 == optimizer_step else value

    trainer.loss = loss


def weights_after_every_step(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    seen: list[dict[str, torch.Tensor]] = []
    trainer.optimizer.register_step_post_hook(lambda *_: seen.append(
        {n: p.detach().clone() for n, p in trainer.strategy.trained_parameters().items()}))
    return seen


def test_the_lagged_guard_adds_no_host_sync_and_the_fallback_one(small_sd1, shapes_data, tmp_path):
    """Fused AdamW: no host sync in 4 optimizer steps (EMA, clipping, accumulation 2 on); foreach AdamW, which cannot
    skip on the device, falls back to the blocking guard: exactly one per step."""
    counts = {}
    for name, options in {"lagged": FUSED, "blocking": {"optimizer.name": "ADAMW"}}.items():
        raw = base_config(small_sd1, shapes_data, tmp_path / name, batch_size=1, gradient_accumulation_steps=2,
                          max_steps=4, log_every_steps=2, clip_grad_norm=1.0,
                          **{"ema.enabled": True, "checkpoint.at_end": False, **options})
        lines = []
        trainer = Trainer(validate(raw), log=lines.append)
        try:
            counter, result = count_trainer_syncs(trainer)
        finally:
            trainer.close()
        assert result.steps == 4 and len(result.losses) == 4
        counts[name] = [f"{s.kind} at {s.where}" for s in counter.in_phase("step")]
        assert any(line.startswith(f"step guard: {name}") for line in lines), lines
    assert counts["lagged"] == [], counts["lagged"]
    assert len(counts["blocking"]) == 4 and all("stopping.py" in s for s in counts["blocking"]), counts["blocking"]


PRODIGY = {"optimizer.name": "PRODIGY", "learning_rate": 1.0}


@pytest.mark.parametrize("optimizer", [FUSED, PRODIGY], ids=["adamw", "prodigy"])
def test_without_nan_the_lagged_guard_trains_bit_identically(optimizer, small_sd1, shapes_data, tmp_path):
    finals, losses = {}, {}
    for mode in ("lagged", "blocking"):
        raw = base_config(small_sd1, shapes_data, tmp_path / mode, batch_size=2, max_steps=3,
                          **{**optimizer, "ema.enabled": True, "checkpoint.at_end": False, "checkpoint.step_guard": mode})
        trainer = Trainer(validate(raw), log=quiet)
        assert trainer.lagged_guard == (mode == "lagged")
        losses[mode] = trainer.train().losses
        finals[mode] = {n: p.detach().clone() for n, p in trainer.strategy.trained_parameters().items()}
        finals[mode].update({f"ema.{n}": v for n, v in trainer.ema.full_weights().items()})
        trainer.close()
    assert losses["lagged"] == losses["blocking"]
    assert all(torch.equal(finals["lagged"][n], v) for n, v in finals["blocking"].items())


@pytest.mark.parametrize("optimizer", [FUSED, {"optimizer.name": "SGD", "optimizer.fused": True, "optimizer.momentum": 0.9},
                                       PRODIGY],
                         ids=["adamw", "sgd", "prodigy"])
def test_a_nan_step_is_skipped_on_the_device_and_counted(optimizer, small_sd1, shapes_data, tmp_path):
    """skip_step: step 2's NaN never reaches a weight or a moment; the step counts (4 steps done), one skipped."""
    raw = base_config(small_sd1, shapes_data, tmp_path / "out", batch_size=1, max_steps=4,
                      **{**optimizer, "checkpoint.at_end": False, "checkpoint.on_nonfinite_loss": "skip_step",
                         "checkpoint.step_guard": "lagged", "ema.enabled": True})
    lines = []
    trainer = Trainer(validate(raw), log=lines.append)
    poison(trainer, 2)
    seen = weights_after_every_step(trainer)
    moments = []
    trainer.optimizer.register_step_post_hook(lambda opt, *_: moments.append(
        [v.clone() for state in opt.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq", "momentum_buffer", "s")]
        + [torch.as_tensor(g[k]).clone() for g in opt.param_groups for k in ("d", "d_numerator", "k") if k in g]))
    result = trainer.train()
    assert result.steps == 4 and result.skipped_steps == 1 and len(seen) == 4
    assert all(torch.isfinite(v).all() for weights in seen for v in weights.values())
    assert all(torch.equal(seen[1][n], v) for n, v in seen[0].items())  # step 2 changed nothing
    assert not all(torch.equal(seen[2][n], v) for n, v in seen[1].items())  # step 3 did
    assert moments[1] and all(torch.equal(a, b) for a, b in zip(moments[1], moments[0]))  # and Prodigy's estimate
    assert all(torch.isfinite(v).all() for v in trainer.ema.full_weights().values())
    assert sum("non-finite loss at step 2" in line for line in lines) == 1
    if optimizer["optimizer.name"] == "ADAMW":  # torch took the skipped step's count back
        assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {3.0}
    trainer.close()


def test_stop_mode_saves_the_weights_from_before_the_nan_step(small_sd1, shapes_data, tmp_path):
    raw = base_config(small_sd1, shapes_data, tmp_path / "out", batch_size=1, max_steps=6,
                      **{**FUSED, "checkpoint.step_guard": "lagged"})
    trainer = Trainer(validate(raw), log=quiet)
    poison(trainer, 3)
    seen = weights_after_every_step(trainer)
    with pytest.raises(TrainingHalted, match="step 3 is NaN") as halted:
        trainer.train()
    assert halted.value.exit_code == 4
    # step 3 ran its optimizer with the NaN flag set (changing nothing); step 4's check read that flag and halted
    # before step 4's update
    assert len(seen) == 3 and all(torch.equal(seen[2][n], v) for n, v in seen[1].items())
    folder = latest_checkpoint(checkpoints_dir(tmp_path / "out"))
    state = read_trainer_state(folder)
    assert state["step"] == 3 and state["reason"] == "non-finite loss"
    saved = gather_full_from_files(SavedShards(folder), state["shapes"])
    assert all(torch.equal(saved[n], seen[1][n]) for n in saved)  # the weights after step 2
    trainer.close()


@pytest.mark.parametrize("mode", ["stop", "skip_step"])
def test_a_nan_in_the_last_step_is_settled_before_the_end(mode, small_sd1, shapes_data, tmp_path):
    """No check follows the last step: its flags are read after the loop, before the end's checkpoint and export."""
    raw = base_config(small_sd1, shapes_data, tmp_path / "out", batch_size=1, max_steps=3,
                      **{**FUSED, "checkpoint.step_guard": "lagged", "checkpoint.on_nonfinite_loss": mode})
    trainer = Trainer(validate(raw), log=quiet)
    poison(trainer, 3)
    seen = weights_after_every_step(trainer)
    if mode == "stop":
        with pytest.raises(TrainingHalted, match="step 3 is NaN"):
            trainer.train()
        state = read_trainer_state(latest_checkpoint(checkpoints_dir(tmp_path / "out")))
        assert state["step"] == 3 and state["reason"] == "non-finite loss"
    else:
        result = trainer.train()
        assert result.steps == 3 and result.skipped_steps == 1 and result.exported
    assert all(torch.equal(seen[2][n], v) for n, v in seen[1].items())
    trainer.close()


@pytest.mark.parametrize("mode", ["lagged", "blocking"])
def test_the_time_based_save_comes_one_step_later_when_lagged(mode, small_sd1, shapes_data, tmp_path):
    """every_n_minutes that is always due: the blocking guard saves after every step; the lagged one reads step 1's
    flag at step 2's check and saves step 2, and drops step 2's flag (made before that save landed), so a due never
    gives two saves in a row: steps 2 and 4."""
    raw = base_config(small_sd1, shapes_data, tmp_path / "out", batch_size=1, max_steps=4,
                      **{**FUSED, "checkpoint.step_guard": mode, "checkpoint.every_n_minutes": 1e-9,
                         "checkpoint.at_end": False, "checkpoint.keep_last": None})
    trainer = Trainer(validate(raw), log=quiet)
    trainer.train()
    trainer.close()
    saved = sorted(int(f.name.split("-")[1]) for f in checkpoints_dir(tmp_path / "out").glob("step-*"))
    assert saved == ([2, 4] if mode == "lagged" else [1, 2, 3, 4])


def test_lagged_is_refused_where_nothing_can_skip_on_the_device(small_sd1, shapes_data, tmp_path):
    def config(**options):
        return base_config(small_sd1, shapes_data, tmp_path / "out", **{"checkpoint.step_guard": "lagged",
                                                                                 **options})

    with pytest.raises(ConfigError, match="checkpoint.step_guard: lagged .*optimizer.name: LION"):
        validate(config(**{"optimizer.name": "LION"}))
    with pytest.raises(ConfigError, match="checkpoint.step_guard: lagged .*strategy zero2, deepspeed.offload_optimizer: "
                       "DeepSpeed sums the gradient norm on the host"):
        validate(config(strategy="zero2", **FUSED, **{"deepspeed.offload_optimizer": True}))
    with pytest.raises(ConfigError, match="checkpoint.step_guard: lagged .*train_dtype float16"):
        validate(config(strategy="zero3", train_dtype="float16", **FUSED))
    with pytest.raises(ConfigError, match="skip_step with strategy zero2 needs checkpoint.step_guard: lagged"):
        validate(config(strategy="zero2", **{**FUSED, "checkpoint.step_guard": "auto",
                                             "checkpoint.on_nonfinite_loss": "skip_step"}))
    with pytest.raises(ConfigError, match="checkpoint.step_guard: lagged .*optimizer.fused: false"):
        validate(config(**{"optimizer.name": "ADAMW", "optimizer.fused": False}))
    # only the built optimizer tells: foreach AdamW on the CPU (fused unset)
    with pytest.raises(ConfigError, match="checkpoint.step_guard: lagged .*foreach"):
        Trainer(validate(config(**{"optimizer.name": "ADAMW"})), log=quiet)


# -- 2 gloo ranks ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(one_level_sd1, shapes_data, tmp_path_factory):
    """One 2-rank launch of every case (tests/helpers/guard_ranks.py); {case: [rank 0 report, rank 1 report]}. On
    one_level_sd1: what is asserted (syncs, skipped steps, agreed stops and saves) does not depend on the UNet's
    depth, and the fsdp cases' cost grows with its parameter count."""
    root = tmp_path_factory.mktemp("guard")

    def config(name, strategy, **options):
        return base_config(one_level_sd1, shapes_data, root / name, strategy=strategy, batch_size=1,
                           **{"checkpoint.at_end": False, **options})

    cases = {
        "ddp_syncs": {"kind": "syncs", "config": config("ddp_syncs", "ddp", max_steps=3, clip_grad_norm=1.0,
                                                        **{**FUSED, "ema.enabled": True})},
        # fsdp: torch's fused AdamW is chosen for the DTensor shards by itself (auto)
        "fsdp_syncs": {"kind": "syncs", "config": config("fsdp_syncs", "fsdp", max_steps=3, clip_grad_norm=1.0,
                                                         **{"optimizer.name": "ADAMW", "ema.enabled": True})},
        # the fused back pass (steps inside backward, before the loss is checked: the guard's fallback read), each
        # gradient averaged inside backward (parallel/fused_reduce.py), which must add no read of its own
        "ddp_fused_syncs": {"kind": "syncs", "config": config("ddp_fused_syncs", "ddp", max_steps=3, clip_grad_norm=None,
                                                              **{"optimizer.name": "ADAMW",
                                                                 "optimizer.fused_back_pass": True})},
        # foreach AdamW: the blocking fallback
        "ddp_blocking_syncs": {"kind": "syncs", "config": config("ddp_blocking_syncs", "ddp", max_steps=3,
                                                                 **{"optimizer.name": "ADAMW"})},
        "ddp_nan": {"kind": "nan", "rank": 1, "at": 2,
                    "config": config("ddp_nan", "ddp", max_steps=4,
                                     **{**FUSED, "checkpoint.on_nonfinite_loss": "skip_step"})},
        "fsdp_nan": {"kind": "nan", "rank": 1, "at": 2,
                     "config": config("fsdp_nan", "fsdp", max_steps=4,
                                      **{"optimizer.name": "ADAMW", "checkpoint.on_nonfinite_loss": "skip_step"})},
        "fsdp_prodigy_nan": {"kind": "nan", "rank": 1, "at": 2,
                             "config": config("fsdp_prodigy_nan", "fsdp", max_steps=4,
                                              **{**PRODIGY, "checkpoint.on_nonfinite_loss": "skip_step"})},
        "ddp_halt": {"kind": "nan", "rank": 1, "at": 3, "config": config("ddp_halt", "ddp", max_steps=6, **FUSED)},
        "ddp_signal": {"kind": "signal", "rank": 1, "at": 2, "config": config("ddp_signal", "ddp", max_steps=8,
                                                                              **FUSED)},
        # rank 0's clock: a save is always due there, never on rank 1
        "ddp_time": {"kind": "signal", "config": config("ddp_time", "ddp", max_steps=4, **{
            **FUSED, "checkpoint.every_n_minutes": 1e-9, "checkpoint.keep_last": None})},
    }
    (root / "cases.json").write_text(json.dumps(cases))
    done = run_ranks(str(REPO / "tests" / "helpers" / "guard_ranks.py"), str(root / "cases.json"), str(root),
                     env=ENV, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = {name: [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(2)] for name in cases}
    return root, reports


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_add_no_host_sync_per_step(two_ranks, strategy):
    _, reports = two_ranks
    for report in reports[f"{strategy}_syncs"]:
        assert report["lagged"] and report["steps"] == 3
        assert report["step_syncs"] == [], report["step_syncs"]
    for case in ("ddp_blocking_syncs", "ddp_fused_syncs"):  # the fallback: the guard's one read per step
        for report in reports[case]:
            assert not report["lagged"] and report["steps"] == 3
            guard = [s for s in report["step_syncs"] if "stopping.py" in s]
            others = [s for s in report["step_syncs"] if "stopping.py" not in s]
            assert len(guard) == 3, report
            # the fused reduce's one read in the whole run: the issue order rank 0 saw in the first step
            assert others == ([] if case == "ddp_blocking_syncs" else [others[0]]), report
            assert case == "ddp_blocking_syncs" or "fused_reduce.py" in others[0], report


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_prodigy"])
def test_a_nan_on_one_rank_is_skipped_on_both(two_ranks, strategy):
    """Step 2's loss is NaN on rank 1 only: neither rank's weights (ddp: replicas, fsdp: shards; fused AdamW, and
    Prodigy, whose estimate is summed over the shards) take it, both skip that step and go on identically, and both
    count one skipped step of 4."""
    _, reports = two_ranks
    for report in reports[f"{strategy}_nan"]:
        assert report["lagged"] and report["steps"] == 4 and report["skipped"] == 1
        assert all(report["finite"])
        assert report["changed"] == [True, False, True, True]
    if strategy == "ddp":  # replicas stay equal
        assert reports["ddp_nan"][0]["checksums"] == reports["ddp_nan"][1]["checksums"]


def test_a_nan_on_one_rank_halts_both_with_the_weights_from_before_it(two_ranks):
    root, reports = two_ranks
    for report in reports["ddp_halt"]:
        assert "the loss of step 3 is NaN" in report["halted"]
        assert report["changed"] == [True, True, False] and all(report["finite"])
    folder = latest_checkpoint(checkpoints_dir(root / "ddp_halt"))
    state = read_trainer_state(folder)
    assert state["step"] == 3 and state["reason"] == "non-finite loss"
    saved = gather_full_from_files(SavedShards(folder), state["shapes"])
    after_two = torch.load(root / "ddp_halt-rank0-weights.pt")[2]
    assert saved.keys() == after_two.keys() and all(torch.equal(saved[n], after_two[n]) for n in saved)


def test_sigterm_on_one_rank_stops_both_at_the_same_step(two_ranks):
    """Rank 1 gets SIGTERM after step 2: its flag goes into step 3's all-reduce, read at step 4's check (one step
    of lag): both ranks finish step 4, save it and leave (the launch exits 0)."""
    root, reports = two_ranks
    assert [r["steps"] for r in reports["ddp_signal"]] == [4, 4]
    assert reports["ddp_signal"][1]["stopped_by"] == "SIGTERM"
    assert reports["ddp_signal"][0]["stopped_by"] == "a signal on another rank"
    state = read_trainer_state(latest_checkpoint(checkpoints_dir(root / "ddp_signal")))
    assert state["step"] == 4 and state["reason"].startswith("stop requested by")


def test_the_time_based_save_is_agreed_one_step_later(two_ranks):
    root, reports = two_ranks
    assert [r["steps"] for r in reports["ddp_time"]] == [4, 4]
    saved = sorted(int(f.name.split("-")[1]) for f in checkpoints_dir(root / "ddp_time").glob("step-*"))
    assert saved == [2, 4]


def test_a_resume_keeps_the_kernel_this_run_chose_not_the_checkpoints(small_sd1, shapes_data, tmp_path):
    """A checkpoint of a foreach run resumed with the fused kernel (e.g. a CPU run continued under fsdp on a GPU)
    steps with the fused kernel, and so takes the lagged guard; the saved learning rate still comes back."""
    def config(steps, **kernel):
        return validate(base_config(small_sd1, shapes_data, tmp_path / "out", method="lora", max_steps=steps,
                                    batch_size=2, log_every_steps=100, **{"optimizer.name": "ADAMW", **kernel}))

    Trainer(config(2, **{"optimizer.fused": False}), log=quiet).train()
    resumed = Trainer(config(3, **{"optimizer.fused": True, "optimizer.foreach": False}), log=quiet, resume="auto")
    assert resumed.position.step == 2
    groups = resumed.optimizer.param_groups
    assert all(g["fused"] and not g["foreach"] for g in groups), [(g["fused"], g["foreach"]) for g in groups]
    assert torch.isfinite(torch.tensor(resumed.train().losses)).all()


# -- ZeRO (DeepSpeed) on 2 gloo ranks: parallel/zero_skip.py -----------------------------------------------------

LAGGED_LINE = "step guard: lagged, no host sync per optimizer step"


@pytest.fixture(scope="module")
def zero_ranks(one_level_sd1, shapes_data, tmp_path_factory):
    """One 2-rank launch of the ZeRO cases; {case: [rank 0 report, rank 1 report]}. Clipping on everywhere: DeepSpeed
    reads the norm once more before clipping, and a NaN norm makes the clipped gradients NaN. On one_level_sd1: what is
    asserted is per step and per rank (host reads, skipped steps, agreed stops and saves), whatever the UNet's depth."""
    root = tmp_path_factory.mktemp("zero_guard")

    def config(name, strategy, guard, **options):
        return base_config(one_level_sd1, shapes_data, root / name, strategy=strategy, batch_size=1,
                           clip_grad_norm=1.0, **{"max_steps": 3, "checkpoint.at_end": False,
                                                  "checkpoint.step_guard": guard, **FUSED, **options})

    # DeepSpeed's bf16 engine: its ZeRO-1/2 overflow flag (zero_skip.py) is what these bf16 cases cover. Under
    # autocast, bfloat16's default (deepspeed.mixed_precision), ZeRO-2 checks the norm only, as in float32.
    bf16_engine = {"train_dtype": "bfloat16", "deepspeed.mixed_precision": "engine"}
    nan = {"kind": "nan", "rank": 1, "at": 2}
    skip = {"max_steps": 4, "checkpoint.on_nonfinite_loss": "skip_step"}
    # DeepSpeed's engine counts the micro steps and steps at the boundary only; 2 steps: 8 of 16 images per rank
    accumulation = {"gradient_accumulation_steps": 2, "max_steps": 2}
    cases = {
        # the same runs with each guard, with gradient accumulation: the syncs counted, the trained weights compared
        **{f"zero2_{guard}": {"kind": "syncs", "config": config(f"zero2_{guard}", "zero2", guard,
                                                                **bf16_engine, **accumulation)}
           for guard in ("lagged", "blocking")},
        **{f"zero3_{guard}": {"kind": "syncs", "config": config(f"zero3_{guard}", "zero3", guard, **accumulation)}
           for guard in ("lagged", "blocking")},
        "zero2_nan": {**nan, "config": config("zero2_nan", "zero2", "lagged", **bf16_engine, **skip)},
        "zero3_nan": {**nan, "config": config("zero3_nan", "zero3", "lagged", **skip)},
        "zero1_prodigy_nan": {**nan, "config": config("zero1_prodigy_nan", "zero1", "lagged",
                                                      **{**PRODIGY, "optimizer.fused": None, **skip})},
        # a finite loss with NaN gradients: no guard sees it, DeepSpeed's norm check (on the device) does
        "zero2_nan_gradient": {**nan, "poison": "gradient",
                               "config": config("zero2_nan_gradient", "zero2", "lagged", max_steps=4)},
        # with accumulation 2: the first of step 2's two micro steps is NaN on rank 1, the second finite
        **{f"{stage}_accumulation_nan": {**nan, "config": config(
            f"{stage}_accumulation_nan", stage, "lagged", **{**skip, **accumulation, "max_steps": 3, **dtype})}
           for stage, dtype in (("zero2", bf16_engine), ("zero3", {}))},
        # SIGTERM to rank 1 after step 2; then a resume of the checkpoint the stop saved, to the end (step 6)
        "zero2_signal": {"kind": "signal", "rank": 1, "at": 2,
                         "config": config("zero2_signal", "zero2", "lagged", max_steps=6)},
        "zero2_signal_resumed": {"kind": "signal", "resume": "auto",
                                 "config": config("zero2_signal", "zero2", "lagged", max_steps=6)},
        # rank 0's clock: a save is always due there, never on rank 1
        "zero2_time": {"kind": "signal", "config": config("zero2_time", "zero2", "lagged", max_steps=4, **{
            "checkpoint.every_n_minutes": 1e-9, "checkpoint.keep_last": None})},
    }
    (root / "cases.json").write_text(json.dumps(cases))
    done = run_ranks(str(REPO / "tests" / "helpers" / "guard_ranks.py"), str(root / "cases.json"), str(root),
                     env=ENV, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {name: [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(2)] for name in cases}


# ZeRO-3 compares the module trace it records with rank 0's (zero/utils.py assert_ints_same_as_other_ranks: a few
# .cpu() of broadcast tensors, then .item() of each host element) when its first two micro steps begin, and again after
# something (a validation) breaks the trace: DeepSpeed's own reads, once per recording, not per step. That the trace
# is not recorded anew at every step is tests/test_zero3_collectives.py's (no broadcast in the steps after).
TRACE_CHECK = "zero/utils.py"


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_adds_no_host_sync_per_step_when_lagged(zero_ranks, stage):
    """2 steps of 2 micro steps. Lagged: no host sync (DeepSpeed's checks run on the device), in the micro step off
    the accumulation boundary neither. Blocking, the same run: the guard's read and DeepSpeed's own, once per
    optimizer step: bf16 ZeRO-2 reads its overflow flag (stage_1_and_2.py has_overflow) and the norm's validity in
    step and before clipping (runtime/utils.py is_invalid_grad_norm); float32 ZeRO-3 the norm's validity in step."""
    steps = 2  # optimizer steps
    assert zero_ranks[f"{stage}_lagged"][0]["guard_line"].startswith(LAGGED_LINE)
    assert zero_ranks[f"{stage}_blocking"][0]["guard_line"].startswith("step guard: blocking")
    for report in zero_ranks[f"{stage}_lagged"]:
        assert report["lagged"] and report["steps"] == steps
        per_step = [s for s, o in zip(report["step_syncs"], report["step_sync_origins"]) if o != TRACE_CHECK]
        assert per_step == [], per_step
    deepspeed_reads = {"zero2": {"runtime/utils.py": 2, "zero/stage_1_and_2.py": 1}, "zero3": {"runtime/utils.py": 1}}
    for report in zero_ranks[f"{stage}_blocking"]:
        assert not report["lagged"] and report["steps"] == steps
        origins = collections.Counter(o for o in report["step_sync_origins"] if o != TRACE_CHECK)
        expected = {"train/stopping.py": 1, **deepspeed_reads[stage]}
        assert origins == {k: steps * n for k, n in expected.items()}, report["step_syncs"]


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_lagged_trains_bit_identically_to_blocking(zero_ranks, stage):
    """With gradient accumulation 2 (the losses of both steps, every rank's weights after them)."""
    for rank in range(2):
        lagged, blocking = (zero_ranks[f"{stage}_{guard}"][rank] for guard in ("lagged", "blocking"))
        assert lagged["losses"] == blocking["losses"] and lagged["checksum"] == blocking["checksum"]


@pytest.mark.parametrize("case", ["zero2_nan", "zero3_nan", "zero1_prodigy_nan"])
def test_zero_skips_a_nan_on_one_rank_on_both(zero_ranks, case):
    """Step 2's loss is NaN on rank 1 only (its gradients are reduced into both ranks' partitions, the clipped
    norm is NaN): on both ranks neither the weights (bf16 ZeRO-2: the model's and the fp32 master partition; ZeRO-3:
    the partitions) nor the moments and step counts change at step 2, nothing turns non-finite, and the run goes on
    (step 3 changes them) with one skipped step of 4."""
    for report in zero_ranks[case]:
        assert report["lagged"] and report["steps"] == 4 and report["skipped"] == 1, report
        assert all(report["finite"]) and all(report["moments_finite"])
        assert report["changed"] == [True, False, True, True]
        assert report["moments_changed"][1:] == [False, True, True]


def test_zero_skips_nan_gradients_of_a_finite_loss(zero_ranks):
    """No guard sees a finite loss, but DeepSpeed's own test of the gradient norm, done on the device, reaches the
    optimizer's found_inf: step 2 changes nothing (not counted as skipped: the host never learns of it)."""
    for report in zero_ranks["zero2_nan_gradient"]:
        assert report["steps"] == 4 and report["skipped"] == 0
        assert all(report["finite"]) and all(report["moments_finite"])
        assert report["changed"] == [True, False, True, True]
        assert report["moments_changed"][1:] == [False, True, True]


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_skips_the_whole_step_of_a_nan_micro_step_on_both(zero_ranks, stage):
    """Accumulation 2: the first micro step of step 2 is NaN on rank 1 only, its second micro step finite. The whole
    optimizer step is skipped on both ranks (the NaN reached the accumulated gradients, the step's mean loss is NaN):
    no weight, moment or step count changes at step 2, nothing turns non-finite, and step 3 trains again (the NaN
    gradients were not carried into its accumulation)."""
    for report in zero_ranks[f"{stage}_accumulation_nan"]:
        assert report["lagged"] and report["steps"] == 3 and report["skipped"] == 1, report
        assert all(report["finite"]) and all(report["moments_finite"])
        assert report["changed"] == [True, False, True]
        assert report["moments_changed"][1:] == [False, True]


def test_zero_sigterm_on_one_rank_stops_both_at_the_same_step(zero_ranks):
    """As under ddp: rank 1's SIGTERM after step 2 is read at step 4's check; both ranks save step 4 (every rank
    writes its ZeRO-2 partitions) and leave. The checkpoint is committed, and resuming it trains steps 5 and 6."""
    reports = zero_ranks["zero2_signal"]
    assert [r["steps"] for r in reports] == [4, 4]
    assert reports[1]["stopped_by"] == "SIGTERM" and reports[0]["stopped_by"] == "a signal on another rank"
    assert reports[0]["checkpoint"] == reports[1]["checkpoint"]
    folder = Path(reports[0]["checkpoint"])
    assert latest_checkpoint(folder.parent) == folder  # committed
    state = read_trainer_state(folder)
    assert state["step"] == 4 and state["reason"].startswith("stop requested by")
    resumed = zero_ranks["zero2_signal_resumed"]
    assert [(r["first_step"], r["steps"], r["stopped_by"]) for r in resumed] == [(4, 6, None)] * 2


def test_zero_time_based_save_is_agreed_one_step_later(zero_ranks):
    """Rank 0's clock says a save is due at every step, rank 1's never: both save steps 2 and 4 (a save is a
    collective: had the ranks disagreed, the launch would have hung)."""
    reports = zero_ranks["zero2_time"]
    assert [r["steps"] for r in reports] == [4, 4] and reports[0]["checkpoint"] == reports[1]["checkpoint"]
    folder = Path(reports[0]["checkpoint"]).parent
    assert sorted(int(f.name.split("-")[1]) for f in folder.glob("step-*")) == [2, 4]


def test_a_step_in_cpu_memory_keeps_the_blocking_guard_on_a_gpu():
    """fsdp.cpu_offload (or DeepSpeed's offload) steps the weights on the CPU while the skip flag is on the GPU:
    torch's fused step copies it to the CPU without waiting, so the step could read a stale flag. Such a run keeps the
    blocking guard; the same fused optimizer on the CPU device may skip on the device. Stand-ins for the strategy."""
    from types import SimpleNamespace

    from ot_dist.train.device_skip import device_skip_unavailable

    config = validate(base_config("m", "d", "o", **{"optimizer.name": "ADAMW", "optimizer.fused": True}))
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], fused=True)

    def strategy(device):
        return SimpleNamespace(name="fsdp", precision=SimpleNamespace(scaler=None),
                               runtime=SimpleNamespace(device=torch.device(device)))

    assert "CPU memory" in device_skip_unavailable(config, strategy("cuda"), optimizer)
    assert device_skip_unavailable(config, strategy("cpu"), optimizer) is None
