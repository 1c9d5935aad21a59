"""The strategy interface. A strategy takes the trainable modules the method chose and the
parameter groups, makes them data parallel its way, and from then on owns backward, the optimizer
step, and gathering full weights for export. Model code and methods know nothing of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ot_dist.config.schema import TrainConfig
from ot_dist.methods.base import KeyFilter, ParamGroup, kept_state_dict
from ot_dist.models.loading import LoadedModel
from ot_dist.optim.stochastic_rounding import RoundingNoise
from ot_dist.parallel.ownership import Ownership, whole
from ot_dist.parallel.runtime import Runtime
from ot_dist.precision import Precision

StateDictOf = Callable[..., dict[str, torch.Tensor]]  # (module, keep: KeyFilter | None = None)
# What a keeping rank does to each tensor a gathering made, as soon as it is whole: (key, tensor) -> what it keeps
Convert = Callable[[str, torch.Tensor], torch.Tensor]


class Strategy:
    name = "single"
    # The strategy moves the trained modules to the device itself, a sharding unit at a time, keeping this rank's shard
    # of each (fsdp): the trainer leaves them in CPU memory, so a model larger than one device still starts, and wraps
    # them inside the rank's load turn, which needs the strategy's wrap to make no collective (see `start`).
    shards_while_placing = False

    def __init__(self, config: TrainConfig, runtime: Runtime):
        self.config = config
        self.runtime = runtime
        self.precision = Precision(config.train_dtype, runtime.device)
        self.trained_modules: dict[str, torch.nn.Module] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        # Noise for averaged gradients rounded back into bfloat16 stochastically (ddp.reduce_rounding); keyed to the
        # optimizer step by the trainer
        self.rounding_noise: RoundingNoise | None = None

    # -- setup -------------------------------------------------------------------------------
    def start(self) -> None:
        """What every rank makes together before the ranks load in turns (a device mesh's process groups)."""

    def shard_ranks(self) -> int:
        """How many ranks each trained weight is split over (1: every rank holds it whole)."""
        return 1

    def places_trained_modules(self, turns: int) -> bool:
        """Whether the trainer leaves the trained modules in CPU memory for the strategy to move to the device as it
        shards them, given how many turns the node's ranks load in."""
        return self.shards_while_placing

    def wrap(self, model: LoadedModel, named: NamedGroups) -> list[ParamGroup]:
        """Make the modules holding trainable parameters data parallel. Takes the groups by their parameters'
        names (`named_groups`) and returns them with the parameters as they are after wrapping (sharding replaces
        parameter objects)."""
        self.trained_modules = trained_modules(model)
        self._wrap_modules(model)
        return grouped(self.trained_modules, named)

    def _wrap_modules(self, model: LoadedModel) -> None:
        pass

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.optimizer = optimizer
        if (fused := getattr(optimizer, "fused_steps", None)) and self.config.clip_grad_norm_scope == "per_tensor":
            fused.clip_to = self.config.clip_grad_norm
        return optimizer

    # -- training ------------------------------------------------------------------------------
    def autocast(self):
        return self.precision.autocast()

    def prepare_micro_step(self, last_micro_step: bool) -> None:
        """Called before a micro step's forward: whether its backward completes an accumulation (strategies
        that reduce gradients during backward decide there whether this one synchronises; the fused back pass
        steps in that one only)."""
        if fused := getattr(self.optimizer, "fused_steps", None):
            fused.holding = not last_micro_step

    def backward(self, loss: torch.Tensor, accumulation: int, last_micro_step: bool) -> None:
        self.precision.backward(loss / accumulation)

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """Synchronise gradients (if not done during backward), clip, step, zero. Returns the total
        gradient norm before clipping as a tensor (read it when convenient: reading waits for the
        device), or None when no gradient is held here (e.g. fused into backward)."""
        self.precision.unscale(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = self.clip_gradients(grads) if grads else None
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def clip_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The total norm of the (synchronised) gradients; scaled in place to clip_grad_norm when it is set."""
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if self.config.clip_grad_norm is not None:
            scale_to_max_norm(grads, self.config.clip_grad_norm, grad_norm)
        return grad_norm

    def drop_gradients(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        """Forget this step's gradients without stepping (a skipped non-finite step)."""
        optimizer.zero_grad(set_to_none=True)

    def diverged_replicas(self) -> dict[str, list[int]]:
        """Trained tensors whose copies differ between the ranks (name -> ranks that differ from rank 0): only where
        the ranks hold replicas (ddp). A collective there."""
        return {}

    # -- export / reporting --------------------------------------------------------------------
    def state_dict_of(self, module: torch.nn.Module, keep: KeyFilter | None = None, *, here: bool = True,
                      host: bool = True, convert: Convert | None = None) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict of a module, or with `keep` the entries whose key it accepts (only those
        are gathered: a LoRA export needs its adapters, not the frozen model). A collective under sharding
        strategies: every rank must call it, in the same order, with the same `keep`.
        `here`: whether this rank keeps the result; a rank that does not (one that writes no export) takes part in
        the gathering and gets an empty dict. `host`: where a sharding strategy keeps what it gathers: in CPU memory,
        each tensor moved there as soon as it is whole (exports: the device holds one gathered tensor at a time,
        never the whole model; torch's full state dict with cpu_offload), or on the device (samples, which compute
        with them there). `convert(key, tensor)`: what the keeping rank keeps of a tensor the gathering made (a copy of
        its own), applied as soon as it is whole, before the next is gathered (samples: the weights autocast computes in
        16 bits, cast to them); never to a tensor the module holds itself, where a converted copy would add memory.
        Here nothing is gathered: the module's own tensors, wherever they are; the stored (float8 / nf4 / int8) weights
        `keep` drops are not dequantized (methods/base.py kept_state_dict)."""
        return kept_state_dict(module, keep) if here else {}

    def trained_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every trainable parameter as "<part>.<name>", in the same order on every rank."""
        return {
            f"{part}.{name}": p
            for part, module in self.trained_modules.items()
            for name, p in module.named_parameters()
            if p.requires_grad
        }

    def ownership(self) -> Ownership:
        """What this rank's optimizer steps, as runs of named parameters (see ownership.py). Here:
        every parameter whole, as in one process or with replicated weights."""
        named = self.trained_parameters()
        shapes = {n: p.shape for n, p in named.items()}
        return Ownership([whole(p, n) for n, p in named.items()], shapes, device=self.runtime.device)

    # -- checkpoints ---------------------------------------------------------------------------
    def writes_checkpoint_shards(self) -> bool:
        """Whether this rank's owned tensors go into a checkpoint: not when another rank holds the same
        (replicated weights save once, from rank 0)."""
        return self.runtime.is_main

    def after_checkpoint_load(self) -> None:
        """The owned (master) tensors were overwritten from a checkpoint: refresh whatever is derived from them."""

    def close(self) -> None:
        """Release what the strategy holds that the interpreter must not destroy on its own at exit (called once
        training and export are done, before the process group goes)."""

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds for training, by kind: params, grads, optimizer_state (local shards)."""
        raise NotImplementedError


def trained_modules(model: LoadedModel) -> dict[str, torch.nn.Module]:
    """The top-level components (denoiser, text encoders) that hold at least one trainable parameter."""
    return {name: m for name, m in model.parts().items() if any(p.requires_grad for p in m.parameters())}


# Parameter groups by their parameters' (part, name), holding none of the parameters themselves
NamedGroups = list[tuple[ParamGroup, list[tuple[str, str]]]]


def named_groups(modules: dict[str, torch.nn.Module], groups: list[ParamGroup]) -> NamedGroups:
    """`groups` by name, for code that replaces parameter objects (a strategy's wrap, torchao's float8 wrappers).
    Holding names, not the parameters, matters on a GPU: FSDP2 moves a unit's parameters to the device in place
    before it shards them, so a parameter object still held (in a list of the old groups) keeps its whole device copy
    while the later units move: the whole model on one device again."""
    by_id = {id(p): (part, name) for part, m in modules.items() for name, p in m.named_parameters()}
    return [(replace(g, params=[]), [by_id[id(p)] for p in g.params]) for g in groups]


def grouped(modules: dict[str, torch.nn.Module], named: NamedGroups) -> list[ParamGroup]:
    """The groups of `named_groups` with the parameters the modules hold now."""
    current = {part: dict(m.named_parameters()) for part, m in modules.items()}
    return [replace(g, params=[current[part][name] for part, name in keys]) for g, keys in named]


@torch.no_grad()
def scale_to_max_norm(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """torch's clipping rule (clip_grad_norm_): scale by min(max_norm / (total + 1e-6), 1), in place, as a tensor
    (no host sync to decide whether to clip)."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for device in {g.device for g in grads}:
        torch._foreach_mul_([g for g in grads if g.device == device], coefficient.to(device))
