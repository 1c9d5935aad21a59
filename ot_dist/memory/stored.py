"""What the storage options for frozen weights share (`weight_dtype: float8`, memory/float8.py, `nf4`,
memory/nf4.py, and `int8`, memory/int8.py): a stored weight is held in a storage format and read in the compute dtype.
A module holding one gets a subclass of its own class (isinstance keeps working) whose parameter reads return the
compute-dtype value, the component reports the compute dtype as its `.dtype`, and Linear / Conv2d layers keep only the
stored weight for backward (StoredWeightOp). nf4 and int8 store Linear weights only, by one loop
(store_linear_weights) given a LinearStorage.

A stored layer's state dict gives its weight dequantized to float32 (in CPU memory), but not while a state dict is
made for a key filter that drops it (`kept_entries`: a LoRA export asks for its adapters, not for the whole model in
float32), and sampling's copies of the trained modules hold the stored tensors themselves (`share_stored`: no
dequantized copy, no quantization again)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

COMPUTE_DTYPE_ATTR = "stored_compute_dtype"  # set on every module holding stored weights and on the component root


# Sub-modules (by their name in the model) whose parameters' dtype the library reads directly, not through the
# model's `.dtype`, and casts its inputs or draws its latents in: their frozen parameters are held in the compute
# dtype instead (a few small layers). Each found by tests/test_float8_dtype.py.
PARAMETER_DTYPE_READS: dict[str, tuple[str, ...]] = {
    # WanTimeTextImageEmbedding: the timestep projection cast to `next(time_embedder.parameters()).dtype`
    "WanTransformer3DModel": ("condition_embedder.time_embedder",),
    # StableCascadePriorPipeline: latents, image embeddings and timestep ratios in `next(prior.parameters()).dtype`
    "StableCascadeUNet": ("clip_txt_pooled_mapper",),
}

_CLASSES: dict[tuple[type, object], type] = {}  # (class, what the subclass adds) -> the subclass

# The key filter of the state dict being made (`kept_entries`), None outside one: stored entries it drops are left as
# the layer holds them, not dequantized.
_KEPT: ContextVar[Callable[[str], bool] | None] = ContextVar("stored_state_kept", default=None)


@dataclass(frozen=True)
class StoredParts:
    """What a stored layer holds of its stored weights (a stored layer's `stored_parts`): the state entries held in the
    storage format (`_parameters` names: their state-dict entries are dequantized copies), the buffers of their
    statistics (non-persistent: not state) and the plain attributes they are read with (float8's scales, nf4's shape).
    Frozen: nothing writes them after storing, so a copy of the layer may hold the same tensors."""

    entries: tuple[str, ...]
    buffers: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()


@contextlib.contextmanager
def kept_entries(keep: Callable[[str], bool] | None):
    """While a state dict is made for the entries `keep` accepts (the keys from the module it is asked of): a stored
    entry `keep` drops is left in the state dict as the layer holds it (its stored tensor, no copy; the caller drops
    it) instead of dequantized into float32 CPU memory. A LoRA export of a Flux.1 base in float8 picks its adapters
    from the transformer's state dict: 48 GB of float32 dequantized for nothing without this."""
    token = _KEPT.set(keep)
    try:
        yield
    finally:
        _KEPT.reset(token)


def dequantizes(key: str) -> bool:
    """Whether a stored layer's state-dict hook gives the entry `key` dequantized: unless the state dict is being made
    for a key filter that drops it (`kept_entries`)."""
    keep = _KEPT.get()
    return keep is None or keep(key)


def stored_layers(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, StoredParts]]:
    """(name, layer, its StoredParts) of each layer of `module` holding stored weights."""
    for name, layer in module.named_modules(remove_duplicate=False):
        parts = getattr(layer, "stored_parts", None)
        if isinstance(parts, StoredParts):
            yield name, layer, parts


def stored_state_keys(module: torch.nn.Module) -> frozenset[str]:
    """The state-dict keys of `module` whose values are stored weights dequantized (none of them dequantized here)."""
    return frozenset(f"{name}.{entry}" if name else entry
                     for name, _, parts in stored_layers(module) for entry in parts.entries)


def stored_tensor_ids(module: torch.nn.Module) -> set[int]:
    """The ids of the stored tensors of `module`'s stored layers: the stored weights and their statistics' buffers."""
    return {id(t) for _, layer, parts in stored_layers(module)
            for t in (*(layer._parameters[n] for n in parts.entries), *(layer._buffers[n] for n in parts.buffers))}


