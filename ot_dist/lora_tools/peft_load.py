"""Load a LoRA file of ot_dist's diffusers layout into a pipeline through peft directly: the path for pipelines that
have no diffusers LoRA loader (`load_lora_weights`), such as PixArtAlphaPipeline / PixArtSigmaPipeline in diffusers
0.42, and for the T5-XXL part of a Flux / SD3 / Chroma file, which diffusers' loaders skip (they load no T5):

    from ot_dist.lora_tools.peft_load import load_peft_lora
    pipe = PixArtSigmaPipeline.from_pretrained(base)
    load_peft_lora(pipe, "lora.safetensors")

    pipe = FluxPipeline.from_pretrained(base)
    pipe.load_lora_weights("out", weight_name="lora.safetensors")          # transformer, CLIP-L
    load_peft_lora(pipe, "out/lora.safetensors", components=["text_encoder_2"])  # T5-XXL

The file holds `<component>.<module path>.lora_A.weight` / `.lora_B.weight` and, for the components the family
names kohya-style (`Family.lora_file_kohya_components`, T5-XXL), `<prefix>_<module path with _>.lora_A.weight` /
`.lora_B.weight` with an `.alpha` tensor (or by another program's dotted names, `Family.lora_file_component_paths`:
Qwen-Image's Qwen2.5-VL as ComfyUI names it, also with `.alpha`). Alpha comes from the `.alpha` tensor, else from diffusers'
`lora_adapter_metadata` (`transformer.lora_alpha`), else alpha = rank, as ComfyUI and diffusers read such a file.
Each component gets a peft adapter on exactly the file's modules, at the change the file makes.
"""

from __future__ import annotations

import re
from pathlib import Path

from ot_dist.errors import InputFileError


def load_peft_lora(pipeline, path: str | Path, adapter_name: str = "default", components: list[str] | None = None,
                   family=None) -> list[str]:
    """Add the file's LoRA to the pipeline's components (peft adapters, active); returns the components loaded.
    `components`: only these (default: every component the file changes). `family`: the ot_dist family whose
    LoRA names the file uses (default: the one whose pipeline class the pipeline is)."""
    from ot_dist.lora_tools.files import read_lora_file
    from ot_dist.methods.lora_layouts import named_components

    lora = read_lora_file(path, tool="load_peft_lora")
    if lora.layout != "diffusers":
        raise InputFileError(f"{path}: a kohya-layout LoRA file (lora_down / lora_up); load it with the pipeline's "
                             "load_lora_weights")
    family = family or _family_of(pipeline)
    named = named_components(family) if family is not None else {}
    roots = dict(family.lora_file_roots) if family is not None else {}
    per_component: dict[str, dict[str, object]] = {}
    resolvers = {component: _resolver(pipeline, component, names) for component, names in named.items()}
    for name, pair in lora.pairs.items():
        component, module_path = _locate(name, resolvers, path)
        per_component.setdefault(component, {})[module_path] = pair
    chosen = sorted(per_component if components is None else set(components) & set(per_component))
    for component in chosen:
        module = getattr(pipeline, component, None)
        if module is None:
            raise InputFileError(f"{path}: the pipeline has no component {component!r}")
        pairs = _drop_missing_root(per_component[component], module, roots.get(component, ""))
        _inject(module, pairs, adapter_name, path, component)
    return chosen


def _family_of(pipeline):
    from ot_dist.models.families.registry import FAMILY_NAMES, get_family

    for name in FAMILY_NAMES:
        if get_family(name).pipeline_class == type(pipeline).__name__:
            return get_family(name)
    return None


def _resolver(pipeline, component: str, names) -> dict[str, str]:
    """The family's file name (kohya-style, or another program's dotted one) -> module path, for every Linear of
    the component."""
    import torch

    module = getattr(pipeline, component, None)
    if module is None:
        return {}
    return {names.module_name(p): p for p, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def _locate(name: str, resolvers: dict[str, dict[str, str]], path) -> tuple[str, str]:
    for component, names in resolvers.items():
        if name in names:
            return component, names[name]
    component, dot, module_path = name.partition(".")
    if not dot:
        raise InputFileError(f"{path}: {name!r} is neither <component>.<module> nor a kohya-style name of this "
                             "pipeline's family")
    return component, module_path


def _drop_missing_root(pairs: dict, module, root: str) -> dict:
    """Paths under the root level the file's names carry and the loaded module lacks (transformers 5's CLIP)."""
    if not root or root in dict(module.named_children()):
        return pairs
    return {p.removeprefix(root + "."): pair for p, pair in pairs.items()}


def _inject(module, pairs: dict, adapter_name: str, path, component: str) -> None:
    """One peft adapter on exactly the pairs' modules, each at its own rank, with the file's scale in the up matrix
    (peft's alpha = rank everywhere)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    ranks = {p: pair.rank for p, pair in pairs.items()}
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {re.escape(p): r for p, r in ranks.items() if r != rank}
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(pairs), rank_pattern=pattern,
                        alpha_pattern=dict(pattern))
    inject_adapter_in_model(config, module, adapter_name=adapter_name)
    state = {}
    for p, pair in pairs.items():
        state[f"{p}.lora_A.weight"] = pair.down
        state[f"{p}.lora_B.weight"] = pair.up.float() * pair.scale
    result = set_peft_model_state_dict(module, state, adapter_name=adapter_name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise InputFileError(f"{path}: {component} has no modules for {sorted(unexpected)[:3]}")
