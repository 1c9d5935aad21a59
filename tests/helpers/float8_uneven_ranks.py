"""Under 3 gloo ranks: float8 matmuls under FSDP2 for a Linear whose 16 rows do not split evenly over 3 ranks and one
whose 48 do (ot_dist.train.fast_path.convert_trained_linears); a forward and backward, then each rank writes OUT_DIR/
rank<R>.json: which layers all-gather their weights in float8, and the weights' gradient norms (tests/
test_float8_matmuls.py). torchao's float8 all-gather sends shards unpadded: the uneven one would abort gloo.

    float8_uneven_ranks.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ot_dist.train.fast_path import convert_trained_linears

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 48))
convert_trained_linears(model, "fsdp", world)
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model(torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
gathered_in_float8 = [type(layer.weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor" for layer in model]
norms = [float(layer.weight.grad.full_tensor().norm()) for layer in model]
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"float8_all_gather": gathered_in_float8, "norms": norms}))
dist.destroy_process_group()
