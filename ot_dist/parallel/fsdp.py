"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded
across ranks as DTensors, wrapped block by block from the family spec's wrap units.

Sharding modes: full_shard (re-gather parameters in backward), shard_grad_op (keep them gathered
between forward and backward: `reshard_after_forward=False`), hybrid_shard (shard within a node,
replicate across nodes, over a 2-D device mesh)."""

from __future__ import annotations


import torch
from torch.distributed.tensor import DTensor

from ot_dist.errors import ConfigError
from ot_dist.methods.base import kept
from ot_dist.models.loading import LoadedModel
from ot_dist.parallel.base import Strategy, scale_to_max_norm
from ot_dist.parallel.dtensor_first_step import linear_first_step
from ot_dist.parallel.ownership import Ownership, dtensor_fragment, local, plain, same_storage, to_host, whole
from ot_dist.parallel.runtime import ranks_on_this_node
from ot_dist.precision import DTYPES
from ot_dist.train.fast_path import float8_scales_once_per_forward


def wrap_units(module: torch.nn.Module, patterns: tuple[str, ...]) -> list[torch.nn.Module]:
    """Sub-modules named by the patterns (a name or a dotted suffix); a ModuleList gives its items."""
    units = []
    for name, sub in module.named_modules():
        if name and any(name == p or name.endswith("." + p) for p in patterns):
            units.extend(sub if isinstance(sub, torch.nn.ModuleList) else [sub])
    return units


def family_units(family, part: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    """A trainable part's repeated blocks as its family declares them (`Family.shard_units`): FSDP2's units, and the
    blocks that compile, checkpoint selectively and cast their weights together."""
    return wrap_units(module, family.shard_units.get(part, ()))


def whole_gradient_bytes(trained: list[torch.nn.Parameter], reduce_dtype: str) -> int:
    """What FSDP2 holds per rank between the micro steps of an accumulation when it reduces only at the last: every
    trained parameter's unsharded gradient, accumulated in the reduce dtype (`FSDPParam.to_accumulated_grad_if_needed`
    upcasts a bfloat16 gradient to it)."""
    return sum(p.numel() for p in trained) * DTYPES[reduce_dtype].itemsize  # a DTensor's numel is its global one


def prefetch_in_execution_order(root: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    """FSDP2's explicit forward prefetch: each unit issues the next unit's all-gather right after its own, from
    the CPU, instead of when the next unit's forward starts (with small units, launch latency matters). The
    order is the one the first forward runs them in (a UNet registers its attentions before the resnets they
    follow). Backward keeps FSDP2's own prefetch: the previous unit in reverse forward order."""
    order: list[torch.nn.Module] = []
    seen: set[int] = set()

    def record(module, *_):
        if id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    def first_forward_done(*_):
        for handle in handles:
            handle.remove()
        for unit, following in zip(order, order[1:]):
            unit.set_modules_to_forward_prefetch([following])

    handles = [unit.register_forward_pre_hook(record) for unit in units]
    handles.append(root.register_forward_hook(first_forward_done))


