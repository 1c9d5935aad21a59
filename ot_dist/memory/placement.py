"""Where a component's frozen weights live and in what: the low-memory options applied once, after
the method has decided what trains (ot_dist/memory/float8.py, nf4.py, int8.py, offload.py)."""

from __future__ import annotations

import torch

from ot_dist.memory.block_streaming import kept_home, stream_blocks
from ot_dist.memory.float8 import store_frozen_in_float8
from ot_dist.memory.int8 import store_frozen_in_int8
from ot_dist.memory.nf4 import store_frozen_in_nf4
from ot_dist.memory.offload import offload_to_cpu
from ot_dist.precision import DTYPES


# weight_dtype values that quantize the frozen weights at placement (from float32), and how
QUANTIZERS = {"float8": store_frozen_in_float8, "nf4": store_frozen_in_nf4, "int8": store_frozen_in_int8}


def frozen_storage_dtype(weight_dtype: str) -> torch.dtype | None:
    """The dtype frozen parameters are cast to first; None for float8, nf4 and int8: their weights stay as loaded and
    each is quantized from its float32 values one layer at a time (quantize_frozen), never the whole component cast
    to float32 at once first (a Flux.1 transformer loaded in bfloat16: ~48 GB of RAM before it was quantized)."""
    return None if weight_dtype in QUANTIZERS else DTYPES[weight_dtype]


def quantize_frozen(component: torch.nn.Module, storage: str, compute_dtype: torch.dtype,
                    keep: frozenset[int] = frozenset()) -> None:
    """Store the frozen weights of `component` as `storage` (a weight_dtype) says, read in `compute_dtype`: float8
    (memory/float8.py), nf4 (memory/nf4.py) and int8 (memory/int8.py) quantize, but in the modules `keep` names
    (ids: quantization.layer_filter's leftovers, held in `compute_dtype`); the plain dtypes were cast at load
    (frozen_storage_dtype)."""
    if storage in QUANTIZERS:
        QUANTIZERS[storage](component, compute_dtype, keep)
        cast_frozen_buffers(component, compute_dtype)  # they meet the dequantized weights' compute dtype


def store_component(module: torch.nn.Module, name: str, config, denoiser: bool) -> bool:
    """A component (`name` as config.component_storage reads it) stored: its parameters by role (store_by_role), then
    its frozen weights quantized where its storage says (quantize_frozen; the denoiser's layers as
    quantization.layer_filter chooses). Returns whether a parameter of it trains."""
    storage = config.component_storage(name)
    trains = store_by_role(module, DTYPES[config.trained_weight_dtype], frozen_storage_dtype(storage))
    keep = unquantized_modules(module, config.quantization) if denoiser else frozenset()
    quantize_frozen(module, storage, DTYPES[config.train_dtype], keep)
    return trains


def store_by_role(module: torch.nn.Module, trained_dtype: torch.dtype, frozen_dtype: torch.dtype | None) -> bool:
    """The module's own and nested parameters cast by role (trained: `trained_dtype`, e.g. float32 masters; frozen:
    `frozen_dtype`, or left as loaded where None: a quantized storage's), the module in train mode if any of them
    trains. Returns whether one does. A text encoder whose
    only trained parameters are new token rows (token_vectors.py) reads them in eval mode instead, as OneTrainer's
    embedding setups put every text encoder in eval mode: a T5's dropout (0.1 in T5 v1.1's config) stays off, so the
    vectors learn against the conditioning the model is used with (`reading_mode`)."""
    trains = False
    for p in module.parameters():
        if p.requires_grad:
            trains = True
            p.data = p.data.to(trained_dtype)
        elif frozen_dtype is not None:
            p.data = p.data.to(frozen_dtype)
    if frozen_dtype is not None:
        cast_frozen_buffers(module, frozen_dtype)
    if trains and not trains_beyond_token_rows(module):
        reading_mode(module)
    else:
        module.train(trains)
    return trains


def trains_beyond_token_rows(module: torch.nn.Module) -> bool:
    """Whether a parameter that trains is one of the module's own weights, not a row of new tokens (a sub-module
    marked `token_rows`: token_vectors.py's ExtendedTokenEmbedding, its output vectors too)."""
    rows = {id(p) for sub in module.modules() if getattr(sub, "token_rows", False) for p in sub.parameters()}
    return any(p.requires_grad and id(p) not in rows for p in module.parameters())


