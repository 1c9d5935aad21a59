"""Undo one or more of ot_dist's fast-path changes for an A/B run inside one process (the benchmarks'
`undone`). Each change is a function the methods' prepare or apply_performance imports when it runs, replaced by one
that does nothing."""

from __future__ import annotations

import contextlib

# change -> (module, function, what the do-nothing replacement returns)
CHANGES = {
    # peft's float32 copy of each LoRA layer's input kept (before ot_dist/methods/lora_autocast.py)
    "lora_input_copies": ("ot_dist.methods.lora_autocast", "skip_input_copies_under_autocast", 0),
    # peft's forward: up projection, scale and sum as separate ops (before ot_dist/methods/lora_forward.py)
    "lora_fused_forward": ("ot_dist.methods.lora_forward", "fuse_up_projections", []),
    # every layer casts its own adapter weights (before ot_dist/methods/lora_block_casts.py)
    "lora_block_casts": ("ot_dist.methods.lora_block_casts", "cast_adapters_per_block", 0),
    # every LoRA layer projects its input down on its own, q / k / v too (before ot_dist/methods/shared_inputs.py)
    "lora_shared_down": ("ot_dist.methods.lora_block_casts", "share_down_projections", 0),
    # diffusers' AttnProcessor2_0, dividing each attention's output by 1.0 (before ot_dist/train/lean_attention.py)
    "lean_attention": ("ot_dist.train.lean_attention", "use_lean_attention", 0),
    # every Linear / Conv2d layer of a full finetune casts its own weights (before weight_block_casts.py)
    "weight_block_casts": ("ot_dist.methods.weight_block_casts", "cast_weights_per_block", 0),
}


@contextlib.contextmanager
def undone(*changes: str | None):
    import importlib

    saved = []
    try:
        for change in filter(None, changes):
            module_name, function, result = CHANGES[change]
            module = importlib.import_module(module_name)
            saved.append((module, function, getattr(module, function)))
            setattr(module, function, lambda *args, _result=result, **kwargs: _result)
        yield
    finally:
        for module, function, real in reversed(saved):
            setattr(module, function, real)
