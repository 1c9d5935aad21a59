"""`weight_dtype: float8`: frozen weights stored in one byte each, upcast when used.

Each frozen floating-point parameter is stored as torch.float8_e4m3fn with one float scale per tensor
(scale = max |w| / 448, e4m3's largest value, so the tensor uses the whole range). A module holding
such parameters gets a subclass of its own class (isinstance keeps working) in which reading the
parameter, e.g. `self.weight` in forward or from outside like peft's LoRA wrappers, returns the
upcast value `q.to(compute dtype) x scale`. Linear and Conv2d layers (almost all the bytes) also
keep only the 1-byte weight for backward: a custom autograd function recomputes the upcast weight for
the input gradient instead of autograd saving its upcast copy, which would cost more than bf16 storage.

`state_dict()` returns the upcast float32 values, in CPU memory, under the original keys (exports and
caches see a normal module); loading a state dict quantizes the incoming weights. What was rounded away is gone
from memory; full exports take the untrained components from model.path instead (checkpoint/frozen_source.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448
COMPUTE_DTYPE_ATTR = "float8_compute_dtype"  # set on every float8 module and on the component root


def quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(float8 values, scale) with tensor ~= values x scale."""
    amax = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    scale = amax / FLOAT8_MAX if amax > 0 else 1.0
    return (tensor.detach().float() / scale).to(FLOAT8), scale


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return stored.to(dtype) * scale


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a module's inputs should be given in: its weights', or the compute dtype of float8 storage."""
    return getattr(module, COMPUTE_DTYPE_ATTR, None) or next(module.parameters()).dtype


# Sub-modules (by their name in the model) whose parameters' dtype the library reads directly, not through the
# model's `.dtype`, and casts its inputs or draws its latents in: their frozen parameters are held in the compute
# dtype instead (a few small layers). Each found by tests/test_float8_dtype.py.
PARAMETER_DTYPE_READS: dict[str, tuple[str, ...]] = {
    # WanTimeTextImageEmbedding: the timestep projection cast to `next(time_embedder.parameters()).dtype`
    "WanTransformer3DModel": ("condition_embedder.time_embedder",),
    # StableCascadePriorPipeline: latents, image embeddings and timestep ratios in `next(prior.parameters()).dtype`
    "StableCascadeUNet": ("clip_txt_pooled_mapper",),
}


def store_frozen_in_float8(component: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating-point parameter of `component` in float8, upcast to `dtype` on use, but in the
    modules PARAMETER_DTYPE_READS names (held in `dtype`). Modules that hold a trainable parameter themselves are left
    alone, but for OFT layers (`lora.variant: oft`, ot_dist/methods/oft.py): their base weight and bias are stored too
    and read through the upcast by the layer's own forward, which rotates the weight with the trainable blocks beside
    it. The component then reports `dtype` as its `.dtype` (report_compute_dtype). Returns the parameters stored."""
    count = 0
    kept = _parameter_dtype_reads(component)
    for module in list(component.modules()):
        if id(module) in kept:
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point() and not param.requires_grad:
                    param.data = param.data.to(dtype)
            continue
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None and p.is_floating_point()]
        if not own or getattr(module, COMPUTE_DTYPE_ATTR, None):
            continue
        if any(p.requires_grad for _, p in own):
            if not _rotates_its_weight(type(module)):
                continue
            own = [(n, p) for n, p in own if not p.requires_grad]
        scales = {}
        for name, param in own:
            stored, scales[name] = quantize(param)
            module._parameters[name] = torch.nn.Parameter(stored, requires_grad=False)
            count += param.numel()
        module._float8_scales = scales
        setattr(module, COMPUTE_DTYPE_ATTR, dtype)
        module.__class__ = _float8_class(type(module), tuple(sorted(scales)))
        module.register_state_dict_post_hook(_upcast_state)
        module.register_load_state_dict_pre_hook(_quantize_loaded)
    setattr(component, COMPUTE_DTYPE_ATTR, dtype)
    report_compute_dtype(component, dtype)
    return count


def _parameter_dtype_reads(component: torch.nn.Module) -> set[int]:
    """The ids of the sub-modules of `component` (and of models nested in it) that PARAMETER_DTYPE_READS names."""
    kept = set()
    for model in component.modules():
        for name in PARAMETER_DTYPE_READS.get(type(model).__name__, ()):
            kept.update(id(m) for m in model.get_submodule(name).modules())
    return kept


_CLASSES: dict[tuple[type, object], type] = {}  # (class, what the subclass adds) -> the subclass


