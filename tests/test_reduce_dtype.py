"""ddp.reduce_dtype: bfloat16 gradients (trained_weight_dtype bfloat16) are averaged in float32 and rounded back, by
DDP's reducer (a communication hook) and by the fused back pass's reduce alike. In a 1-rank gloo group in this process:
which dtype the collectives carry (with 2 ranks a sum of two rounds once either way; the rounding a bfloat16 ring adds
grows with the ranks), and that the gradients come back as they were (one rank: the average is the gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ot_dist.optim.fused_backward import install_fused_back_pass
from ot_dist.parallel.ddp import Replica
from ot_dist.parallel.fused_reduce import FusedGradientReduce


def bfloat16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def loss_of(model):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return model(x).float().square().mean()


@pytest.fixture
def reduced_dtypes(monkeypatch):
    """The dtype of every tensor all-reduced (gradient buckets; the fused reduce's reached flags are int32)."""
    seen, all_reduce = [], dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recorded)
    return seen


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_ddp_averages_bfloat16_gradients_in_the_reduce_dtype(one_rank_group, reduced_dtypes, reduce_dtype):
    expected = bfloat16_model()
    loss_of(expected).backward()
    model = bfloat16_model()
    Replica(model, None, reduce_dtype=reduce_dtype)
    loss_of(model).backward()
    # float32: the hook's own all-reduce; bfloat16: DDP's built-in one (no hook, nothing recorded here)
    assert reduced_dtypes == ([torch.float32] if reduce_dtype == torch.float32 else [])
    for got, want in zip(model.parameters(), expected.parameters()):
        assert got.grad.dtype == torch.bfloat16 and torch.equal(got.grad, want.grad)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_the_fused_reduce_averages_bfloat16_gradients_in_the_reduce_dtype(one_rank_group, reduced_dtypes,
                                                                          reduce_dtype):
    expected = bfloat16_model()
    loss_of(expected).backward()
    stepped = [p.detach() - 0.5 * p.grad for p in expected.parameters()]  # SGD on the bfloat16 gradient
    model = bfloat16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    install_fused_back_pass(optimizer)
    FusedGradientReduce([list(model.parameters())], torch.device("cpu"), coalesce_bytes=64,
                        reduce_dtype=reduce_dtype).connect(optimizer.fused_steps)
    loss_of(model).backward()
    assert set(reduced_dtypes) == {reduce_dtype, torch.int32}  # gradients (alone and in a bucket) and the flags
    for got, want in zip(model.parameters(), stepped):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_stochastic_reduce_rounding_needs_bfloat16_weights_averaged_in_float32(small_sd1, shapes_data, tmp_path):
    """ddp.reduce_rounding: stochastic rounds float32 averages back into bfloat16 gradients; anywhere else nothing
    would be rounded, and the config says so, naming the field (its effect: tests/test_fused_reduce.py)."""
    from conftest import base_config

    from ot_dist.config.load import validate
    from ot_dist.errors import ConfigError

    raw = base_config(small_sd1, shapes_data, tmp_path / "run", strategy="ddp", train_dtype="bfloat16",
                      trained_weight_dtype="bfloat16", ddp={"reduce_rounding": "stochastic"})
    assert validate(raw).ddp.reduce_rounding == "stochastic"
    for change, named in (({"trained_weight_dtype": "float32"}, "trained_weight_dtype: bfloat16 \\(is float32\\)"),
                          ({"ddp": {"reduce_rounding": "stochastic", "reduce_dtype": "bfloat16"}},
                           "ddp.reduce_dtype: float32 \\(is bfloat16\\)")):
        with pytest.raises(ConfigError, match="ddp.reduce_rounding: stochastic.*" + named):
            validate({**raw, **change})


def test_a_bucketed_gradient_is_held_once(one_rank_group, monkeypatch):
    """Small gradients averaged in a shared bucket: once the bucket's flat copy holds their values, their parameters
    no longer hold the gradients (each would otherwise be kept twice, in the copy and on the parameter, until its
    step). Checked at each all-reduce: no parameter of the bucket being reduced still holds its `.grad`."""
    model = bfloat16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    install_fused_back_pass(optimizer)
    params = list(model.parameters())
    FusedGradientReduce([params], torch.device("cpu"), coalesce_bytes=1 << 20).connect(optimizer.fused_steps)
    holding, all_reduce = [], dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        if tensor.is_floating_point():  # a gradient bucket (the reached flags are int32)
            holding.append([p.grad is not None for p in params])
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recorded)
    loss_of(model).backward()
    assert holding == [[False] * len(params)]  # every gradient in the one bucket, none still on its parameter
