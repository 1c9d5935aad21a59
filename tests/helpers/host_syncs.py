"""Count the reads that would block the host on the device (issue 21), on the CPU.

On a GPU, `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()` / `float()` / `int()` of a tensor and
`torch.cuda.synchronize()` wait for every queued kernel. On the CPU nothing waits, so these calls are
counted instead, with the Python stack of each (the ot_dist frames), as `torch.cuda.set_sync_debug_mode` would
report them. Tensors that live on the host on a GPU run too (the loader's batches, torch's optimizer `step`
counters, which stay on the CPU unless fused or capturable) are registered with `host()` and not counted.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def device_target(args, kwargs):
    """The device a `Tensor.to` call names (positionally or as `device=`), or None (a dtype or tensor target)."""
    target = kwargs.get("device", args[0] if args else None)
    return target if isinstance(target, (str, torch.device)) else None


@dataclass
class Sync:
    kind: str
    where: str  # the innermost ot_dist frames, innermost first
    phase: str
    origin: str = ""  # the file of the innermost frame, whatever its package (a library's own copy is not ours)


@dataclass
class SyncCounter:
    syncs: list[Sync] = field(default_factory=list)
    # `.to(device)` of a host tensor without non_blocking: on a GPU the copy from pageable memory waits for the
    # stream (on the CPU every device is the host, so each such call is counted as one)
    blocking_copies: list[Sync] = field(default_factory=list)
    phase: str = "step"
    _host: set[int] = field(default_factory=set)
    _keep: list[torch.Tensor] = field(default_factory=list)  # keeps registered ids from being reused
    also_host: object = None  # a predicate: more tensors that stay on the host on a GPU run

    def host(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._host.add(id(t))
                self._keep.append(t)

    def _record(self, kind: str, tensor: torch.Tensor | None, into: list | None = None) -> None:
        if into is None and tensor is not None and (id(tensor) in self._host or (self.also_host and self.also_host(tensor))):
            return
        stack = traceback.extract_stack()[:-2]
        frames = [f for f in stack if "ot_dist" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))
        (self.syncs if into is None else into).append(Sync(kind, where, self.phase, stack[-1].filename if stack else ""))

    def in_phase(self, phase: str) -> list[Sync]:
        return [s for s in self.syncs if s.phase == phase]

    @contextmanager
    def during(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    @contextmanager
    def counting(self):
        originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to")}
        synchronize = torch.cuda.synchronize
        active = [True]  # a read inside a counted read (tolist -> item) is one sync, not two

        def counted(name):
            original = originals[name]

            def read(tensor, *args, **kwargs):
                if not active[0]:
                    return original(tensor, *args, **kwargs)
                self._record(name, tensor)
                active[0] = False
                try:
                    return original(tensor, *args, **kwargs)
                finally:
                    active[0] = True
            return read

        def to(tensor, *args, **kwargs):
            if active[0] and tensor.device.type == "cpu" and device_target(args, kwargs) is not None \
                    and not kwargs.get("non_blocking", False):
                self._record("to(device)", tensor, self.blocking_copies)
            return originals["to"](tensor, *args, **kwargs)

        def cuda_synchronize(*args, **kwargs):
            self._record("cuda.synchronize", None)
            return synchronize(*args, **kwargs) if torch.cuda.is_available() else None

        try:
            for name in READS:
                setattr(torch.Tensor, name, counted(name))
            torch.Tensor.to = to
            torch.cuda.synchronize = cuda_synchronize
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            torch.cuda.synchronize = synchronize


def count_trainer_syncs(trainer) -> tuple[SyncCounter, object]:
    """Train `trainer` while counting. Phases: "data" (the loader: host work), "log" (`_log_window`), "other"
    (checkpoints, exports, samples, the replicas' comparison: not the step path) and "step" (micro steps, the step guard, the optimizer
    step). The loader's batches, torch's CPU `step` counters of the optimizer and the lagged step
    guard's host copy of its flags are host tensors.
    Returns the counter and the TrainResult."""
    counter = SyncCounter()
    optimizer = trainer.optimizer
    step_counters: dict = {}  # len(optimizer.state) -> ids of its `step` tensors

    def is_step_counter(tensor):
        if len(optimizer.state) not in step_counters:
            step_counters.clear()
            step_counters[len(optimizer.state)] = {id(s.get("step")) for s in optimizer.state.values()}
        return id(tensor) in step_counters[len(optimizer.state)]

    def on_host(tensor):
        # the lagged step guard's copy of the flags is host memory on a GPU run too (pinned), filled by a
        # non-blocking copy whose event is waited for a step later
        return is_step_counter(tensor) or (trainer.guard is not None and trainer.guard.is_host_tensor(tensor))

    counter.also_host = on_host
    batches = trainer.epoch_batches

    def host_batches(epoch):
        loader = iter(batches(epoch))
        while True:
            with counter.during("data"):
                batch = next(loader, None)
            if batch is None:
                return
            counter.host(*(v for v in batch.values() if isinstance(v, torch.Tensor)))
            counter.host(*(t for v in batch.values() if isinstance(v, (list, tuple)) for t in v))
            counter.host(*(t for v in batch.values() if isinstance(v, dict) for t in v.values()))  # token_ids
            yield batch

    def in_phase(phase, function):
        def wrapped(*args, **kwargs):
            with counter.during(phase):
                return function(*args, **kwargs)
        return wrapped

    trainer.epoch_batches = host_batches
    trainer._log_window = in_phase("log", trainer._log_window)
    for name in ("export", "_save", "_check_replicas"):  # the replica check runs at saves and before the exports
        setattr(trainer, name, in_phase("other", getattr(trainer, name)))
    for name in ("after_step", "at_end"):
        setattr(trainer.sampler, name, in_phase("other", getattr(trainer.sampler, name)))
    with counter.counting():
        result = trainer.train()
    return counter, result
