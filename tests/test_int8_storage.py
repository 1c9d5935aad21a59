"""`weight_dtype: int8` (memory/int8.py): frozen Linear weights in int8 computing in int8 matmuls, OneTrainer's
INT_W8A8. The stored weight, the forward and the input gradient against OneTrainer's formulas
(modules/util/quantization_util.py quantize_int8_tensorwise / _axiswise, modules/module/quantized/LinearW8A8.py
int8_forward_tokenwise / int8_backward_axiswise) computed here in plain integer arithmetic, the small-input path,
what backward keeps, state dicts, a tiny LoRA run against the bfloat16 one, the importer's INT_W8A8 and the refusals
(gradient checkpointing: tests/test_nf4_storage.py, with the other stored formats)."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.checkpoint.frozen_source import held_as_loaded
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory.placement import quantize_frozen
from ot_dist.train.trainer import Trainer

# A 3-step LoRA run's losses against the bfloat16-stored run's (tiny SD 1.x, every Linear of the UNet, text encoder
# and VAE in int8): measured within 0.1 % (0.05 %, 0.08 %, 0.01 %) (docs/low-memory.md "int8 accuracy").
INT8_LOSS_RTOL = 0.02


def onetrainer_tensorwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_tensorwise: scale max|w| / 127 (at least 1e-30), values rounded and clamped to int8."""
    scale = (w.abs().max().float() / 127.0).clamp(min=1e-30)
    return w.float().mul(1.0 / scale).round_().clamp_(-128.0, 127.0).to(torch.int8), scale


def onetrainer_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_axiswise(x, dim=-1)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(min=1e-30)
    return x.float().mul(1.0 / scale).round_().clamp_(-128.0, 127.0).to(torch.int8), scale


def stored_linear(i: int, o: int, bias: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(i, o, bias=bias)).requires_grad_(False)
    reference = model[0].weight.detach().clone(), None if not bias else model[0].bias.detach().clone()
    quantize_frozen(model, "int8", torch.float32)
    return model, reference


def test_the_stored_weight_is_onetrainers_int_w8a8():
    model, (weight, _) = stored_linear(96, 40)
    expected, scale = onetrainer_tensorwise(weight)
    assert model[0]._parameters["weight"].dtype == torch.int8
    assert torch.equal(model[0]._parameters["weight"], expected)
    torch.testing.assert_close(model[0].weight, expected.float() * scale, rtol=0, atol=0)  # `.weight`: dequantized
    zero = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False)).requires_grad_(False)
    torch.nn.init.zeros_(zero[0].weight)
    quantize_frozen(zero, "int8", torch.float32)
    assert torch.equal(zero[0].weight, torch.zeros(8, 16))  # the scale floor keeps an all-zero weight zero


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_input_gradient_are_onetrainers_int8_products(bias):
    """More than 16 rows: input and output gradient quantized per row, multiplied in int8 with int32 sums, scaled
    back by both scales; bit for bit what the formulas give in integer arithmetic. Nothing but the int8 weight (and
    its scale) is kept for backward."""
    model, (weight, b) = stored_linear(64, 48, bias=bias)
    w8, w_scale = onetrainer_tensorwise(weight)
    x = torch.randn(3, 7, 64, requires_grad=True)  # 21 rows
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    x8, x_scale = onetrainer_rowwise(x.detach().reshape(-1, 64))
    expected = (x8.int() @ w8.int().T).float().mul_(w_scale * x_scale)
    expected = (expected + b if bias else expected).reshape(3, 7, 48)
    assert torch.equal(out, expected)
    assert not any(t.numel() >= weight.numel() and t.dtype != torch.int8 for t in saved)
    grad = torch.randn(3, 7, 48)
    out.backward(grad)
    g8, g_scale = onetrainer_rowwise(grad.reshape(-1, 48))
    expected_grad = (g8.int() @ w8.int()).float().mul_(w_scale * g_scale).reshape(3, 7, 64)
    assert torch.equal(x.grad, expected_grad)
    reference = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(reference, weight, b).backward(grad)
    assert (x.grad - reference.grad).norm() / reference.grad.norm() < 0.02  # int8 rounding, measured ~0.008


