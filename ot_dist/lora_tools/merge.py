"""`ot-dist lora merge`: W += weight * alpha / rank * up @ down for every module of the file (LoHa / LoKr: their
products; DoRA: W + weight * (magnitude * (W + delta) / ||W + delta|| - W)), then write the merged model as a
diffusers folder or a single file, with the family's own exporters."""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.errors import InputFileError
from ot_dist.lora_tools.files import ALL_VARIANTS, LoraFile, Pair, read_lora_file
from ot_dist.lora_tools.matching import check_shape, match, module_index
from ot_dist.models.load_dtype import hold_as_float32


def changed_parts(model, lora: LoraFile, source: str) -> set[str]:
    """The model's parts (denoiser, text encoders) that the file has modules of."""
    from ot_dist.lora_tools.foreign import in_family_names

    lora = in_family_names(model, lora, source)
    matched, _ = match(lora.pairs, module_index(model, lora.layout), source)
    return {target.part for target in matched.values()}


@torch.no_grad()
def merge_into(model, lora: LoraFile, weight: float, source: str) -> tuple[int, list[str]]:
    """Add the file's changes to the model in place, in float32: a float32 weight keeps its storage, a 16-bit one
    (a base read in its files' dtype, models/load_dtype.py) becomes the float32 merged weight, so that another file
    merged after it adds to the unrounded sum and the export casts it once. Returns (modules merged, the file's names
    the model lacks). Other trainers' names are resolved first (foreign.py)."""
    from ot_dist.lora_tools.foreign import in_family_names

    lora = in_family_names(model, lora, source)
    matched, missing = match(lora.pairs, module_index(model, lora.layout), source)
    for name, target in matched.items():
        w = target.module.weight
        change = lora.pairs[name]
        if isinstance(change, Pair):
            check_shape(name, change.delta(), w, source)
        try:
            merged = change.merged(w, weight)
        except RuntimeError as err:  # a LoHa / LoKr product that does not fit the weight
            raise InputFileError(f"{source}: {name} ({change.variant}) does not fit the model's {tuple(w.shape)} "
                                 f"weight ({err}): another model's LoRA?") from None
        hold_as_float32(w, merged)
    return len(matched), missing


def title_of(model_path: str) -> str:
    """A base model's name in `merged_from`: a single file's own ModelSpec title, else its file or folder name."""
    path = Path(model_path)
    if path.suffix == ".safetensors" and path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            title = (f.metadata() or {}).get("modelspec.title")
        if title:
            return title
    return path.stem if path.suffix == ".safetensors" else path.name


def merge_command(base: str, family: str, lora_paths: list[str], weights: list[float], out: str, fmt: str,
                  config_folder: str | None, dtype_name: str, log=print) -> Path:
    from ot_dist.checkpoint.export import export_diffusers_folder
    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model
    from ot_dist.precision import DTYPES

    # in its files' dtype: every merged weight becomes float32 (merge_into), the others are the files' values, and
    # the export casts each once to `dtype`: the float32 load's files, at half its memory for a 16-bit base
    model = load_model(ModelConfig(family=family, path=base, config=config_folder), in_files_dtype=True)
    changed: set[str] = set()
    titles = [title_of(base)]  # the single file's ModelSpec `merged_from`, as kohya's merge scripts write it
    for path, weight in zip(lora_paths, weights):
        lora = read_lora_file(path, ALL_VARIANTS, 'ot-dist lora merge')
        changed |= changed_parts(model, lora, path)
        titles.append(lora.metadata.get("modelspec.title") or Path(path).stem)
        merged, missing = merge_into(model, lora, weight, path)
        log(f"{path}: merged {merged} modules at weight {weight}")
        if missing:
            log(f"warning: {path}: {len(missing)} modules are not in the model and were skipped: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    dtype = DTYPES[dtype_name]
    target = Path(out)
    if fmt == "diffusers":
        # with what complete_pipeline reads back beside diffusers' files (Stable Cascade's EfficientNet)
        export_diffusers_folder(model.pipeline, target, dtype, family=model.family)
    else:
        from ot_dist.checkpoint.frozen_source import module_components, single_file_components

        # with the scheduler, as training exports: a v-prediction / zero-terminal-SNR model keeps its v_pred / ztsnr
        # markers, by which ComfyUI and Forge choose how to sample it
        components = single_file_components(model)
        states = {n: m.state_dict() for n, m in module_components(components).items()}
        from ot_dist.checkpoint.modelspec import header_for, tool_facts

        header = header_for(model, "checkpoint", tool_facts(model.family, target, merged_from=titles))
        # a LoRA that changed a text encoder: the file carries the text encoders, as a trained full finetune's does
        model.family.export_single_file(components, states, target, dtype,
                                        with_text_encoders=bool(changed & set(model.text_encoders)), metadata=header)
    log(f"wrote {target}")
    return target
