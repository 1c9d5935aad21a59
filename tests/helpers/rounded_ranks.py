"""Under 2 ranks: train each case of CASES_JSON (bfloat16 trained weights rounded stochastically under ddp) and write,
from rank 0, per case: the largest difference between the ranks' trained weights (replicas must stay equal, bit for
bit) and the weights themselves (rank 0's, as float32 lists), for tests/test_fused_reduce.py.

    rounded_ranks.py CASES_JSON RESULT_JSON"""

import json
import sys

import torch
import torch.distributed as dist

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime
from ot_dist.train.trainer import Trainer

if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    runtime = start_runtime(5, needs_group=True)
    results = {}
    for name, raw in cases.items():
        trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
        trainer.train()
        named = trainer.strategy.trained_parameters()
        flat = torch.cat([p.detach().float().flatten() for p in named.values()])
        gathered = [torch.zeros_like(flat) for _ in range(runtime.world_size)]
        dist.all_gather(gathered, flat)
        results[name] = {"ranks_apart": max((g - gathered[0]).abs().max().item() for g in gathered),
                         "dtypes": sorted({str(p.dtype) for p in named.values()}),
                         "weights": {n: p.detach().float().flatten().tolist() for n, p in named.items()}}
        trainer.close()
    if runtime.is_main:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    runtime.shutdown()
