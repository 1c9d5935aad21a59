"""fsdp with gradient accumulation: reduce-scatter only at the last micro step (each rank holds every trained
parameter's whole gradient until then) or after every micro step (`fsdp.reduce_every_micro_step`: only this rank's
shards accumulate). Both give the same gradients; the second holds no whole gradient between micro steps. The
2-rank runs of both against one process are in test_family_strategies.py (the fsdp accumulation cases)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from ot_dist.parallel.fsdp import FSDPStrategy, whole_gradient_bytes


def strategy_over(module, reduce_every_micro_step, cpu_offload=False, device="cpu", reduce_dtype="float32"):
    config = SimpleNamespace(train_dtype="float32", fsdp=SimpleNamespace(
        reduce_every_micro_step=reduce_every_micro_step, cpu_offload=cpu_offload, reduce_dtype=reduce_dtype))
    strategy = FSDPStrategy(config, SimpleNamespace(device=torch.device(device), world_size=1))
    strategy.trained_modules = {"denoiser": module}
    return strategy


def whole_gradients_held(module) -> int:
    """Elements of unsharded gradients FSDP2 keeps for the next micro step (its accumulated upcast one, or the
    unsharded parameter's own gradient when no upcast was needed)."""
    held = 0
    for unit in module.modules():
        state = getattr(unit, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for fsdp_param in group.fsdp_params if group else ():
            for grad in (fsdp_param.unsharded_accumulated_grad, fsdp_param._unsharded_param.grad):
                held += grad.numel() if grad is not None else 0
    return held


@pytest.mark.parametrize("reduce_every_micro_step", [False, True])
def test_accumulated_gradients_are_the_same_and_only_shards_are_held_when_reducing_every_micro_step(
        one_rank_group, reduce_every_micro_step):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (1,))
    for unit in (sharded[0], sharded[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    strategy = strategy_over(sharded, reduce_every_micro_step)
    batches = [torch.randn(3, 8) for _ in range(2)]
    for micro, batch in enumerate(batches):
        plain(batch).square().mean().div(2).backward()
        last = micro == len(batches) - 1
        strategy.backward(sharded(batch).square().mean(), 2, last)
        if not last:
            held = whole_gradients_held(sharded)
            assert held == (0 if reduce_every_micro_step else sum(p.numel() for p in plain.parameters()))
    assert whole_gradients_held(sharded) == 0
    for (name, expected), param in zip(plain.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), expected.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_unset_reduces_every_micro_step_where_whole_gradients_would_not_fit(monkeypatch):
    weights = torch.nn.Linear(1000, 1000)  # 1.001 M elements: 4.0 MB of float32 gradients, 2.0 MB in bfloat16
    assert whole_gradient_bytes(list(weights.parameters()), "float32") == 4_004_000
    assert not strategy_over(weights, None).reduces_every_micro_step  # on the CPU: nothing to save room on
    assert strategy_over(weights, None, cpu_offload=True).reduces_every_micro_step
    assert strategy_over(weights, False, cpu_offload=True).reduces_every_micro_step is False  # as set
    assert strategy_over(weights, True).reduces_every_micro_step
    gpu_memory = SimpleNamespace(total_memory=12_000_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu_memory)
    assert strategy_over(weights, None, device="cuda:0").reduces_every_micro_step  # 4.0 MB > 12 MB / 4
    assert not strategy_over(weights, None, device="cuda:0", reduce_dtype="bfloat16").reduces_every_micro_step
    weights.requires_grad_(False)  # a frozen part has no gradient
    assert not strategy_over(weights, None, device="cuda:0").reduces_every_micro_step
