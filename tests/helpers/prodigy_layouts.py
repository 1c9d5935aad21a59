"""Under torchrun (2 ranks): train a small model with ShardedProdigy under FSDP2, ZeRO-2 and ZeRO-3,
every rank on the SAME batch, so the averaged gradients are exactly the single-process ones and any
difference in d can only come from how the optimizer sums over shards. Rank 0 writes, per layout
and slice_p: d per step, the final full weights, the collectives issued inside the optimizer step,
and a check that the ownership map reassembles the optimizer's fp32 tensors into the weights."""

import json
import sys

import torch
import torch.distributed as dist

from ot_dist.optim.prodigy import ShardedProdigy
from ot_dist.parallel.deepspeed import skip_shared_memory_op_build, zero_ownership
from ot_dist.parallel.fsdp import fsdp_ownership
from ot_dist.parallel.runtime import start_runtime, exit_process

STEPS = 20


def toy_model() -> torch.nn.Module:
    # Odd sizes put shard and partition boundaries inside slice_p's pattern; the (1, 9) layer leaves
    # rank 1 an empty FSDP shard.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(9, 37), torch.nn.Tanh(), torch.nn.Linear(37, 23), torch.nn.Tanh(), torch.nn.Linear(23, 9),
        torch.nn.Tanh(), torch.nn.Linear(9, 1),
    )


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 9, generator=torch.Generator().manual_seed(step))


def count_collectives(optimizer) -> list[int]:
    inside, counts = [False], [0]
    original = dist.all_reduce

    def all_reduce(*args, **kwargs):
        counts[0] += inside[0]
        return original(*args, **kwargs)

    dist.all_reduce = all_reduce
    optimizer.register_step_pre_hook(lambda *_: inside.__setitem__(0, True))
    optimizer.register_step_post_hook(lambda *_: inside.__setitem__(0, False))
    return counts


def run_fsdp(slice_p: int):
    from torch.distributed.fsdp import fully_shard

    model = toy_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = ShardedProdigy(model.parameters(), lr=1.0, slice_p=slice_p, weight_decay=0.01)
    ownership = fsdp_ownership(dict(model.named_parameters()), None, torch.device("cpu"))
    optimizer.attach_ownership(ownership)

    def step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def weights():
        return {n: p.full_tensor() for n, p in model.named_parameters()}

    return model, optimizer, ownership, step, weights


def run_zero(stage: int, slice_p: int):
    import deepspeed

    # As the zero strategy does: DeepSpeed's shared-memory all-reduce op is not built (only inference uses it).
    skip_shared_memory_op_build()
    model = toy_model()
    optimizer = ShardedProdigy(model.parameters(), lr=1.0, slice_p=slice_p, weight_decay=0.01)
    config = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 8 * dist.get_world_size(),
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    named = dict(model.named_parameters())
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    ownership = zero_ownership(zero, stage, named, torch.device("cpu"))
    optimizer.attach_ownership(ownership)

    def step(loss):
        engine.backward(loss)
        engine.step()

    def weights():
        params = list(named.values())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            return {n: p.detach().clone() for n, p in named.items()}

    return engine, optimizer, ownership, step, weights


def main() -> None:
    runtime = start_runtime(5, needs_group=True)
    results = {}
    for layout in ("fsdp", "zero2", "zero3"):
        for slice_p in (1, 11):
            model, optimizer, ownership, step, weights = (
                run_fsdp(slice_p) if layout == "fsdp" else run_zero(int(layout[-1]), slice_p)
            )
            counts = count_collectives(optimizer)
            d = []
            for i in range(STEPS):
                step(model(batch(i)).pow(2).mean())
                d.append(float(optimizer.param_groups[0]["d"]))
            full = weights()
            reassembled = ownership.gather_full([o.local() for o in ownership.owned])
            empty = torch.tensor([sum(o.local().numel() == 0 for o in ownership.owned)])
            dist.all_reduce(empty)  # over both ranks
            results[f"{layout}/{slice_p}"] = {
                "d": d,
                "collectives": counts[0],
                "weights": {n: w.flatten().tolist() for n, w in full.items()},
                "ownership_reassembles": max((reassembled[n] - full[n]).abs().max().item() for n in full),
                "empty_local_tensors": int(empty),
            }
            if layout != "fsdp":
                model.destroy()  # the engine's communication state goes now, not at interpreter exit
    if runtime.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    runtime.shutdown()
    exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run


if __name__ == "__main__":
    main()
