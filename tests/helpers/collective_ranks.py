"""Under torchrun (2 gloo ranks): the collectives each rank issues per optimizer step (tests/test_zero3_collectives.py).

    collective_ranks.py CASES_JSON OUT_DIR

CASES_JSON: {"case name": raw config (a zero3 run), ...}. Every rank writes OUT_DIR/<case>-rank<R>.json:
- "steps": per optimizer step, {collective: count} of its micro steps and its optimizer step;
- "where": the same collectives by the frames that issued them (the innermost outside torch.distributed and
  DeepSpeed's comm wrappers), summed over the steps, to name the culprit when a bound fails;
- "setup" and "other": the trainer's construction (engine, checkpoint load) and the rest of train() (validation,
  samples, checkpoints, export), each {collective: count};
- the inputs of the bound, read from the engine's module and DeepSpeed's persistence threshold: "persistent" (the
  parameters at or below it, which ZeRO-3 keeps gathered) and "sharded_modules" (modules that gather a parameter
  above it when they run: their own or one registered with them as external);
- "steps_done";
- "model_collected": whether the closed trainer's model was freed by the next full collection (a closed ZeRO-3
  engine once stayed referenced from DeepSpeed's module-level state: parallel/deepspeed_process_state.py
  forget_closed_engine).
  Not for the first case: ot_dist/memory/heap.py freezes what exists when the process's first trainer is built.

Collectives are counted in torch.distributed.distributed_c10d (patched there and in torch.distributed before the
engine exists: DeepSpeed's comm backend looks its all-gather function up once, when it starts)."""

import gc
import itertools
import json
import sys
import traceback
import weakref
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import exit_process, start_runtime
from ot_dist.train.trainer import Trainer

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "all_reduce",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce", "broadcast",
               "broadcast_object_list", "all_to_all", "all_to_all_single", "barrier")
LIBRARY_PLUMBING = ("site-packages/torch/", "deepspeed/comm/", "deepspeed/utils/")


class Counts:
    def __init__(self):
        self.phase = "setup"
        self.setup, self.other, self.steps, self.where = Counter(), Counter(), [], Counter()

    def record(self, kind: str) -> None:
        if self.phase != "step":
            (self.setup if self.phase == "setup" else self.other)[kind] += 1
            return
        self.steps[-1][kind] += 1
        frames = [f for f in traceback.extract_stack()[:-2] if not any(p in f.filename for p in LIBRARY_PLUMBING)]
        self.where[f"{kind} at " + " <- ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(frames[-4:]))] += 1


current: list[Counts | None] = [None]
_inside = [False]  # a collective made of another (all_gather_object's all_gather) counts once


def count_collectives() -> None:
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            if _inside[0] or current[0] is None:
                return _original(*args, **kwargs)
            current[0].record(_name)
            _inside[0] = True
            try:
                return _original(*args, **kwargs)
            finally:
                _inside[0] = False

        setattr(c10d, name, counted)
        if getattr(dist, name, None) is original:
            setattr(dist, name, counted)


def bound_inputs(engine) -> dict:
    threshold = engine.zero_param_persistence_threshold()
    params = list(engine.module.parameters())
    gathered_when_run = (
        itertools.chain(m.parameters(recurse=False), getattr(m, "_external_params", {}).values())
        for m in engine.module.modules()
    )
    return {"persistent": sum(p.ds_numel <= threshold for p in params),
            "sharded_modules": sum(any(p.ds_numel > threshold for p in ps) for ps in gathered_when_run)}


def weights_sum(params) -> float:
    return float(sum(p.detach().double().sum() for p in params))


def start_from_other_weights_on_rank_1(runtime, record: dict):
    """Rank 1's trained modules are shifted by 1 just before the engine is built, and every rank records the sum of
    its weights then: the engine must start every rank from rank 0's (ZeRO-3 partitions from rank 0's values)."""
    from ot_dist.parallel.deepspeed import DeepSpeedStrategy

    original = DeepSpeedStrategy.wrap_optimizer

    def shifted(strategy, optimizer):
        params = [p for m in strategy.trained_modules.values() for p in m.parameters()]
        if runtime.rank == 1:
            with torch.no_grad():
                for p in params:
                    p.add_(1.0)
        record["before"] = weights_sum(params)
        return original(strategy, optimizer)

    DeepSpeedStrategy.wrap_optimizer = shifted
    return original


def run_case(raw: dict, runtime) -> tuple[dict, weakref.ref]:
    import deepspeed

    from ot_dist.parallel.deepspeed import DeepSpeedStrategy

    counts = current[0] = Counts()
    start = {}
    original = start_from_other_weights_on_rank_1(runtime, start)
    try:
        trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
    finally:
        DeepSpeedStrategy.wrap_optimizer = original
    params = list(trainer.strategy.engine.module.parameters())
    trained = [p for m in trainer.strategy.trained_modules.values() for p in m.parameters()]
    with deepspeed.zero.GatheredParameters(trained):  # a collective: the whole weights, as every rank now holds them
        start["after"] = weights_sum(trained)
    counts.phase = "other"
    micro_step, optimizer_step = trainer.micro_step, trainer.optimizer_step
    step_open = [False]

    def counted_micro_step(*args, **kwargs):
        if not step_open[0]:
            counts.steps.append(Counter())
            step_open[0] = True
        counts.phase = "step"
        try:
            return micro_step(*args, **kwargs)
        finally:
            counts.phase = "other"

    def counted_optimizer_step(*args, **kwargs):
        counts.phase = "step"
        try:
            return optimizer_step(*args, **kwargs)
        finally:
            counts.phase, step_open[0] = "other", False

    trainer.micro_step, trainer.optimizer_step = counted_micro_step, counted_optimizer_step
    result = trainer.train()
    report = {"steps": counts.steps, "where": dict(counts.where.most_common(20)), "setup": counts.setup,
              "other": counts.other, "steps_done": result.steps, "engine_parameters": len(params), "start": start,
              **bound_inputs(trainer.strategy.engine)}
    trainer.close()
    current[0] = None
    return report, weakref.ref(trainer.model.denoiser)


count_collectives()
cases = json.loads(open(sys.argv[1]).read())
out = Path(sys.argv[2])
runtime = start_runtime(5, needs_group=True)
for name, raw in cases.items():
    report, model = run_case(raw, runtime)
    gc.collect()
    report["model_collected"] = model() is None
    (out / f"{name}-rank{runtime.rank}.json").write_text(json.dumps(report, indent=1))
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
