"""Under torchrun (2 gloo ranks): what the fast-path tests observe inside a real process group.

CASE_JSON: {"ddp_config": raw config, "result": path rank 0 writes}.

- ddp event order: every trainable parameter records "grad" when its gradient is accumulated; every
  gradient all-reduce records "allreduce" when issued (torch.distributed.all_reduce patched, and a DDP
  communication hook on each reducer the strategy holds). Per micro step, the order of events is kept.
- CPU-tensor collectives over a group made with the CPU half of the backends a CUDA run initialises
  ("cpu:gloo"): the sharded EMA's gather of CPU tensors (Ownership.gather_full)."""

import json
import sys

import torch
import torch.distributed as dist

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime, exit_process
from ot_dist.train.trainer import Trainer


def record_ddp_events(trainer) -> list[list[str]]:
    micro_steps: list[list[str]] = []
    original_all_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        if micro_steps:
            micro_steps[-1].append("allreduce")
        return original_all_reduce(*args, **kwargs)

    dist.all_reduce = all_reduce

    def comm_hook(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        micro_steps[-1].append("allreduce")
        return allreduce_hook(state, bucket)

    for replica in getattr(trainer.strategy, "replicas", {}).values():
        replica.ddp.register_comm_hook(None, comm_hook)
    for p in trainer.params:
        p.register_post_accumulate_grad_hook(lambda _: micro_steps[-1].append("grad"))
    original_micro_step = trainer.micro_step

    def micro_step(*args, **kwargs):
        micro_steps.append([])
        return original_micro_step(*args, **kwargs)

    trainer.micro_step = micro_step
    original_step = trainer.strategy.step

    def step(*args, **kwargs):  # a hand reduction at the optimizer step belongs to the last micro step
        micro_steps.append([])
        result = original_step(*args, **kwargs)
        done = micro_steps.pop()
        micro_steps[-1].extend(done)
        return result

    trainer.strategy.step = step
    return micro_steps


case = json.loads(open(sys.argv[1]).read())
runtime = start_runtime(5, needs_group=True)
result = {}

# Small buckets, so that a tiny model's gradients fill several of them, as a real model's do.
trainer = Trainer(validate({**case["ddp_config"], "ddp": {"bucket_mb": 0.05}}), runtime=runtime, log=lambda *_: None)
events = record_ddp_events(trainer)
trainer.train()
result["ddp_events"] = events


def gather_cpu_shards_over_cpu_backend(runtime) -> dict:
    from ot_dist.parallel.ownership import Fragment, Owned, Ownership
    from ot_dist.parallel.runtime import process_group_backend

    cpu_backend = [b for b in process_group_backend(torch.device("cuda")).split(",") if b.startswith("cpu:")]
    if not cpu_backend:
        return {"error": f"no CPU backend in {process_group_backend(torch.device('cuda'))!r}"}
    group = dist.new_group(backend=cpu_backend[0])
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    half = full.numel() // runtime.world_size
    shard = full.reshape(-1)[runtime.rank * half:(runtime.rank + 1) * half].clone()  # a CPU tensor, as ema.device: cpu
    owned = [Owned(shard, [Fragment("unet.w", runtime.rank * half, 0, half)])]
    ownership = Ownership(owned, {"unet.w": full.shape}, group=group, sharded=True, device=torch.device("cpu"))
    gathered = ownership.gather_full([shard])["unet.w"]
    return {"backend": cpu_backend[0], "gathered": gathered.tolist(), "expected": full.tolist()}


result["cpu_collectives"] = gather_cpu_shards_over_cpu_backend(runtime)

if runtime.is_main:
    with open(case["result"], "w") as f:
        json.dump(result, f)
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
