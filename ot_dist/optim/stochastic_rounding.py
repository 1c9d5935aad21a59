"""Stochastic rounding of bfloat16 weights: the optimizer updates a float32 copy, which is rounded to
bfloat16 up or down with probability proportional to the distance, so an update smaller than
bfloat16's resolution still moves the weight on average instead of being rounded away every step.

Works around any torch optimizer through its step pre/post hooks; parameters in other dtypes are left
alone. The optimizer state of such a parameter is float32.

The noise of each tensor comes from a generator seeded by (seed, optimizer step, the tensor's key), not from one
sequence drawn in the order tensors happen to be rounded in (`RoundingNoise`). So a weight gets the same rounding
whatever order the fused back pass steps weights in (streamed blocks' weights step in another order than resident
ones; a rank that missed an expert steps it last), on every rank of a ddp run, and after a resume (a sequence would
restart from its seed, or need its state in every checkpoint).
"""

from __future__ import annotations

import torch

from ot_dist.randomness import derive_seed

MASK64 = (1 << 64) - 1


def stochastic_round_to_bf16(source: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the discarded fraction."""
    bits = source.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, source.shape, dtype=torch.int32, device=source.device, generator=generator)
    # Adding noise below the 16 kept bits then truncating them rounds up with the right probability.
    rounded = (bits + noise) & -65536
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def rounded_back(averaged: torch.Tensor, dtype: torch.dtype, noise: RoundingNoise | None, key: int) -> torch.Tensor:
    """A tensor computed in a wider dtype, back in `dtype`: stochastically into bfloat16 with `noise`, else to
    nearest (the tensor itself where it has that dtype already)."""
    if noise is not None and dtype == torch.bfloat16 and averaged.dtype == torch.float32:
        return stochastic_round_to_bf16(averaged, noise.generator(key, averaged.device))
    return averaged.to(dtype)


class RoundingNoise:
    """Generators for stochastic rounding, one per (seed, purpose, optimizer step, tensor key).

    `at_step(step)` keys what follows to that optimizer step (the trainer calls it before each step's micro steps,
    with the number of steps done, a resumed run too). Used without it (a benchmark, a bare optimizer), the step
    advances by itself when a key is drawn a second time, so steps never share noise."""

    def __init__(self, seed: int, purpose: str):
        self.base = derive_seed(seed, "stochastic_rounding", purpose)
        self.step = 0
        self.keyed = False  # whether the steps come from at_step
        self._drawn: set[int] = set()

    def at_step(self, step: int) -> None:
        self.step, self.keyed = step, True

    def generator(self, key: int, device: torch.device) -> torch.Generator:
        if not self.keyed:
            if key in self._drawn:
                self.step += 1
                self._drawn.clear()
            self._drawn.add(key)
        # A new generator for each draw: DDP's communication hooks round in callbacks that may run on another
        # thread, side by side, so a shared one could be reseeded between another draw's seeding and its use. Making
        # and seeding one is host work only (no device sync).
        return torch.Generator(device).manual_seed(_mixed(self.base, self.step, key))


def _mixed(*words: int) -> int:
    """A 63-bit seed from 64-bit words (splitmix64's finaliser over each): distinct for neighbouring steps and keys,
    and cheap enough for every tensor of every step (a hash of the key's repr would cost microseconds each)."""
    h = 0x9E3779B97F4A7C15
    for word in words:
        h = ((h ^ (word & MASK64)) * 0xBF58476D1CE4E5B9) & MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & MASK64
        h ^= h >> 29
    return h >> 1


def parameter_keys(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its rounding key: its place in the optimizer's groups as built, the same on every rank and in
    every run of the config."""
    return {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}


def install_stochastic_rounding(optimizer: torch.optim.Optimizer, seed: int = 0) -> RoundingNoise:
    """Round the optimizer's bfloat16 parameters stochastically after each step, each with its own key
    (`parameter_keys`). Returns the noise (also `optimizer.rounding_noise`), whose step the trainer keys.

    The step runs on float32 stand-ins: for each bfloat16 parameter with a gradient, a float32 copy takes its place in
    its group (and its optimizer state moves to it) for the step, and the result is rounded back into the parameter
    in place. Setting the parameter's `.data` to a float32 tensor and back instead would change its dtype twice, and
    autograd then drops the parameter's gradient-accumulation node: hooks on it are lost (DDP's reducer stopped
    averaging after the first step) and a node held from before is no longer the one backward runs."""
    noise = RoundingNoise(seed, "weights")
    keys = parameter_keys(optimizer)
    swapped: list[tuple[dict, list, list[tuple[torch.Tensor, torch.Tensor]]]] = []  # (group, its params, stand-ins)

    @torch.no_grad()
    def before_step(opt, args, kwargs):
        for group in opt.param_groups:
            stand_ins = []
            params = group["params"]
            for k, p in enumerate(params):
                if p.dtype == torch.bfloat16 and p.grad is not None:
                    wide = p.detach().float().requires_grad_(p.requires_grad)
                    wide.grad = p.grad.float()
                    if p in opt.state:
                        opt.state[wide] = opt.state.pop(p)
                    stand_ins.append((p, wide))
                    if len(stand_ins) == 1:
                        params = list(params)  # the group's own list stays as it was
                    params[k] = wide
            if stand_ins:
                swapped.append((group, group["params"], stand_ins))
                group["params"] = params

    @torch.no_grad()
    def after_step(opt, args, kwargs):
        while swapped:
            group, params, stand_ins = swapped.pop()
            group["params"] = params
            for p, wide in stand_ins:
                if wide in opt.state:
                    opt.state[p] = opt.state.pop(wide)
                p.copy_(stochastic_round_to_bf16(wide, noise.generator(keys[id(p)], p.device)))

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    optimizer.rounding_noise = noise
    return noise


def key_own_rounding(optimizer: torch.optim.Optimizer, generators: dict, seed: int = 0) -> RoundingNoise:
    """For an optimizer that rounds its bfloat16 weights stochastically itself, drawing from one generator per device
    (`generators`: adv_optm's, which it seeds once with 42): before each parameter's step (adv_optm's
    `step_parameter`; where a step does not go through it, before the whole step), its device's generator becomes one
    keyed like ours, by (seed, optimizer step, the parameter). So its rounding too is the same in any order of fused
    steps, on every rank, and after a resume. Returns the noise (also `optimizer.rounding_noise`)."""
    noise = RoundingNoise(seed, "weights")
    keys = parameter_keys(optimizer)

    def before_step(opt, args, kwargs):  # a step that draws outside step_parameter: keyed by the step alone
        for device in {p.device for group in opt.param_groups for p in group["params"] if p.grad is not None}:
            generators[device] = noise.generator(len(keys), device)

    optimizer.register_step_pre_hook(before_step)
    if hasattr(optimizer, "step_parameter"):
        step_parameter = optimizer.step_parameter

        def keyed_step_parameter(p, *args, **kwargs):
            # Only bfloat16 weights are rounded; ZeRO hands the optimizer flat float32 partitions of its own instead
            # of the parameters it was built with (no bfloat16 trained weights there: the config refuses them).
            if p.dtype == torch.bfloat16 and id(p) in keys:
                generators[p.device] = noise.generator(keys[id(p)], p.device)
            return step_parameter(p, *args, **kwargs)

        optimizer.step_parameter = keyed_step_parameter
    optimizer.rounding_noise = noise
    return noise
