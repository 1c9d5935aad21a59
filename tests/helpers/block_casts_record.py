"""Inside a rank: train a case on the per-layer casts instead of the block casts (ot_dist/methods/block_casts.py), or
on the block casts without the shared down projections (shared_inputs.py),
and record whether the block casts were active, so that a comparison of the two can not pass because both ran the
same code (the block casts skip themselves without autocast, or where a strategy hooks the layers).

The per-layer casts: the undo switches of the benchmarks (tests/benchmarks/fast_path_levers.py), which make the
methods' prepare hook no block, as before the block casts. The record, per rank (PATH.rank<N>.json): how many blocks
cast together, how many times CastTogether cast a block's weights in forward and their gradients in backward,
whether the layers computed with torch's own linear, and how many groups of LoRA layers shared a down projection."""

from __future__ import annotations

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
from fast_path_levers import undone  # noqa: E402

PER_LAYER_CASTS = ("lora_block_casts", "weight_block_casts")
OWN_DOWN_PROJECTIONS = ("lora_shared_down",)  # block casts, each LoRA layer with its own down projection


def fast_path_undone(changes: list[str] | None):
    """The trainer built inside it has these fast-path changes undone (fast_path_levers.CHANGES)."""
    return undone(*changes) if changes else contextlib.nullcontext()


def trainer_block_casts(trainer) -> list:
    from ot_dist.methods.block_casts import block_casts_in

    return [casts for part in trainer.model.parts().values() for casts in block_casts_in(part)]


def blocks_hooked(trainer) -> int:
    return len(trainer_block_casts(trainer))


def shared_groups(trainer) -> int:
    """How many groups of LoRA layers share a down projection (learned in the first step)."""
    return sum(len(c.sharing.groups) for c in trainer_block_casts(trainer) if c.sharing is not None)


@contextlib.contextmanager
def recording_block_casts(trainer, path: str | None, rank: int):
    """Count CastTogether's forward and backward calls while the body trains; write them with the blocks hooked."""
    if path is None:
        yield
        return
    import torch

    from ot_dist.methods.block_casts import CastTogether

    # Building a ZeRO-3 engine replaces torch.nn.functional.linear with DeepSpeed's (zero.Init, partition_parameters.py
    # `_enable_mem_efficient_linear`), which adds a float32 bias to the bfloat16 product where the block casts hand it
    # the bias in bfloat16: left in place after a ZeRO-3 case of the same launch, the two casts would differ by a
    # rounding. Closing the trainer puts torch's back (parallel/deepspeed_process_state.py restore_torch_linear):
    # recorded, so that a case run after ZeRO-3 ones shows it was.
    counts = {"blocks": blocks_hooked(trainer), "forward": 0, "backward": 0,
              "torch_linear": torch.nn.functional.linear is torch._C._nn.linear}
    forward, backward = CastTogether.forward, CastTogether.backward  # the functions (staticmethods unwrapped)

    def counted(name, function):
        def call(*args):
            counts[name] += 1
            return function(*args)

        return staticmethod(call)

    # autograd looks both up on the class at each call (Function.apply, BackwardCFunction._get_user_fn)
    CastTogether.forward, CastTogether.backward = counted("forward", forward), counted("backward", backward)
    try:
        yield
    finally:
        CastTogether.forward, CastTogether.backward = staticmethod(forward), staticmethod(backward)
    counts["shared_groups"] = shared_groups(trainer)
    with open(f"{path}.rank{rank}.json", "w") as f:
        json.dump(counts, f)
