"""`weight_dtype: int8`: frozen Linear weights in one byte each, computing in int8 matmuls (OneTrainer's INT_W8A8).

Every frozen nn.Linear weight is quantized as OneTrainer's LinearW8A8 does it (modules/module/quantized/LinearW8A8.py,
modules/util/quantization_util.py): one scale per tensor, max |w| / 127 (at least 1e-30), values rounded and clamped
to [-128, 127]. A forward of more than 16 rows quantizes its input per row (max |x| / 127 each) and multiplies in int8
with int32 sums (`torch._int_mm`: int8 tensor cores on a GPU), scaled back by both scales, then adds the bias in the
compute dtype; its input gradient quantizes the output gradient per row the same way and multiplies it by the int8
weight. 16 rows or fewer, or a shape cuBLAS's int8 kernel refuses (a side under 16 or not a multiple of 8), compute with
the dequantized weight instead, as OneTrainer's forward does for small inputs. The other frozen parameters of the
component are held in the compute dtype, as with nf4 storage (memory/nf4.py; what they share: memory/stored.py).

Only the input gradient is computed: the weight is frozen (a LoRA's base). `state_dict()` gives the dequantized
float32 weight under the original key; loading one quantizes it. Full exports take the frozen parts from model.path.
"""

from __future__ import annotations

import torch

from ot_dist.memory.stored import (
    COMPUTE_DTYPE_ATTR,
    LinearStorage,
    StoredParts,
    StoredWeightOp,
    call_dtype,
    dequantizes,
    quantize_loaded_weight,
    store_linear_weights,
)

INT8_MAX = 127.0
MIN_SCALE = 1e-30  # OneTrainer's clamp: an all-zero tensor keeps a usable scale
MIN_ROWS = 16  # OneTrainer's LinearW8A8: int8 matmuls for more rows than this (torch._int_mm needs them on CUDA)
SCALE_BUFFER = "int8_scale"


def quantize(tensor: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale) with tensor ~= values x scale: one scale for the tensor, or per slice along
    `dim` (keepdim), as quantize_int8_tensorwise / quantize_int8_axiswise compute them, bit for bit, in fewer passes
    over an activation: max |x| as max(-min x, max x) in one read (no |x| written), and the bfloat16 input
    multiplied by the float32 reciprocal scale straight into float32 (no float32 copy of the input first)."""
    tensor = tensor.detach()
    if dim is None:
        amax = tensor.abs().max()
    else:
        low, high = torch.aminmax(tensor, dim=dim, keepdim=True)
        amax = torch.maximum(low.neg(), high)
    scale = (amax.float() / INT8_MAX).clamp(min=MIN_SCALE)
    scaled = torch.mul(tensor, 1.0 / scale)  # float32: bfloat16 to float32 is exact, so the product is unchanged
    return scaled.round_().clamp_(-128.0, 127.0).to(torch.int8), scale


def rescaled(products: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """products.float() * scale rounded to `dtype` in one pass: the float32 product is computed as
    `.float().mul_(scale).to(dtype)` computes it, and rounded once as it is written."""
    if torch.compiler.is_compiling():  # inductor fuses the plain form, and an out= argument can break its graph
        return products.float().mul_(scale).to(dtype)
    out = torch.empty(products.shape, dtype=dtype, device=products.device)
    return torch.mul(products, scale, out=out)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (stored.float() * scale).to(dtype)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in int8 with int32 sums; `b` passed column-major, the layout cuBLASLt's int8 kernel takes."""
    return torch._int_mm(a.contiguous(), b.t().contiguous().t())


def takes_int8(rows: int, inner: int, out: int) -> bool:
    """Whether a product of these sizes runs in int8: more than MIN_ROWS rows, and sides cuBLAS's int8 kernel takes
    (at least 16 and a multiple of 8, forward and backward: the weight's two sides are each the inner one once)."""
    return rows > MIN_ROWS and all(side >= 16 and side % 8 == 0 for side in (inner, out))


class Int8LinearOp(torch.autograd.Function):
    """x @ W^T (+ bias) with int8 operands, the int8 weight and its scale saved (nothing of weight size in another
    dtype); the gradient for x only."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias):
        dtype = call_dtype(x)
        rows = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            x8, x_scale = quantize(rows, dim=-1)
            out = rescaled(int8_matmul(x8, weight.t()), scale * x_scale, dtype)
            if bias is not None:
                out.add_(bias.to(dtype))
        ctx.save_for_backward(weight, scale)
        ctx.input_dtype = x.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight, scale = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        g8, g_scale = quantize(rows, dim=-1)
        grad_x = rescaled(int8_matmul(g8, weight), scale * g_scale, ctx.input_dtype)
        return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1]), None, None, None


def store_frozen_in_int8(component: torch.nn.Module, dtype: torch.dtype, keep: frozenset[int] = frozenset()) -> int:
    """Store the weight of every frozen nn.Linear of `component` in int8 (W8A8), computing in `dtype` around the int8
    products; every other frozen floating-point parameter is cast to `dtype` (stored.store_linear_weights). An OFT
    layer's frozen weight stays in `dtype` (its forward rotates the weight, no int8 product). Returns the weights
    stored (elements)."""
    return store_linear_weights(component, dtype, keep, INT8)


def _store(module: torch.nn.Module, weight: torch.Tensor) -> None:
    stored, buffers = _quantized_with_scale(weight.float())
    module._parameters["weight"] = torch.nn.Parameter(stored, requires_grad=False)
    for name, tensor in buffers.items():
        module.register_buffer(name, tensor, persistent=False)


def _scale(module: torch.nn.Module) -> torch.Tensor:
    return module._buffers[SCALE_BUFFER].view(torch.float32)


def _dequantized(self) -> torch.Tensor:
    return dequantize(self._parameters["weight"], _scale(self), getattr(self, COMPUTE_DTYPE_ATTR))


def _dequantized_state(module, state_dict, prefix, local_metadata):
    # In CPU memory: a whole model's float32 state dict must not land on a small accelerator. Not where a key filter
    # drops the weight (stored.kept_entries).
    if dequantizes(prefix + "weight"):
        weight, scale = module._parameters["weight"].cpu(), _scale(module).cpu()
        state_dict[prefix + "weight"] = dequantize(weight, scale, torch.float32)


def _quantized_with_scale(weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    stored, scale = quantize(weight)
    # float32 held as its int32 bits: a module's `.to(dtype)` would round a floating-point buffer (memory/nf4.py)
    return stored, {SCALE_BUFFER: scale.reshape(1).view(torch.int32)}


_quantize_loaded = quantize_loaded_weight(_quantized_with_scale)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self._parameters["weight"], self._parameters.get("bias")
    if takes_int8(x.numel() // max(1, x.shape[-1]), weight.shape[1], weight.shape[0]):
        return Int8LinearOp.apply(x, weight, _scale(self), bias)

    def weight_of(dtype, stored, scale):
        return dequantize(stored, scale, dtype)

    def bias_of(dtype):
        return bias.to(dtype) if bias is not None else None

    return StoredWeightOp.apply(x, weight_of, bias_of, "linear", (), weight, _scale(self))


INT8 = LinearStorage(prefix="Int8", store=_store, dequantized=_dequantized, forward=_linear_forward,
                     state_hook=_dequantized_state, load_hook=_quantize_loaded, oft=False,
                     parts=StoredParts(entries=("weight",), buffers=(SCALE_BUFFER,)))
