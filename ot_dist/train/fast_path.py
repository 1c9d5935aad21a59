"""The `performance` options applied to the loaded denoiser (issue 21): checked against the device once, then
applied after placement and before a strategy wraps the modules, so sharding, checkpointing and exports see the
same module tree and weight names. What each option does: docs/performance.md."""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from ot_dist.config.performance import CHANNELS_LAST_STRATEGIES, PerformanceConfig
from ot_dist.errors import ConfigError

# The kernels `performance.attention_backend` allows, by name; "auto" leaves torch's choice.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
CPU_SDPA_BACKENDS = ("flash", "math")  # torch's CPU kernels
FLOAT8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: float8 tensor cores (torch._scaled_mm)


def check_performance(options: PerformanceConfig, device: torch.device) -> None:
    """Refuse, naming the field, what this device cannot run (before anything is loaded)."""
    backend = options.attention_backend
    if backend != "auto" and device.type != "cuda" and backend not in CPU_SDPA_BACKENDS:
        raise ConfigError(f"performance.attention_backend: {backend} attention is a CUDA kernel and this run's device is "
                          f"{device.type}; use auto, {' or '.join(CPU_SDPA_BACKENDS)}")
    if options.records_cuda_graphs and device.type != "cuda":
        raise ConfigError(f"performance.compile_mode: {options.compile_mode} records CUDA graphs and this run's device "
                          f"is {device.type}; use default or max-autotune-no-cudagraphs")
    if options.float8_matmuls:
        if device.type not in ("cuda", "cpu"):
            raise ConfigError(f"performance.float8_matmuls: float8 training matmuls run on CUDA devices with compute "
                              f"capability {'.'.join(map(str, FLOAT8_MIN_CAPABILITY))}+ (float8 tensor cores) and, "
                              f"slower than bfloat16, on the CPU; this run's device is {device.type}")
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is not None and capability < FLOAT8_MIN_CAPABILITY:
            raise ConfigError(f"performance.float8_matmuls: {torch.cuda.get_device_name(device)} has compute capability "
                              f"{capability[0]}.{capability[1]}; float8 matmuls need "
                              f"{'.'.join(map(str, FLOAT8_MIN_CAPABILITY))}+ (Ada, Hopper or newer)")
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise ConfigError("performance.float8_matmuls: needs torchao; install the extra: "
                              "pip install 'ot-dist[float8]'") from None


def denoiser_blocks(model) -> list[torch.nn.Module]:
    """The denoiser's repeated blocks: its family's shard units (UNet resnets, attention blocks, samplers;
    transformer blocks), in registration order."""
    from ot_dist.parallel.fsdp import family_units

    return family_units(model.family, model.family.denoiser, model.denoiser)


