"""The optimizer from the config's `optimizer` section and the method's parameter groups.

The class comes from the registry (`spec.target`); `optimizer_class` loads it, so a strategy can swap
in a subclass (a sharding-aware Prodigy) by passing `cls`. Each group keeps its `name` and
`initial_lr`, which the schedulers and the progress line read.
"""

from __future__ import annotations

import importlib

import torch
from torch.distributed.tensor import DTensor

from ot_dist.config.optim import OptimizerConfig
from ot_dist.methods.base import ParamGroup
from ot_dist.optim.fused_backward import install_fused_back_pass
from ot_dist.optim.registry import SPECS, OptimizerSpec
from ot_dist.optim.stochastic_rounding import install_stochastic_rounding, key_own_rounding

WRAPPER_OPTIONS = ("stochastic_rounding", "fused_back_pass")  # act around the step, not passed to the class


def optimizer_class(spec: OptimizerSpec) -> type[torch.optim.Optimizer]:
    return _load(spec.target)


def constructor_kwargs(spec: OptimizerSpec, options: dict) -> dict:
    """Config options -> the implementation's keyword arguments (betas and Adafactor's eps are tuples; an option
    OneTrainer names differently from the implementation is renamed; an optimizer that rounds stochastically itself is
    handed `stochastic_rounding`; options only the group split reads stay out)."""
    kwargs = {k: v for k, v in options.items() if k not in WRAPPER_OPTIONS and k not in spec.group_only}
    if spec.own_stochastic_rounding:
        kwargs["stochastic_rounding"] = options["stochastic_rounding"]
    if spec.betas:
        kwargs["betas"] = tuple(kwargs.pop(name) for name in spec.betas)
    if spec.eps_pair:
        kwargs["eps"] = (kwargs.pop("eps"), kwargs.pop("eps2"))
    for option, keyword in spec.renames:
        kwargs[keyword] = kwargs.pop(option)
    return kwargs


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def kernel_choice(spec: OptimizerSpec, kwargs: dict, params: list[torch.Tensor]) -> dict:
    """torch's fused kernel (one launch for all parameters) where it runs, with `fused` left unset:
    - FSDP2's sharded parameters (DTensors): fused where DTensor has a sharding rule for the fused op (Adam, AdamW),
      on any device, otherwise the options as given. A foreach op over DTensors is planned by DTensor's sharding
      propagation, which grows faster than the number of tensors, partly in a scan that parallel/dtensor_first_step.py
      makes linear (measured on CPU, AdamW's first step over 600 sharded tensors: foreach 10.0 s, 4.8 s with that;
      fused 2.9 s, 0.9 s with it); fused SGD has no DTensor rule and would fail at its first step.
    - Plain tensors: fused when the optimizer has a CUDA kernel and every parameter is a floating CUDA tensor of a
      dtype it takes; otherwise `foreach` (the registry's default) batches the per-tensor loops.
    `fused: false` keeps foreach. An implementation whose multi-tensor path fails on DTensor shards steps them one
    tensor at a time."""
    if not spec.dtensor_foreach and any(isinstance(p, DTensor) for p in params):
        return {**kwargs, "foreach": False}
    if kwargs.get("fused") is not None or kwargs.get("differentiable") or not params:
        return kwargs
    if all(isinstance(p, DTensor) for p in params):
        fused = spec.dtensor_fused and all(p.dtype in FUSED_DTYPES for p in params) and len({p.device.type for p in params}) == 1
    else:
        fused = spec.cuda_fused and all(p.device.type == "cuda" and p.dtype in FUSED_DTYPES for p in params)
    return {**kwargs, "fused": True, "foreach": False} if fused else kwargs


def build_optimizer(
    config: OptimizerConfig, groups: list[ParamGroup], cls: type[torch.optim.Optimizer] | None = None, seed: int = 0
) -> torch.optim.Optimizer:
    """`seed` keys stochastic rounding's noise (the run's seed: stochastic_rounding.RoundingNoise)."""
    spec = SPECS[config.name]
    options = config.options()
    kwargs = kernel_choice(spec, constructor_kwargs(spec, options), [p for g in groups for p in g.params])
    param_groups = [
        {"params": g.params, "lr": g.learning_rate, "initial_lr": g.learning_rate, "name": g.name} for g in groups
    ]
    if spec.group_split:  # e.g. Muon: matrices and the rest in groups of their own
        param_groups = _load(spec.group_split)(param_groups, options)
    # Adafactor with relative_step computes its own step size and refuses a learning rate.
    lr = None if config.name == "ADAFACTOR" and config.relative_step else groups[0].learning_rate
    optimizer = (cls or optimizer_class(spec))(param_groups, lr=lr, **kwargs)
    if spec.schedule_free:
        optimizer.train()  # schedulefree starts in eval mode; training steps in train mode (schedule_free.py)
    if options.get("stochastic_rounding") and spec.own_stochastic_rounding:
        from adv_optm.util import param_update  # its generator per device: the only one that rounds itself

        key_own_rounding(optimizer, param_update._generators, seed)
    elif options.get("stochastic_rounding"):
        install_stochastic_rounding(optimizer, seed)
    if options.get("fused_back_pass"):
        install_fused_back_pass(optimizer)
    return optimizer
