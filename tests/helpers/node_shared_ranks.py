"""Under 2 ranks of one node: frozen CPU weights held once per node (ot_dist/memory/node_shared.py); for
tests/test_node_shared.py. Writes RESULT_JSON from rank 0:

    node_shared_ranks.py CASES_JSON RESULT_JSON SPARE_DIR

The synthetic cases use /dev/shm where it holds four times their weights (a container's is 64 MB by default), else
SPARE_DIR: a file there is mapped and shared the same way (its pages are the page cache's).

- "synthetic": 4 streamed blocks of frozen 3200 x 3200 float32 weights (41 MB each: above glibc's largest mmap
  threshold, so a freed private copy goes back to the system at once; one bias NaN): each rank's proportional set
  size (Pss) before and after sharing, the node file's name on each rank and whether it still exists, a value rank 0
  wrote into a shared weight as rank 1 reads it, and whether the blocks compute the same after.
- "differs": rank 1's copy of one weight differs: every rank's error.
- "pin_fails": rank 1 cannot page-lock its mapping: every rank's error (none may go on into a collective alone).
- "full": the memory filesystem has no room: the reason, and whether any weight left its private memory.
- each case of CASES_JSON (a raw config): the losses and the LoRA of a training run, and what was shared."""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.memory import node_shared
from ot_dist.memory.block_streaming import stream_blocks
from ot_dist.parallel.runtime import gather_objects, start_runtime
from ot_dist.train.trainer import Trainer

WIDTH = 3200


def proportional_set_size() -> int:
    """This process's share of the memory it maps (bytes): private pages whole, shared ones divided by their users."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def streamed_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as a model loaded from one file
    root = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]).requires_grad_(False)
    root[3].bias[0] = float("nan")  # the same bytes on both ranks, though NaN equals no value
    stream_blocks(root, list(root), torch.device("cpu"))
    return root


def synthetic(rank: int, directory: str) -> dict:
    root = streamed_model()
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))
    before_output = root(x)
    pss_before = proportional_set_size()
    sharing = node_shared.share_frozen_cpu_weights([root], pin=False, log=print, directory=directory)
    pss_after = proportional_set_size()
    filenames = [p.untyped_storage().filename for p in root.parameters()]
    same_output = torch.allclose(root(x), before_output, rtol=0, atol=0, equal_nan=True)
    if rank == 0:  # one copy of the bytes: what rank 0 writes, rank 1 reads
        with torch.no_grad():
            root[0].weight[0, 0] = 12345.0
    dist.barrier()
    seen = root[0].weight[0, 0].item()
    dist.barrier()
    return {"pss_before": pss_before, "pss_after": pss_after, "bytes": sharing.bytes, "tensors": sharing.tensors,
            "ranks_on_node": sharing.ranks_on_node, "filenames": sorted(set(map(str, filenames))),
            "file_left": any(f and os.path.exists(f) for f in filenames), "seen_by_this_rank": seen,
            "same_output": same_output, "directory": directory}


def differs(rank: int, directory: str) -> dict:
    root = streamed_model()
    if rank == 1:
        with torch.no_grad():
            root[2].weight[5, 5] += 1.0
    try:
        node_shared.share_frozen_cpu_weights([root], pin=False, log=print, directory=directory)
        return {"error": None}
    except RuntimeError as error:
        return {"error": str(error)}


def pin_fails(rank: int, directory: str) -> dict:
    """Rank 1 cannot page-lock its mapping (a CUDA run's pin, stood in for on the CPU): every rank's error."""
    root = streamed_model()
    pin_mapping = node_shared.pin_mapping

    def pin_on_rank_0(storage):
        if rank == 1:
            raise RuntimeError("share_frozen_cpu_weights: cudaHostRegister of n bytes failed with CUDA error 1")

    node_shared.pin_mapping = pin_on_rank_0
    try:
        node_shared.share_frozen_cpu_weights([root], pin=True, log=print, directory=directory)
        return {"error": None}
    except RuntimeError as error:
        return {"error": str(error)}
    finally:
        node_shared.pin_mapping = pin_mapping


def full(rank: int, directory: str) -> dict:
    root = streamed_model()
    node_shared.free_bytes = lambda directory: 0
    logged = []
    sharing = node_shared.share_frozen_cpu_weights([root], pin=False, log=logged.append, directory=directory)
    return {"reason": sharing.reason, "logged": logged, "tensors": sharing.tensors,
            "shared": [p.untyped_storage().filename for p in root.parameters() if p.untyped_storage().filename],
            "files_left": [f for f in os.listdir(directory)
                           if f.startswith(node_shared.FILE_PREFIX) and f.split("-")[2] == str(os.getpid())]}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    runtime = start_runtime(5, needs_group=True)
    weights = 4 * (WIDTH * WIDTH + WIDTH) * 4
    shm = node_shared.SHARED_MEMORY_DIR
    directory = shm if os.path.isdir(shm) and node_shared.free_bytes(shm) >= 4 * weights else sys.argv[3]
    results = {"synthetic": gather_objects(synthetic(runtime.rank, directory)),
               "differs": gather_objects(differs(runtime.rank, directory))}
    free_bytes = node_shared.free_bytes
    results["pin_fails"] = gather_objects(pin_fails(runtime.rank, directory))
    results["full"] = gather_objects(full(runtime.rank, directory))
    node_shared.free_bytes = free_bytes
    for name, raw in cases.items():
        trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
        sharing = trainer.node_sharing
        losses = trainer.train().losses
        trainer.close()
        results[name] = {"losses": losses, "tensors": sharing.tensors, "bytes": sharing.bytes, "reason": sharing.reason}
        if runtime.rank == 0:
            results[name]["lora"] = {k: v.float().flatten().tolist()
                                     for k, v in load_file(f"{raw['output_dir']}/lora.safetensors").items()}
    if runtime.rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    runtime.shutdown()
