"""OFT files (`lora.variant: oft`, ot_dist/methods/oft.py) of the diffusers-layout families (Flux, Chroma, SD3,
PixArt: `Family.lora_oft_diffusers_layout`), in the names ComfyUI maps for them.

Per module `<name>.oft_blocks` and `<name>.alpha` (the constraint), `<name>` as a diffusers-layout LoRA names it:
`transformer.<path>` for the transformer (comfy/lora.py model_lora_keys_unet maps it through utils.flux_to_diffusers /
mmdit_to_diffusers / pixart_to_diffusers), `text_encoder.text_model.<path>` for CLIP-L / CLIP-G (model_lora_keys_clip),
kohya names (`lora_te3_<path>`) for T5-XXL and ComfyUI's own paths where the family lists them
(ot_dist/methods/lora_layouts.py `named_components`). ComfyUI applies its OFT rule (comfy/weight_adapter/oft.py) to
what the name maps to: a whole weight, or a block of a fused weight's output rows (Flux's `to_q` is rows 0..h of
`img_attn.qkv`; ComfyUI narrows the weight to them first), which is the rotation of the diffusers module's rows that
training used. A weight whose rows it reorders (swap_scale_shift: shift | scale against diffusers' scale | shift) gets
its change computed in its own order and then reordered, not the trained rotation: those modules are not adapted
(`Family.lora_oft_reordered_modules`), and naming one in the targets is an error.

diffusers has no OFT loader; `ot-dist lora merge` applies these files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ot_dist.errors import ConfigError


def left_out_modules(config, family, part: str, module: torch.nn.Module, key: str, targets: list[str]) -> list[str]:
    """The paths of `part` oft must not adapt in this config's file layout: the denoiser modules whose rows ComfyUI
    reorders. A preset or lora.layer_filter (broad selections: all_linear, OneTrainer's substrings) leaves them out;
    module names the user listed (`lora.<denoiser>_targets`) that select one are refused, naming it."""
    if config.lora_file_layout() == "kohya" or part != family.denoiser:
        return []
    reordered = family.lora_oft_reordered_modules(module)
    if key.endswith("_targets"):
        named = [p for p in reordered if any(p == t or p.endswith("." + t) for t in targets)]
        if named:
            raise ConfigError(f"{key}: selects {named[0]}, which lora.variant oft cannot adapt for "
                              f"{config.model.family}: ComfyUI maps it onto a weight with its rows in another order "
                              "(shift | scale) and would not apply the trained rotation; leave it out")
    return reordered


def write_oft_file(model, states: dict[str, dict[str, torch.Tensor]], target: Path, lora, dtype: torch.dtype,
                   modelspec: dict[str, str], bundle: dict[str, torch.Tensor]) -> None:
    """`states`: per part, its `<path>.oft_blocks` tensors. Written under the names above, each module with its
    float32 `.alpha` (= lora.oft_constraint), beside the bundled embeddings' tensors; the metadata as the kohya
    layout's (LyCORIS' algo diag-oft, ot_dist_lora with layout diffusers)."""
    from safetensors.torch import save_file

    from ot_dist.checkpoint.export import atomic_path
    from ot_dist.methods.lora_layouts import kohya_metadata, named_components, to_kohya

    family = model.family
    named = named_components(family)
    tensors = dict(bundle)
    for part, state in states.items():
        names = named.get(part) or _dotted_names(part, family.lora_file_roots.get(part, ""), model.part(part))
        tensors.update(to_kohya(state, names, lora.oft_constraint, dtype, rank=lora.rank))
    targets = {part: sorted(k.rsplit(".", 1)[0] for k in state) for part, state in states.items()}
    metadata = kohya_metadata(lora.rank, lora.alpha, {"ot_dist_lora": json.dumps(
        {"layout": "diffusers", "family": family.name, "variant": "oft", "rank": lora.rank, "alpha": lora.alpha,
         "targets": targets})}, variant="oft", base_model_version=family.lora_base_model_version)
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", **metadata, **modelspec})


def _dotted_names(part: str, root: str, module: torch.nn.Module):
    """`<part>.<path>`, with the module level the family's files carry and the loaded module lacks (CLIP-L's
    `text_model.`, as lora.py `with_file_root` inserts it for LoRA)."""
    from ot_dist.methods.lora_layouts import PathNames

    if root and root not in dict(module.named_children()):
        return PathNames(part, (("", f"{part}.{root}."),))
    return PathNames(part, ())