def attention_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """diffusers' attention modules (the outermost ones)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in module.modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def checkpoint_forward(module: torch.nn.Module, offload_activations: bool = False) -> None:
    """Recompute `module`'s activations in backward (non-reentrant checkpoint), keeping its weight names; with
    `offload_activations` its inputs wait in CPU memory (train/activation_offload.py)."""
    from ot_dist.methods.block_casts import cast_inside_forward
    from ot_dist.train.activation_offload import checkpoint_function

    original = module.forward
    forward = cast_inside_forward(module, original)  # its weights' casts recompute too
    checkpoint = checkpoint_function(offload_activations)

    @functools.wraps(original)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, **kwargs)

    module.forward = checkpointed


def selective_checkpointing(model, options: PerformanceConfig, offload_activations: bool = False) -> list[torch.nn.Module]:
    """Checkpoint every N-th denoiser block, or only its attention modules (instead of diffusers' every block), their
    inputs in CPU memory with `offload_activations`. Returns the modules that recompute."""
    if options.checkpoint_only_attention:
        chosen = attention_modules(model.denoiser)
    else:
        chosen = denoiser_blocks(model)[::options.checkpoint_every_n_blocks]
    for module in chosen:
        checkpoint_forward(module, offload_activations)
    return chosen


def uses_channels_last(options: PerformanceConfig, family, device: torch.device, strategy: str) -> bool:
    """auto: a UNet's weights NHWC on CUDA where the strategy keeps them as tensors (the config refuses `on` elsewhere)."""
    if options.channels_last == "auto":
        return family.convolutional_denoiser and device.type == "cuda" and strategy in CHANNELS_LAST_STRATEGIES
    return options.channels_last == "on"


def apply_performance(model, options: PerformanceConfig, device: torch.device, strategy: str, log=print,
                      shard_ranks: int = 1) -> None:
    """The lean attention processor, float8 matmuls, channels_last and regional compilation of the denoiser, in that
    order (compile traces the final modules). `shard_ranks`: the ranks fsdp shards each weight over."""
    from ot_dist.train.lean_attention import use_lean_attention

    denoiser = model.denoiser
    use_lean_attention(denoiser)  # the same bits, two full-size ops fewer per attention call (lean_attention.py)
    if options.float8_matmuls:
        from ot_dist.train.frozen_float8 import convert_frozen_linears

        frozen = convert_frozen_linears(denoiser, float8_eligible)  # no weight gradient to compute (a LoRA's base)
        trained = [m for n, m in denoiser.named_modules() if float8_eligible(m, n)]  # the frozen ones no longer are
        convert_trained_linears(denoiser, strategy, shard_ranks)
        log(f"performance: float8 matmuls in the denoiser's linear layers: {len(trained)} trained (torchao "
            f"Float8Linear), {frozen} frozen (forward and input gradient only)")
    if uses_channels_last(options, model.family, device, strategy):
        denoiser.to(memory_format=torch.channels_last)
    if options.compile:
        compile_blocks(model, options, log)


def compile_blocks(model, options: PerformanceConfig, log=print) -> None:
    """Regional compilation: each denoiser block's call compiled in place; a streamed block's forward alone
    (`compile_forward`)."""
    from ot_dist.memory.block_streaming import streamed_in

    blocks = denoiser_blocks(model)
    streamed = {id(b) for b in streamed_in(model.denoiser)}
    variants = allow_recompiles_for(blocks)
    mode = None if options.compile_mode == "default" else options.compile_mode
    for block in blocks:
        if id(block) in streamed:
            compile_forward(block, backend=options.compile_backend, mode=mode)
        else:
            block.compile(backend=options.compile_backend, mode=mode)
    only_forward = f", {len(streamed)} streamed ones their forward only" if streamed else ""
    log(f"performance: {len(blocks)} denoiser blocks compiled ({options.compile_backend}"
        f"{', ' + mode if mode else ''}, {variants} distinct{only_forward})")


# On a block whose forward alone is compiled: the forward it had before, which `tracking.utilization.uncompiled` runs.
EAGER_FORWARD = "_eager_forward"


def compile_forward(block: torch.nn.Module, **options) -> None:
    """Compile `block`'s forward and leave its call (`_call_impl`, its hooks) eager. A streamed block's hooks
    (memory/block_streaming.py) put new device copies of its frozen parameters in place before each forward and
    the CPU ones back after it, with a prefetcher's Python state and a CUDA side stream: traced (`Module.compile`
    compiles the call), they break the graph and recompile on every block until dynamo's limit leaves them eager.
    The forward they wrap reads the parameters as graph inputs, so a new copy each call reuses the graph.

    Bound as a method of the block: a deep copy of the block calls its own forward, not this one's (a deep copy
    of a block compiled whole drops `_compiled_call_impl` and runs eagerly). Casts of the block's trained weights
    made together by a hook (methods/block_casts.py) would enter the graph from outside as Python state: they are
    removed, and its layers cast their own weights inside the graph, as in a block compiled whole (whose hooks see
    `is_compiling()` and make none)."""
    from ot_dist.methods.block_casts import casts_of

    casts = casts_of(block)
    if casts is not None:
        casts.remove()
    eager = block.forward
    block.forward = types.MethodType(torch.compile(eager.__func__, **options), block)
    setattr(block, EAGER_FORWARD, eager)


def begin_step(options: PerformanceConfig) -> None:
    """Before a training step's forward: with CUDA graphs, the outputs of the previous step's replays may be
    overwritten from now on (cudagraph trees would otherwise guess from pending backwards)."""
    if options.records_cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


@contextlib.contextmanager
def eager_unless_training_step(model, options: PerformanceConfig):
    """Forwards outside the training steps (validation) with the blocks' CUDA graphs off: such a forward has no
    backward to end its step, eval mode would record graphs of its own, and EMA weights may be swapped in."""
    if not options.records_cuda_graphs:
        yield
        return
    from ot_dist.tracking.utilization import uncompiled

    with uncompiled(model.denoiser):
        yield


def block_variants(blocks: list[torch.nn.Module]) -> int:
    """Blocks that need their own graph: a different class or parameter shapes."""
    return len({(type(b), tuple(tuple(p.shape) for p in b.parameters())) for b in blocks})


def allow_recompiles_for(blocks: list[torch.nn.Module]) -> int:
    """Every compiled block shares one code object (nn.Module._call_impl), so each distinct block is a recompile
    of it; past dynamo's recompile_limit (8) the remaining blocks silently run eager. Raise the limit to the
    blocks' variants x 4 (a few input shapes each: aspect buckets, then dynamic shapes). Returns the variants."""
    variants = block_variants(blocks)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 4 * variants)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * variants)
    return variants


