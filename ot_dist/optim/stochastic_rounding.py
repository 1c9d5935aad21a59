"""Stochastic rounding of bfloat16 weights: the optimizer updates a float32 copy, which is rounded to
bfloat16 up or down with probability proportional to the distance, so an update smaller than
bfloat16's resolution still moves the weight on average instead of being rounded away every step.

Works around any torch optimizer through its step pre/post hooks; parameters in other dtypes are left
alone. The optimizer state of such a parameter is float32.
"""

from __future__ import annotations

import torch


def stochastic_round_to_bf16(source: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the discarded fraction."""
    bits = source.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, source.shape, dtype=torch.int32, device=source.device, generator=generator)
    # Adding noise below the 16 kept bits then truncating them rounds up with the right probability.
    rounded = (bits + noise) & -65536
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def install_stochastic_rounding(optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
    generators: dict[torch.device, torch.Generator] = {}
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        return generators[device]

    def before_step(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.dtype == torch.bfloat16 and p.grad is not None:
                    grad = p.grad
                    p.grad = None
                    p.data = p.data.float()
                    p.grad = grad.float()
                    swapped.append((p, grad))

    def after_step(opt, args, kwargs):
        while swapped:
            p, grad = swapped.pop()
            p.grad = None
            p.data = stochastic_round_to_bf16(p.data, generator(p.device))
            p.grad = grad

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
