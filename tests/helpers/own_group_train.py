"""Under run_ranks: a script that makes its own process group the way a notebook, Ray or a launcher of its own does
(init_method tcp://, explicit rank and world size, none of torchrun's variables left in the environment), then calls
ot_dist.train.train, and prints what ot_dist saw as JSON: the steps run, the world size of its bucket report and
whether the caller's group is still there afterwards.

    own_group_train.py CONFIG_JSON"""

import json
import os
import sys

import torch.distributed as dist

from ot_dist.config.load import validate
from ot_dist.train.trainer import train

address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(name, None)
dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
lines = []
result = train(validate(json.loads(open(sys.argv[1]).read())), log=lines.append)
report = next((line for line in lines if "process(es)" in line), "")
print(json.dumps({"rank": rank, "steps": result.steps, "report": report, "group_kept": dist.is_initialized(),
                  "local_rank": os.environ.get("LOCAL_RANK")}))
dist.destroy_process_group()
