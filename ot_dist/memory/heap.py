"""Keep Python's garbage collector off the objects that live for the whole run.

Importing torch, diffusers, transformers (and DeepSpeed, peft) and loading a model leaves ~650 k objects the
collector tracks: modules, classes, functions, parameters. A full collection walks all of them, 1-2 s of a CPU
core; a rank paused there stalls every other rank at its next collective, and `Trainer.close` /
`Runtime.shutdown` collect explicitly. Once the trainer is built, what exists is moved to the permanent
generation (`gc.freeze`), so later collections walk only what training creates.

Frozen objects are still freed when their reference count drops; only reference cycles among them are never
collected. In a process that builds several trainers one after another (tests), that keeps the first
trainer's cycles, so freezing happens once per process."""

from __future__ import annotations

import gc

_frozen = False


def freeze_long_lived_objects() -> None:
    """Collect once (the garbage of imports and loading is freed, not kept), then freeze what remains."""
    global _frozen
    if _frozen:
        return
    gc.collect()
    gc.freeze()
    _frozen = True
