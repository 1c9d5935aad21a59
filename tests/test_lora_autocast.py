"""LoRA layers skip peft's float32 copy of their input under autocast (ot_dist/methods/lora_autocast.py): the same
loss and gradients bit for bit, and none of those copies in the step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ot_dist.bench.architectures import BENCH_MODELS
from ot_dist.bench.setup import BenchOptions, prepare, train_config
from ot_dist.methods.lora_autocast import skip_input_copies_under_autocast as SKIP_INPUT_COPIES


class CountUpcasts(TorchDispatchMode):
    """bfloat16 -> float32 copies of tensors with at least `min_numel` elements (activations, not LoRA weights)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.count = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.float32:
            source = args[0]
            if source.dtype is torch.bfloat16 and source.numel() >= self.min_numel:
                self.count += 1
        return func(*args, **kwargs)


def lora_step(tmp_path, skip: bool, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """One bf16-autocast LoRA forward + backward of the tiny SDXL UNet (the bench's trainer path, on the CPU):
    the loss, the adapters' gradients, the activation upcasts counted and the LoRA layers changed."""
    import ot_dist.methods.lora_autocast as lora_autocast
    import ot_dist.methods.lora_block_casts as lora_block_casts

    changed = []
    real = SKIP_INPUT_COPIES
    monkeypatch.setattr(lora_autocast, "skip_input_copies_under_autocast",
                        lambda module, adapter: changed.append(real(module, adapter) if skip else 0))
    # every layer on its own casts, where the input copy is made (block casts bypass it: test_block_casts.py)
    monkeypatch.setattr(lora_block_casts, "cast_adapters_per_block", lambda *args: 0)
    options = BenchOptions(model="tiny-sdxl", method="lora", lora_rank=4, resolution=64, batch_size=2,
                           dtype="bf16", device="cpu")
    bench = BENCH_MODELS[options.model]
    run = prepare(bench, options, train_config(bench, options, str(tmp_path)), torch.device("cpu"))
    smallest_activation = 2 * 16  # batch x the smallest adapted layer's tokens or pixels at 64 px
    with CountUpcasts(smallest_activation) as upcasts:
        loss = run.loss()
        run.backward(loss)
    grads = {name: p.grad.clone() for name, p in run.model.denoiser.named_parameters() if p.grad is not None}
    return loss.detach(), grads, upcasts.count, sum(changed)


def test_lora_under_autocast_computes_the_same_bits_without_the_input_copies(tmp_path, monkeypatch):
    loss_peft, grads_peft, upcasts_peft, _ = lora_step(tmp_path / "peft", False, monkeypatch)
    loss_skip, grads_skip, upcasts_skip, layers = lora_step(tmp_path / "skip", True, monkeypatch)
    assert layers > 10  # every adapted attention projection of the UNet
    assert grads_skip.keys() == grads_peft.keys() and len(grads_skip) == 2 * layers
    assert torch.equal(loss_skip, loss_peft)
    for name, grad in grads_skip.items():
        assert torch.equal(grad, grads_peft[name]), name
    # peft copies each adapted layer's input to float32 in forward (and its gradient back in backward)
    assert upcasts_peft - upcasts_skip >= layers
    assert upcasts_skip < upcasts_peft


def test_without_autocast_the_input_is_still_cast_to_the_adapter_dtype():
    from peft import LoraConfig, inject_adapter_in_model

    from ot_dist.methods.lora_autocast import skip_input_copies_under_autocast

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), model, adapter_name="default")
    assert skip_input_copies_under_autocast(model, "default") == 1
    layer = model[0]
    layer.base_layer.to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert layer._cast_input_dtype(x, torch.float32).dtype is torch.float32  # no autocast: peft's cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer._cast_input_dtype(x, torch.float32) is x
        out = model(x)
    assert out.dtype is torch.bfloat16


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layers_whose_input_is_used_outside_autocast_ops_keep_the_cast(dropout):
    from peft import LoraConfig, inject_adapter_in_model

    from ot_dist.methods.lora_autocast import skip_input_copies_under_autocast

    for dora in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], lora_dropout=dropout, use_dora=dora), model,
                                adapter_name="default")
        expected = int(not dora and not dropout)
        assert skip_input_copies_under_autocast(model, "default") == expected, (dora, dropout)