def report_compute_dtype(component: torch.nn.Module, dtype: torch.dtype) -> None:
    """From now on the component and the models nested in it report `dtype` as `.dtype` wherever `.dtype` read the
    stored float8, as diffusers' own layerwise casting does (its models' `.dtype` is the casting hook's compute
    dtype). diffusers / transformers take `.dtype` from the first floating-point parameter and draw or cast tensors
    in it: pipelines create their latents in it (torch.randn has no float8 kernel) and cast prompt embeddings to it
    (no float8 arithmetic either), Qwen2.5-VL's vision tower casts its pixels to its own (they would keep 3 mantissa
    bits). A model whose `.dtype` reads a trained parameter keeps its own. Once, when stored: the class of each is
    switched here, not on every call (a walk over every module of a 7 B encoder per step); that no training path
    computes differently for it (every `.dtype` read there cast activations to float8) is tests/test_float8_dtype.py's."""
    for module in component.modules():
        if not isinstance(getattr(type(module), "dtype", None), property) or module.dtype != FLOAT8:
            continue
        if getattr(module, COMPUTE_DTYPE_ATTR, None) is None:
            setattr(module, COMPUTE_DTYPE_ATTR, dtype)
        module.__class__ = _reporting_class(type(module))


def _reporting_class(cls: type) -> type:
    key = (cls, "dtype")
    if key not in _CLASSES:
        attrs = {"dtype": property(lambda self: getattr(self, COMPUTE_DTYPE_ATTR)),
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__}  # named as its class (configs)
        _CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _CLASSES[key]


def _rotates_its_weight(cls: type) -> bool:
    """An OFT layer's class: its forward computes with `adapted_weight()`, made of `self.weight`, whatever stores it."""
    from ot_dist.methods.oft import OrthogonalConv2d, OrthogonalLinear

    return issubclass(cls, (OrthogonalLinear, OrthogonalConv2d))


def _float8_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with each stored parameter read through its upcast (a property wins over nn.Module's
    __getattr__, which would return the stored float8 tensor). An OFT layer keeps its forward (the rotation; the
    weight it rotates is the upcast one)."""
    key = (cls, names)
    if key not in _CLASSES:
        attrs = {name: property(_upcast_getter(name)) for name in names}
        plain = not _rotates_its_weight(cls)
        if plain and issubclass(cls, torch.nn.Linear) and "weight" in names:
            attrs["forward"] = _linear_forward
        elif plain and issubclass(cls, torch.nn.Conv2d) and "weight" in names:
            attrs["forward"] = _conv2d_forward
        _CLASSES[key] = type(f"Float8{cls.__name__}", (cls,), attrs)
    return _CLASSES[key]


def _upcast_getter(name: str):
    def upcast(self):
        return dequantize(self._parameters[name], self._float8_scales[name], getattr(self, COMPUTE_DTYPE_ATTR))

    return upcast


def _upcast_state(module, state_dict, prefix, local_metadata):
    # Upcast in CPU memory: a whole model's float32 state dict must not land on a small accelerator
    # (a LoRA export asks for the UNet's full state dict to pick its adapter keys from).
    for name, scale in module._float8_scales.items():
        state_dict[prefix + name] = dequantize(module._parameters[name].cpu(), scale, torch.float32)


def _quantize_loaded(module, state_dict, prefix, *args):
    for name in module._float8_scales:
        if prefix + name in state_dict:
            state_dict[prefix + name], module._float8_scales[name] = quantize(state_dict[prefix + name])


def _call_dtype(x: torch.Tensor) -> torch.dtype:
    """What the op would compute in with ordinary weights: the autocast dtype if on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _Float8Op.apply(x, *_stored(self), "linear", ())


def _conv2d_forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.padding_mode != "zeros" or isinstance(self.padding, str):  # rare layouts: plain upcast
        return self._conv_forward(x, self.weight, self.bias)
    return _Float8Op.apply(x, *_stored(self), "conv2d", (self.stride, self.padding, self.dilation, self.groups))


def _stored(layer) -> tuple:
    """(weight, its scale, bias, its scale) as stored; the bias may be absent or not float8 (trainable)."""
    scales = layer._float8_scales
    bias = layer._parameters.get("bias")
    return layer._parameters["weight"], scales["weight"], bias, scales.get("bias", 1.0)


class _Float8Op(torch.autograd.Function):
    """linear / conv2d with a float8 weight, saving that weight (1 byte per element) rather than its
    upcast copy for the input gradient. The weight and bias are frozen: no gradients for them."""

    @staticmethod
    def forward(ctx, x, stored, scale, stored_bias, bias_scale, op, geometry):
        dtype = _call_dtype(x)
        weight = dequantize(stored, scale, dtype)
        bias = dequantize(stored_bias, bias_scale, dtype) if stored_bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            if op == "linear":
                out = F.linear(x.to(dtype), weight, bias)
            else:
                out = F.conv2d(x.to(dtype), weight, bias, *geometry)
        ctx.save_for_backward(stored)
        ctx.scale, ctx.dtype, ctx.op, ctx.geometry = scale, dtype, op, geometry
        ctx.input_shape, ctx.input_dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        (stored,) = ctx.saved_tensors
        weight = dequantize(stored, ctx.scale, ctx.dtype)
        grad_out = grad_out.to(ctx.dtype)
        if ctx.op == "linear":
            grad_x = grad_out.matmul(weight)
        else:
            stride, padding, dilation, groups = ctx.geometry
            grad_x = torch.nn.grad.conv2d_input(ctx.input_shape, weight, grad_out, stride, padding, dilation, groups)
        return (grad_x.to(ctx.input_dtype),) + (None,) * 6
