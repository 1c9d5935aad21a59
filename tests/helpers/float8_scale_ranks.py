"""Under 2 gloo ranks: four float8 Linear layers wrapped by the fsdp strategy (its own `_wrap_modules`, float8
all-gathers), with and without `performance.float8_matmuls` telling the strategy to compute the float8 weights'
scales once per forward. Each rank writes OUT_DIR/rank<R>.json: per variant, the all-reduces of a forward and
backward (torch's CommDebugMode), the loss, and the loss of a forward after the weights were scaled by 50 outside any
step (tests/test_float8_matmuls.py).

    float8_scale_ranks.py OUT_DIR
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from ot_dist.parallel.fsdp import FSDPStrategy
from ot_dist.train.fast_path import convert_trained_linears

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
results = {}
for once_per_forward in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    convert_trained_linears(model, "fsdp", world)
    config = SimpleNamespace(train_dtype="float32", performance=SimpleNamespace(float8_matmuls=once_per_forward),
                             fsdp=SimpleNamespace(sharding="full_shard", cpu_offload=False, reduce_dtype="float32",
                                                  reduce_every_micro_step=None))
    strategy = FSDPStrategy(config, SimpleNamespace(device=torch.device("cpu"), world_size=world))
    strategy.trained_modules = {"denoiser": model}
    strategy._wrap_modules(SimpleNamespace(family=SimpleNamespace(shard_units={"denoiser": ("0", "1", "2", "3")})))
    batch = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    with CommDebugMode() as comm:
        loss = model(batch).square().mean()
        loss.backward()
    with torch.no_grad():
        for layer in model:  # as a loaded checkpoint or swapped-in EMA weights change them, outside a step
            layer.weight.mul_(50)
        changed = float(model(batch).square().mean())
    results[str(once_per_forward)] = {
        "all_reduces": sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op)),
        "loss": float(loss), "changed": changed}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(results))
dist.destroy_process_group()
