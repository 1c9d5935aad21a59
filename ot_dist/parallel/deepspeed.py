"""DeepSpeed ZeRO stages 1/2/3 via `deepspeed.initialize`, with our own optimizer object handed in
(so every optimizer of the stack runs under ZeRO) and a DeepSpeed config generated from ours.

The trainable components (UNet and/or text encoders) go into one container module for the engine;
the forward passes still call the components directly: ZeRO's gradient hooks sit on the parameters and
ZeRO-3's gather hooks on every sub-module. What DeepSpeed does at the start of its engine's forward
(the start of a micro step for ZeRO) is done by calling the engine with nothing to run
(`DeepSpeedStrategy.prepare_micro_step`)."""

from __future__ import annotations

import contextlib

import torch

from ot_dist.errors import ConfigError
from ot_dist.methods.base import ParamGroup, kept
from ot_dist.parallel.base import Strategy
from ot_dist.parallel.deepspeed_file import users_deepspeed_config
from ot_dist.parallel.deepspeed_process_state import (forget_closed_engine, forget_stale_world_group,
                                                      restore_torch_linear)
from ot_dist.parallel.ownership import Fragment, Owned, Ownership, same_storage, to_host
from ot_dist.parallel.zero_skip import norm_checks_on_device


class TrainableParts(torch.nn.Module):
    """The engine's module. Its forward runs nothing: the trainer calls the components itself (the family knows how);
    calling the engine marks the start of a micro step."""

    def __init__(self, modules: dict[str, torch.nn.Module], parameters_stay: bool = False):
        super().__init__()
        self.parts = torch.nn.ModuleDict(modules)
        self.parameters_stay = parameters_stay

    def forward(self) -> None:
        return None

    def to(self, *args, **kwargs):
        """The engine moves its module to the device whole before ZeRO-3 partitions it, unless the module was built
        partitioned (zero.Init). With `parameters_stay` only the buffers move: ZeRO-3's partitioning then moves each
        parameter to the device, keeps this rank's partition and frees the rest before the next one moves."""
        if not self.parameters_stay:
            return super().to(*args, **kwargs)
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        for module in self.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
        return self


