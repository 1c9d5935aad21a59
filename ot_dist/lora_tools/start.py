"""`lora.init_from`: the freshly added peft adapters take the matrices of a LoRA file (either layout, any trainer's),
so training continues from the change the file makes instead of from zero."""

from __future__ import annotations

import torch

from ot_dist.errors import ConfigError
from ot_dist.lora_tools.files import read_lora_file
from ot_dist.lora_tools.matching import match, module_index


@torch.no_grad()
def start_from_file(model, parts: dict[str, torch.nn.Module], path: str, rank: int, adapter: str) -> int:
    """Copy the file's pairs into the adapters of `parts` (part name -> module with peft adapters added). The file's
    scale (its alpha / rank) is moved into the up matrix so that peft's own scale reproduces the file's change."""
    from ot_dist.lora_tools.foreign import in_family_names

    # other trainers' names (kohya's fused qkv split onto to_q / to_k / to_v, ...) as the family's own first
    lora = in_family_names(model, read_lora_file(path, tool="lora.init_from"), f"lora.init_from: {path}",
                           _unwrapped(parts))
    for name, pair in lora.pairs.items():
        if pair.rank != rank:
            raise ConfigError(f"lora.init_from: {path} has rank {pair.rank} ({name}); lora.rank {rank} must equal it "
                              "(resize the file first: ot-dist lora resize)")
    # Names are matched on the modules as the file sees them: peft keeps each adapted Linear at its path (as the
    # wrapper's base_layer), so an index of the wrapped parts with `.base_layer` dropped names the same modules.
    matched, missing = match(lora.pairs, module_index(model, lora.layout, _unwrapped(parts)), f"lora.init_from: {path}")
    if missing:
        raise ConfigError(f"lora.init_from: {path} has {len(missing)} modules that are not targeted or not in the "
                          f"model (first: {missing[0]!r}); target them (lora.preset / *_targets) or drop them")
    for name, target in matched.items():
        pair = lora.pairs[name]
        layer = parts[target.part].get_submodule(target.path)
        if not hasattr(layer, "lora_A") or adapter not in layer.lora_A:
            raise ConfigError(f"lora.init_from: {path} changes {target.part}.{target.path}, which lora does not target "
                              "(lora.preset / *_targets)")
        peft_scale = layer.scaling[adapter]
        down, up = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        if down.shape != pair.down.shape or up.shape != pair.up.shape:
            raise ConfigError(f"lora.init_from: {name} has shapes {tuple(pair.down.shape)} / {tuple(pair.up.shape)}, "
                              f"the model's adapter {tuple(down.shape)} / {tuple(up.shape)}: another model's LoRA?")
        down.copy_(pair.down.float())
        up.copy_(pair.up.float() * (pair.scale / peft_scale))
    return len(matched)


class _Unwrapped(torch.nn.Module):
    """A view of a part in which each peft LoRA wrapper stands at its path as the Linear / Conv2d it wraps."""

    def __init__(self, part: torch.nn.Module):
        super().__init__()
        self.part = part

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        for path, module in self.part.named_modules():
            if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
                yield path, module.base_layer
            elif ".lora_" not in path and not path.endswith(".base_layer") and "base_layer." not in path:
                yield path, module

    def named_children(self):
        return self.part.named_children()


def _unwrapped(parts: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    return {name: _Unwrapped(module) for name, module in parts.items()}
