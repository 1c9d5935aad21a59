"""A worker for `accelerate launch` that only meets the others: ot_dist's runtime starts the process group from
the environment the launcher set (as `ot-dist train` does), every rank's RANK, GROUP_RANK (its node) and WORLD_SIZE
are gathered, and rank 0 writes them to the JSON file given as the argument. Run by the Kubernetes test, whose
other flavor's pods train through the same launcher."""

import json
import os
import sys

import torch.distributed as dist

from ot_dist.parallel.runtime import exit_process, start_runtime

runtime = start_runtime(5, needs_group=True)
everyone = [None] * runtime.world_size
dist.all_gather_object(everyone, {key: os.environ.get(key) for key in ("RANK", "GROUP_RANK", "WORLD_SIZE")})
if runtime.is_main:
    with open(sys.argv[1], "w") as out:
        json.dump(everyone, out)
runtime.shutdown()
exit_process(0)