def reading_mode(module: torch.nn.Module) -> None:
    """Eval mode (no dropout) for a module that backpropagates to its inputs only, except the training flag of its
    transformers layers themselves: transformers checkpoints a GradientCheckpointingLayer only in train mode, and that
    flag gates nothing else in them (their attention and MLP children, which drop out, stay in eval mode)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    module.eval()
    for sub in module.modules():
        if isinstance(sub, GradientCheckpointingLayer):
            sub.training = True


def cast_frozen_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point state buffers (BatchNorm's running statistics) of every sub-module that trains none of its
    own parameters follow the frozen weights' dtype, as loading the checkpoint in that dtype casts them: a bfloat16
    input meeting float32 running statistics is an error in BatchNorm on the CPU (the EfficientNet encoder of
    Stable Cascade / Würstchen). Non-persistent buffers are tables the libraries derive and keep in float32 on
    purpose (rotary frequencies); they, and a trained module's buffers, stay as they are."""
    for sub in module.modules():
        if any(p.requires_grad for p in sub.parameters(recurse=False)):
            continue
        for name, buffer in sub.named_buffers(recurse=False):
            if name in sub._non_persistent_buffers_set:
                continue
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(sub, name, buffer.to(dtype))


def place_component(component: torch.nn.Module, config, device: torch.device, offloadable: bool,
                    prefer_cpu: bool = False, streamed: list[torch.nn.Module] = (), strategy_places: bool = False) -> None:
    """`offload_frozen_components` (or `prefer_cpu`: a text encoder whose outputs are cached) keeps an entirely frozen
    `offloadable` component (text encoder, VAE) in CPU memory, else the component moves to `device`, but the frozen
    weights of its `streamed` blocks (memory/block_streaming.py; the trained ones too when
    `config.streams_trained_weights()`), which stay in CPU memory. A component with trained weights stays where it is
    when `strategy_places` (the strategy moves it, a sharding unit at a time: Strategy.shards_while_placing). After
    store_component."""
    frozen = not any(p.requires_grad for p in component.parameters())
    if strategy_places and not frozen:
        if device.type == "cpu":
            into_aligned_memory(component)
    elif (config.offload_frozen_components or prefer_cpu) and offloadable and frozen:
        offload_to_cpu(component, device)
    else:
        trained = bool(streamed) and config.streams_trained_weights()
        with kept_home(streamed, trained):
            component.to(device)
        if device.type == "cpu":
            into_aligned_memory(component)
        if streamed:
            stream_blocks(component, streamed, device, trained)


# oneDNN / MKL pick their code paths by the address alignment of the operands.
CPU_KERNEL_ALIGNMENT = 64


def into_aligned_memory(module: torch.nn.Module) -> None:
    """Copy the CPU tensors that lie at unaligned addresses (views into a memory-mapped .safetensors file) into
    allocated memory. The CPU kernels round differently for unaligned operands, so one model loaded from a diffusers
    folder (transformers copies its weights, diffusers maps them) and from a single file would train to different
    bits. A move to a GPU copies anyway; on the CPU this copy makes training independent of how it was loaded."""
    module._apply(lambda t: t.clone() if t.device.type == "cpu" and t.data_ptr() % CPU_KERNEL_ALIGNMENT else t)


def unquantized_modules(denoiser: torch.nn.Module, settings) -> frozenset[int]:
    """The ids of the denoiser's modules a quantized storage leaves alone under `settings` (quantization.layer_filter:
    OneTrainer quantizes only the Linear layers the filter selects); none without a filter."""
    if settings.layer_filter is None:
        return frozenset()
    from ot_dist.methods.lora import layer_filter_targets

    chosen = set(layer_filter_targets(settings.layer_filter, settings.layer_filter_regex, denoiser,
                                      field="quantization.layer_filter", kinds=(torch.nn.Linear,)))
    return frozenset(id(m) for name, m in denoiser.named_modules() if name not in chosen)
