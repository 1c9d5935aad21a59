"""The one-process reference for DeepSpeed's bf16 / fp16 engine (deepspeed.mixed_precision: engine): the same
master-weight recipe, written out plainly in one process, so that 2 ZeRO ranks can be compared with it.

What DeepSpeed 0.19's engine does with a module (runtime/engine.py `_configure_distributed_model`, the ZeRO
optimizers' `step`), and what this strategy does in one process:
- the trained modules' parameters are cast to train_dtype (buffers stay float32), and the forward runs without
  autocast: every op computes in the weights' dtype, the family derives its inputs' dtype from them;
- each trained parameter has a float32 master copy, and the optimizer steps the masters;
- float16: the loss is multiplied by the loss scale (DeepSpeed's initial 2**16) before backward, the
  float16 gradients are unscaled into the masters' float32 gradients; a non-finite gradient skips the step (no
  master changes; DeepSpeed's hysteresis of 2 keeps the scale at the first overflow, as here);
- the global gradient norm (of the unscaled float32 gradients) clips them, then the masters are copied into the
  half-precision weights;
- EMA, checkpoints and exports read the float32 masters.

Not ot_dist code: a test's yardstick. An independent writing of the recipe, so that a defect shared by
every world size of ot_dist's DeepSpeed path (an export of the rounded copy, clipping of scaled gradients, an EMA of
the bf16 weights) fails the comparison too, which a 1-rank DeepSpeed run would share."""

from __future__ import annotations

import contextlib

import torch

from ot_dist.methods.base import ParamGroup
from ot_dist.parallel.base import Strategy
from ot_dist.parallel.ownership import Ownership, whole
from ot_dist.precision import DTYPES

INITIAL_LOSS_SCALE = 2.0 ** 16  # deepspeed_config: fp16 initial_scale_power 16


class OneProcessEngine(Strategy):
    name = "single"

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.dtype = DTYPES[config.train_dtype]
        self.loss_scale = INITIAL_LOSS_SCALE if self.dtype == torch.float16 else 1.0
        self.masters: dict[str, torch.Tensor] = {}  # "part.name" -> float32 master
        self.weights: list[tuple[torch.Tensor, torch.nn.Parameter]] = []  # (master, half-precision weight)
        self.skipped = 0  # steps not applied (float16 overflow)

    def wrap(self, model, groups):
        groups = super().wrap(model, groups)
        named = self.trained_parameters()
        name_of = {id(p): n for n, p in named.items()}
        by_weight = {}
        for name, param in named.items():
            master = param.detach().to(torch.float32, copy=True).requires_grad_(True)
            self.masters[name] = by_weight[id(param)] = master
            self.weights.append((master, param))
        for module in self.trained_modules.values():
            for param in module.parameters():  # parameters only, as DeepSpeed casts them
                param.data = param.data.to(self.dtype)
        assert all(id(p) in name_of for g in groups for p in g.params)
        return [ParamGroup(g.name, [by_weight[id(p)] for p in g.params], g.learning_rate, g.part) for g in groups]

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss, accumulation, last_micro_step):
        (loss * (self.loss_scale / accumulation)).backward()

    @torch.no_grad()
    def step(self, optimizer, params):
        for master, weight in self.weights:
            master.grad = None if weight.grad is None else weight.grad.to(torch.float32) / self.loss_scale
            weight.grad = None
        grads = [m.grad for m, _ in self.weights if m.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if not torch.isfinite(norm):
            self.skipped += 1
            optimizer.zero_grad(set_to_none=True)
            return norm
        if self.config.clip_grad_norm:
            torch._foreach_mul_(grads, torch.clamp(self.config.clip_grad_norm / (norm + 1e-6), max=1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for master, weight in self.weights:
            weight.copy_(master)
        return norm

    def ownership(self):
        return Ownership([whole(m, n) for n, m in self.masters.items()],
                         {n: m.shape for n, m in self.masters.items()}, device=self.runtime.device)

    def state_dict_of(self, module, keep=None, *, here=True, host=True, convert=None):
        # nothing gathered: the module's tensors and the masters, its own storage, are not converted (Strategy's rule)
        if not here:
            return {}
        part = next((p for p, m in self.trained_modules.items() if m is module), None)
        state = {k: v for k, v in module.state_dict().items() if keep is None or keep(k)}
        if part is None:
            return state
        return {k: self.masters.get(f"{part}.{k}", v) for k, v in state.items()}

    def after_checkpoint_load(self):
        with torch.no_grad():
            for master, weight in self.weights:
                weight.copy_(master)


@contextlib.contextmanager
def one_process_engine():
    """Trainers built inside use OneProcessEngine instead of strategy single."""
    import ot_dist.train.trainer as trainer_module

    original = trainer_module.build_strategy
    trainer_module.build_strategy = OneProcessEngine
    try:
        yield
    finally:
        trainer_module.build_strategy = original


@contextlib.contextmanager
def fp16_reported(enabled: bool = True):
    """DeepSpeed's CPU accelerator reports float16 (as on a CPU with AVX512-FP16 / AMX-FP16) while a trainer is
    built: its fp16 engine then starts on a CPU without them too (it checks the report once, in
    deepspeed.initialize; torch computes float16 on any CPU, only more slowly), and so does ot_dist, which refuses
    what the accelerator does not report (parallel/deepspeed.py `refuse_engine_dtype_the_device_lacks`)."""
    if not enabled:
        yield
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        del accelerator.is_fp16_supported  # the class's probe again
