"""CAME_8BIT (ot_dist/optim/came8bit.py): CAME with the first moment of each factored tensor above min_8bit_size kept
in bitsandbytes' 8-bit blocks, as OneTrainer's CAME_8BIT quantises. OneTrainer's CAME_8BIT factors a weight matrix and
a 1x1 convolution (as its (out, in) matrix) and steps every other tensor (a bias, a 3x3 kernel) with a full second
moment and no confidence factor, as CAME steps a vector. With nothing quantised each tensor steps exactly as
pytorch-optimizer's CAME steps it in that shape; quantised, it stays within about 1% of that path at a quarter of the
moment's bytes. (Training 2 steps: tests/test_optimizers.py; refused under fsdp / zero: tests/test_optimizers_new.py;
save and resume: tests/test_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import CAME

from ot_dist.checkpoint.shards import classify
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.optim.came8bit import CAME8bit

MINIMAL = {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o", "data": {"path": "d"}}
# a matrix, a bias, a 3x3 convolution, a matrix of exactly 1024 elements, a 1x1 convolution
SHAPES = [(64, 96), (96,), (16, 16, 3, 3), (32, 32), (48, 40, 1, 1)]
# the shape OneTrainer's CAME_8BIT steps each in: factored as a matrix, or unfactored as a vector
AS_CAME_8BIT_STEPS_THEM = [(64, 96), (96,), (16 * 16 * 9,), (32, 32), (48, 40)]


def run(cls, steps: int, shapes=SHAPES, **kwargs) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).reshape(view)) for shape, view in zip(SHAPES, shapes)]
    start = [p.detach().clone() for p in params]
    optimizer = cls(params, lr=1e-3, weight_decay=1e-2, **kwargs)
    noise = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, shape in zip(params, SHAPES):  # gradients with a steady part, so the momentum matters
            p.grad = (torch.randn(shape, generator=noise) * 0.1 + 0.05).reshape(p.shape)
        optimizer.step()
    return [(p.detach() - s).reshape(shape) for p, s, shape in zip(params, start, SHAPES)], optimizer


def test_with_nothing_quantised_each_tensor_steps_as_came_steps_it_in_onetrainers_shape():
    reference, _ = run(CAME, 5, shapes=AS_CAME_8BIT_STEPS_THEM, foreach=False)
    ours, optimizer = run(CAME8bit, 5, min_8bit_size=10**9)
    for shape, a, b in zip(SHAPES, reference, ours):
        assert torch.equal(a, b), shape
    assert not any(v.dtype == torch.uint8 for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    states = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    assert [sorted(k for k in s if k.startswith("exp_avg_sq")) for s in states] == [
        ["exp_avg_sq_col", "exp_avg_sq_row"], ["exp_avg_sq"], ["exp_avg_sq"], ["exp_avg_sq_col", "exp_avg_sq_row"],
        ["exp_avg_sq_col", "exp_avg_sq_row"]]
    assert states[4]["exp_avg_sq_row"].shape == (48,) and states[4]["exp_avg_sq_col"].shape == (40,)
    # CAME (and OneTrainer's CAME) factors the convolutions over their last two dimensions: a different step
    came, _ = run(CAME, 5, foreach=False)
    assert torch.equal(came[0], ours[0]) and torch.equal(came[1], ours[1])
    assert not torch.allclose(came[2], ours[2], rtol=0.05) and not torch.allclose(came[4], ours[4], rtol=0.05)


def test_the_first_moment_of_large_matrices_is_8_bit_and_stays_on_cames_path():
    reference, _ = run(CAME, 20, shapes=AS_CAME_8BIT_STEPS_THEM, foreach=False)
    ours, optimizer = run(CAME8bit, 20, min_8bit_size=1024, quant_block_size=256)
    states = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    # OneTrainer's rule: factored (a matrix or a 1x1 convolution) with MORE than min_8bit_size elements; the 3x3
    # convolution (2304 elements) is not factored, so it stays 32-bit
    assert [("exp_avg_8bit" in s, "exp_avg" in s) for s in states] == [(True, False), (False, True), (False, True),
                                                                       (False, True), (True, False)]
    big = states[0]
    assert big["exp_avg_8bit"].dtype == torch.uint8 and big["exp_avg_8bit"].shape == SHAPES[0]
    assert big["exp_avg_absmax"].shape == (64 * 96 // 256,)  # one float32 scale per block
    moment_bytes = big["exp_avg_8bit"].nbytes + big["exp_avg_absmax"].nbytes
    assert moment_bytes <= 0.26 * 64 * 96 * 4
    for i in (0, 4):
        a, b = reference[i].flatten(), ours[i].flatten()
        gap = ((a - b).norm() / a.norm()).item()
        assert 0 < gap < 0.02, (SHAPES[i], gap)  # quantised (not bit-equal), yet on CAME's path (1.1% after 20 steps)
    assert all(torch.equal(reference[i], ours[i]) for i in (1, 2, 3))  # unquantised tensors are untouched by it
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
    assert isinstance(optimizer, CAME8bit)
    assert group["betas"] == (0.9, 0.999, 0.9999) and group["eps1"] == 1e-30 and group["eps2"] == 1e-16
    assert group["weight_decay"] == 1e-2 and group["min_8bit_size"] == 16384 and group["quant_block_size"] == 512
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, "optimizer": {"name": "CAME_8BIT", "quant_block_size": 2000}})
    assert "optimizer.quant_block_size: 2000" in str(err.value) and "2048" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, "optimizer": {"name": "CAME", "quant_block_size": 2048}})
    assert "CAME does not take quant_block_size" in str(err.value)


def test_a_state_factored_by_the_earlier_rule_is_refused_by_name():
    """An earlier ot_dist factored a 3x3 convolution over its last two dimensions; such a state cannot continue."""
    kernel = torch.nn.Parameter(torch.zeros(4, 4, 3, 3))
    optimizer = CAME8bit([kernel], lr=1e-3)
    optimizer.state[kernel].update({"exp_avg": torch.zeros(4, 4, 3, 3), "RMS": 0.0,
                                    **{f"exp_avg_{k}_{d}": torch.zeros(4, 4, 3) for k in ("sq", "res")
                                       for d in ("row", "col")}})
    kernel.grad = torch.ones(4, 4, 3, 3)
    with pytest.raises(RuntimeError, match=r"CAME_8BIT: the state of a \(4, 4, 3, 3\) tensor was saved by an earlier"):
        optimizer.step()
