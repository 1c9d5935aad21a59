"""Watching for activations cast to float8: with `weight_dtype: float8` the only float8 tensors a step should see are
the stored weights (made by memory/float8.py `quantize`) and their views or copies (a device move). Anything else
of a float8 dtype is an activation that went through 3 mantissa bits, typically an input cast to a module's
`.dtype`, which diffusers / transformers read from the first parameter: the 1-byte storage."""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FLOAT8_DTYPES = frozenset(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _float8(values) -> list[torch.Tensor]:
    return [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.dtype in FLOAT8_DTYPES]


class Float8Activations(TorchDispatchMode):
    """Records every op whose output is float8 without a stored weight (or a view / copy of one) among its inputs:
    `found` holds (op, the innermost project or library frames that called it)."""

    def __init__(self):
        super().__init__()
        self.storage: set[int] = set()  # the float8 storages and their views' / copies' storages
        self.found: list[tuple[str, str]] = []
        self.storing = 0

    def adopt(self, modules) -> None:
        """The float8 parameters of `modules` are storage."""
        for module in modules:
            if isinstance(module, torch.nn.Module):
                self.storage.update(_storage(p) for p in module.parameters() if p.dtype in FLOAT8_DTYPES)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in _float8(out) if t.device.type != "meta"]  # a structure's copy: no values
        if made:
            if self.storing or any(_storage(t) in self.storage for t in _float8((args, kwargs))):
                self.storage.update(_storage(t) for t in made)
            else:
                self.found.append((str(func), _callers()))
        return out

    @contextmanager
    def storing_weights(self):
        """Within: float8 tensors made are storage (quantize)."""
        self.storing += 1
        try:
            yield
        finally:
            self.storing -= 1


def _callers(depth: int = 6) -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "site-packages" in f.filename or "/ot_dist/" in f.filename]
    frames = [f for f in frames if "/torch/" not in f.filename]
    return " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/ot_dist/')[-1]}:{f.lineno} {f.name}"
                       for f in reversed(frames[-depth:]))


@contextmanager
def float8_activation_watch(monkeypatch):
    """A Float8Activations mode (enter it with `with mode:`, as often as needed), `quantize` exempted while the block
    runs: storing weights, at placement or when a state dict is loaded into float8 modules, as sampling's copies of
    the trained modules are."""
    import ot_dist.memory.float8 as float8

    mode = Float8Activations()
    quantize = float8.quantize

    def storing(tensor):
        with mode.storing_weights():
            return quantize(tensor)

    monkeypatch.setattr(float8, "quantize", storing)
    yield mode


@contextmanager
def storage_dtype_reported(modules):
    """Within: the float8-stored models among `modules` (and those nested in them) report their first parameter's
    dtype as `.dtype` again, the stored float8, as they did before memory/float8.py's report_compute_dtype."""
    from ot_dist.memory.float8 import _CLASSES

    reporting = {cls: key[0] for key, cls in _CLASSES.items() if key[1] == "dtype"}
    swapped = []
    try:
        for module in {id(m): m for root in modules if isinstance(root, torch.nn.Module)
                       for m in root.modules()}.values():
            if type(module) in reporting:
                swapped.append((module, type(module)))
                module.__class__ = reporting[type(module)]
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
