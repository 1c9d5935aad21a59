"""Under 2 ranks: train each case of CASES_JSON under ddp and write, from rank 0, per case: the largest difference
between the ranks' trained weights (replicas must stay equal, bit for bit), the weights themselves (rank 0's, as
float32 lists) and the lines the trainer logged; for tests/test_fused_reduce.py.

    replica_ranks.py CASES_JSON RESULT_JSON

A case {"config": raw config, "perturb": "after_first_step"} has rank 1 move one weight of its own after its first
step (a replica drifting away), which the trainer must report; "before_training" before the run (ranks that loaded
different weights), which it must refuse on every rank: the case's "error" is then the message each rank raised."""

import json
import sys

import torch
import torch.distributed as dist

from ot_dist.config.load import validate
from ot_dist.errors import InputFileError
from ot_dist.parallel.runtime import start_runtime
from ot_dist.train.trainer import Trainer


def nudge_first_weight(trainer) -> None:
    with torch.no_grad():
        next(iter(trainer.strategy.trained_parameters().values())).view(-1)[0] += 0.125


def perturbed_after_first_step(trainer) -> None:
    optimizer_step = trainer.optimizer_step

    def step(*args, **kwargs):
        result = optimizer_step(*args, **kwargs)
        if args[0] == 0:
            nudge_first_weight(trainer)
        return result

    trainer.optimizer_step = step


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    runtime = start_runtime(5, needs_group=True)
    results = {}
    for name, case in cases.items():
        logged = []
        trainer = Trainer(validate(case["config"]), runtime=runtime, log=logged.append)
        if case.get("perturb") == "after_first_step" and runtime.rank == 1:
            perturbed_after_first_step(trainer)
        if case.get("perturb") == "before_training" and runtime.rank == 1:
            nudge_first_weight(trainer)
        try:
            trainer.train()
        except InputFileError as error:  # every rank: gathered below, as the weights are
            messages = [None] * runtime.world_size
            dist.all_gather_object(messages, str(error))
            results[name] = {"errors": messages}
            trainer.close()
            continue
        named = trainer.strategy.trained_parameters()
        flat = torch.cat([p.detach().float().flatten() for p in named.values()])
        gathered = [torch.zeros_like(flat) for _ in range(runtime.world_size)]
        dist.all_gather(gathered, flat)
        results[name] = {"ranks_apart": max((g - gathered[0]).abs().max().item() for g in gathered),
                         "dtypes": sorted({str(p.dtype) for p in named.values()}),
                         "first": next(iter(named)), "logged": [str(line) for line in logged],
                         "weights": {n: p.detach().float().flatten().tolist() for n, p in named.items()}}
        trainer.close()
    if runtime.is_main:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    runtime.shutdown()
