"""LoRA file layouts: the key names a LoRA file gives each adapted module, so that the file loads where people use it.

- `kohya` (the default where a family declares kohya names): `<prefix>_<module path with "_" for ".">` per
  module, `.lora_down.weight` / `.lora_up.weight` and an `.alpha` scalar tensor. ComfyUI, A1111 / Forge and kohya's
  scripts read it, and diffusers' `load_lora_weights` converts it. Loaders that find no `.alpha` tensor apply the
  change at strength alpha = rank, so the tensor is always written.
- `diffusers`: peft's keys under the diffusers component name (`unet.<path>.lora_A.weight`), alpha and rank in the
  file's adapter metadata; written by the pipeline's `save_lora_weights` (see ot_dist/methods/lora.py). Components
  a family lists in `lora_file_kohya_components` (T5-XXL encoders) are written in the same file under kohya-style
  names instead: `<prefix>_<path with "_">.lora_A.weight` / `.lora_B.weight` and an `.alpha` tensor, the names
  ComfyUI maps for T5-XXL (comfy/lora.py model_lora_keys_clip), keeping peft's suffixes so that diffusers does
  not take the whole file for a kohya one (its Flux loader then keeps only `transformer.` keys). Components a
  family lists in `lora_file_component_paths` (Qwen-Image's Qwen2.5-VL) keep dotted names, with the start of each
  module path replaced by the name another program gives that part (ComfyUI's `text_encoders.qwen25_7b.transformer.
  model.` for transformers' `model.language_model.`), also with `.alpha` tensors: ComfyUI maps such a text encoder
  only by its own state-dict keys (comfy/lora.py model_lora_keys_clip: `text_encoders.<key>`).

The converter knows no family. A family declares, as data on its `Family` (ot_dist/models/families/base.py):
- `lora_file_prefixes`: component -> the name prefix, e.g. SD 1.x {"unet": "lora_unet", "text_encoder": "lora_te"};
  None when the family has no kohya names yet (it then writes the diffusers layout);
- `lora_file_roots`: component -> a module level that the file's names carry but the loaded module may lack
  (transformers 5's `CLIPTextModel` dropped the `text_model.` level that kohya's and ComfyUI's names keep). The
  level is inserted only when the module has no child of that name, so a module that still has it
  (`CLIPTextModelWithProjection.text_model`) keeps its own paths, and its top-level `text_projection` stays
  outside the level as in the original model;
- `lora_file_renames`: component -> {module path: the path the file names instead}, for modules whose kohya name
  is not their diffusers path. A path `*.a.b` -> `*.c` renames the end of every module path ending in `.a.b`
  (Stable Cascade's diffusers attention `attention.to_out.0` is the original `attention.attn.out_proj` in every
  block). `Family.lora_file_module_renames` gives them per loaded component: SDXL computes its whole UNet's there,
  each module's original SGM path (kohya sd-scripts' SDXL UNet is the original one, and its names are those paths).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

LAYOUTS = ("kohya", "diffusers")

PEFT_DOWN, PEFT_UP = ".lora_A.weight", ".lora_B.weight"
KOHYA_DOWN, KOHYA_UP, KOHYA_ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"


@dataclass(frozen=True)
class KohyaNames:
    """How one component's module paths become kohya module names."""

    prefix: str  # "lora_unet", "lora_te1", ...
    root: str = ""  # a module level put in front of every path ("text_model"), "" for none
    renames: tuple[tuple[str, str], ...] = ()  # (module path, the path the file uses), whole modules only

    @cached_property
    def _exact(self) -> dict[str, str]:  # a whole UNet's renames (SDXL): looked up once per module
        return dict(self.renames)

    @cached_property
    def _endings(self) -> tuple[tuple[str, str], ...]:
        return tuple((old[1:], new[1:]) for old, new in self.renames if old.startswith("*."))

    def module_name(self, path: str) -> str:
        path = self._exact.get(path, path)
        for old, new in self._endings:  # "*.a.b" -> "*.c": every module path ending in .a.b
            if path.endswith(old):
                path = path[: -len(old)] + new
                break
        full = f"{self.root}.{path}" if self.root else path
        return f"{self.prefix}_{full.replace('.', '_')}"


