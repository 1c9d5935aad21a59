"""ShardedProdigy: prodigyopt's results in one process, the same d on any sharded layout, one
collective and no host sync per step whatever the number of tensors (d stays on the device)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import prodigyopt
import pytest
from forked_ranks import run_ranks
import torch
from torch.overrides import TorchFunctionMode

from ot_dist.optim.prodigy import ShardedProdigy

REPO = Path(__file__).resolve().parents[1]


def toy(width: int = 31, depth: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(13, width), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 5))


def train(cls, steps: int = 20, model=None, lrs=None, chunking=None, **options):
    model = model or toy()
    optimizer = cls(model.parameters(), lr=1.0, **options)
    if chunking is not None:
        optimizer.chunking = chunking
    d = []
    for i in range(steps):
        if lrs is not None:
            optimizer.param_groups[0]["lr"] = lrs[i]
        x = torch.randn(8, 13, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        d.append(optimizer.param_groups[0]["d"])
    return d, [p.detach().clone() for p in model.parameters()]


OPTIONS = [
    {},
    {"slice_p": 11},
    {"weight_decay": 0.1},
    {"weight_decay": 0.1, "decouple": False},
    {"use_bias_correction": True, "safeguard_warmup": True, "betas": (0.0, 0.99)},
    {"d_coef": 2.0, "growth_rate": 1.05},
]


@pytest.mark.parametrize("options", OPTIONS, ids=[",".join(o) or "defaults" for o in OPTIONS])
def test_one_process_matches_prodigyopt(options):
    d_ref, w_ref = train(prodigyopt.Prodigy, **options)
    d_got, w_got = train(ShardedProdigy, **options)
    assert d_ref[-1] > 4 * d_ref[0]  # d grew: the comparison covers the estimate, not just d0
    # Only float rounding separates the two (prodigyopt sums each tensor in float32 on the host).
    assert max(abs(a - b) / a for a, b in zip(d_ref, d_got)) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(w_ref, w_got)) < 1e-4


def test_the_multi_tensor_branch_equals_the_per_tensor_branch():
    """The accelerator's foreach chunk and the CPU's per-tensor loop are the same arithmetic: equal d and
    weights over 20 steps, with several tensors per group (a chunk of one would test nothing)."""
    for options in OPTIONS:
        d_one, w_one = train(ShardedProdigy, chunking="per_tensor", model=toy(depth=3), **options)
        d_all, w_all = train(ShardedProdigy, chunking="whole", model=toy(depth=3), **options)
        assert max(abs(a - b) / a for a, b in zip(d_one, d_all)) < 1e-12, options
        assert max((a - b).abs().max().item() for a, b in zip(w_one, w_all)) < 1e-6, options


def test_steps_at_learning_rate_zero_change_nothing_and_do_not_count():
    lrs = [0.0, 0.0, 0.0] + [1.0] * 17
    d_ref, w_ref = train(prodigyopt.Prodigy, lrs=lrs)
    d_got, w_got = train(ShardedProdigy, lrs=lrs)
    assert d_got[:3] == [1e-6] * 3 and d_got[-1] > 1e-5
    assert max(abs(a - b) / a for a, b in zip(d_ref, d_got)) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(w_ref, w_got)) < 1e-4


class HostSyncs(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host (what stalls a GPU stream)."""

    SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "any"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(cls, depth: int) -> float:
    model = toy(depth=depth)
    optimizer = cls(model.parameters(), lr=1.0)
    model(torch.randn(4, 13)).pow(2).mean().backward()
    optimizer.step()  # state initialisation happens once, not per step
    model(torch.randn(4, 13)).pow(2).mean().backward()
    with HostSyncs() as syncs:
        optimizer.step()
    return syncs.count


def test_no_host_sync_in_the_step_whatever_the_number_of_tensors():
    few, many = syncs_per_step(ShardedProdigy, depth=1), syncs_per_step(ShardedProdigy, depth=12)
    assert few == many == 0  # the estimate d is a device tensor: reduced and used there, read only to log
    # prodigyopt syncs for every tensor: what this replaces
    assert syncs_per_step(prodigyopt.Prodigy, depth=12) > 4 * syncs_per_step(prodigyopt.Prodigy, depth=1)


def test_state_dict_round_trip_continues_identically():
    model_a = toy()
    d_a, w_a = train(ShardedProdigy, steps=10, model=model_a, slice_p=3)
    model_b = toy()
    optimizer = ShardedProdigy(model_b.parameters(), lr=1.0, slice_p=3)
    for i in range(5):
        model_b(torch.randn(8, 13, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved_model, saved_optimizer = toy(), None
    saved_model.load_state_dict(model_b.state_dict())
    saved_optimizer = ShardedProdigy(saved_model.parameters(), lr=1.0, slice_p=3)
    saved_optimizer.load_state_dict(optimizer.state_dict())
    for i in range(5, 10):
        saved_model(torch.randn(8, 13, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        saved_optimizer.step()
        saved_optimizer.zero_grad()
    assert saved_optimizer.param_groups[0]["d"] == d_a[-1]
    assert all(torch.equal(a, b) for a, b in zip(w_a, saved_model.parameters()))


def test_every_sharded_layout_gives_the_single_process_d(tmp_path):
    """2 ranks on the same batch: the gradients equal the single-process ones bit for bit, so d may
    differ only by float64 rounding of the sharded sums."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_ranks(str(REPO / "tests" / "helpers" / "prodigy_layouts.py"), str(tmp_path / "r.json"),
        env=env, timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((tmp_path / "r.json").read_text())
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from prodigy_layouts import STEPS, batch, toy_model

    for slice_p in (1, 11):
        model = toy_model()
        optimizer = ShardedProdigy(model.parameters(), lr=1.0, slice_p=slice_p, weight_decay=0.01)
        d_ref = []
        for i in range(STEPS):
            model(batch(i)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            d_ref.append(optimizer.param_groups[0]["d"])
        assert d_ref[-1] > 100 * d_ref[0]
        for layout in ("fsdp", "zero2", "zero3"):
            got = results[f"{layout}/{slice_p}"]
            assert max(abs(a - b) / a for a, b in zip(d_ref, got["d"])) <= 1e-6, (layout, slice_p)
            for name, p in model.named_parameters():
                diff = (p.detach().flatten() - torch.tensor(got["weights"][name])).abs().max().item()
                assert diff <= 1e-5, (layout, slice_p, name, diff)
            assert got["collectives"] == STEPS, layout  # exactly one all-reduce per optimizer step
            assert got["ownership_reassembles"] == 0.0, layout
    # the (1, 9) layer's FSDP shards on rank 1 are empty, and rank 1 still took part in every reduction
    assert results["fsdp/1"]["empty_local_tensors"] >= 1
