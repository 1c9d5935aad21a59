"""`weight_dtype: float8`: frozen weights stored in one byte each, upcast when used.

Each frozen floating-point parameter is stored as torch.float8_e4m3fn with one float scale per tensor
(scale = max |w| / 448, e4m3's largest value, so the tensor uses the whole range). A module holding
such parameters gets a subclass of its own class (isinstance keeps working) in which reading the
parameter, e.g. `self.weight` in forward or from outside like peft's LoRA wrappers, returns the
upcast value `q.to(compute dtype) x scale`. Linear and Conv2d layers (almost all the bytes) also
keep only the 1-byte weight for backward: a custom autograd function (memory/stored.py, shared with nf4 storage)
recomputes the upcast weight for the input gradient instead of autograd saving its upcast copy, which would cost more
than bf16 storage.

`state_dict()` returns the upcast float32 values, in CPU memory, under the original keys (exports and
caches see a normal module), but for the entries a key filter drops (stored.kept_entries); loading a state dict
quantizes the incoming weights. What was rounded away is gone from memory; full exports take the untrained
components from model.path instead (checkpoint/frozen_source.py).
"""

from __future__ import annotations

import torch

from ot_dist.memory.stored import (  # noqa: F401  (compute_dtype, _CLASSES: read from here by callers and tests)
    _CLASSES,
    COMPUTE_DTYPE_ATTR,
    PARAMETER_DTYPE_READS,
    StoredParts,
    StoredWeightOp,
    compute_dtype,
    dequantizes,
    parameter_dtype_reads,
    report_compute_dtype,
    rotates_its_weight,
    stored_class,
)

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448


def quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(float8 values, scale) with tensor ~= values x scale."""
    amax = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    scale = amax / FLOAT8_MAX if amax > 0 else 1.0
    return (tensor.detach().float() / scale).to(FLOAT8), scale


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return stored.to(dtype) * scale


def store_frozen_in_float8(component: torch.nn.Module, dtype: torch.dtype, keep: frozenset[int] = frozenset()) -> int:
    """Store every frozen floating-point parameter of `component` in float8, upcast to `dtype` on use, but in the
    modules PARAMETER_DTYPE_READS names (held in `dtype`). Modules that hold a trainable parameter themselves are left
    alone, but for OFT layers (`lora.variant: oft`, ot_dist/methods/oft.py): their base weight and bias are stored too
    and read through the upcast by the layer's own forward, which rotates the weight with the trainable blocks beside
    it. The component then reports `dtype` as its `.dtype` (report_compute_dtype). Returns the parameters stored."""
    count = 0
    kept = parameter_dtype_reads(component) | keep  # `keep`: modules left out by quantization.layer_filter
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
            if not rotates_its_weight(type(module)):
                for _, param in own:  # frozen beside trained ones: float32, as quantized weights are made from
                    if not param.requires_grad:
                        param.data = param.data.float()
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
    report_compute_dtype(component, dtype)
    return count


def _float8_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with each stored parameter read through its upcast."""
    attrs = {name: property(_upcast_getter(name)) for name in names}
    attrs["stored_parts"] = property(_stored_parts)
    forwards = {torch.nn.Linear: _linear_forward, torch.nn.Conv2d: _conv2d_forward} if "weight" in names else {}
    return stored_class(cls, "Float8", attrs, forwards)


def _upcast_getter(name: str):
    def upcast(self):
        return dequantize(self._parameters[name], self._float8_scales[name], getattr(self, COMPUTE_DTYPE_ATTR))

    return upcast


def _stored_parts(self) -> StoredParts:
    return StoredParts(entries=tuple(self._float8_scales), attributes=("_float8_scales",))


def _upcast_state(module, state_dict, prefix, local_metadata):
    # Upcast in CPU memory: a whole model's float32 state dict must not land on a small accelerator. Not the entries a
    # key filter drops (a LoRA export's, which picks the adapters): they stay the float8 tensors, dropped by the caller.
    for name, scale in module._float8_scales.items():
        if dequantizes(prefix + name):
            state_dict[prefix + name] = dequantize(module._parameters[name].cpu(), scale, torch.float32)


def _quantize_loaded(module, state_dict, prefix, *args):
    for name in module._float8_scales:
        if prefix + name in state_dict:
            state_dict[prefix + name], module._float8_scales[name] = quantize(state_dict[prefix + name])


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight_of, bias_of, stored = _stored(self)
    return StoredWeightOp.apply(x, weight_of, bias_of, "linear", (), stored)


def _conv2d_forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.padding_mode != "zeros" or isinstance(self.padding, str):  # rare layouts: plain upcast
        return self._conv_forward(x, self.weight, self.bias)
    weight_of, bias_of, stored = _stored(self)
    geometry = (self.stride, self.padding, self.dilation, self.groups)
    return StoredWeightOp.apply(x, weight_of, bias_of, "conv2d", geometry, stored)


def _stored(layer) -> tuple:
    """(how to upcast the weight, how to upcast the bias) and the float8 weight: saved for backward, 1 byte per
    element. The bias may be absent."""
    scale, bias_scale = layer._float8_scales["weight"], layer._float8_scales.get("bias", 1.0)
    bias = layer._parameters.get("bias")

    def weight_of(dtype, stored):
        return dequantize(stored, scale, dtype)

    def bias_of(dtype):
        return dequantize(bias, bias_scale, dtype) if bias is not None else None

    return weight_of, bias_of, layer._parameters["weight"]
