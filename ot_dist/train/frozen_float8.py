"""Float8 matmuls for frozen Linear layers (a LoRA's base layers): forward and input gradient, no weight gradient.

torchao's Float8Linear computes all three matmuls of a linear layer in float8, the weight gradient included, whether
or not the weight trains: its backward returns that gradient unconditionally. Under LoRA every adapted base layer is
frozen, so a third of its float8 matmuls would be thrown away (issue 21). This layer does what torchao's default
recipe does for the other two (dynamic tensorwise scales from the current absolute maximum, e4m3 for the input and
weight, e5m2 for the output gradient; `torch._scaled_mm`, which has CUDA kernels for compute capability 8.9+ and a
CPU implementation the tests run on) and nothing for the weight. The weight stays stored as it was (the frozen
base's dtype); it is cast to float8 once in forward and once, transposed, in backward, as torchao casts it.
"""

from __future__ import annotations

import torch

INPUT_DTYPE = torch.float8_e4m3fn  # inputs and weights: more mantissa
GRAD_DTYPE = torch.float8_e5m2  # gradients: more range


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` scaled so that its absolute maximum is float8's largest value, in float8, and the scale that undoes it
    (what `torch._scaled_mm` multiplies back)."""
    largest = torch.finfo(dtype).max
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = amax / largest
    return (t.float() / scale).clamp(-largest, largest).to(dtype), scale


class FrozenFloat8Matmul(torch.autograd.Function):
    """x @ weight.T + bias with float8 operands; the gradient for x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        rows = x.reshape(-1, x.shape[-1])
        x8, x_scale = to_float8(rows, INPUT_DTYPE)
        w8, w_scale = to_float8(weight, INPUT_DTYPE)  # [out, in] row-major: its transpose is the column-major mat2
        fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)  # what cuBLASLt adds itself
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype,
                               bias=bias.to(out_dtype) if fused_bias else None)
        if bias is not None and not fused_bias:
            out = out + bias.to(out_dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        g8, g_scale = to_float8(rows, GRAD_DTYPE)
        wt8, w_scale = to_float8(weight.t().contiguous(), INPUT_DTYPE)  # [in, out] row-major; .t() column-major
        grad_x = torch._scaled_mm(g8, wt8.t(), scale_a=g_scale, scale_b=w_scale, out_dtype=grad_out.dtype)
        return grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1]).to(ctx.x_dtype), None, None, None


class FrozenFloat8Linear(torch.nn.Linear):
    """A frozen nn.Linear computing in float8 (same weight and bias parameters, so the same state dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return FrozenFloat8Matmul.apply(x, self.weight, self.bias, out_dtype)


def frozen(module: torch.nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters(recurse=False))


def convert_frozen_linears(root: torch.nn.Module, chosen) -> int:
    """Turn every frozen nn.Linear of `root` that `chosen(module, name)` accepts into a FrozenFloat8Linear in place
    (its class swapped: parameters, hooks and position in the tree stay). Returns how many."""
    count = 0
    for name, module in root.named_modules():
        if type(module) is torch.nn.Linear and frozen(module) and chosen(module, name):
            module.__class__ = FrozenFloat8Linear
            count += 1
    return count
