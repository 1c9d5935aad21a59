"""Under torchrun: train each case of CASES_JSON in one process group and write, per case (rank 0),
what the test compares with a single process: Prodigy's d x lr per step, the collectives issued
inside the optimizer's step (counted on every rank), and each rank's EMA bytes.

CASES_JSON: {"case name": {"config": raw config dict}, ...}; RESULT_JSON: where rank 0 writes."""

import json
import sys

import torch
import torch.distributed as dist

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime, exit_process
from ot_dist.train.trainer import Trainer

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce")


def count_collectives_inside_step(optimizer) -> list[int]:
    """Patch torch.distributed's collectives to count calls made while `optimizer.step` runs."""
    inside, counts = [False], [0]

    def counting(original):
        def call(*args, **kwargs):
            if inside[0]:
                counts[0] += 1
            return original(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(getattr(dist, name)))
    optimizer.register_step_pre_hook(lambda *_: inside.__setitem__(0, True))
    optimizer.register_step_post_hook(lambda *_: inside.__setitem__(0, False))
    return counts


cases = json.loads(open(sys.argv[1]).read())
runtime = start_runtime(5, needs_group=True)
results = {}
for name, case in cases.items():
    trainer = Trainer(validate(case["config"]), runtime=runtime, log=lambda *_: None)
    counts = count_collectives_inside_step(trainer.optimizer)
    result = trainer.train()
    ema_bytes = torch.tensor([trainer.ema.nbytes() if trainer.ema else 0])
    all_bytes = [torch.zeros_like(ema_bytes) for _ in range(runtime.world_size)]
    dist.all_gather(all_bytes, ema_bytes)
    trainer.close()
    results[name] = {
        "d_lr": result.d_lr,
        "steps": result.steps,
        "collectives_in_step": counts[0],
        "ema_bytes": [int(b) for b in all_bytes],
        "lrs": [g["lr"] for g in trainer.optimizer.param_groups],
    }
if runtime.is_main:
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=1)
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
