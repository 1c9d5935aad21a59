"""Each component is read in the narrowest dtype that holds its files' values exactly, not in float32.

Loading everything in float32 doubled the host memory and the conversion time of a model stored in 16 bits (nearly
every published one): Flux.1 dev with T5-XXL took ~68 GB before placement cast its frozen weights to their storage.
A bfloat16 file's values are bfloat16 values, so reading them as bfloat16 and casting later (to float32 masters, to a
bfloat16 / float8 / nf4 storage) gives the very numbers that reading them as float32 and casting gives: what trains
and what is stored is unchanged, the load peak is what the files hold.

What a 16-bit load changes besides the weights is put back here, so the loaded model is the float32 load's:
* diffusers and transformers build the model under the load dtype as torch's default dtype, so tables a module
  computes when it is built and keeps out of its state dict (Gemma's `embed_scale`) would come out rounded: they are
  taken from a float32 build of the same class whose weights stay on the meta device (no memory, no init);
* transformers records the load dtype in the model's config (`dtype`), which an export writes: float32, as before;
* peft makes a new adapter in its base layer's dtype: `adapters_as_on_float32` keeps them as made, in float32.
Whether the result is the float32 load's is tests/test_load_dtype.py's, for every family and training method."""

from __future__ import annotations

import contextlib
import json
import struct
from contextvars import ContextVar
from pathlib import Path
from typing import Iterable, Iterator

import torch

FLOAT32 = torch.float32
# Set by load_model(in_files_dtype=True) for the loaders it calls: the trainer, which stores every component
# afterwards, `lora merge`, which merges into float32 copies of the weights it changes, `lora extract`, which
# subtracts in float32, and `ot-dist export CHECKPOINT`, which puts the trained weights in as float32. Elsewhere (a
# library caller computing with the weights) float32.
_IN_FILES_DTYPE: ContextVar[bool] = ContextVar("ot_dist_in_files_dtype", default=False)


@contextlib.contextmanager
def reading_in_files_dtype(enabled: bool = True) -> Iterator[None]:
    """Inside: the loaders read each component in load_dtype_of its files; outside, in float32."""
    token = _IN_FILES_DTYPE.set(enabled)
    try:
        yield
    finally:
        _IN_FILES_DTYPE.reset(token)


def load_dtype_of(files: Iterable[Path]) -> torch.dtype:
    """The dtype a loader reads a component of these files in: exact_dtype inside reading_in_files_dtype, else
    float32."""
    return exact_dtype(files) if _IN_FILES_DTYPE.get() else FLOAT32


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype inside (what a module built there creates its tensors in)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# The 16-bit containers, narrowest first, and the safetensors dtypes each holds exactly (a float8 value is both a
# bfloat16 and a float16 value: e4m3's and e5m2's exponents and mantissas fit in either).
EXACT_CONTAINERS: tuple[tuple[torch.dtype, frozenset[str]], ...] = (
    (torch.bfloat16, frozenset({"BF16", "F8_E4M3", "F8_E5M2"})),
    (torch.float16, frozenset({"F16", "F8_E4M3", "F8_E5M2"})),
)
FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def tensor_entries(file: Path) -> dict[str, dict] | None:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets) from its header alone; None where the
    file is not readable as safetensors (the loader then names the problem)."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(Path(file).stat().st_size, 100 * 2**20):  # safetensors caps its header at 100 MB
                return None
            header = json.loads(f.read(length))
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        return entries if all(isinstance(e, dict) and "dtype" in e for e in entries.values()) else None
    except (OSError, ValueError, AttributeError, struct.error):
        return None


def safetensors_dtypes(file: Path) -> set[str] | None:
    """The safetensors dtype names of a file's floating tensors; None where it is not readable as safetensors."""
    entries = tensor_entries(file)
    return None if entries is None else {e["dtype"] for e in entries.values() if e["dtype"] in FLOATING}


def exact_dtype(files: Iterable[Path]) -> torch.dtype:
    """The narrowest dtype that holds every floating value of `files` exactly: bfloat16 for a bfloat16 (or float8)
    model, float16 for a float16 one, float32 for anything wider, mixed, unreadable, or no file at all."""
    found: set[str] = set()
    files = list(files)
    for file in files:
        dtypes = safetensors_dtypes(file)
        if dtypes is None:
            return FLOAT32
        found |= dtypes
    if not files or not found:
        return FLOAT32
    for dtype, holds in EXACT_CONTAINERS:
        if found <= holds:
            return dtype
    return FLOAT32


VARIANTS = (".fp16", ".bf16", ".fp32", ".fp8")


def loaded_files(files: list[Path]) -> list[Path]:
    """The files a load reads: a variant (diffusion_pytorch_model.fp16.safetensors, its shards
    ...fp16-00001-of-00002...) only where its folder has no plain weights, since ot_dist asks for no variant."""
    def variant(file: Path) -> bool:
        return any(tag + "." in file.name or tag + "-" in file.name for tag in VARIANTS)

    plain_folders = {file.parent for file in files if not variant(file)}
    return [file for file in files if not variant(file) or file.parent not in plain_folders]


def component_load_dtype(folder: Path) -> torch.dtype:
    """The dtype to read one component's folder in: load_dtype_of its weight files, as from_pretrained picks them."""
    return load_dtype_of(loaded_files(sorted(Path(folder).glob("*.safetensors"))))


def folder_load_dtypes(path: Path, names: Iterable[str]) -> dict[str, torch.dtype]:
    """Each named component of a diffusers folder (a subfolder of `path`) -> the dtype to read it in."""
    return {name: component_load_dtype(path / name) for name in names if (path / name).is_dir()}


