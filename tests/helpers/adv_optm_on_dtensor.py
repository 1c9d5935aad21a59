"""2 gloo ranks: adv_optm's element-wise optimizers stepped on DTensor shards (FSDP2's parameters, Shard(0)), as
`fully_shard` hands them to an optimizer. Rank 0 writes {class name: "ok" | the error} to the file given."""

from __future__ import annotations

import json
import sys

import adv_optm
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
results = {}
for name in ("AdamW_adv", "Adopt_adv", "SignSGD_adv"):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    optimizer = getattr(adv_optm, name)([weight], lr=1e-2)
    try:
        for _ in range(2):
            weight.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
            optimizer.step()
        results[name] = "ok"
    except Exception as err:  # the failure is the result
        results[name] = f"{type(err).__name__}: {err}"
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
dist.destroy_process_group()
