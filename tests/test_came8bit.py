"""CAME_8BIT (ot_dist/optim/came8bit.py): pytorch-optimizer's CAME with the first moment of each weight matrix above
min_8bit_size kept in bitsandbytes' 8-bit blocks, as OneTrainer's CAME_8BIT quantises. With nothing quantised it
steps exactly as CAME; quantised, it stays within about 1% of CAME's path at a quarter of the moment's bytes.
(Training 2 steps: tests/test_optimizers.py; refused under fsdp / zero: tests/test_optimizers_new.py; save and
resume: tests/test_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import CAME

from ot_dist.checkpoint.shards import classify
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.optim.came8bit import CAME8bit, came8bit_class

MINIMAL = {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o", "data": {"path": "d"}}
SHAPES = [(64, 96), (96,), (8, 4, 3, 3), (32, 32)]  # a matrix, a bias, a 3x3 conv (factored over its last two
# dimensions, as pytorch-optimizer's CAME factors it), a matrix of exactly 1024 elements


def run(cls, steps: int, **kwargs) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    start = [p.detach().clone() for p in params]
    optimizer = cls(params, lr=1e-3, weight_decay=1e-2, **kwargs)
    noise = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:  # gradients with a steady part, so the momentum matters
            p.grad = torch.randn(p.shape, generator=noise) * 0.1 + 0.05
        optimizer.step()
    return [p.detach() - s for p, s in zip(params, start)], optimizer


def test_with_nothing_quantised_it_steps_exactly_as_came():
    came, _ = run(CAME, 5, foreach=False)
    ours, optimizer = run(CAME8bit, 5, min_8bit_size=10**9)
    assert all(torch.equal(a, b) for a, b in zip(came, ours))
    assert not any(v.dtype == torch.uint8 for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    batched, _ = run(CAME, 5)  # CAME's default (foreach) path: the same arithmetic, batched
    assert max((a - b).abs().max().item() for a, b in zip(came, batched)) <= 1e-7


def test_the_first_moment_of_large_matrices_is_8_bit_and_stays_on_cames_path():
    came, _ = run(CAME, 20, foreach=False)
    ours, optimizer = run(CAME8bit, 20, min_8bit_size=1024, quant_block_size=256)
    states = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    # OneTrainer's rule: factored (2-D and up) with MORE than min_8bit_size elements
    assert [("exp_avg_8bit" in s, "exp_avg" in s) for s in states] == [(True, False), (False, True), (False, True),
                                                                       (False, True)]
    big = states[0]
    assert big["exp_avg_8bit"].dtype == torch.uint8 and big["exp_avg_8bit"].shape == SHAPES[0]
    assert big["exp_avg_absmax"].shape == (64 * 96 // 256,)  # one float32 scale per block
    moment_bytes = big["exp_avg_8bit"].nbytes + big["exp_avg_absmax"].nbytes
    assert moment_bytes <= 0.26 * 64 * 96 * 4
    a, b = came[0].flatten(), ours[0].flatten()
    gap = ((a - b).norm() / a.norm()).item()
    assert 0 < gap < 0.02, gap  # quantised (not bit-equal), yet on CAME's path (measured 1.1% after 20 steps)
    assert all(torch.equal(x, y) for x, y in zip(came[1:], ours[1:]))  # unquantised tensors are untouched by it
    # the checkpoint keeps 8-bit moments and their scales together, in the layout that saved them
    assert classify(big, torch.Size(SHAPES[0])) == {"exp_avg_8bit": "opaque", "exp_avg_absmax": "opaque",
                                                   "exp_avg_sq_row": "opaque", "exp_avg_sq_col": "opaque",
                                                   "exp_avg_res_row": "opaque", "exp_avg_res_col": "opaque",
                                                   "RMS": "scalar"}


def test_defaults_and_block_size_reach_the_optimizer_and_bad_block_sizes_are_config_errors():
    from ot_dist.methods.base import ParamGroup
    from ot_dist.optim.factory import build_optimizer

    config = validate({**MINIMAL, "optimizer": {"name": "CAME_8BIT", "quant_block_size": 512}}).optimizer
    optimizer = build_optimizer(config, [ParamGroup("unet", [torch.nn.Parameter(torch.zeros(3, 3))], 1e-4)])
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, came8bit_class())
    assert group["betas"] == (0.9, 0.999, 0.9999) and group["eps1"] == 1e-30 and group["eps2"] == 1e-16
    assert group["weight_decay"] == 1e-2 and group["min_8bit_size"] == 16384 and group["quant_block_size"] == 512
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, "optimizer": {"name": "CAME_8BIT", "quant_block_size": 2000}})
    assert "optimizer.quant_block_size: 2000" in str(err.value) and "2048" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, "optimizer": {"name": "CAME", "quant_block_size": 2048}})
    assert "CAME does not take quant_block_size" in str(err.value)
