"""What a full export writes for the components a run did not train: the weights the user loaded, not the copies
training held. Low-memory storage (`weight_dtype: float8`, `nf4`, `bfloat16`, `float16`) rounds every frozen weight
in memory; exporting those copies would silently degrade the VAE and frozen text encoders of the file users load. When
any frozen module holds rounded copies, the writing rank loads `model.path` again (in each file's own dtype where that
holds it exactly, else float32: lossless) and takes every untrained component from it, so the export casts the
original once to output_dtype. From a diffusers folder only the untrained components are read again."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_dist.memory.stored import holds_stored_weights
from ot_dist.models.load_dtype import loaded_in
from ot_dist.models.loading import LoadedModel, load_model


def held_as_loaded(module: torch.nn.Module) -> bool:
    """Whether a module still holds the weights `load_model` gave it: every floating weight in float32 or in the
    16-bit dtype its files hold (models/load_dtype.py `loaded_in`: a bfloat16 model stored in bfloat16 is its files'
    values). float8 and nf4 storage and a narrower 16-bit weight_dtype store rounded copies. nf4's packed weights are
    uint8, which the dtype check skips: stored weights are found by their marker (a float32 train_dtype leaves every
    other parameter float32)."""
    exact = {torch.float32, loaded_in(module)}
    return not holds_stored_weights(module) and all(
        p.dtype in exact for p in module.parameters() if p.is_floating_point())


@dataclass
class ExportSource:
    pipeline: object  # what the diffusers folder is written from
    components: dict[str, object]  # the single file's components (modules, and the scheduler)
    states: dict[str, dict[str, torch.Tensor]]  # the modules' full state dicts


def single_file_components(model: LoadedModel) -> dict[str, object]:
    """The parts, the latent encoder as "vae", and the scheduler: what the model predicts is part of the single file
    (the UNet families' v_pred and ztsnr markers, by which ComfyUI and Forge tell v-prediction SDXL models)."""
    return {**model.parts(), "vae": model.vae, "scheduler": model.pipeline.scheduler}


def module_components(components: dict[str, object]) -> dict[str, torch.nn.Module]:
    """The single file's components that hold weights (all but the scheduler)."""
    return {name: c for name, c in components.items() if isinstance(c, torch.nn.Module)}


def export_source(model: LoadedModel, model_config, trained: set[str], state_dict_of, write: bool) -> ExportSource:
    """The pipeline, components ("vae" for the latent encoder, as the single-file exports name it) and state dicts
    to export: `trained` (part names) from `state_dict_of` (a collective under sharding: every rank calls it for the
    same modules), everything else as loaded from `model_config.path`. Only a `write` rank loads the source."""
    parts = model.parts()
    components = single_file_components(model)
    frozen = [m for m in model.modules() if not any(m is parts[name] for name in trained)]
    if all(held_as_loaded(m) for m in frozen):  # nothing rounded: the modules in memory are the originals
        return ExportSource(model.pipeline, components,
                            {n: state_dict_of(m) for n, m in module_components(components).items()})
    states = {name: state_dict_of(parts[name]) for name in trained}
    if not write:
        return ExportSource(model.pipeline, components, states)
    # a folder: only the frozen components; in their files' dtype, which casting to output_dtype turns into what
    # the float32 load would (models/load_dtype.py), at half its memory for a 16-bit model
    source = load_model(model_config, given={name: parts[name] for name in trained}, in_files_dtype=True)
    for name in trained:  # the trained modules in the original's pipeline (their configs; weights from `states`)
        if getattr(source.pipeline, name) is parts[name]:
            continue  # given to the loader, not read again
        entry = source.pipeline.config[name]
        setattr(source.pipeline, name, parts[name])  # frees the source's copy
        # diffusers re-registers the class of what is set: a wrapped module (FSDP2's FSDPUNet...) would
        # rename it in model_index.json; the loaded class is what loaders must build.
        source.pipeline.register_to_config(**{name: entry})
    components = single_file_components(source)
    states.update({name: module.state_dict() for name, module in module_components(components).items()
                   if name not in trained})
    return ExportSource(source.pipeline, components, states)
