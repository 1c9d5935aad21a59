"""CAME_8BIT: CAME with its first moment kept in 8 bits between steps, as OneTrainer's CAME_8BIT
(modules/util/optimizer/CAME8bit.py, after "Memory-Efficient CAME-8bit Optimizer", SANA 1.5 section 2.3) steps it.

Which tensors are factored follows OneTrainer's CAME_8BIT, which differs from its CAME there: a weight matrix, and a
1x1 convolution as its (out, in) matrix, keep factored row / column statistics and take the confidence factor; every
other tensor (a bias, a norm scale, a 3x3 convolution kernel) keeps a full second moment and steps by its momentum
alone, as CAME steps a vector. (CAME and pytorch-optimizer factor anything of 2 dimensions and up over its last two.)

What is quantised follows it too: only the first moment `exp_avg`, and only of the factored tensors with more than
`min_8bit_size` elements; the row / column statistics are small and stay in 32 bits, and so does everything of the
other tensors. The quantisation itself is bitsandbytes' block-wise dynamic 8-bit code (`quantize_blockwise`: one
absmax per block of `quant_block_size` elements; it runs on CPU and CUDA) instead of OneTrainer's own min/max code.

The arithmetic is pytorch-optimizer's CAME (its per-tensor path, the one `CAME` in this registry runs): with nothing
quantised, a matrix or a vector steps exactly as CAME steps it, a 1x1 convolution as CAME steps its (out, in) matrix
and any other tensor as CAME steps it flattened. Each tensor's moment is dequantised, updated and quantised again in
turn, so at most one tensor's 32-bit moment exists at a time.

State per quantised tensor: `exp_avg_8bit` (uint8, the parameter's shape) and `exp_avg_absmax` (float32, one per
block). The checkpoint classifies them as layout-bound (`opaque`): they resume in the layout that saved them.
"""

from __future__ import annotations

from functools import cache

import torch

from ot_dist.optim.registry import QUANT_BLOCK_SIZES