def pipeline_from_pretrained(cls: type, folder: Path, index: dict, passed: dict, **kwargs):
    """`cls.from_pretrained(folder)` with the modules in `passed` put in and every other component the folder's
    model_index.json (`index`) lists read in its folder_load_dtypes, each made what the float32 load makes of it."""
    dtypes = folder_load_dtypes(folder, [name for name, entry in index.items()
                                         if isinstance(entry, list) and name not in passed])
    pipeline = cls.from_pretrained(folder, dtype={**dtypes, "default": FLOAT32}, **passed, **kwargs)
    for name, dtype in dtypes.items():
        if isinstance(getattr(pipeline, name, None), torch.nn.Module):
            as_float32_load(getattr(pipeline, name), dtype)
    return pipeline


def component_from_pretrained(cls: type, folder: Path, **kwargs) -> torch.nn.Module:
    """`cls.from_pretrained(folder)` of one component's folder, in component_load_dtype, made what the float32 load
    makes of it (a family that reads a component itself: one Wan 2.2 A14B expert)."""
    dtype = component_load_dtype(folder)
    module = cls.from_pretrained(folder, dtype=dtype, **kwargs)
    as_float32_load(module, dtype)
    return module


LOADED_IN_ATTR = "ot_dist_loaded_in"  # on a component read in 16 bits: the dtype whose values its files hold


def loaded_in(module: torch.nn.Module) -> torch.dtype:
    """The dtype a component was read in (float32 unless as_float32_load marked it): a weight held in it is the
    file's value, one held in a narrower dtype may be rounded."""
    return getattr(module, LOADED_IN_ATTR, FLOAT32)


def as_float32_load(module: torch.nn.Module, loaded_in: torch.dtype, config_follows_load: bool = True) -> None:
    """A component read in `loaded_in` made what the float32 load makes of it, but for its weights' dtype: the tables
    it computed when it was built (non-persistent floating buffers) computed in float32, and, where the loader
    recorded the load dtype in transformers' config (`config_follows_load`: from_pretrained does, from_single_file
    keeps the config folder's), the config saying float32. Nothing to do for a float32 load. The component is marked
    with the dtype (`loaded_in`)."""
    if loaded_in == FLOAT32:
        return
    setattr(module, LOADED_IN_ATTR, loaded_in)
    config = getattr(module, "config", None)
    if config_follows_load and config is not None and getattr(config, "dtype", None) == loaded_in:
        config.dtype = FLOAT32  # transformers' PretrainedConfig
    built = _built_tables(module)
    if not built:
        return
    reference = float32_build_of(type(module), config)
    if reference is None:
        raise RuntimeError(f"{type(module).__name__} was read in {loaded_in} but cannot be rebuilt in float32 to "
                           f"recompute its tables {', '.join(f'{owner}.{name}'.lstrip('.') for owner, name in built)}")
    for owner, name in built:
        target = module.get_submodule(owner)
        target._buffers[name] = reference.get_submodule(owner)._buffers[name].to(target._buffers[name].device)


def _built_tables(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(sub-module path, buffer name) of the non-persistent floating buffers of `module`: what a build computes, no
    file holds."""
    return [(path, name) for path, sub in module.named_modules() for name in sub._non_persistent_buffers_set
            if sub._buffers.get(name) is not None and sub._buffers[name].is_floating_point()]


def float32_build_of(cls: type, config) -> torch.nn.Module | None:
    """`cls` built from `config` under float32, its parameters on the meta device (no memory, no initialisation),
    its buffers computed as a float32 load computes them; a state dict is then put in with `assign=True`. None for a
    class that builds from no config (transformers' `_from_config`, diffusers' `from_config`)."""
    from accelerate import init_empty_weights

    if config is None:
        return None
    with default_dtype(FLOAT32), init_empty_weights(include_buffers=False):
        if hasattr(cls, "_from_config") and hasattr(config, "to_dict"):  # transformers' PreTrainedModel
            return cls._from_config(config, dtype=FLOAT32)
        if hasattr(cls, "from_config"):  # diffusers' ModelMixin
            return cls.from_config(config)
        return None


@torch.no_grad()
def hold_as_float32(weight: torch.Tensor, value: torch.Tensor) -> None:
    """Set `weight` to `value` in float32: in place where the weight is float32; a weight read in its files' 16 bits
    holds the float32 value instead, as the float32 load would (a merged or trained weight, not rounded back)."""
    if weight.dtype == FLOAT32:
        weight.copy_(value)
    else:
        weight.data = value.to(FLOAT32)


def own_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A converted state dict's floating tensors in `dtype`, each in storage of its own: a view (one of q / k / v
    split from a fused tensor) is copied, so the fused tensor is freed once its views are, and no parameter keeps a
    larger storage alive than it uses. The dict given is emptied as it goes: the peak is one copy of the state."""
    own = {}
    for key in list(state):
        tensor = state.pop(key)
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        elif tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        own[key] = tensor
    return own


@contextlib.contextmanager
def adapters_as_on_float32() -> Iterator[None]:
    """peft makes each new adapter (LoRA / DoRA / LoHa / LoKr) in float32 and then casts it to its base layer's
    dtype. On a base read in 16 bits that rounded the adapter's initial values, which a float32 load keeps: inside
    this block peft sees a floating base as float32, which it is until placement stores it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer._get_base_layer_device_and_dtype

    def as_float32(self, base_layer):
        device, dtype = original(self, base_layer)
        return device, (FLOAT32 if dtype is not None and dtype.is_floating_point else dtype)

    BaseTunerLayer._get_base_layer_device_and_dtype = as_float32
    try:
        yield
    finally:
        BaseTunerLayer._get_base_layer_device_and_dtype = original
