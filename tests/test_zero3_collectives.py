"""ZeRO-3 gathers a parameter when the model needs it, not at every use (issue 21): the collectives of each optimizer
step, counted on 2 gloo ranks, stay under a bound read from the model.

Per step, DeepSpeed 0.19's ZeRO-3 gathers
- every persistent parameter (at or below stage3_param_persistence_threshold) once, after the optimizer step, one
  all-gather each (stage3.py `step`: `_partition_all_parameters` releases every parameter, `_post_step` gathers the
  persistent ones back through `Init._all_gather` -> `_allgather_params_coalesced`, one all_gather_into_tensor per
  parameter); it keeps them gathered through forward and backward;
- the other parameters when their module runs: at most one all-gather per module and pass (forward, the recompute of
  gradient checkpointing, backward), fewer once the module trace is recorded and the next modules are prefetched.

When DeepSpeed never learnt where a micro step begins (its engine never called: the trainer calls the components), it
recorded no trace and released every parameter after each use, the persistent ones too: 473 all-gathers per step on
the full finetune below (bound 281) instead of 228. That 2 ranks under zero3 end where 1 process with the same global
batch ends is tests/test_family_strategies.py's.

At start-up each parameter is broadcast once (ZeRO-3 partitions from rank 0's values; the engine's whole-model broadcast
before it is skipped, parallel/deepspeed.py one_broadcast_of_the_model), and a rank whose weights differ before the
engine is built starts from rank 0's.

The same launch checks that a closed ZeRO-3 trainer is freed: DeepSpeed's module-level state kept every engine's model
(parallel/deepspeed_process_state.py forget_closed_engine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import base_config
from forked_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
STEPS = 4
STEADY_FROM = 3  # step 1 records the module trace, step 2's start checks it across ranks; then it is only replayed
PASSES = 3  # forward, recompute (gradient checkpointing), backward
GATHERS = ("all_gather", "all_gather_into_tensor", "_all_gather_base")
# Below the largest weights of the small UNet and the text encoder (up to 73,728 elements), above biases and norms:
# some parameters are sharded and gathered by their modules, the rest persist, as in a real model (SDXL's UNet at
# DeepSpeed's default 1e5: 888 persistent parameters of 1.6M elements, 792 modules with sharded ones).
SHARDED_ABOVE = 10_000


def test_zero3_gathers_parameters_per_step_not_per_use(small_sd1, shapes_data, tmp_path):
    deepspeed_json = tmp_path / "deepspeed.json"
    deepspeed_json.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": SHARDED_ABOVE}}))
    common = {"batch_size": 2, "strategy": "zero3", "max_steps": STEPS, "optimizer.name": "SGD", "learning_rate": 0.05}
    cases = {
        # two trained modules in the engine's container, sharded and persistent parameters, recompute
        "full": base_config(small_sd1, shapes_data, tmp_path / "full", method="full",
                            gradient_checkpointing=True, **common,
                            **{"text_encoder.train": True, "deepspeed.config_file": str(deepspeed_json)}),
        # DeepSpeed's defaults (every tiny parameter persists); the frozen base weights live in the engine's module
        # too, and the adapters' parameters are registered as external with their layers
        "lora": base_config(small_sd1, shapes_data, tmp_path / "lora", method="lora", **{"lora.rank": 4},
                            **common),
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "counts"
    out.mkdir()
    done = run_ranks(str(REPO / "tests" / "helpers" / "collective_ranks.py"), str(tmp_path / "cases.json"), str(out),
                     env=ENV, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for order, case in enumerate(cases):
        for rank in (0, 1):
            report = json.loads((out / f"{case}-rank{rank}.json").read_text())
            assert report["steps_done"] == STEPS == len(report["steps"]), case
            # a closed ZeRO-3 trainer is freed (DeepSpeed's module-level state let go of it); the first case's objects
            # are frozen by ot_dist/memory/heap.py, so the later ones tell
            assert order == 0 or report["model_collected"], f"{case}, rank {rank}: the closed trainer's model lives on"
            bound = report["persistent"] + PASSES * report["sharded_modules"]
            for number, step in enumerate(report["steps"][STEADY_FROM - 1:], start=STEADY_FROM):
                gathers = sum(step.get(kind, 0) for kind in GATHERS)
                assert gathers <= bound, (
                    f"{case}, rank {rank}, step {number}: {gathers} all-gathers > {bound} ({report['persistent']} "
                    f"persistent parameters + {PASSES} x {report['sharded_modules']} modules with sharded ones); "
                    f"issued by {json.dumps(report['where'], indent=1)}")
                # a trace recorded anew (each reset of an incomplete trace compares it across ranks by broadcast)
                assert step.get("broadcast", 0) == 0, f"{case}, rank {rank}, step {number}: the trace was recorded anew"
    full = json.loads((out / "full-rank0.json").read_text())
    assert full["sharded_modules"] > 0 and full["persistent"] > 0  # both terms of the bound are exercised
    for case in cases:
        reports = [json.loads((out / f"{case}-rank{rank}.json").read_text()) for rank in (0, 1)]
        for rank, report in enumerate(reports):
            # Each parameter is broadcast once at start-up, by ZeRO-3's partitioning; the engine's own whole-model
            # broadcast before it doubled that (over gloo for weights in CPU memory). A few of ot_dist's own allowed.
            broadcasts, parameters = report["setup"].get("broadcast", 0), report["engine_parameters"]
            assert broadcasts <= parameters + 10, f"{case}, rank {rank}: {broadcasts} broadcasts at start for {parameters}"
            # rank 1 shifted its weights before the engine was built: every rank starts from rank 0's
            assert abs(report["start"]["after"] - reports[0]["start"]["before"]) <= 1e-9 * abs(reports[0]["start"]["before"])
        assert abs(reports[1]["start"]["before"] - reports[0]["start"]["before"]) > 1  # the shift did happen


def test_a_closed_zero3_trainer_gives_torch_its_linear_back(one_level_sd1, shapes_data, tmp_path, one_rank_group):
    """Building a ZeRO-3 engine replaces torch.nn.functional.linear for the rest of the process (DeepSpeed's
    zero3_linear_wrap, which rounds bfloat16 differently); closing the trainer puts back the one it found, so the
    next training in the process (a notebook's sweep, the next case of a launch) computes as a fresh process does.
    A 1-rank group in this process; also after a construction that failed once the engine existed."""
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from ot_dist.config.load import validate
    from ot_dist.errors import ConfigError
    from ot_dist.train.trainer import Trainer

    original = torch.nn.functional.linear
    assert original is torch._C._nn.linear, "an earlier test in this process left a replaced linear"
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "run", method="lora", strategy="zero3", batch_size=2,
                      max_steps=1)
    trainer = Trainer(validate(raw), log=lambda *_: None)
    assert torch.nn.functional.linear is zero3_linear_wrap  # what is undone below: DeepSpeed did replace it
    trainer.train()
    trainer.close()
    assert torch.nn.functional.linear is original
    # Prodigy refuses ZeRO-3's sub-groups after the engine is built: nobody holds the trainer to close it
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"zero_optimization": {"sub_group_size": 1000}}))
    refused = {**raw, "output_dir": str(tmp_path / "refused"), "optimizer": {"name": "PRODIGY"}, "learning_rate": 1.0,
               "deepspeed": {"config_file": str(split)}}
    refused = validate(refused)
    with pytest.raises(ConfigError, match="sub_group_size splits the parameters into"):
        Trainer(refused, log=lambda *_: None)
    assert torch.nn.functional.linear is original


def test_closing_leaves_a_linear_replaced_since_by_someone_else(monkeypatch):
    """Only DeepSpeed's own replacement is undone: a wrapper installed after the engine (a profiler, another
    library) stays; its owner restores it."""
    import torch

    from ot_dist.parallel.deepspeed_process_state import restore_torch_linear

    def theirs(*args, **kwargs):
        return torch._C._nn.linear(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", theirs)
    restore_torch_linear(torch._C._nn.linear)
    assert torch.nn.functional.linear is theirs


def test_a_process_trains_under_zero3_again_in_a_process_group_of_its_own(one_level_sd1, shapes_data, tmp_path,
                                                                          monkeypatch):
    """A notebook calling ot_dist.train.train twice: each run starts a 1-rank process group and ends it. The second
    engine starts (DeepSpeed kept a clone of the first run's world group: parallel/deepspeed_process_state.py
    forget_stale_world_group) and both runs leave torch's linear in place."""
    import torch
    import torch.distributed as dist

    from ot_dist.config.load import validate
    from ot_dist.ports import free_port
    from ot_dist.train.trainer import train

    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # what start_runtime would set in os.environ, restored after the test
    for run in ("first", "second"):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        raw = base_config(one_level_sd1, shapes_data, tmp_path / run, method="lora", strategy="zero3", batch_size=2,
                          max_steps=1)
        assert train(validate(raw), log=lambda *_: None).steps == 1, run
        assert not dist.is_initialized(), run  # the run ended its group
        assert torch.nn.functional.linear is torch._C._nn.linear, run


def test_a_refused_run_ends_the_process_group_it_started(one_level_sd1, shapes_data, tmp_path, monkeypatch):
    """ot_dist.train.train on a config whose construction is refused (here: the model folder is gone) ends the 1-rank
    group it started for fsdp, so that the notebook's next run can start its own."""
    import torch.distributed as dist

    from ot_dist.config.load import validate
    from ot_dist.errors import InputFileError
    from ot_dist.ports import free_port
    from ot_dist.train.trainer import train

    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    raw = base_config(one_level_sd1, shapes_data, tmp_path / "run", strategy="fsdp", max_steps=1)
    config = validate(raw)
    config.model.path = str(tmp_path / "gone")  # removed after the config was checked
    with pytest.raises(InputFileError):
        train(config, log=lambda *_: None)
    assert not dist.is_initialized()