def convert_trained_linears(denoiser: torch.nn.Module, strategy: str, shard_ranks: int) -> None:
    """torchao's Float8Linear for every eligible trained Linear; under fsdp its weights are all-gathered in float8,
    except those whose rows do not split evenly over the `shard_ranks`: torchao's float8 all-gather sends each rank's
    shard unpadded, so those ranks would send different sizes (gloo aborts, NCCL hangs or mixes the shards)."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # pad_inner_dim: a weight gradient's matmul runs over the batch's rows (batch x tokens; one row a sample in the
    # timestep and pooled-text embeddings), which CUDA's _scaled_mm takes in multiples of 16 only
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=strategy == "fsdp", pad_inner_dim=True)
    if config.enable_fsdp_float8_all_gather and shard_ranks > 1:
        def uneven(module, name):
            return float8_eligible(module, name) and module.out_features % shard_ranks != 0

        convert_to_float8_training(denoiser, config=replace(config, enable_fsdp_float8_all_gather=False),
                                   module_filter_fn=uneven)  # converted: no longer eligible below
    convert_to_float8_training(denoiser, config=config, module_filter_fn=float8_eligible)


def float8_scales_once_per_forward(root: torch.nn.Module):
    """Under FSDP2 with float8 all-gathers (after fully_shard): each float8 weight's scale for the next forward's
    all-gathers is computed before that forward, for every such weight at once, in one all-reduce of their maxima
    (torchao's `precompute_float8_dynamic_scale_for_fsdp`). Without it each weight's all-gather makes its own small
    all-reduce, in forward and again in backward. Computed before every forward of the root, training or not, so a
    weight changed by anything (a step, a loaded checkpoint, EMA weights swapped in) never meets a stale scale.
    Returns the hook's handle, or None where no weight is gathered in float8."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor, precompute_float8_dynamic_scale_for_fsdp

    if not any(isinstance(p, DTensor) and isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)
               for p in root.parameters()):
        return None

    def precompute(*_):
        with torch.no_grad():
            precompute_float8_dynamic_scale_for_fsdp(root)

    # before FSDP2's own pre-forward (which gathers the root's weights)
    return root.register_forward_pre_hook(precompute, prepend=True)


def float8_eligible(module: torch.nn.Module, name: str) -> bool:
    """torch._scaled_mm needs both matrix sides in multiples of 16. A LoRA's adapter matrices (peft's lora_A /
    lora_B, one side the rank) stay as they are: float8 buys nothing on a rank-wide matmul and would quantise the
    very weights that train."""
    adapter = any(part in ("lora_A", "lora_B") for part in name.split("."))
    return (type(module) is torch.nn.Linear and not adapter and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def attention_kernel(options: PerformanceConfig, device: torch.device, avoided: tuple[str, ...] = ()):
    """The context a training step runs in: only the chosen SDPA kernel; for `auto`, torch's choice, less the
    kernels the family avoids on CUDA (Family.attention_kernels_avoided)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if options.attention_backend != "auto":
        return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[options.attention_backend]))
    if device.type != "cuda" or not avoided:
        return contextlib.nullcontext()
    # sdpa_kernel with a list keeps torch's own priority among the kernels it allows.
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name]) for name in SDPA_BACKENDS if name not in avoided])
