"""`weight_dtype: nf4`: frozen Linear weights stored in 4 bits (QLoRA's NormalFloat4), OneTrainer's NFLOAT_4.

Every frozen nn.Linear weight is quantized by bitsandbytes exactly as OneTrainer's LinearNf4 does it
(modules/module/quantized/LinearNf4.py): `quantize_4bit(weight, blocksize=64, compress_statistics=True,
quant_type='nf4', quant_storage=torch.uint8)`: two 4-bit codes per byte, one absmax per 64 weights, itself quantized
to 8 bits in blocks of 256 with a float32 scale each (0.5 + 1/64 + 1/4096 bytes per weight). Its other frozen
parameters (biases, norms, embeddings, convolutions) are held in the compute dtype, as OneTrainer loads every tensor
of a quantized part that LinearNf4 does not quantize in the train dtype (HFModelLoaderMixin: `dtype.is_quantized()`).

As with float8 storage (memory/float8.py; what both share is memory/stored.py) the layer becomes a subclass of its
own class: reading `.weight` (peft's LoRA wrappers do) gives the dequantized weight of the original shape in the
compute dtype; its forward keeps only the packed weight and its statistics for backward and dequantizes again for
the input gradient. `state_dict()` gives the dequantized float32 weight under the original key; loading a state
dict quantizes the incoming weight. The quantization statistics are non-persistent buffers: they move with the
module and stay out of the state dict. Full exports take the frozen parts from model.path
(checkpoint/frozen_source.py): what the 4 bits rounded away is gone from memory.
"""

from __future__ import annotations

import torch

from ot_dist.memory.stored import (
    COMPUTE_DTYPE_ATTR,
    LinearStorage,
    StoredParts,
    StoredWeightOp,
    dequantizes,
    quantize_loaded_weight,
    store_linear_weights,
)

BLOCKSIZE = 64  # OneTrainer's LinearNf4.block_size; bitsandbytes quantizes the absmaxes in blocks of 256
STATISTICS = ("absmax", "offset", "code", "nested_absmax", "nested_code")  # QuantState's tensors, kept as buffers
BUFFER_PREFIX = "nf4_"


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(packed uint8 codes, the quantization statistics by STATISTICS name) of `weight`, with OneTrainer's settings.
    The float32 statistics are held as int32 views of their bits: a module's `.to(dtype)` casts floating-point
    buffers, which would round them, and diffusers' / transformers' `.dtype` reads a float buffer where a model's
    parameters hold none (an nf4 model of bias-free Linear layers reported float32, not its compute dtype)."""
    import bitsandbytes as bnb

    packed, state = bnb.functional.quantize_4bit(weight.detach(), blocksize=BLOCKSIZE, compress_statistics=True,
                                                 quant_type="nf4", quant_storage=torch.uint8)
    statistics = {"absmax": state.absmax, "offset": state.offset.reshape(()), "code": state.code,
                  "nested_absmax": state.state2.absmax, "nested_code": state.state2.code}
    return packed, {name: t.view(torch.int32) if t.dtype == torch.float32 else t for name, t in statistics.items()}


def dequantize(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, *statistics: torch.Tensor) -> torch.Tensor:
    """The weight of `shape` in `dtype`, as OneTrainer's LinearNf4.unquantized_weight computes it. Dequantized as one
    flat row, then shaped: the blocks of 64 run over the flattened weight, which bitsandbytes' CUDA kernel and its
    1-D CPU kernel follow, but its 2-D CPU kernel (0.50.2) does not for some row lengths (shorter than a block, or 96:
    half the weights wrong, a relative error of 0.2-0.4 instead of NF4's 0.09; tests/test_nf4_storage.py)."""
    import bitsandbytes as bnb

    absmax, offset, code, nested_absmax, nested_code = (
        t.view(torch.float32) if t.dtype == torch.int32 else t for t in statistics)
    nested = bnb.functional.QuantState(absmax=nested_absmax, code=nested_code, blocksize=256, dtype=torch.float32)
    state = bnb.functional.QuantState(absmax=absmax, shape=torch.Size([shape.numel()]), code=code,
                                      blocksize=BLOCKSIZE, quant_type="nf4", dtype=dtype, offset=offset, state2=nested)
    return bnb.functional.dequantize_4bit(packed, quant_state=state, quant_type="nf4").to(dtype).reshape(shape)


def store_frozen_in_nf4(component: torch.nn.Module, dtype: torch.dtype, keep: frozenset[int] = frozenset()) -> int:
    """Store the weight of every frozen nn.Linear of `component` in NF4, read in `dtype`; every other frozen
    floating-point parameter is cast to `dtype` (stored.store_linear_weights). OFT layers (`lora.variant: oft`) have
    their frozen weight stored too, read dequantized by the layer's own forward that rotates it. Returns the weights
    stored (elements)."""
    return store_linear_weights(component, dtype, keep, NF4)


def _store(module: torch.nn.Module, weight: torch.Tensor) -> None:
    # From float32: the weights as loaded (placement casts nf4 parts' frozen parameters to float32 first).
    packed, statistics = quantize(weight.float())
    module._parameters["weight"] = torch.nn.Parameter(packed, requires_grad=False)
    module.nf4_shape = weight.shape
    for name, tensor in statistics.items():
        module.register_buffer(BUFFER_PREFIX + name, tensor, persistent=False)


def _statistics(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(module._buffers[BUFFER_PREFIX + name] for name in STATISTICS)


def _dequantized(self) -> torch.Tensor:
    return dequantize(self._parameters["weight"], self.nf4_shape, getattr(self, COMPUTE_DTYPE_ATTR),
                      *_statistics(self))


def _dequantized_state(module, state_dict, prefix, local_metadata):
    # In CPU memory, as float8's: a whole model's float32 state dict must not land on a small accelerator. Not where a
    # key filter drops the weight (stored.kept_entries): the packed weight stays, dropped by the caller.
    if not dequantizes(prefix + "weight"):
        return
    stored = (t.cpu() for t in (module._parameters["weight"], *_statistics(module)))
    state_dict[prefix + "weight"] = dequantize(next(stored), module.nf4_shape, torch.float32, *stored)


def _quantized_with_buffers(weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    packed, statistics = quantize(weight)
    return packed, {BUFFER_PREFIX + name: tensor for name, tensor in statistics.items()}


_quantize_loaded = quantize_loaded_weight(_quantized_with_buffers)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    shape, bias = self.nf4_shape, self._parameters.get("bias")

    def weight_of(dtype, packed, *statistics):
        return dequantize(packed, shape, dtype, *statistics)

    def bias_of(dtype):
        return bias.to(dtype) if bias is not None else None

    return StoredWeightOp.apply(x, weight_of, bias_of, "linear", (), self._parameters["weight"], *_statistics(self))


NF4 = LinearStorage(prefix="Nf4", store=_store, dequantized=_dequantized, forward=_linear_forward,
                    state_hook=_dequantized_state, load_hook=_quantize_loaded, oft=True,
                    parts=StoredParts(entries=("weight",), buffers=tuple(BUFFER_PREFIX + name for name in STATISTICS),
                                      attributes=("nf4_shape",)))