def test_bfloat16_products_round_once_as_onetrainers():
    """Under bfloat16 autocast (how training runs): OneTrainer's int8_forward_tokenwise rescales the int32 products
    in float32, rounds them to bfloat16 and adds the bias there; its backward rounds the rescaled input gradient to
    the input's dtype. Same bits here, where each is done in fewer passes over the activations."""
    model, (weight, b) = stored_linear(64, 48)
    w8, w_scale = onetrainer_tensorwise(weight)
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    x8, x_scale = onetrainer_rowwise(x.detach().reshape(-1, 64))
    expected = (x8.int() @ w8.int().T).float().mul_(w_scale * x_scale).to(torch.bfloat16).add_(b.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.reshape(3, 7, 48))
    grad = torch.randn(3, 7, 48, dtype=torch.bfloat16)
    out.backward(grad)
    g8, g_scale = onetrainer_rowwise(grad.reshape(-1, 48))
    expected_grad = (g8.int() @ w8.int()).float().mul_(w_scale * g_scale).to(torch.bfloat16)
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, expected_grad.reshape(3, 7, 64))


def test_an_int8_layer_makes_few_passes_over_its_activations():
    """In eager mode every elementwise op is a kernel reading and writing activation-sized memory, which made int8
    storage 2.3x slower than bfloat16 for SDXL LoRA on an H200: count the activation-sized ops of one layer's
    forward and backward (views and the matmul itself aside). Forward: scale the input, round, clamp, cast to int8,
    rescale the products into the output, add the bias; backward the same without the bias."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows, inner, outer = 256, 256, 128
    model, _ = stored_linear(inner, outer)
    x = torch.randn(rows, inner, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, outer, dtype=torch.bfloat16)
    # metadata, allocation, the matmul, and the weight's column-major copy for cuBLAS (weight-sized, not activations)
    free = {"view", "_unsafe_view", "detach", "t", "empty", "_int_mm", "clone"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if isinstance(out, torch.Tensor) and out.numel() >= rows * outer and name not in free:
                self.ops.append(name)
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Count() as forward:
            out = model(x)
    assert forward.ops == ["mul", "round_", "clamp_", "_to_copy", "mul", "add_"], forward.ops
    with Count() as backward:
        out.backward(grad)
    assert backward.ops == ["mul", "round_", "clamp_", "_to_copy", "mul"], backward.ops


def test_small_inputs_and_odd_shapes_use_the_dequantized_weight():
    """16 rows or fewer (OneTrainer's rule) or a side cuBLAS's int8 kernel refuses (not a multiple of 8): linear with
    the dequantized weight, in the autocast dtype when autocast is on."""
    model, (weight, b) = stored_linear(64, 48)
    dequantized = model[0].weight
    x = torch.randn(16, 64)
    assert torch.equal(model(x), torch.nn.functional.linear(x, dequantized, b))
    odd, (odd_weight, odd_bias) = stored_linear(60, 48)
    y = torch.randn(32, 60)
    assert torch.equal(odd(y), torch.nn.functional.linear(y, odd[0].weight, odd_bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(40, 64)).dtype == torch.bfloat16


def test_the_state_dict_is_a_normal_one_and_loading_quantizes():
    model, (weight, bias) = stored_linear(64, 32)
    state = model.state_dict()
    assert state["0.weight"].dtype == torch.float32 and state["0.weight"].shape == weight.shape
    assert (state["0.weight"] - weight).abs().max() <= weight.abs().max() / 127 / 2 + 1e-7  # half a step
    assert not held_as_loaded(model)  # full exports read the frozen parts from model.path again
    other, (other_weight, _) = stored_linear(64, 32, seed=1)
    model.load_state_dict(other.state_dict())
    assert torch.equal(model[0]._parameters["weight"], other[0]._parameters["weight"])
    assert torch.equal(model[0].weight, other[0].weight)


def test_a_lora_run_on_int8_base_weights_trains_close_to_the_bfloat16_one(tiny_models, shapes_data, tmp_path):
    losses = {}
    for weight_dtype in ("bfloat16", "int8"):
        raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / weight_dtype, method="lora", max_steps=3,
                          weight_dtype=weight_dtype, gradient_checkpointing=True)
        trainer = Trainer(validate(raw), log=lambda *_: None)
        if weight_dtype == "int8":
            linears = [m for c in (trainer.model.denoiser, trainer.model.vae, *trainer.model.text_encoders.values())
                       for m in c.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
            assert linears and all(m._parameters["weight"].dtype == torch.int8 for m in linears)
        losses[weight_dtype] = trainer.train().losses
    print(f"losses bfloat16 {losses['bfloat16']}, int8 {losses['int8']}")
    assert losses["int8"] != losses["bfloat16"]
    torch.testing.assert_close(torch.tensor(losses["int8"]), torch.tensor(losses["bfloat16"]), rtol=INT8_LOSS_RTOL,
                               atol=0)
    assert load_file(tmp_path / "int8" / "lora.safetensors")


def test_int8_needs_strategy_single_or_ddp(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, method="lora", strategy="zero2",
                      **{"unet.weight_dtype": "int8"})
    with pytest.raises(ConfigError, match="unet.weight_dtype: int8 storage is supported with strategy single or ddp"):
        validate(raw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_int8_products_are_the_formulas():
    """On a GPU the products run on cuBLAS's int8 kernel (torch._int_mm): int32 sums are exact, so forward and input
    gradient equal integer arithmetic on the CPU bit for bit, under bfloat16 autocast too. The per-row quantization
    is OneTrainer's formula computed on the GPU, as OneTrainer computes it there: CUDA divides by the Python scalar
    127 as a multiplication by its reciprocal, which can move a scale by one unit in the last place from the CPU's."""
    model, (weight, b) = stored_linear(128, 64)
    model.cuda()
    w8, w_scale = onetrainer_tensorwise(weight)
    x = torch.randn(4, 32, 128, device="cuda", requires_grad=True)
    out = model(x)
    x8, x_scale = (t.cpu() for t in onetrainer_rowwise(x.detach().reshape(-1, 128)))
    expected = ((x8.int() @ w8.int().T).float().mul_(w_scale * x_scale) + b).reshape(4, 32, 64)
    assert torch.equal(out.cpu(), expected)
    grad = torch.randn(4, 32, 64, device="cuda")
    out.backward(grad)
    g8, g_scale = (t.cpu() for t in onetrainer_rowwise(grad.reshape(-1, 64)))
    assert torch.equal(x.grad.cpu(), (g8.int() @ w8.int()).float().mul_(w_scale * g_scale).reshape(4, 32, 128))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16


def test_quantization_layer_filter_stores_only_the_chosen_layers(family_models, shapes_data, tmp_path):
    """quantization.layer_filter (OneTrainer's quantization section, on the denoiser): only the Linear layers of
    the transformer whose path contains a pattern are stored quantized; its other layers keep the compute dtype, and
    the text encoders are stored whole as their weight_dtype says. A pattern that selects nothing, and a filter on an
    unquantized denoiser, are refused naming the field."""
    def config(out="o", **overrides):
        return validate(base_config(family_models["flux"], shapes_data, tmp_path / out, family="flux", method="lora",
                                    max_steps=1, batch_size=2, **overrides))

    trainer = Trainer(config(weight_dtype="int8", **{"quantization.layer_filter": ["single_transformer_blocks"]}),
                      log=lambda *_: None)
    frozen = {name: m for name, m in trainer.model.denoiser.named_modules()
              if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
    chosen = {name for name in frozen if "single_transformer_blocks" in name}
    assert chosen and len(chosen) < len(frozen)
    for name, layer in frozen.items():
        assert layer._parameters["weight"].dtype == (torch.int8 if name in chosen else torch.float32), name
    encoder = [m for m in trainer.model.text_encoders["text_encoder_2"].modules() if isinstance(m, torch.nn.Linear)]
    assert encoder and all(m._parameters["weight"].dtype == torch.int8 for m in encoder)
    assert trainer.train().losses
    with pytest.raises(ConfigError, match=r"quantization.layer_filter\[1\]: 'no_such_block' selects no Linear layer"):
        Trainer(config("refused", weight_dtype="int8", **{"quantization.layer_filter": ["blocks", "no_such_block"]}),
                log=lambda *_: None)
    with pytest.raises(ConfigError, match="quantization.layer_filter: chooses the transformer's layers a quantized"):
        config(**{"quantization.layer_filter": ["blocks"]})
    with pytest.raises(ConfigError, match=r"quantization.layer_filter\[0\]: '\(a' is not a regular expression"):
        config(weight_dtype="int8", **{"quantization.layer_filter": ["(a"], "quantization.layer_filter_regex": True})
    with pytest.raises(ConfigError, match="quantization.layer_filter_regex: reads quantization.layer_filter's"):
        config(weight_dtype="int8", **{"quantization.layer_filter_regex": True})