def __getattr__(name: str):
    """`CAME8bit`, the class the registry names, is defined when first asked for (PEP 562)."""
    if name == "CAME8bit":
        return came8bit_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def came8bit_class() -> type:
    """The optimizer class, defined on first use: bitsandbytes and pytorch-optimizer are optional packages."""
    from bitsandbytes import functional as bnb_functional
    from pytorch_optimizer import CAME

    class CAME8bit(CAME):
        def __init__(self, params, lr: float = 2e-4, betas=(0.9, 0.999, 0.9999), weight_decay: float = 0.0,
                     eps1: float = 1e-30, eps2: float = 1e-16, min_8bit_size: int = 16384, quant_block_size: int = 2048,
                     **kwargs):
            if quant_block_size not in QUANT_BLOCK_SIZES:
                raise ValueError(f"quant_block_size {quant_block_size}: bitsandbytes takes one of {QUANT_BLOCK_SIZES}")
            if kwargs.get("ams_bound"):
                raise ValueError("CAME_8BIT does not take ams_bound")
            super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, eps1=eps1, eps2=eps2, foreach=False,
                             **kwargs)
            for group in self.param_groups:
                group.setdefault("min_8bit_size", min_8bit_size)
                group.setdefault("quant_block_size", quant_block_size)
            self._codes: dict[torch.device, torch.Tensor] = {}

        def __str__(self) -> str:
            return "CAME_8BIT"

        @staticmethod
        def matrix_shape(shape: torch.Size) -> tuple[int, int] | None:
            """The (rows, columns) OneTrainer's CAME_8BIT factors a tensor as: a matrix, or a 1x1 convolution as its
            (out, in) matrix; None for any other tensor (full second moment, no confidence factor)."""
            if len(shape) == 2:
                return shape[0], shape[1]
            if len(shape) == 4 and shape[2] == 1 and shape[3] == 1:
                return shape[0], shape[1]
            return None

        @classmethod
        def quantised(cls, p: torch.Tensor, group) -> bool:
            """OneTrainer's rule: a factored tensor with more than min_8bit_size elements."""
            return cls.matrix_shape(p.shape) is not None and p.numel() > group["min_8bit_size"]

        def _code(self, device: torch.device) -> torch.Tensor:
            if device not in self._codes:
                self._codes[device] = bnb_functional.create_dynamic_map(signed=True).to(device)
            return self._codes[device]

        def _store(self, state: dict, exp_avg: torch.Tensor, block: int) -> None:
            quantised, quant_state = bnb_functional.quantize_blockwise(
                exp_avg.float().contiguous(), code=self._code(exp_avg.device), blocksize=block)
            state["exp_avg_8bit"] = quantised
            state["exp_avg_absmax"] = quant_state.absmax

        def _load(self, state: dict, block: int, dtype: torch.dtype) -> torch.Tensor:
            q = state["exp_avg_8bit"]
            full = bnb_functional.dequantize_blockwise(q, absmax=state["exp_avg_absmax"].float(),
                                                       code=self._code(q.device),
                                                       blocksize=block)
            return full.to(dtype)

        def _init_state(self, p: torch.Tensor, group) -> None:
            state, grad = self.state[p], p.grad
            if grad.is_sparse:
                raise RuntimeError("CAME_8BIT does not support sparse gradients")
            if self.quantised(p, group):
                self._store(state, torch.zeros_like(p, dtype=torch.float32), group["quant_block_size"])
            else:
                state["exp_avg"] = torch.zeros_like(p)
            matrix = self.matrix_shape(grad.shape)
            if matrix is not None:
                for kind in ("sq", "res"):
                    state[f"exp_avg_{kind}_row"] = torch.zeros(matrix[0], dtype=grad.dtype, device=grad.device)
                    state[f"exp_avg_{kind}_col"] = torch.zeros(matrix[1], dtype=grad.dtype, device=grad.device)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
            state["RMS"] = 0.0

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                beta1, beta2, beta3 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if not self.state[p]:
                        self._init_state(p, group)
                    self._step_one(p, group, beta1, beta2, beta3)
            return loss

        def _step_one(self, p: torch.Tensor, group, beta1: float, beta2: float, beta3: float) -> None:
            grad, state = p.grad, self.state[p]
            self.maximize_gradient(grad, maximize=self.maximize)
            matrix = self.matrix_shape(grad.shape)
            if (matrix is not None) != ("exp_avg_sq_row" in state):
                raise RuntimeError(
                    f"CAME_8BIT: the state of a {tuple(grad.shape)} tensor was saved by an earlier ot_dist, which "
                    "factored every tensor of 2 dimensions and up; it cannot resume with OneTrainer's rule (matrices "
                    "and 1x1 convolutions only). Resume with that ot_dist, or start the optimizer afresh")
            quantised = "exp_avg_8bit" in state
            state["RMS"] = self.get_rms(p)
            self.apply_weight_decay(p=p, grad=grad, lr=group["lr"], weight_decay=group["weight_decay"],
                                    weight_decouple=group["weight_decouple"], fixed_decay=group["fixed_decay"])

            g = grad.reshape(matrix) if matrix is not None else grad  # a 1x1 convolution as its (out, in) matrix
            update = torch.mul(g, g).add_(self.eps1)
            if matrix is not None:
                row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                row.mul_(beta2).add_(update.mean(dim=-1), alpha=1.0 - beta2)
                col.mul_(beta2).add_(update.mean(dim=-2), alpha=1.0 - beta2)
                self.approximate_sq_grad(row, col, update)
            else:
                exp_avg_sq = state["exp_avg_sq"]
                exp_avg_sq.mul_(beta2).add_(update, alpha=1.0 - beta2)
                torch.rsqrt(exp_avg_sq, out=update)
            update.mul_(g)
            update.div_((self.get_rms(update) / self.clip_threshold).clamp_(min=1.0))

            exp_avg = self._load(state, group["quant_block_size"], update.dtype) if quantised else state["exp_avg"]
            momentum = exp_avg.view(update.shape)  # the same storage, in the shape the update is computed in
            momentum.lerp_(update, weight=1.0 - beta1)
            if matrix is not None:
                res = (update - momentum).pow_(2).add_(self.eps2)
                row, col = state["exp_avg_res_row"], state["exp_avg_res_col"]
                row.mul_(beta3).add_(res.mean(dim=-1), alpha=1.0 - beta3)
                col.mul_(beta3).add_(res.mean(dim=-2), alpha=1.0 - beta3)
                self.approximate_sq_grad(row, col, update)
                update.mul_(momentum)
            else:
                update = momentum
            p.add_(update.view(p.shape), alpha=-group["lr"])
            if quantised:
                self._store(state, exp_avg, group["quant_block_size"])

    return CAME8bit