@dataclass(frozen=True)
class PathNames:
    """How one component's module paths become dotted names of another program's state dict: the first
    (path prefix, name prefix) pair whose path prefix starts the path replaces it; other paths keep
    `<component>.<path>`, the diffusers layout's name."""

    component: str
    prefixes: tuple[tuple[str, str], ...]

    def module_name(self, path: str) -> str:
        for old, new in self.prefixes:
            if path.startswith(old):
                return new + path[len(old):]
        return f"{self.component}.{path}"


def renamed(peft_state: dict[str, torch.Tensor], names: PathNames) -> dict[str, torch.Tensor]:
    """A component's peft state dict (`<path><suffix>`) under `names` (`<name><suffix>`), the tensors as they are."""
    from ot_dist.methods.lora_variants import split_modules

    return {names.module_name(path) + suffix: tensor for path, factors in split_modules(peft_state).items()
            for suffix, tensor in factors.items()}


def named_components(family) -> dict[str, KohyaNames | PathNames]:
    """Component -> its names, for the components a diffusers-layout file names otherwise than
    `<component>.<path>`: the family's `lora_file_kohya_components` and `lora_file_component_paths`."""
    names: dict[str, KohyaNames | PathNames] = {c: KohyaNames(p) for c, p in family.lora_file_kohya_components.items()}
    names.update({c: PathNames(c, tuple(paths.items())) for c, paths in family.lora_file_component_paths.items()})
    return names


def kohya_names(prefixes: dict[str, str], roots: dict[str, str], modules: dict[str, torch.nn.Module],
                renames: dict[str, dict[str, str]] | None = None) -> dict[str, KohyaNames]:
    """Component -> its KohyaNames, from a family's declared prefixes, roots and renames and the loaded modules."""
    names = {}
    for component, module in modules.items():
        if component not in prefixes:
            raise ValueError(f"the family declares no kohya LoRA prefix for its {component}")
        root = roots.get(component, "")
        if root and root in dict(module.named_children()):
            root = ""  # the module's own paths already start with it
        names[component] = KohyaNames(prefixes[component], root, tuple((renames or {}).get(component, {}).items()))
    return names


def to_kohya(peft_state: dict[str, torch.Tensor], names: KohyaNames, alpha: float, dtype: torch.dtype | None = None,
             suffixes: tuple[str, str] = (KOHYA_DOWN, KOHYA_UP), rank: int | None = None) -> dict[str, torch.Tensor]:
    """One component's peft adapter state dict (as `get_peft_model_state_dict` returns it: LoRA's
    `<path>.lora_A.weight` / `.lora_B.weight`, DoRA's `.lora_magnitude_vector`, LoHa's `.hada_*`, LoKr's `.lokr_*`)
    in kohya's layout, with an `.alpha` tensor (float32 scalar, so any alpha is stored exactly) per module and the
    variants' tensors under the names LyCORIS and ComfyUI use (ot_dist/methods/lora_variants.py). Matrices are cast
    to `dtype` when given. `suffixes` (down, up): kohya's own by default; (PEFT_DOWN, PEFT_UP) for kohya names inside
    a diffusers-layout file. `rank`: the adapter's rank (needed for LoKr modules with two full factors; default:
    each module's down matrix rank)."""
    from ot_dist.methods.lora_variants import PEFT_TO_KOHYA, file_factors, split_modules

    renamed = {**PEFT_TO_KOHYA, PEFT_DOWN: suffixes[0], PEFT_UP: suffixes[1]}
    out: dict[str, torch.Tensor] = {}
    paths: dict[str, str] = {}
    for path, factors in split_modules(peft_state).items():
        name = names.module_name(path)
        if name in paths:  # "a_b.c" and "a.b_c" would both be a_b_c
            raise ValueError(f"modules {paths[name]!r} and {path!r} both get the kohya name {name!r}")
        paths[name] = path
        module_rank = rank if rank is not None else _rank_of(factors, path)
        for suffix, tensor in file_factors(factors, module_rank, alpha).items():
            if dtype is not None:
                tensor = tensor.to(dtype)
            out[name + renamed[suffix]] = tensor.detach().contiguous()
        out[name + KOHYA_ALPHA] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def _rank_of(factors: dict[str, torch.Tensor], path: str) -> int:
    for key, dim in ((PEFT_DOWN, 0), (".hada_w1_b", 0), (".lokr_w2_b", 0), (".lokr_w1_b", 0)):
        if key in factors:
            return factors[key].shape[dim]
    raise ValueError(f"{path}: the rank of a LoKr module with two full factors is not in its tensors; pass rank")


