"""Under torchrun (2 gloo ranks): the lagged step guard inside a real process group (tests/test_step_guard.py).

    guard_ranks.py CASES_JSON OUT_DIR

CASES_JSON: {"case name": {"config": raw config, "kind": "syncs" | "nan" | "signal",
             "rank": the rank that gets the NaN / the signal, "at": its optimizer step (1-based),
             "resume": optional, the Trainer's resume (e.g. "auto")}, ...}. Cases run in order, so a case may resume
             from an earlier one's checkpoint.
Every rank writes OUT_DIR/<case>-rank<R>.json:
- syncs: the host syncs counted in the step phase (tests/helpers/host_syncs.py), one string each;
- syncs also: the losses and a checksum of this rank's final weights (to compare lagged with blocking);
- nan: the loss of step `at` is NaN on `rank` only, in its first micro step (with gradient accumulation the other
  micro steps stay finite; with "poison": "gradient", the loss is finite and its gradient NaN); per optimizer step
  whether this rank's weights (its shard; under ZeRO also the fp32 master partition) changed and stayed finite,
  whether the optimizer's moments and step counts changed and stayed finite, a checksum of the weights, the
  result's steps / skipped steps, and for on_nonfinite_loss: stop the halt message and this rank's weights after
  every step (a file);
- signal: `rank` sends itself SIGTERM once optimizer step `at` is done; the steps done (and those before a resume),
  what stopped the run, the checkpoint.
"""

import gc
import json
import os
import signal
import sys
from pathlib import Path

import torch

from ot_dist.config.load import validate
from ot_dist.errors import TrainingHalted
from ot_dist.parallel.runtime import exit_process, start_runtime
from ot_dist.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from host_syncs import count_trainer_syncs  # noqa: E402


def local_weights(trainer) -> dict[str, torch.Tensor]:
    """This rank's weights: replicas, FSDP shards; under ZeRO the model's weights (ZeRO-3: this rank's
    partition of each) and the fp32 master partitions the optimizer steps."""
    weights = {n: (p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p)
               .detach().clone() for n, p in trainer.strategy.trained_parameters().items()}
    if hasattr(trainer.strategy, "engine_optimizer"):
        masters = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        weights.update({f"master.{i}": p.detach().clone() for i, p in enumerate(masters)})
    return weights


def moments(trainer) -> list[torch.Tensor]:
    """The optimizer's state tensors (moments, Prodigy's s) and its step counts."""
    return [v.detach().clone() for state in trainer.optimizer.state.values() for v in state.values()
            if torch.is_tensor(v) and v.is_floating_point()]


class NanGradient(torch.autograd.Function):
    """The loss as it is, its gradient NaN: a finite loss whose backward is not."""

    @staticmethod
    def forward(ctx, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def poison(trainer, rank_step: int, gradient: bool = False) -> None:
    calls, original = [0], trainer.loss

    def loss(batch, epoch):
        calls[0] += 1
        value = original(batch, epoch)
        if calls[0] != rank_step:
            return value
        return NanGradient.apply(value) if gradient else value * float("nan")

    trainer.loss = loss


def run_case(name: str, case: dict, runtime, out: Path) -> dict:
    lines = []
    trainer = Trainer(validate(case["config"]), runtime=runtime, log=lines.append, resume=case.get("resume"))
    report = {"lagged": trainer.lagged_guard}
    mine = runtime.rank == case.get("rank")
    if case["kind"] == "syncs":
        counter, result = count_trainer_syncs(trainer)
        report["steps"], report["losses"] = result.steps, result.losses
        report["step_syncs"] = [f"{s.kind} at {s.where}" for s in counter.in_phase("step")]
        report["step_sync_origins"] = ["/".join(Path(s.origin).parts[-2:]) for s in counter.in_phase("step")]
        report["checksum"] = float(sum(v.double().sum() for v in local_weights(trainer).values()))
    elif case["kind"] == "nan":
        if mine:  # the first micro step of optimizer step `at`
            accumulation = trainer.config.gradient_accumulation_steps
            poison(trainer, (case["at"] - 1) * accumulation + 1, gradient=case.get("poison") == "gradient")
        history, states = [local_weights(trainer)], [moments(trainer)]
        step = trainer.optimizer_step

        def recorded_step(*args):  # after the whole step: ZeRO copies the master partitions back into the weights
            out = step(*args)
            history.append(local_weights(trainer))
            states.append(moments(trainer))
            return out

        trainer.optimizer_step = recorded_step
        try:
            result = trainer.train()
            report.update(steps=result.steps, skipped=result.skipped_steps)
        except TrainingHalted as halted:
            report["halted"] = str(halted)
        report["changed"] = [any(not torch.equal(a[n], b[n]) for n in a) for a, b in zip(history, history[1:])]
        report["finite"] = [all(bool(torch.isfinite(v).all()) for v in w.values()) for w in history]
        # the first step creates the state: compared from the second on
        report["moments_changed"] = [len(a) != len(b) or any(not torch.equal(x, y) for x, y in zip(a, b))
                                     for a, b in zip(states, states[1:])]
        report["moments_finite"] = [all(bool(torch.isfinite(v).all()) for v in s) for s in states]
        report["checksums"] = [float(sum(v.double().sum() for v in w.values())) for w in history]
        torch.save(history, out / f"{name}-rank{runtime.rank}-weights.pt")
    elif case["kind"] == "signal":
        if mine:
            # after the trainer's whole optimizer step (DeepSpeed calls the optimizer's step once per group)
            done, step = [0], trainer.optimizer_step

            def signalling_step(*args):
                out = step(*args)
                done[0] += 1
                if done[0] == case["at"]:
                    os.kill(os.getpid(), signal.SIGTERM)
                return out

            trainer.optimizer_step = signalling_step
        result = trainer.train()
        report.update(steps=result.steps, first_step=result.first_step, stopped_by=result.stopped_by,
                      checkpoint=str(result.checkpoint) if result.checkpoint else None)
    trainer.close()  # ends with a full collection: what survives it stays alive
    gc.freeze()  # a closed ZeRO-3 trainer's objects, not walked again by later collections (optimizers_under_strategy.py)
    report["guard_line"] = next((line for line in lines if line.startswith("step guard")), None)
    return report


cases = json.loads(open(sys.argv[1]).read())
out = Path(sys.argv[2])
runtime = start_runtime(5, needs_group=True)
for name, case in cases.items():
    report = run_case(name, case, runtime, out)
    (out / f"{name}-rank{runtime.rank}.json").write_text(json.dumps(report, indent=1))
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
