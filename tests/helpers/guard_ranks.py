"""Under torchrun (2 gloo ranks): the lagged step guard inside a real process group (tests/test_step_guard.py).

    guard_ranks.py CASES_JSON OUT_DIR

CASES_JSON: {"case name": {"config": raw config, "kind": "syncs" | "nan" | "signal",
             "rank": the rank that gets the NaN / the signal, "at": its optimizer step (1-based)}, ...}.
Every rank writes OUT_DIR/<case>-rank<R>.json:
- syncs: the host syncs counted in the step phase (tests/helpers/host_syncs.py), one string each;
- nan: the loss of step `at` is NaN on `rank` only; per optimizer step whether this rank's weights (its
  shard) changed and stayed finite, a checksum of them, the result's steps / skipped steps, and for
  on_nonfinite_loss: stop the halt message and this rank's weights after every step (a file);
- signal: `rank` sends itself SIGTERM once step `at` is done; the steps done, what stopped the run, the checkpoint.
"""

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
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in trainer.strategy.trained_parameters().items()}


def poison(trainer, rank_step: int) -> None:
    calls, original = [0], trainer.loss

    def loss(batch, epoch):
        calls[0] += 1
        value = original(batch, epoch)
        return value * float("nan") if calls[0] == rank_step else value

    trainer.loss = loss


def run_case(name: str, case: dict, runtime, out: Path) -> dict:
    trainer = Trainer(validate(case["config"]), runtime=runtime, log=lambda *_: None)
    report = {"lagged": trainer.lagged_guard}
    mine = runtime.rank == case.get("rank")
    if case["kind"] == "syncs":
        counter, result = count_trainer_syncs(trainer)
        report["steps"] = result.steps
        report["step_syncs"] = [f"{s.kind} at {s.where}" for s in counter.in_phase("step")]
    elif case["kind"] == "nan":
        if mine:
            poison(trainer, case["at"])  # accumulation 1: micro step `at` is optimizer step `at`
        history = [local_weights(trainer)]
        trainer.optimizer.register_step_post_hook(lambda *_: history.append(local_weights(trainer)))
        try:
            result = trainer.train()
            report.update(steps=result.steps, skipped=result.skipped_steps)
        except TrainingHalted as halted:
            report["halted"] = str(halted)
        report["changed"] = [any(not torch.equal(a[n], b[n]) for n in a) for a, b in zip(history, history[1:])]
        report["finite"] = [all(bool(torch.isfinite(v).all()) for v in w.values()) for w in history]
        report["checksums"] = [float(sum(v.double().sum() for v in w.values())) for w in history]
        torch.save(history, out / f"{name}-rank{runtime.rank}-weights.pt")
    elif case["kind"] == "signal":
        if mine:
            done = [0]

            def after_step(*_):
                done[0] += 1
                if done[0] == case["at"]:
                    os.kill(os.getpid(), signal.SIGTERM)

            trainer.optimizer.register_step_post_hook(after_step)
        result = trainer.train()
        report.update(steps=result.steps, stopped_by=result.stopped_by,
                      checkpoint=str(result.checkpoint) if result.checkpoint else None)
    trainer.close()
    return report


cases = json.loads(open(sys.argv[1]).read())
out = Path(sys.argv[2])
runtime = start_runtime(5, needs_group=True)
for name, case in cases.items():
    report = run_case(name, case, runtime, out)
    (out / f"{name}-rank{runtime.rank}.json").write_text(json.dumps(report, indent=1))
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