def deepspeed_config(config, stage: int, world_size: int, device_type: str = "cpu") -> dict:
    settings = config.deepspeed
    ds = {
        "train_micro_batch_size_per_gpu": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_batch_size": config.batch_size * config.gradient_accumulation_steps * world_size,
        "zero_optimization": {"stage": stage, **zero_communication(settings, stage, device_type)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # Its throughput timer synchronizes the device when the engine is called and when it steps (by default):
        # two waits per step on a GPU since the engine is called at each micro step. ot_dist measures its own.
        "timers": {"throughput": {"enabled": False}},
    }
    # Always explicit: DeepSpeed 0.19 clips at 1.0 when the key is absent, so clip_grad_norm: null would clip.
    ds["gradient_clipping"] = config.clip_grad_norm if config.clip_grad_norm is not None else 0.0
    if settings.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # ot_dist hands in its own optimizer (any of the stack), not DeepSpeedCPUAdam.
        ds["zero_force_ds_cpu_optimizer"] = False
    if settings.offload_params:
        if stage != 3:
            raise ConfigError("deepspeed.offload_params: parameter offload needs strategy zero3")
        ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if computes_under_autocast(config):
        # DeepSpeed's default lower_precision_safe_modules (Linear, Conv1d/2d/3d): their weights are all-gathered
        # (ZeRO-3) and their gradients reduced in train_dtype, every other parameter in float32.
        ds["torch_autocast"] = {"enabled": True, "dtype": config.train_dtype}
    elif config.train_dtype == "bfloat16":
        ds["bf16"] = {"enabled": True}
    elif config.train_dtype == "float16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if settings.config_file:
        user = users_deepspeed_config(settings.config_file, ds)  # "auto" resolved; what the loop cannot follow refused
        ds = merge(ds, user)
        if "torch_autocast" not in user and any(isinstance(user.get(k), dict) and user[k].get("enabled")
                                                for k in ("bf16", "fp16")):
            ds.pop("torch_autocast", None)  # their file asks for DeepSpeed's bf16 / fp16 engine
    return ds


def engine_casts(ds_config: dict) -> bool:
    """Whether DeepSpeed's bf16 / fp16 engine runs (it casts the module's parameters to that dtype)."""
    return any(bool(ds_config.get(key, {}).get("enabled")) for key in ("bf16", "fp16"))


def refuse_engine_dtype_the_device_lacks(ds_config: dict) -> None:
    """DeepSpeed's engine refuses a dtype its accelerator does not report (engine.py `_do_sanity_check`: "Type fp16
    is not supported on your device."), after the model is loaded and without saying why. On the CPU accelerator
    float16 is reported only where oneDNN computes it natively (cpu_accelerator.py `is_fp16_supported`:
    torch.ops.mkldnn._is_mkldnn_fp16_supported(), x86 CPUs with AVX512-FP16 or AMX-FP16, Sapphire Rapids and later);
    bfloat16 always."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for key, dtype, supported in (("fp16", "float16", accelerator.is_fp16_supported),
                                  ("bf16", "bfloat16", accelerator.is_bf16_supported)):
        if ds_config.get(key, {}).get("enabled") and not supported():
            raise ConfigError(
                f"deepspeed.mixed_precision: DeepSpeed's {key} engine (train_dtype {dtype}) is not supported on this "
                f"{accelerator.device_name()} device: DeepSpeed's {type(accelerator).__name__} reports no {dtype} "
                + ("(on the CPU it needs oneDNN's native float16: AVX512-FP16 or AMX-FP16). " if key == "fp16" else ". ")
                + ("Use train_dtype bfloat16 (deepspeed.mixed_precision autocast or engine), float32, or strategy ddp / "
                   "fsdp, whose float16 autocast runs anywhere" if key == "fp16" else "Use train_dtype float32")
            )


@torch.no_grad()
def masters_from_loaded_weights(ownership: Ownership, loaded: dict[str, torch.Tensor]) -> None:
    """DeepSpeed's bf16 / fp16 engine casts the module's parameters to that dtype, then clones the float32 master
    partitions its optimizer steps from the cast copies (stage_1_and_2.py `single_partition_of_fp32_groups`,
    stage3.py `_create_fp32_partitions`): the weights as loaded lost their low 16 (bf16) or 13 (fp16) bits before the
    first step, up to half a bf16 step of each weight (5e-4 at |w| = 0.1, as much as a few SGD updates), and every
    later step went on from there. The masters are set to the loaded float32 values instead (this rank's fragments);
    the engine's half-precision weights are those values rounded, as after any step."""
    for owned in ownership.owned:
        master = owned.local().view(-1)
        for f in owned.fragments:
            source = loaded[f.name].reshape(-1)[f.param_offset:f.param_offset + f.numel]
            master[f.local_offset:f.local_offset + f.numel].copy_(source)


def loaded_for_masters(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 weights as loaded, kept through `deepspeed.initialize` for `masters_from_loaded_weights`, in CPU
    memory: kept on the GPU they stayed beside the engine's half-precision copies until the masters were set, the
    weights' bytes three times over at start-up (a Flux full finetune under ZeRO-2: 48 GB more than the 24 GB of
    bf16 weights, past an 80 GB GPU). Weights in CPU memory already are the ones kept (no copy)."""
    return {name: p.data if p.device.type == "cpu" else p.data.to("cpu") for name, p in named.items()}


def computes_under_autocast(config) -> bool:
    """Whether a low-precision train_dtype runs as float32 weights under torch autocast (DeepSpeed's torch_autocast),
    as single, ddp and fsdp run it, instead of in DeepSpeed's bf16 / fp16 engine (deepspeed.mixed_precision).

    The engine holds the weights in train_dtype and computes without autocast: every norm, softmax and residual sum
    rounds to bfloat16, and so does each float input the denoiser gets (the families derive them from the latents'
    dtype, as the half-precision pipelines do: Stable Cascade's timestep ratio, which its embedding scales by 10000).
    Measured on the tiny models, zero2 against one process in bfloat16 (3 SGD steps, in units of the one process's
    bfloat16-to-float32 distance): engine 4.3 (SDXL) to 56 (Wuerstchen v2), autocast 0.03-1.1 (docs/parallel.md)."""
    mode = config.deepspeed.mixed_precision
    if config.train_dtype == "float32":
        return False
    return mode == "autocast" or (mode == "auto" and config.train_dtype == "bfloat16")


def zero_communication(settings, stage: int, device_type: str) -> dict:
    """How ZeRO-1/2 reduce gradients: in explicit buckets, overlapped with backward on a GPU (DeepSpeed's
    default overlaps only ZeRO-3). The CPU accelerator has no side stream, so on the CPU nothing would overlap:
    off there unless asked for.

    ZeRO-3 keeps DeepSpeed's overlap, bucket, prefetch and persistence defaults (they act once the engine sees each
    micro step begin: `DeepSpeedStrategy.prepare_micro_step`), but releases a parameter as soon as its module is done,
    as fsdp's full_shard reshards after forward: stage3_max_reuse_distance 0 instead of 1e9 elements. 1e9 kept whatever
    the trace reuses within the next 1e9 elements gathered (around the turn from forward to backward: up to 40 % of
    an SDXL UNet, 4 GB in float32, on every rank) to save gathering it again, which the trace's prefetch overlaps
    anyway; and deciding it walks the trace ahead from every module release (partitioned_param_coordinator.py
    `__params_to_release`), quadratic in the modules within that distance, each time a trace is recorded: on the tiny
    test models, which fit in 1e9 many times over, that was 2x the CPU of a short LoRA run."""
    if stage == 3:
        return {"stage3_max_reuse_distance": 0}
    overlap = settings.overlap_comm if settings.overlap_comm is not None else device_type == "cuda"
    return {
        "overlap_comm": overlap,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": settings.reduce_bucket_size,
        "allgather_bucket_size": settings.allgather_bucket_size,
    }


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def share_fp32_master_with_partitions(zero_optimizer) -> None:
    """ZeRO-3 means to use the parameter partition itself as the fp32 master copy when the partition
    is already fp32 on the same device (stage3.py, `_create_fp32_partitions`: "we don't need another
    copy of the weights"). Its test compares a torch.device with a device-name string, which is never
    equal, so a second full copy of every partition is kept. Do what it meant: the master copy becomes
    the partition's storage (DeepSpeed's copy back after each step is then a copy onto itself)."""
    partitions = getattr(zero_optimizer, "fp16_partitioned_groups_flat", None) or []
    masters = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None) or []
    for partition, master in zip(partitions, masters):
        store_master_in(master, partition)


def store_master_in(master: torch.Tensor, partition: torch.Tensor) -> bool:
    """Make the fp32 master a view of the weights' partition when it can be one (same dtype, device and shape) and
    is not already; True when it became one. The master keeps its identity, only its storage changes."""
    if (
        master.data_ptr() == partition.data_ptr()
        or master.dtype != partition.dtype
        or master.device != partition.device
        or master.shape != partition.shape
    ):
        return False
    master.data = partition.data
    return True


def share_fp32_master_with_flat_weights(zero_optimizer) -> None:
    """ZeRO-1/2 step a master copy of this rank's partition of each group's flat weights: a float32 clone of
    `parallel_partitioned_bit16_groups[g][rank]` (stage_1_and_2.py `single_partition_of_fp32_groups`). When the
    weights are float32 themselves (float32 runs; bfloat16 under torch_autocast) that clone holds the same numbers as
    the slice it was cloned from: 4/N bytes per parameter on every rank for nothing. The master becomes a view of
    that slice, so the optimizer steps the weights in place and what DeepSpeed does with the master stays right:
    the copy into the partition after a step (and `update_lp_params` after a checkpoint load) is a copy onto
    itself, the all-gather sends the stepped slice as before, a skipped step leaves both unchanged, clipping
    scales the master's gradient only. Not under optimizer offload (asked for by ot_dist's setting or by the user's
    config_file): the master lives on the CPU there, beside the step's CPU gradient buffers.

    The master keeps its identity (the optimizer's param and state key, ot_dist's ownership); only its storage
    changes. DeepSpeed's per-parameter views of the master (`_hp_mapping`, from `_link_all_hp_params` in the
    constructor) still point into the clone and would keep it alive, so they are made again, as DeepSpeed itself
    does when it moves the master (reload_states)."""
    import torch.distributed as dist

    if getattr(zero_optimizer, "cpu_offload", False):
        return
    shared = False
    for group, master in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        rank = dist.get_rank(group=zero_optimizer.real_dp_process_group[group])
        partition = zero_optimizer.parallel_partitioned_bit16_groups[group][rank]
        shared |= store_master_in(master, partition)
    if shared:
        zero_optimizer._link_all_hp_params()


def skip_shared_memory_op_build() -> None:
    """DeepSpeed's torch comm backend compiles its shared-memory all-reduce (the C++ op deepspeed_shm_comm, about
    a minute on a small CPU) when it starts on the CPU accelerator, in every fresh container or torch extensions
    folder, and again whenever the install path it is compiled against changes. Only `inference_all_reduce`
    (DeepSpeed inference, AutoTP) calls it; ZeRO training reduces through torch.distributed. Marked incompatible,
    it is not built (deepspeed/comm/torch.py build_shm_op reads this table, which DeepSpeed keeps for edits)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def one_broadcast_of_the_model():
    """ZeRO-3 partitions every parameter of the engine's module from rank 0's values: when the engine builds its
    optimizer, Init converts each one with a broadcast from rank 0 (partition_parameters.py `_zero_init_param`, the
    parameter moved to the device first). The engine's own broadcast of the whole model before that (engine.py
    `_broadcast_model`, unless the model was built under zero.Init) sends every parameter a second time, where it is:
    over gloo for the weights ZeRO-3 takes from CPU memory (places_trained_modules), 48 GB for a Flux.1 dev full
    finetune at start-up. While the engine is built, that first broadcast is skipped; what the ranks start from is
    still rank 0's (tests/test_zero3_collectives.py counts the broadcasts and starts rank 1 from other weights)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model
    DeepSpeedEngine._broadcast_model = lambda self: None
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original


@contextlib.contextmanager
def parameters_shown_by_shape():
    """ZeRO-3's optimizer formats its constructor's arguments into a debug line that it logs only when asked
    (stage3.py `DeepSpeedZeroOptimizer_Stage3.__init__`: print_rank_0(f"... {locals()}", force=False)); among them is
    the engine's {parameter: name} map, so every parameter's values were formatted as text, on every rank, and thrown
    away: 0.15 s of a core per rank for the 2-level test UNet (208 parameters), a device-to-host read per parameter on
    a GPU. While DeepSpeed builds the engine, a parameter prints as its shape and dtype."""
    original = torch.nn.Parameter.__repr__
    torch.nn.Parameter.__repr__ = lambda self: f"Parameter(shape={tuple(self.shape)}, dtype={self.dtype})"
    try:
        yield
    finally:
        torch.nn.Parameter.__repr__ = original


def register_embeddings_as_external(root: torch.nn.Module) -> None:
    """ZeRO-3 gathers a parameter only while its own module runs. Embedding tables are read from
    their parent's forward too (CLIP checks `position_embedding.weight.shape` before using it), so
    each embedding's weight is also registered with its parent. Embeddings are small; the cost is nil.
    The same for the parameters of a ParameterList / ParameterDict: a container runs no forward of its own, its
    parent reads them (token_vectors.py's ExtendedTokenEmbedding: the additional embeddings' rows, `additional.<i>`;
    ungathered, its forward read empty partitions)."""
    import deepspeed

    for parent in root.modules():
        for child in parent.children():
            if isinstance(child, torch.nn.Embedding):
                deepspeed.zero.register_external_parameter(parent, child.weight)
            elif isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
                for param in child.parameters():
                    deepspeed.zero.register_external_parameter(parent, param)


def register_adapter_reads_as_external(root: torch.nn.Module) -> None:
    """peft's adapter layers read tensors outside the forward of the module that owns them: DoRA the adapted
    layer's weight and lora_A / lora_B's weights (for the weight norm), LoHa / LoKr their factors (held in
    ParameterDicts, which never run a forward) and the adapted weight's shape. Under ZeRO-3 each of those is an
    empty partition there, so every parameter under an adapter layer is registered with that layer: ZeRO-3
    gathers them for the adapter layer's forward and backward, the span in which the adapted layer's own forward
    gathered its weight anyway."""
    import deepspeed
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in root.modules():
        if isinstance(module, BaseTunerLayer):
            for param in module.parameters():
                deepspeed.zero.register_external_parameter(module, param)


class DeepSpeedStrategy(Strategy):
    def __init__(self, config, runtime, stage: int):
        super().__init__(config, runtime)
        self.stage = stage
        self.name = f"zero{stage}"
        self.engine = None
        self.under_autocast = computes_under_autocast(config)  # as deepspeed_config decides, a config_file aside
        self.linear_before = None  # torch.nn.functional.linear before this engine was built (restore_torch_linear)

    def wrap(self, model, groups):
        groups = super().wrap(model, groups)
        if self.config.optimizer.adaptive and len(groups) > 1:
            # DeepSpeed steps the optimizer once per parameter group, showing it that group alone. Prodigy's
            # estimate spans every group (they share one learning rate by then), so they become one group.
            merged = [p for g in groups for p in g.params]
            groups = [ParamGroup("+".join(g.name for g in groups), merged, groups[0].learning_rate)]
        return groups

    def places_trained_modules(self, turns: int) -> bool:
        # ZeRO-3 partitions the trained modules from CPU memory, a parameter at a time, where every rank of a node
        # loads at once: each rank then holds its CPU copy until DeepSpeed partitions it (a collective, after the
        # turns), which adds nothing to the node's peak. With several turns a rank's copy must be gone before the next
        # turn, so it is placed on the device whole, in its turn.
        return self.stage == 3 and turns == 1

    def wrap_optimizer(self, optimizer):
        import deepspeed

        # left in CPU memory by the trainer (places_trained_modules): ZeRO-3 moves them a parameter at a time
        left = any(p.device != self.runtime.device for m in self.trained_modules.values() for p in m.parameters())
        container = TrainableParts(self.trained_modules, parameters_stay=self.stage == 3 and left)
        if self.stage == 3:
            register_embeddings_as_external(container)
            register_adapter_reads_as_external(container)
        skip_shared_memory_op_build()
        ds_config = deepspeed_config(self.config, self.stage, self.runtime.world_size, self.runtime.device.type)
        self.under_autocast = bool(ds_config.get("torch_autocast", {}).get("enabled"))
        refuse_engine_dtype_the_device_lacks(ds_config)
        # DeepSpeed's bf16 / fp16 engine casts the weights, then clones its float32 masters from the cast copies
        loaded = loaded_for_masters(self.trained_parameters()) if engine_casts(ds_config) else {}
        forget_stale_world_group()  # a notebook's second run, in a process group of its own
        self.linear_before = torch.nn.functional.linear  # ZeRO-3 replaces it (restore_torch_linear)
        try:
            with (parameters_shown_by_shape() if self.stage == 3 else contextlib.nullcontext(),
                  one_broadcast_of_the_model() if self.stage == 3 else contextlib.nullcontext()):
                self.engine, engine_optimizer, _, _ = deepspeed.initialize(
                    model=container, optimizer=optimizer, config=ds_config, dist_init_required=False,
                )
            self.optimizer = optimizer  # our optimizer: its param_groups carry the scheduled learning rates
            self.engine_optimizer = engine_optimizer
            if loaded:
                masters_from_loaded_weights(self.ownership(), loaded)
            if not self.config.deepspeed.offload_optimizer:
                if self.stage == 3:
                    share_fp32_master_with_partitions(engine_optimizer)
                else:
                    share_fp32_master_with_flat_weights(engine_optimizer)
            if self.stage == 3 and self.config.optimizer.adaptive and len(engine_optimizer.fp16_groups) > 1:
                raise ConfigError(
                    f"deepspeed.config_file: zero_optimization.sub_group_size splits the parameters into "
                    f"{len(engine_optimizer.fp16_groups)} sub-groups, each stepped on its own, and "
                    f"{self.config.optimizer.name} needs all of them in one step to estimate its step size. Raise "
                    "sub_group_size above the trained parameter count (the default does)"
                )
            if (self.stage == 3 and self.config.preserve_embedding_norm
                    and len(engine_optimizer.fp16_groups) > len(optimizer.param_groups)):
                # the rescale runs when a parameter group steps (ot_dist/train/embedding_norm.py): with a group in
                # several sub-groups it would run before the sub-group holding the vectors had stepped
                raise ConfigError(
                    f"preserve_embedding_norm: deepspeed.config_file's zero_optimization.sub_group_size splits the "
                    f"{len(optimizer.param_groups)} parameter groups into {len(engine_optimizer.fp16_groups)} "
                    "sub-groups, each stepped on its own, and the embedding vectors are rescaled once their group has "
                    "stepped. Raise sub_group_size above the trained parameter count (the default does)"
                )
        except BaseException:
            # a trainer whose construction failed is never closed (nobody holds it): its engine and DeepSpeed's
            # linear would outlive it in the process (a notebook correcting its config and training again)
            self.close()
            raise
        return optimizer

    def close(self):
        # The engine holds ZeRO's buckets, hooks and (stage 3) prefetched all-gathers whose gloo / NCCL work
        # objects keep tensors alive. Left to interpreter finalization, their destruction can take the GIL while
        # the interpreter is torn down and abort the rank (SIGABRT, "terminate called without an active
        # exception") after training succeeded. destroy() releases them while everything is still alive.
        if self.engine is not None:
            self.engine.destroy()
            forget_closed_engine(self.engine.module)
        self.engine = self.engine_optimizer = None
        if self.linear_before is not None:  # also when deepspeed.initialize failed after replacing it
            restore_torch_linear(self.linear_before)
            self.linear_before = None

    def autocast(self):
        if self.under_autocast:
            return super().autocast()  # ot_dist calls the components, not the engine's forward, which would enter it
        # DeepSpeed's bf16 / fp16 engine owns the compute dtype (weights held in it, fp32 master copy).
        return contextlib.nullcontext()

    def prepare_micro_step(self, last_micro_step):
        """Call the engine, with nothing to run, before each micro step's forward: that is where DeepSpeed learns that
        a micro step begins (DeepSpeedEngine.forward), and two things need it.
        - The ZeRO optimizer's per-forward reset (`clear_backward_seen_flag`). ZeRO-3 counts its micro steps there
          (stage3.py `micro_step_id`: the first micro step's gradient partitions are copied, later ones added); never
          called, each micro step overwrote the last, and accumulation kept only the last micro step's gradients.
          (ZeRO-1/2 run deferred cleanup there: stage_1_and_2.py, the last backward's `grad_accum`.)
        - ZeRO-3's parameter coordinator, reset by a forward pre-hook on the engine's module (parameter_offload.py
          `_start_of_forward_hook` -> `reset_step`). Never reset, it records no trace of the order the modules run in,
          so it prefetches nothing (on a GPU each module waits for its own all-gather) and releases every parameter
          after each module's forward and backward, even those under stage3_param_persistence_threshold that it
          means to keep gathered: they were gathered again at every use (tiny SD 1.x UNet: 871 instead of 440
          all-gathers per step; tests/test_zero3_collectives.py)."""
        self.engine()

    def backward(self, loss, accumulation, last_micro_step):
        # The engine divides by the accumulation steps itself and finds the accumulation boundary by
        # counting its step() calls, so it must see one per micro step; off the boundary it only counts.
        self.engine.backward(loss)
        if not last_micro_step:
            self.engine.step()

    def step(self, optimizer, params):
        with norm_checks_on_device(self.engine_optimizer, self.optimizer):  # the lagged step guard: no host read
            self.engine.step()  # reduce, clip, optimizer step, zero grads
        grad_norm = self.engine.get_global_grad_norm()  # ZeRO's global norm before clipping (a tensor, or inf)
        return None if grad_norm is None else torch.as_tensor(grad_norm).detach()

    def state_dict_of(self, module, keep=None, *, here=True, host=True, convert=None):
        if self.stage != 3 or not any(hasattr(p, "ds_id") for p in module.parameters()):
            return super().state_dict_of(module, keep, here=here, host=host, convert=convert)
        import deepspeed

        # The entries in bounded groups (`export_groups`), each group's parameters gathered together and copied (to
        # CPU memory with `host`) by the rank that keeps the result before ZeRO-3 partitions them again on leaving
        # the context: the device holds the partitions and one group, never the whole module. Other entries
        # (buffers) are whole on every rank already: kept as they are, as in one process.
        state = {}
        for group in export_groups(kept(module.state_dict(keep_vars=True), keep), EXPORT_GATHER_BYTES):
            partitioned = {k: v for k, v in group.items() if hasattr(v, "ds_id")}
            with deepspeed.zero.GatheredParameters(list(partitioned.values()), modifier_rank=None):
                for key, value in group.items() if here else ():
                    if key not in partitioned:
                        state[key] = value.detach()
                    else:  # a copy: the gathered storage goes back to ZeRO-3 on leaving the context
                        state[key] = gathered_copy(key, value, host, convert)
        return state

    def ownership(self):
        return zero_ownership(self.engine_optimizer, self.stage, self.trained_parameters(), self.runtime.device)

    def writes_checkpoint_shards(self):
        return True  # every rank steps its own partition

    def after_checkpoint_load(self):
        """The fp32 master partitions were loaded: copy them into the model's (bit16) weights, as DeepSpeed
        does after an optimizer step."""
        zero = self.engine_optimizer
        if self.stage == 3:
            for sub_group in range(len(zero.fp16_partitioned_groups_flat)):
                zero._reassign_or_swap_out_partitioned_parameters(sub_group)
        else:
            zero.update_lp_params()

    def held_tensors(self):
        params = [p for m in self.trained_modules.values() for p in m.parameters()]
        if self.stage == 3:
            param_tensors = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
        else:
            param_tensors = params
        zero = self.engine_optimizer
        state = [v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        partitions = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", [])
        grads = [g for g in getattr(zero, "averaged_gradients", {}).values() for g in (g if isinstance(g, list) else [g])]
        return {"params": param_tensors + list(partitions), "grads": grads, "optimizer_state": state}


# What an export's ZeRO-3 gather makes whole at once, at most (a parameter larger than this is gathered alone): few
# collectives for a model's many small tensors, and the device holds this much of the model beside its partitions.
EXPORT_GATHER_BYTES = 256 * 2**20


def gathered_copy(key: str, value: torch.Tensor, host: bool, convert) -> torch.Tensor:
    """What a keeping rank keeps of a ZeRO-3 parameter while it is gathered: a copy (in CPU memory with `host`), or
    what `convert` makes of it, which is that copy where it changes the dtype (no full-size copy in the gathered
    dtype beside it). Nothing here outlives the call holding the gathered storage."""
    converted = value.detach() if convert is None else convert(key, value.detach())
    if host:
        return to_host(converted)
    return converted.clone() if same_storage(converted, value) else converted


def export_groups(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """`state` (a `state_dict(keep_vars=True)`: the parameters themselves) cut into consecutive groups whose ZeRO-3
    parameters (those with a `ds_id`) hold at most `limit` bytes when whole, or one parameter each where one alone
    is larger. The other entries (buffers) ride in the group they fall in."""
    groups, group, size = [], {}, 0
    for key, value in state.items():
        full = value.ds_numel * value.element_size() if hasattr(value, "ds_id") else 0
        if full and size and size + full > limit:
            groups.append(group)
            group, size = {}, 0
        group[key] = value
        size += full
    return groups + [group] if group else groups


def zero_ownership(zero, stage: int, named: dict[str, torch.Tensor], device: torch.device) -> Ownership:
    """The fp32 partitions a ZeRO optimizer hands ours, as runs of the named parameters."""
    import torch.distributed as dist

    names = {id(p): n for n, p in named.items()}
    if stage == 3:
        owned = [
            Owned(master, stage3_fragments(params, names, dist.get_rank(group=process_group)))
            for params, master, process_group in zip(
                zero.fp16_groups, zero.fp32_partitioned_groups_flat, zero.sub_group_process_groups
            )
        ]
        shapes = {n: p.ds_shape for n, p in named.items()}
    else:
        owned = [
            Owned(master, partition_fragments(params, padding, names, size, dist.get_rank(group=group)))
            for params, padding, master, size, group in zip(
                zero.round_robin_bit16_groups, zero.round_robin_bit16_padding, zero.single_partition_of_fp32_groups,
                zero.partition_size, zero.real_dp_process_group,
            )
        ]
        shapes = {n: p.shape for n, p in named.items()}
    return Ownership(owned, shapes, group=None, sharded=True, device=device)


def partition_fragments(params, padding, names, partition_size: int, rank: int) -> list[Fragment]:
    """ZeRO-1/2: a group's parameters are laid end to end (each followed by its alignment padding) and
    cut into equal partitions; rank r steps elements [r * size, (r + 1) * size) of that line."""
    start, end = rank * partition_size, (rank + 1) * partition_size
    fragments, position = [], 0
    for param, pad in zip(params, padding):
        first, last = max(start, position), min(end, position + param.numel())
        if first < last:
            fragments.append(Fragment(names[id(param)], first - position, first - start, last - first))
        position += param.numel() + pad
    return fragments


def stage3_fragments(params, names, rank: int) -> list[Fragment]:
    """ZeRO-3: every parameter is partitioned on its own (rank r holds elements [r * n, (r + 1) * n),
    padded at the end), and a sub-group's partitions sit back to back."""
    fragments, position = [], 0
    for param in params:
        n = param.partition_numel()
        first = rank * n
        held = max(0, min(n, param.ds_numel - first))
        if held:
            fragments.append(Fragment(names[id(param)], first, position, held))
        position += n
    return fragments
