"""Training runs for the checkpoint tests, in one process or under torchrun.

    resume_run.py CONFIG_JSON RESULT_JSON [--resume auto] [--signal-after-step N]
                  [--then CONFIG_JSON RESULT_JSON [--signal-after-step N]] ...

--signal-after-step N: rank 0 (only) sends itself SIGTERM once optimizer step N is done, as a
preemption would; the ranks must agree to finish the next step (the lagged step guard: the one after), save
and stop.
--then: one more run in the same launch, after the previous one (its own config, result and signal step;
no resume), so that one launch of the ranks can do e.g. the uninterrupted run and the stopped one.
Rank 0 writes each RESULT_JSON: the step losses, the first and last step, what stopped the run, and every
sample id each epoch handed out, over all ranks."""

import argparse
import json
import os
import signal
import sys

import torch.distributed as dist

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime, exit_process
from ot_dist.train.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from zero_master import assert_master_shares_the_weights  # noqa: E402


def parse(argv: list[str]) -> list[argparse.Namespace]:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("result")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--signal-after-step", type=int, default=None)
    groups, current = [], []
    for arg in argv:
        if arg == "--then":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    return [parser.parse_args(group) for group in groups]


def one_run(args: argparse.Namespace, runtime) -> None:
    config = validate(json.loads(open(args.config).read()))
    trainer = Trainer(config, runtime=runtime, log=lambda *_: None, resume=args.resume)
    seen: dict[int, list[int]] = {}
    original_batches = trainer.epoch_batches

    def recording_batches(epoch):
        for batch in original_batches(epoch):
            seen.setdefault(epoch, []).extend(batch["sample_id"].tolist())
            yield batch

    trainer.epoch_batches = recording_batches
    if args.signal_after_step is not None and runtime.is_main:
        steps = [trainer.position.step]

        def after_step(*_):
            steps[0] += 1
            if steps[0] == args.signal_after_step:
                os.kill(os.getpid(), signal.SIGTERM)

        trainer.optimizer.register_step_post_hook(after_step)
    result = trainer.train()
    assert_master_shares_the_weights(trainer)  # zero1/2: still no second copy of the weights, a resume included
    trainer.close()
    everyone = [None] * runtime.world_size
    if runtime.distributed:
        dist.all_gather_object(everyone, seen)
    else:
        everyone = [seen]
    if runtime.is_main:
        merged = {}
        for per_rank in everyone:
            for epoch, ids in per_rank.items():
                merged.setdefault(str(epoch), []).extend(ids)
        json.dump({"losses": result.losses, "first_step": result.first_step, "steps": result.steps,
                   "stopped_by": result.stopped_by, "seen": merged, "lag": int(trainer.lagged_guard),
                   "checkpoint": str(result.checkpoint) if result.checkpoint else None}, open(args.result, "w"))


if __name__ == "__main__":
    runs = parse(sys.argv[1:])
    first = validate(json.loads(open(runs[0].config).read()))
    runtime = start_runtime(5, needs_group=first.strategy != "single")
    for run_args in runs:
        one_run(run_args, runtime)
    runtime.shutdown()
    exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
