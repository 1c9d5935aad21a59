"""Load a diffusers-layout LoRA file into a pipeline through peft directly: the path for pipelines that have no
diffusers LoRA loader (`load_lora_weights`), such as PixArtAlphaPipeline / PixArtSigmaPipeline in diffusers 0.42.

    from ot_dist.lora_tools.peft_load import load_peft_lora
    pipe = PixArtSigmaPipeline.from_pretrained(base)
    load_peft_lora(pipe, "lora.safetensors")

The file holds `<component>.<module path>.lora_A.weight` / `.lora_B.weight` (what ot_dist writes in the diffusers
layout), alpha per component in diffusers' `lora_adapter_metadata` (`transformer.lora_alpha`); without it alpha =
rank, as ComfyUI and diffusers read such a file. Each component gets a peft adapter on exactly the file's modules.
"""

from __future__ import annotations

import json
from pathlib import Path

from ot_dist.errors import InputFileError

DOWN, UP = ".lora_A.weight", ".lora_B.weight"


def load_peft_lora(pipeline, path: str | Path, adapter_name: str = "default") -> list[str]:
    """Add the file's LoRA to the pipeline's components (peft adapters, active); returns the components."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
    settings = json.loads(metadata.get("lora_adapter_metadata") or "{}")
    per_component: dict[str, dict] = {}
    for key, tensor in tensors.items():
        component, _, rest = key.partition(".")
        if not rest.endswith((DOWN, UP)):
            raise InputFileError(f"{path}: {key!r} is not a diffusers-layout LoRA tensor "
                                 "(<component>.<module>.lora_A / lora_B.weight)")
        per_component.setdefault(component, {})[rest] = tensor
    for component, state in per_component.items():
        module = getattr(pipeline, component, None)
        if module is None:
            raise InputFileError(f"{path}: the pipeline has no component {component!r}")
        modules = sorted(k[: -len(DOWN)] for k in state if k.endswith(DOWN))
        rank = state[modules[0] + DOWN].shape[0]
        alpha = settings.get(f"{component}.lora_alpha", rank)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules), module,
                                adapter_name=adapter_name)
        result = set_peft_model_state_dict(module, state, adapter_name=adapter_name)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise InputFileError(f"{path}: {component} has no modules for {sorted(unexpected)[:3]}")
    return sorted(per_component)