def share_stored(copy: torch.nn.Module, source: torch.nn.Module) -> frozenset[str]:
    """Make each stored layer of `copy` (a structure of `source`: sampling's copy of a trained module) hold the stored
    tensors of `source`'s layer of the same name themselves (the stored weights, their statistics, a copy of the
    attributes they are read with), wherever `source` holds them: no dequantized weight, nothing quantized again, no
    memory but the copy's own modules. What is shared is frozen (nothing writes it). The same for every storage kind:
    each describes what it holds (StoredParts). Returns the state keys shared (`stored_state_keys`): the state dict
    loaded into `copy` leaves them out."""
    layers = dict(source.named_modules(remove_duplicate=False))
    for name, layer, parts in stored_layers(copy):
        own = layers[name]
        for entry in parts.entries:  # a Parameter of its own (a `.to()` of the copy sets `.data` of its parameters)
            layer._parameters[entry] = torch.nn.Parameter(own._parameters[entry].detach(), requires_grad=False)
        for buffer in parts.buffers:
            layer._buffers[buffer] = own._buffers[buffer]
        for attribute in parts.attributes:
            value = getattr(own, attribute)
            setattr(layer, attribute, dict(value) if isinstance(value, dict) else value)
    return stored_state_keys(copy)


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a module's inputs should be given in: its weights', or the compute dtype of stored weights."""
    return getattr(module, COMPUTE_DTYPE_ATTR, None) or next(module.parameters()).dtype


def holds_stored_weights(module: torch.nn.Module) -> bool:
    """Whether float8 or nf4 storage was applied to `module` or to a module inside it."""
    return any(getattr(m, COMPUTE_DTYPE_ATTR, None) is not None for m in module.modules())


def parameter_dtype_reads(component: torch.nn.Module) -> set[int]:
    """The ids of the sub-modules of `component` (and of models nested in it) that PARAMETER_DTYPE_READS names."""
    kept = set()
    for model in component.modules():
        for name in PARAMETER_DTYPE_READS.get(type(model).__name__, ()):
            kept.update(id(m) for m in model.get_submodule(name).modules())
    return kept


def report_compute_dtype(component: torch.nn.Module, dtype: torch.dtype) -> None:
    """From now on the component and the models nested in it report `dtype` as `.dtype` wherever `.dtype` read a
    stored weight, as diffusers' own layerwise casting does (its models' `.dtype` is the casting hook's compute
    dtype). diffusers / transformers take `.dtype` from the first floating-point parameter and draw or cast tensors
    in it: pipelines create their latents in it (torch.randn has no float8 kernel) and cast prompt embeddings to it
    (no float8 arithmetic either), Qwen2.5-VL's vision tower casts its pixels to its own (they would keep 3 mantissa
    bits). A model whose `.dtype` reads a trained parameter keeps its own. Once, when stored: the class of each is
    switched here, not on every call (a walk over every module of a 7 B encoder per step); that no training path
    computes differently for it (every `.dtype` read there cast activations to float8) is
    tests/test_float8_dtype.py's."""
    setattr(component, COMPUTE_DTYPE_ATTR, dtype)
    for module in component.modules():
        if not isinstance(getattr(type(module), "dtype", None), property) or not _reads_storage(module.dtype):
            continue
        if getattr(module, COMPUTE_DTYPE_ATTR, None) is None:
            setattr(module, COMPUTE_DTYPE_ATTR, dtype)
        module.__class__ = _reporting_class(type(module))


def _reads_storage(dtype: torch.dtype) -> bool:
    """Whether a model's `.dtype` read stored weights: float8 storage, or no floating-point dtype at all (nf4's packed
    uint8 weights and int32-held statistics, which diffusers and transformers fall back to where a model holds no
    floating-point parameter or buffer)."""
    return dtype == torch.float8_e4m3fn or not dtype.is_floating_point


def _reporting_class(cls: type) -> type:
    key = (cls, "dtype")
    if key not in _CLASSES:
        attrs = {"dtype": property(lambda self: getattr(self, COMPUTE_DTYPE_ATTR)),
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__}  # named as its class (configs)
        _CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _CLASSES[key]


def stored_class(cls: type, prefix: str, attrs: dict, forwards: dict[type, object]) -> type:
    """`cls` with `attrs` (the stored parameters read through properties: a property wins over nn.Module's
    __getattr__, which would return the stored tensor) and, for a plain layer of a class in `forwards`, that class's
    forward. An OFT layer keeps its forward (the rotation; the weight it rotates is the compute-dtype one)."""
    key = (cls, (prefix, tuple(sorted(attrs))))
    if key not in _CLASSES:
        attrs = dict(attrs)
        if not rotates_its_weight(cls):
            for base, forward in forwards.items():
                if issubclass(cls, base):
                    attrs["forward"] = forward
                    break
        _CLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,), attrs)
    return _CLASSES[key]


def rotates_its_weight(cls: type) -> bool:
    """An OFT layer's class: its forward computes with `adapted_weight()`, made of `self.weight`, whatever stores it."""
    from ot_dist.methods.oft import OrthogonalConv2d, OrthogonalLinear

    return issubclass(cls, (OrthogonalLinear, OrthogonalConv2d))


