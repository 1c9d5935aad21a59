"""LoRA via peft on the denoiser and/or text encoders. Exported in kohya's layout where the family declares its
names (ComfyUI, A1111 / Forge, kohya and diffusers' `load_lora_weights` read it; ot_dist/methods/lora_layouts.py),
or in the diffusers layout (`lora.file_layout: diffusers`; alpha and rank in the file's adapter metadata)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ot_dist.checkpoint.canonical import with_metadata
from ot_dist.checkpoint.export import atomic_path
from ot_dist.errors import ConfigError
from ot_dist.methods.base import ParamGroup, TrainingMethod, freeze_all, plain_state_dict, trainable
from ot_dist.models.loading import LoadedModel
from ot_dist.precision import DTYPES

ADAPTER = "default"


class LoraMethod(TrainingMethod):
    formats = ("lora",)

    def prepare(self, model: LoadedModel) -> list[ParamGroup]:
        from ot_dist.methods.lora_autocast import skip_input_copies_under_autocast
        from ot_dist.methods.lora_block_casts import cast_adapters_per_block, share_down_projections
        from ot_dist.methods.lora_forward import fuse_up_projections
        from ot_dist.methods.lora_variants import (drop_down_output, init_loha_as_lycoris, match_lycoris_scale,
                                                   peft_config)
        from ot_dist.models.load_dtype import adapters_as_on_float32
        from ot_dist.parallel.fsdp import family_units

        freeze_all(model)
        groups = []
        for part in self.config.part_names():
            if not self.config.part_trains(part):
                continue
            module = model.part(part)
            key, targets = lora_targets(self.config.lora, model.family, part, module)
            lora = self.config.lora
            if lora.variant == "oft":  # ot_dist's own module: peft's OFT rotates the input, which no file rule reads
                from ot_dist.methods.oft import add_oft
                from ot_dist.methods.oft_file import left_out_modules

                # exactly the selected paths, as for peft (exclude_modules below)
                extras = suffix_matched_extras(module, targets) if key == "lora.layer_filter" else []
                extras += left_out_modules(self.config, model.family, part, module, key, targets)
                if not add_oft(module, targets, lora.oft_block_size, lora.oft_constraint, extras):
                    raise ConfigError(f"{key}: {targets} match no Linear or Conv2d layer of the {part}")
                groups.append(ParamGroup(part, trainable(module), self.config.part_learning_rate(part), part=part))
                continue
            lora_config = peft_config(lora.variant, lora.rank, lora.alpha, lora.dropout, targets)
            if key == "lora.layer_filter":  # exactly the selected paths: peft also takes a target as a path suffix
                lora_config.exclude_modules = suffix_matched_extras(module, targets) or None
            try:
                with adapters_as_on_float32():  # a base read in 16 bits (models/load_dtype.py) is float32's values
                    add_adapter(module, lora_config)
            except ValueError as err:
                raise ConfigError(f"{key}: {targets} do not match modules of the {part}: {err}") from None
            if lora.variant == "lokr":  # LyCORIS's scale (1.0) where both Kronecker factors are full matrices
                match_lycoris_scale(module, ADAPTER)
            if lora.variant == "loha":  # LyCORIS's initial factors (peft's trained 130-270x slower at first)
                init_loha_as_lycoris(module, ADAPTER)
            if lora.variant == "lora" and (lora.dropout or lora.rank_dropout or lora.module_dropout):
                # on the rank features, as OneTrainer and kohya drop
                drop_down_output(module, ADAPTER, lora.dropout, lora.rank_dropout, lora.module_dropout)
            skip_input_copies_under_autocast(module, ADAPTER)
            fused = fuse_up_projections(module, ADAPTER)
            cast_adapters_per_block(module, family_units(model.family, part, module), fused, ADAPTER)
            share_down_projections(module)
            # Adapters are trained and kept in float32 whatever the frozen base weights are stored in.
            params = trainable(module)
            for p in params:
                p.data = p.data.float()
            groups.append(ParamGroup(part, params, self.config.part_learning_rate(part), part=part))
        if self.config.lora.init_from:
            from ot_dist.lora_tools.start import start_from_file

            start_from_file(model, {g.part: model.part(g.part) for g in groups}, self.config.lora.init_from,
                            self.config.lora.rank, ADAPTER)
        return groups + self.additional.prepare(model)

    def export(
        self, model: LoadedModel, output_dir: Path, state_dict_of=plain_state_dict, write=True, suffix="",
        created: float | None = None,
    ) -> list[Path]:
        from peft.utils import get_peft_model_state_dict

        dtype = DTYPES[self.config.output_dtype]
        states, adapter_configs = {}, {}
        for part in self.config.part_names():
            module = model.part(part)
            if not self.config.part_trains(part):
                continue
            if self.config.lora.variant == "oft":
                from ot_dist.methods.oft import SUFFIX as OFT_SUFFIX, oft_state

                states[part] = oft_state(state_dict_of(module, keep=lambda key: key.endswith(OFT_SUFFIX)))
                adapter_configs[part] = {"target_modules": sorted(k.rsplit(".", 1)[0] for k in states[part])}
                continue
            # the adapters only: under fsdp / zero3 the rest would be gathered whole on every rank for nothing
            states[part] = get_peft_model_state_dict(module, state_dict=state_dict_of(module, keep=adapter_keys(module)),
                                                     adapter_name=ADAPTER)
            adapter_configs[part] = module.peft_config[ADAPTER].to_dict()
        vectors = self.additional.vectors(model, state_dict_of)  # gathered once: the bundle and the files
        embeddings = self.additional.export(model, output_dir, state_dict_of, write, suffix, created, vectors)
        target = output_dir / f"lora{suffix}.safetensors"
        if not write:
            return [target] + embeddings
        output_dir.mkdir(parents=True, exist_ok=True)
        layout = self.config.lora_file_layout()
        modelspec = self.modelspec(model, "lora", created, suffix, lora_layout=layout)
        bundle = self.additional.bundled(model, vectors, dtype) if self.config.bundle_additional_embeddings else {}
        # the families' extra files hold plain LoRA only (and read peft's adapter configs, which oft has not)
        extra = [] if self.config.lora.variant == "oft" else model.family.extra_lora_files(
            model, dict(states), adapter_configs, target, dtype,
            self.modelspec(model, "lora", created, suffix, lora_layout="kohya"))
        if layout == "kohya":
            self._write_kohya(model, states, adapter_configs, target, dtype, modelspec, bundle)
        elif self.config.lora.variant == "oft":  # no peft adapter: ComfyUI's names, ot_dist/methods/oft_file.py
            from ot_dist.methods.oft_file import write_oft_file

            write_oft_file(model, states, target, self.config.lora, dtype, modelspec, bundle)
        else:
            self._write_diffusers(model, states, adapter_configs, target, dtype, modelspec, bundle)
        return [target] + extra + embeddings

    def _write_kohya(self, model, states, adapter_configs, target: Path, dtype, modelspec: dict[str, str],
                     bundle: dict[str, torch.Tensor]) -> None:
        import json

        from safetensors.torch import save_file

        from ot_dist.methods.lora_layouts import kohya_metadata, kohya_names, to_kohya

        family, lora = model.family, self.config.lora
        parts = {p: model.part(p) for p in states}
        names = kohya_names(family.lora_file_prefixes, family.lora_file_roots, parts,
                            {p: family.lora_file_module_renames(p, m) for p, m in parts.items()})
        tensors = dict(bundle)  # bundle_emb.*: the additional embeddings, when bundled
        for part, state in states.items():
            # an OFT module's .alpha is its constraint (ComfyUI's and LyCORIS' reading), not a scale
            alpha = lora.oft_constraint if lora.variant == "oft" else lora.alpha
            tensors.update(to_kohya(state, names[part], alpha, dtype, rank=lora.rank))
        targets = {part: sorted(config["target_modules"]) for part, config in adapter_configs.items()}
        metadata = kohya_metadata(lora.rank, lora.alpha, {"ot_dist_lora": json.dumps(
            {"layout": "kohya", "family": family.name, "variant": lora.variant, "rank": lora.rank, "alpha": lora.alpha,
             "targets": targets})}, variant=lora.variant, base_model_version=family.lora_base_model_version)
        with atomic_path(target) as tmp:
            save_file(tensors, str(tmp), metadata={**metadata, **modelspec})

    def _write_diffusers(self, model, states, adapter_configs, target: Path, dtype, modelspec: dict[str, str],
                         bundle: dict[str, torch.Tensor]) -> None:
        # peft's own key layout (lora_A / lora_B): what diffusers' loader reads natively, together with the
        # adapter config (rank, targets) it finds in the file's metadata; the scale is inside the weights.
        # Components the family names kohya-style (T5-XXL) go in under those names, with their alpha tensors;
        # those it names by another program's keys (Qwen2.5-VL: ComfyUI's) under those, their scale inside the
        # weights as the peft-named ones (an `.alpha` tensor would make diffusers' Qwen-Image loader take the whole
        # file for a non-diffusers one).
        from ot_dist.methods.lora_layouts import PEFT_DOWN, PEFT_UP, KohyaNames, named_components, renamed, to_kohya

        names = named_components(model.family)
        named = {}
        for part in [p for p in states if isinstance(names.get(p), KohyaNames)]:
            named.update(to_kohya(states.pop(part), names[part], self.config.lora.alpha, dtype,
                                  suffixes=(PEFT_DOWN, PEFT_UP), rank=self.config.lora.rank))
        kwargs = {}
        for part, state in states.items():
            state, metadata = scale_baked_in(state, adapter_configs[part])
            if part in names:  # another program's names (PathNames): whole paths, no root level to add
                state = renamed(state, names[part])
            # DoRA's magnitude as the parameter it is (`.lora_magnitude_vector.weight`): transformers' load_adapter
            # (diffusers' text-encoder path) maps only that name onto the parameter and silently skips the bare one
            state = {k + ".weight" if k.endswith(".lora_magnitude_vector") else k: v for k, v in state.items()}
            state = with_dora_scale(state)
            if part in names:
                named.update({k: v.detach().to(dtype).contiguous() for k, v in state.items()})
                continue
            state = with_file_root(state, model.family.lora_file_roots.get(part, ""), model.part(part))
            if isinstance(metadata.get("target_modules"), (set, list, tuple)):
                # peft keeps them in a set: its order changes with each process's hash seed, and so would the file
                metadata = {**metadata, "target_modules": sorted(metadata["target_modules"])}
            kwargs[f"{part}_lora_layers"] = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
            kwargs[f"{part}_lora_adapter_metadata"] = metadata
        pipeline_cls = model.family.pipeline_cls()
        # kohya-named parts, bundled embeddings (diffusers' saver takes components only), or no LoRA saver for these parts
        if named or bundle or not saves_lora_of(pipeline_cls, kwargs):
            write_peft_layout(kwargs, target, named, modelspec, bundle)
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as staging, atomic_path(target) as tmp:
            pipeline_cls.save_lora_weights(staging, weight_name=target.name, **kwargs)
            # diffusers' saver takes no metadata of ours: added to its header (a LoRA's, small to rewrite)
            with_metadata(Path(staging) / target.name, modelspec)
            os.replace(Path(staging) / target.name, tmp)


def saves_lora_of(pipeline_cls, kwargs: dict) -> bool:
    """Whether the pipeline class's `save_lora_weights` takes these `<part>_lora_layers` / metadata arguments: some
    pipelines inherit a LoRA mixin written for other components (WuerstchenPriorPipeline has SD's, which knows `unet`
    and `text_encoder`, not `prior`), and some mixins have no saver of their own (AnimaLoraLoaderMixin)."""
    import inspect

    from diffusers.loaders.lora_base import LoraBaseMixin

    saver = getattr(pipeline_cls, "save_lora_weights", None)
    # a mixin that loads but never wrote a saver (Anima's) leaves LoraBaseMixin's, which only raises
    if saver is None or getattr(saver, "__func__", None) is LoraBaseMixin.save_lora_weights.__func__:
        return False
    parameters = inspect.signature(saver).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    return all(key in parameters for key in kwargs)


def add_adapter(module: torch.nn.Module, lora_config) -> None:
    """The LoRA adapter on `module`: through its own `add_adapter` (diffusers' PeftAdapterMixin, transformers'
    PreTrainedModel) or, for a module without one (diffusers 0.42's PixArtTransformer2DModel), peft's
    `inject_adapter_in_model`, which leaves the same layers and `peft_config` on the module."""
    if hasattr(module, "add_adapter"):
        module.add_adapter(lora_config, adapter_name=ADAPTER)
        return
    from peft import inject_adapter_in_model

    inject_adapter_in_model(lora_config, module, adapter_name=ADAPTER)
    if not hasattr(module, "peft_config"):
        module.peft_config = {ADAPTER: lora_config}


def write_peft_layout(parts: dict, target: Path, named: dict[str, torch.Tensor] | None = None,
                      extra_metadata: dict[str, str] | None = None, bundle: dict[str, torch.Tensor] | None = None) -> None:
    """What `save_lora_weights` writes, for a pipeline without it: every component's peft keys under its name
    (`transformer.<module>.lora_A.weight`) and the adapter configs as diffusers' `lora_adapter_metadata`.

    `named`: tensors under kohya-style names with `.alpha` tensors (T5-XXL components) or under another program's
    names with the scale inside (Qwen-Image's Qwen2.5-VL as ComfyUI names it), written as they are. A file
    with them carries no `lora_adapter_metadata`: diffusers' loader refuses alpha tensors beside it (peft.py
    `load_lora_adapter`: "Both `network_alphas` and `metadata` cannot be specified"), and without it diffusers takes
    alpha = rank, which is right for the peft-named components, whose scale is inside their up matrices.
    `bundle`: the bundled embeddings' `bundle_emb.*` tensors, written as they are."""
    import json

    from safetensors.torch import save_file

    tensors, adapter_metadata = {**(bundle or {}), **(named or {})}, {}
    for key, value in parts.items():
        if key.endswith("_lora_layers"):
            component = key[: -len("_lora_layers")]
            tensors.update({f"{component}.{name}": tensor for name, tensor in value.items()})
        else:
            component = key[: -len("_lora_adapter_metadata")]
            adapter_metadata.update({f"{component}.{k}": list(v) if isinstance(v, (set, tuple)) else v
                                     for k, v in value.items()})
    metadata = {"format": "pt", **(extra_metadata or {})}
    if not named:
        metadata["lora_adapter_metadata"] = json.dumps(adapter_metadata, sort_keys=True)
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def lora_targets(settings, family, part: str, module) -> tuple[str, list[str]]:
    """(the config key that chose them, the module-name suffixes peft adapts) for one part."""
    if part != family.denoiser:
        targets = settings.text_encoder_targets or family.text_lora_default_targets(part)
        return "lora.text_encoder_targets", list(targets)
    key = f"{part}_targets"
    if getattr(settings, key, None):
        return f"lora.{key}", list(getattr(settings, key))
    if getattr(settings, "layer_filter", None) is not None:
        return "lora.layer_filter", layer_filter_targets(settings.layer_filter, settings.layer_filter_regex, module)
    if settings.preset in WHOLE_MODULE_PRESETS:
        takes = WHOLE_MODULE_PRESETS[settings.preset]
        return "lora.preset", [name for name, sub in module.named_modules() if takes(sub)]
    return "lora.preset", list(family.denoiser_lora_presets[settings.preset])


# Presets derived from the module: every layer of a kind. all_layers is OneTrainer's "full" layer filter (every
# Linear and Conv2d, 3x3 convolutions LoCon-style as kohya's conv_dim), but grouped (depthwise) convolutions, which
# peft adapts only at a rank divisible by the groups.
WHOLE_MODULE_PRESETS = {
    "all_linear": lambda sub: isinstance(sub, torch.nn.Linear),
    "all_layers": lambda sub: isinstance(sub, torch.nn.Linear) or (isinstance(sub, torch.nn.Conv2d)
                                                                    and sub.groups == 1),
}


def layer_filter_targets(patterns: list[str], regex: bool, module: torch.nn.Module, field: str = "lora.layer_filter",
                         kinds: tuple[type, ...] = (torch.nn.Linear, torch.nn.Conv2d)) -> list[str]:
    """The paths of `module`'s layers of `kinds` (Linear and Conv2d) that OneTrainer's layer filter selects (its
    LoRAModuleWrapper with ModuleFilter; its quantization filter too): a path is taken when one pattern is found in
    it, as a substring or, with `regex`, by re.search; an empty pattern takes every such layer. Layers of other kinds
    are never taken. A pattern that selects nothing is an error (OneTrainer's too), naming it (`field`)."""
    import re

    found = [(lambda path, p=re.compile(p): p.search(path) is not None) if regex and p else
             (lambda path, p=p: p in path) for p in patterns]
    layers = [path for path, sub in module.named_modules() if isinstance(sub, kinds)]
    kind_names = " or ".join(k.__name__ for k in kinds)
    for i, (pattern, matches) in enumerate(zip(patterns, found)):
        if not any(matches(path) for path in layers):
            raise ConfigError(f"{field}[{i}]: {pattern!r} selects no {kind_names} layer of the "
                              f"{type(module).__name__} (paths such as {layers[0] if layers else '-'!r}; "
                              f"{field}_regex is {str(regex).lower()})")
    return [path for path in layers if any(matches(path) for matches in found)]


def suffix_matched_extras(module: torch.nn.Module, paths: list[str]) -> list[str]:
    """The module paths peft would adapt beside `paths` because they end in ".<one of paths>" (a top-level
    proj_out and Flux's single_transformer_blocks.0.proj_out), to pass as its exclude_modules."""
    chosen = set(paths)
    return sorted(name for name, _ in module.named_modules()
                  if name not in chosen and any(name.endswith("." + path) for path in chosen))


def with_dora_scale(state: dict) -> dict:
    """DoRA's magnitude also as `<module>.dora_scale` ([out, 1] / [out, 1, 1, 1], output axis), the only name ComfyUI
    and Forge read it by (comfy/lora.py load_lora): with peft's `lora_magnitude_vector.weight` alone they applied the
    plain LoRA part without DoRA's normalisation and magnitude. diffusers drops `dora_scale` keys (with a warning,
    lora_pipeline `lora_state_dict`) and reads the magnitude vector; ot_dist's readers take either."""
    suffix = ".lora_magnitude_vector.weight"
    scales = {}
    for key, magnitude in state.items():
        if key.endswith(suffix):
            path = key[: -len(suffix)]
            ndim = state[path + ".lora_A.weight"].dim()
            scales[path + ".dora_scale"] = magnitude.reshape(-1, *[1] * (ndim - 1)).clone()
    return {**state, **scales}


def with_file_root(state: dict, root: str, module: torch.nn.Module) -> dict:
    """Keys under the module level that LoRA files name and the loaded module lacks (transformers 5's CLIPTextModel
    has no `text_model.`; ComfyUI reads CLIP LoRA keys only with it, diffusers accepts both)."""
    if not root or root in dict(module.named_children()):
        return state
    return {f"{root}.{key}": value for key, value in state.items()}


def scale_baked_in(state: dict, metadata: dict) -> tuple[dict, dict]:
    """The adapter with its scale (alpha / rank, or alpha / sqrt(rank) for rsLoRA; 1.0 for a LoKr module with two full
    factors, as trained) multiplied into one factor of each module's product (LoRA / DoRA: the up matrix; LoHa:
    hada_w1_a; LoKr: lokr_w1 or lokr_w1_a) and alpha written as the rank, so that peft (diffusers' loader) applies
    1.0 to every module. Loaders disagree on where alpha lives (diffusers: the file's metadata; ComfyUI, A1111 /
    Forge: an `.alpha` tensor per module, strength 1.0 without one); with the scale inside the weights every one of them
    applies exactly the change training made."""
    from ot_dist.methods.lora_variants import baked_factors, config_scale, full_kronecker, split_modules

    scale, metadata = config_scale(metadata)
    baked = {}
    for path, factors in split_modules(state).items():
        trained = 1.0 if full_kronecker(factors) else scale
        baked.update({path + suffix: t for suffix, t in baked_factors(factors, trained).items()})
    return baked, metadata


def adapter_keys(module: torch.nn.Module):
    """A state-dict key filter: the entries of the module's peft adapters (lora_A / lora_B, DoRA's magnitudes, LoHa's
    and LoKr's factors: each tuner layer's `adapter_layer_names`), which is what peft's state dict of the adapter
    picks from a module's full one."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = {name for m in module.modules() if isinstance(m, BaseTunerLayer) for name in m.adapter_layer_names}
    markers = tuple(f".{name}." for name in names)
    return lambda key: any(marker in f".{key}" for marker in markers)