def kohya_metadata(rank: int, alpha: float, extra: dict[str, str] | None = None, variant: str = "lora",
                   base_model_version: str | None = None) -> dict[str, str]:
    """safetensors metadata of a kohya-layout file: kohya's own `ss_network_*` keys (A1111 / Forge show them), with
    LyCORIS's network module and `algo` for the variants, and the base model's version (`model_version_metadata`)."""
    from ot_dist.methods.lora_variants import network_metadata

    return {**network_metadata(variant), "ss_network_dim": str(rank), "ss_network_alpha": str(alpha),
            **model_version_metadata(base_model_version), **(extra or {})}


def model_version_metadata(base_model_version: str | None) -> dict[str, str]:
    """kohya's `ss_base_model_version` and `ss_v2` ("True" for SD 2.x, as kohya's `--v2`) for a family's
    `lora_base_model_version`. A1111 reads a LoRA's model version from these alone ("sdxl_..." -> SDXL, ss_v2 "True"
    -> SD 2.x, any other file with metadata -> SD 1.x), and its Lora page hides LoRAs of another version than the
    loaded checkpoint's (`lora_show_all` is off by default): without them an SDXL or SD 2.x file is hidden there."""
    if base_model_version is None:
        return {}
    return {"ss_base_model_version": base_model_version, "ss_v2": str(base_model_version.startswith("sd_v2"))}


def renamed_plain_lora(state: dict[str, torch.Tensor], adapter_config: dict,
                       name_of) -> dict[str, torch.Tensor] | None:
    """A peft adapter state (`get_peft_model_state_dict`) as plain LoRA factors under other module names:
    `name_of(path)` gives a module's new name (or None: it has none there), written with peft's `.lora_A.weight` /
    `.lora_B.weight` and the scale inside the up matrix (no alpha tensors, so a reader applies it at strength 1).
    None for a DoRA, LoHa or LoKr adapter, or when a module has no new name: such a file could not hold the trained
    change."""
    from ot_dist.methods.lora import scale_baked_in
    from ot_dist.methods.lora_variants import split_modules

    if adapter_config.get("use_dora"):
        return None
    baked, _ = scale_baked_in(state, adapter_config)
    out: dict[str, torch.Tensor] = {}
    for path, factors in split_modules(baked).items():
        name = name_of(path)
        if set(factors) != {PEFT_DOWN, PEFT_UP} or name is None:
            return None
        out[name + PEFT_DOWN], out[name + PEFT_UP] = factors[PEFT_DOWN].contiguous(), factors[PEFT_UP].contiguous()
    return out


def write_companion_lora(target, tensors: dict[str, torch.Tensor] | None, dtype: torch.dtype, modelspec: dict[str, str],
                         *, family: str, scale: str, layout: str = "comfyui", rank: int | None = None) -> list:
    """A family's `extra_lora_files` file: `tensors` (the adapters in the names another program reads) written beside
    the LoRA file `target` as `<name>_comfyui.safetensors`, atomically, its weights in `dtype` (alpha tensors stay
    float32, as kohya writes them). The header says which layout and scale convention the file follows, with kohya's
    network keys where `rank` is given, and the ModelSpec of the original names. Nothing (`[]`) when `tensors` is
    None or empty: the adapter has no such layout."""
    import json

    from safetensors.torch import save_file

    from ot_dist.checkpoint.export import atomic_path

    if not tensors:
        return []
    path = target.with_name(target.name.replace(".safetensors", "_comfyui.safetensors"))
    note = {"ot_dist_lora": json.dumps({"layout": layout, "family": family, "scale": scale})}
    metadata = note if rank is None else kohya_metadata(rank, rank, note)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({k: (v.to(dtype) if k.endswith(".weight") else v).detach().cpu() for k, v in tensors.items()},
                  str(tmp), metadata={**metadata, **modelspec})
    return [path]
