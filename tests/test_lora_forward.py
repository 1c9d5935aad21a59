"""The fused LoRA up projection (ot_dist/methods/lora_forward.py): peft's sum within rounding, forward and backward,
fewer kernels and no full-size multiply or add per layer, and peft's forward wherever the fused form would not
reproduce it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ot_dist.methods.lora_forward import fuse_up_projections

VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default,
         torch.ops.aten.transpose.int, torch.ops.aten.reshape.default, torch.ops.aten.expand.default,
         torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class CountKernels(TorchDispatchMode):
    """Ops that compute (a kernel on a GPU), views left out; and multiplies / adds over at least `full` elements."""

    def __init__(self, full: int):
        super().__init__()
        self.full, self.count, self.full_size = full, 0, {"mul": 0, "add": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in VIEWS:
            self.count += 1
        name = func.overloadpacket.__name__.rstrip("_")
        if name in self.full_size and isinstance(out, torch.Tensor) and out.numel() >= self.full:
            self.full_size[name] += 1
        return out


def adapted(scaling_alpha: float = 8.0, layers: int = 3) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=scaling_alpha, target_modules=[str(i) for i in range(layers)],
                                       init_lora_weights=False), model, adapter_name="default")
    return model


def run(model, x, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_layers_give_peft_sum_and_gradients(autocast):
    peft_model = adapted()
    fused_model = copy.deepcopy(peft_model)
    assert len(fuse_up_projections(fused_model, "default")) == 3
    for p in [*peft_model.parameters(), *fused_model.parameters()]:
        p.requires_grad_(True)  # the base weights' gradients too: the fused sum feeds them
    x = torch.randn(2, 5, 32)
    out_peft, grads_peft = run(peft_model, x, autocast)
    out_fused, grads_fused = run(fused_model, x, autocast)
    assert out_fused.dtype == out_peft.dtype
    # bfloat16 rounds the two sums differently (the fused one once, in float32): relative to the values' size
    tolerance = 2e-2 if autocast else 1e-6
    assert relative_distance(out_fused, out_peft) < tolerance
    assert grads_fused.keys() == grads_peft.keys() and any("lora_B" in n for n in grads_fused)
    for name, grad in grads_fused.items():
        assert relative_distance(grad, grads_peft[name]) < tolerance, name


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fused_layers_launch_fewer_kernels():
    peft_model = adapted(layers=4)
    fused_model = copy.deepcopy(peft_model)
    fuse_up_projections(fused_model, "default")
    x = torch.randn(2, 5, 32)
    counted = []
    for model in (peft_model, fused_model):
        with CountKernels(full=x.numel()) as kernels:
            run(model, x, autocast=True)
        counted.append(kernels)
    peft, fused = counted
    # per layer: the full-size multiply (forward and backward) and add (forward) are gone; the scale moves to the
    # rank-wide features; the adds that remain sum each input's two gradients (base and adapter path)
    assert peft.full_size["mul"] - fused.full_size["mul"] == 2 * 4
    assert peft.full_size["add"] - fused.full_size["add"] == 4
    assert peft.count - fused.count >= 4, (peft.count, fused.count)


def test_peft_forward_where_the_fused_form_would_differ():
    model = adapted(layers=1)
    fuse_up_projections(model, "default")
    layer = model[0]
    x = torch.randn(3, 32)
    up_calls = []
    layer.lora_B["default"].register_forward_pre_hook(lambda module, args: up_calls.append(1))
    model(x)
    assert up_calls == [1]  # a hook on the up projection (ZeRO-3 gathers in one): peft's path calls the module
    with torch.no_grad():
        layer._disable_adapters = True  # what peft's disable_adapters property reads
        torch.testing.assert_close(model(x), layer.base_layer(x))
        layer._disable_adapters = False
        assert not torch.allclose(model(x), layer.base_layer(x))


@pytest.mark.parametrize("setting", ["dropout", "dora", "bias"])
def test_layers_the_fused_form_does_not_cover_keep_peft(setting):
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    options = {"dropout": dict(lora_dropout=0.1), "dora": dict(use_dora=True), "bias": dict(lora_bias=True)}[setting]
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], **options), model, adapter_name="default")
    assert fuse_up_projections(model, "default") == []


def test_mixed_dtypes_outside_autocast_take_peft_sum():
    peft_model = adapted(layers=1)
    fused_model = copy.deepcopy(peft_model)
    fuse_up_projections(fused_model, "default")
    for model in (peft_model, fused_model):
        model[0].base_layer.to(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        expected, got = peft_model(x), fused_model(x)
    assert got.dtype is expected.dtype is torch.bfloat16
    assert torch.equal(got, expected)


def test_lora_training_uses_the_fused_layers(tmp_path):
    from ot_dist.bench.architectures import BENCH_MODELS
    from ot_dist.bench.setup import BenchOptions, prepare, train_config
    from ot_dist.methods.lora_forward import _fused_forward

    options = BenchOptions(model="tiny-sdxl", method="lora", lora_rank=4, resolution=64, batch_size=1, device="cpu")
    bench = BENCH_MODELS[options.model]
    run_ = prepare(bench, options, train_config(bench, options, str(tmp_path)), torch.device("cpu"),
                   with_optimizer=False)
    fused = [m for m in run_.model.denoiser.modules() if getattr(m.forward, "__func__", None) is _fused_forward]
    assert len(fused) > 10
