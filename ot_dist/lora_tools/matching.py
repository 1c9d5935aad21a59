"""Which module of a loaded model each name in a LoRA file means, using only what the family declares
(`lora_file_prefixes`, `lora_file_roots`, `lora_file_module_renames`, `lora_file_kohya_components`,
`lora_file_component_paths`): no family is named
here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_dist.errors import InputFileError
from ot_dist.methods.lora_layouts import kohya_names, named_components

ADAPTABLE = (torch.nn.Linear, torch.nn.Conv2d)


@dataclass(frozen=True)
class Target:
    part: str  # "unet", "transformer", "text_encoder", ...
    path: str  # the module's path inside the part
    module: torch.nn.Module


def adaptable_modules(part_module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Path -> module for every Linear / Conv2d a LoRA can change."""
    return {path: m for path, m in part_module.named_modules() if path and isinstance(m, ADAPTABLE)}


def module_index(model, layout: str, parts: dict[str, torch.nn.Module] | None = None) -> dict[str, Target]:
    """File module name -> Target for every adaptable module of the model's trainable parts, under each name a
    file of `layout` may give it."""
    family = model.family
    parts = parts if parts is not None else model.parts()
    index: dict[str, Target] = {}
    if layout == "kohya":
        if not family.lora_file_prefixes:
            raise InputFileError(f"a kohya-layout LoRA (lora_unet_*) has no meaning for {family.name}: its LoRA files "
                                 "use the diffusers layout (<component>.<module>.lora_A.weight)")
        known = {p: m for p, m in parts.items() if p in family.lora_file_prefixes}
        names = kohya_names(family.lora_file_prefixes, family.lora_file_roots, known,
                            {p: family.lora_file_module_renames(p, m) for p, m in known.items()})
        for part, module in known.items():
            for path, sub in adaptable_modules(module).items():
                index[names[part].module_name(path)] = Target(part, path, sub)
        return index
    named = named_components(family)
    for part, module in parts.items():
        if part in named:  # written under kohya-style names (T5-XXL encoders) or another program's (Qwen2.5-VL)
            names = named[part]
            index.update({names.module_name(path): Target(part, path, sub)
                          for path, sub in adaptable_modules(module).items()})
            continue
        root = family.lora_file_roots.get(part, "")
        has_root = root in dict(module.named_children())
        for path, sub in adaptable_modules(module).items():
            # The first name is the one ot_dist writes (with the family's root level, as ComfyUI reads CLIP keys);
            # the other is what files written without it (transformers 5 based trainers) use.
            target = Target(part, path, sub)
            if root and not has_root:
                index[f"{part}.{root}.{path}"] = target
            index[f"{part}.{path}"] = target
            if root and has_root and path.startswith(root + "."):
                index[f"{part}.{path[len(root) + 1:]}"] = target
    return index


def match(pairs: dict, index: dict[str, Target], source: str) -> tuple[dict[str, Target], list[str]]:
    """(file name -> Target for the names the model has, the names it lacks). None matching is an error."""
    matched = {name: index[name] for name in pairs if name in index}
    missing = sorted(name for name in pairs if name not in index)
    if pairs and not matched:
        raise InputFileError(f"{source}: none of its {len(pairs)} modules is a module of this model (first: "
                             f"{missing[0]!r}): another family's LoRA?")
    return matched, missing


def check_shape(name: str, delta: torch.Tensor, weight: torch.Tensor, source: str) -> None:
    if delta.shape != weight.shape:
        raise InputFileError(f"{source}: {name} changes a {tuple(delta.shape)} weight, the model's is "
                             f"{tuple(weight.shape)}: another model's LoRA?")