def call_dtype(x: torch.Tensor) -> torch.dtype:
    """What the op would compute in with ordinary weights: the autocast dtype if on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class StoredWeightOp(torch.autograd.Function):
    """linear / conv2d with a stored weight, saving the stored tensors (`stored`: what `weight_of(dtype, *stored)`
    rebuilds the weight from) rather than the compute-dtype weight for the input gradient. The weight and bias are
    frozen: no gradients for them. `bias_of(dtype)` gives the bias (or None)."""

    @staticmethod
    def forward(ctx, x, weight_of, bias_of, op, geometry, *stored):
        dtype = call_dtype(x)
        weight = weight_of(dtype, *stored)
        bias = bias_of(dtype)
        with torch.autocast(x.device.type, enabled=False):
            if op == "linear":
                out = F.linear(x.to(dtype), weight, bias)
            else:
                out = F.conv2d(x.to(dtype), weight, bias, *geometry)
        ctx.save_for_backward(*stored)
        ctx.weight_of, ctx.dtype, ctx.op, ctx.geometry = weight_of, dtype, op, geometry
        ctx.input_shape, ctx.input_dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        stored = ctx.saved_tensors  # once: under non-reentrant checkpointing a second read is an error
        none = (None,) * (4 + len(stored))
        if not ctx.needs_input_grad[0]:
            return (None,) + none
        weight = ctx.weight_of(ctx.dtype, *stored)
        grad_out = grad_out.to(ctx.dtype)
        if ctx.op == "linear":
            grad_x = grad_out.matmul(weight)
        else:
            stride, padding, dilation, groups = ctx.geometry
            grad_x = torch.nn.grad.conv2d_input(ctx.input_shape, weight, grad_out, stride, padding, dilation, groups)
        return (grad_x.to(ctx.input_dtype),) + none


def quantize_loaded_weight(quantize):
    """A load_state_dict pre-hook for a layer whose weight is stored: the incoming `weight` is replaced by its stored
    form and the statistics `quantize(weight) -> (stored, {buffer name: tensor})` gives are put beside the stored
    weight: where the module holds it, or where the weight arrives when the module is a meta structure it is assigned
    into (sampling's copies of the trained modules)."""
    def hook(module, state_dict, prefix, *args):
        if prefix + "weight" not in state_dict:
            return
        weight = state_dict[prefix + "weight"]
        stored, buffers = quantize(weight.float())
        state_dict[prefix + "weight"] = stored
        device = module._parameters["weight"].device
        device = weight.device if device.type == "meta" else device
        for name, tensor in buffers.items():
            module._buffers[name] = tensor.to(device)

    return hook


@dataclass(frozen=True)
class LinearStorage:
    """How a format that stores Linear weights only (nf4, int8) holds one: `store(module, weight)` puts the stored
    weight (and its statistics, as buffers) into the layer; a stored layer reads `.weight` through `dequantized`,
    runs `forward`, gives its dequantized weight to state dicts (`state_hook`) and stores a loaded one (`load_hook`).
    `oft`: an OFT layer's frozen weight is stored too (its own forward rotates the dequantized weight). `parts`: what
    a stored layer holds (its `stored_parts`)."""

    prefix: str  # of the stored layer's class name
    store: Callable[[torch.nn.Module, torch.Tensor], None]
    dequantized: Callable[[torch.nn.Module], torch.Tensor]
    forward: Callable
    state_hook: Callable
    load_hook: Callable
    oft: bool
    parts: StoredParts


def store_linear_weights(component: torch.nn.Module, dtype: torch.dtype, keep: frozenset[int],
                         storage: LinearStorage) -> int:
    """Store the weight of every frozen nn.Linear of `component` as `storage` says, read in `dtype`; every other
    frozen floating-point parameter is cast to `dtype`. Left in `dtype`: the modules PARAMETER_DTYPE_READS names,
    those in `keep` (ids: quantization.layer_filter's leftovers) and Linear layers holding a trainable parameter
    themselves, but for OFT layers where `storage.oft`. The component then reports `dtype` as its `.dtype`
    (report_compute_dtype). Returns the weights stored (elements)."""
    count = 0
    kept = parameter_dtype_reads(component) | keep
    for module in list(component.modules()):
        if _linear_storable(module, kept, storage.oft):
            count += module.weight.numel()
            storage.store(module, module.weight.data)  # from the weight as loaded, before the cast below
            setattr(module, COMPUTE_DTYPE_ATTR, dtype)
            attrs = {"weight": property(storage.dequantized), "stored_parts": storage.parts}
            module.__class__ = stored_class(type(module), storage.prefix, attrs, {torch.nn.Linear: storage.forward})
            module.register_state_dict_post_hook(storage.state_hook)
            module.register_load_state_dict_pre_hook(storage.load_hook)
        for param in module.parameters(recurse=False):  # a stored weight is an integer tensor: not cast
            if param.is_floating_point() and not param.requires_grad:
                param.data = param.data.to(dtype)
    report_compute_dtype(component, dtype)
    return count


def _linear_storable(module: torch.nn.Module, kept: set[int], oft: bool) -> bool:
    """A Linear layer with a frozen floating-point weight, not yet stored, outside the `kept` modules, trained
    parameters of its own only if it is an OFT layer (which trains blocks beside its frozen weight) and `oft`."""
    weight = module._parameters.get("weight") if isinstance(module, torch.nn.Linear) else None
    if (weight is None or not weight.is_floating_point() or weight.requires_grad or id(module) in kept
            or getattr(module, COMPUTE_DTYPE_ATTR, None) is not None):
        return False
    if rotates_its_weight(type(module)):
        return oft
    return not any(p.requires_grad for p in module.parameters(recurse=False))