class FSDPStrategy(Strategy):
    name = "fsdp"
    # fully_shard moves each unit's parameters to the mesh's device and keeps this rank's shard of them before the next
    # unit moves: the device holds the shards and one whole unit, never the whole model (FLUX.2 dev's transformer is
    # 120 GiB in float32), and the wrap makes no collective once the mesh exists (`start`).
    shards_while_placing = True
    mesh = None

    def start(self) -> None:
        self.mesh = self._mesh()  # new process groups for a hybrid mesh: every rank at once, before the load turns

    def shard_ranks(self) -> int:
        if self.mesh is None:  # not started (the bench wraps without starting): one group of every rank
            return self.runtime.world_size
        return self.mesh.size(self.mesh.mesh_dim_names.index("shard"))

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        world = self.runtime.world_size
        device_type = self.runtime.device.type
        if self.config.fsdp.sharding == "hybrid_shard":
            per_node = ranks_on_this_node(world)
            return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))

    def _wrap_modules(self, model: LoadedModel) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        linear_first_step()  # the first optimizer step over the DTensors: seconds, not a minute (SDXL)
        settings = self.config.fsdp
        if settings.cpu_offload and self.runtime.device.type == "cpu":
            raise ConfigError(
                "fsdp.cpu_offload: offloading moves shards from the GPU to CPU memory; this run is on the CPU "
                "already (no GPU found), so set fsdp.cpu_offload to false"
            )
        train_dtype = DTYPES[self.config.train_dtype]
        precision = dict(param_dtype=None if train_dtype == torch.float32 else train_dtype,
                         reduce_dtype=DTYPES[settings.reduce_dtype])
        offload = CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy()
        if self.mesh is None:  # a caller that wraps without starting (the bench)
            self.mesh = self._mesh()
        options = dict(
            mesh=self.mesh,
            reshard_after_forward=settings.sharding != "shard_grad_op",
            offload_policy=offload,
        )
        # The root of each module gets its inputs as the family passes them, as under single / ddp: FSDP's
        # default cast of every floating forward input to param_dtype would round the float32 timesteps,
        # ratios, size conditions and guidance a family hands the denoiser (SD3's t near 1000 to a multiple of
        # 4). The root's own layers run under the strategy's autocast, which casts at each matmul / conv; the
        # units inside (blocks) still take their inputs in param_dtype.
        root_policy = MixedPrecisionPolicy(**precision, cast_forward_inputs=False)
        unit_policy = MixedPrecisionPolicy(**precision)
        for name, module in self.trained_modules.items():
            units = family_units(model.family, name, module)
            for unit in units:
                fully_shard(unit, mp_policy=unit_policy, **options)
            fully_shard(module, mp_policy=root_policy, **options)
            if self.config.performance.float8_matmuls:
                float8_scales_once_per_forward(module)  # one all-reduce per forward, not one per weight and gather
            if self.runtime.device.type == "cuda":
                # Issuing the next all-gather early pays on a GPU stream; gloo on the CPU has nothing to overlap it
                # with, and keeping one collective in flight at a time there avoids gloo's concurrent-op paths.
                prefetch_in_execution_order(module, units)

    def backward(self, loss, accumulation, last_micro_step):
        # Reduce-scatter gradients on the last micro step of an accumulation only, unless the unsharded gradients
        # FSDP2 accumulates until then would not fit (`reduce_every_micro_step`).
        sync = last_micro_step or self.reduces_every_micro_step
        for module in self.trained_modules.values():
            module.set_requires_gradient_sync(sync)
        super().backward(loss, accumulation, last_micro_step)

    @property
    def reduces_every_micro_step(self) -> bool:
        setting = self.config.fsdp.reduce_every_micro_step
        if setting is not None:
            return setting
        if self.config.fsdp.cpu_offload:
            return True  # whole gradients on the GPU between micro steps would undo the offload
        device = self.runtime.device
        if device.type != "cuda":
            return False
        trained = [p for m in self.trained_modules.values() for p in m.parameters() if p.requires_grad]
        return whole_gradient_bytes(trained, self.config.fsdp.reduce_dtype) > torch.cuda.get_device_properties(
            device).total_memory / 4

    def clip_gradients(self, grads):
        # On each rank's shards as plain tensors, one all-reduce of the squared norm over the shard group (replica
        # groups hold the same shards). torch's clip_grad_norm_ on the DTensors computes the same, but plans every
        # foreach op through DTensor's sharding propagation (seconds at the first step for a UNet's tensors).
        if not all(isinstance(g, DTensor) for g in grads):
            grad_norm = super().clip_gradients(grads)
            return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        shards = [g.to_local() for g in grads]
        squared = torch.stack([n.float() for n in torch._foreach_norm(shards)]).square().sum()
        torch.distributed.all_reduce(squared, group=self.mesh.get_group("shard"))
        grad_norm = squared.sqrt()
        if self.config.clip_grad_norm is not None:
            scale_to_max_norm(shards, self.config.clip_grad_norm, grad_norm)
        return grad_norm

    def state_dict_of(self, module, keep=None, *, here=True, host=True, convert=None):
        # One DTensor made whole at a time (a collective), converted (`convert`) and moved to CPU memory at once
        # (`host`) and kept by the rank that keeps the result (`here`) only: the device never holds more than one full
        # tensor beside the shards. Other entries (buffers) are whole on every rank already: kept as they are, as in
        # one process.
        state = {}
        for key, value in kept(module.state_dict(), keep).items():
            if not isinstance(value, DTensor):
                if here:
                    state[key] = plain(value)
                continue
            whole = plain(value.full_tensor())
            if here:
                # Converted only when gathered into storage of its own: over a shard group of one rank the full tensor
                # is the local shard, the parameter itself, which a converted copy would sit beside.
                if convert is not None and not same_storage(whole, plain(value.to_local())):
                    whole = convert(key, whole)
                state[key] = to_host(whole) if host else whole
            del whole  # gone before the next one is gathered
        return state

    def ownership(self):
        # Over a hybrid mesh the replicas hold the same shards: the pieces add up over the shard group.
        return fsdp_ownership(self.trained_parameters(), self.mesh.get_group("shard"), self.runtime.device)

    def writes_checkpoint_shards(self):
        # Over a hybrid mesh every replica group holds the same shards: the first one saves them.
        return "replicate" not in (self.mesh.mesh_dim_names or ()) or self.mesh.get_local_rank("replicate") == 0

    def held_tensors(self):
        params = [p for m in self.trained_modules.values() for p in m.parameters()]
        return {
            "params": [local(p) for p in params],
            "grads": [local(p.grad) for p in params if p.grad is not None],
            "optimizer_state": [
                local(v) for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
            ],
        }


def fsdp_ownership(named: dict[str, torch.Tensor], group, device: torch.device) -> Ownership:
    owned = [dtensor_fragment(p, n) if isinstance(p, DTensor) else whole(p, n) for n, p in named.items()]
    return Ownership(owned, {n: p.shape for n, p in named.items()}, group=group, sharded=True, device=device)
