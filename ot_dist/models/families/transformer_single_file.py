"""Loading and writing a transformer family's single file (Flux / Chroma from Black Forest Labs / lodestones, SD3
from Stability, Stable Cascade's stage C): the file holds the denoiser in its original layout, and may hold the VAE
and text encoders as a full checkpoint does (full_checkpoint.py); the components it lacks (and the tokenizers,
scheduler and every config) come from a diffusers folder named by `model.config`, weights included, or from their own
files (`model.component_files`, component_files.py: the folder then needs only the configs and tokenizers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ot_dist.errors import InputFileError
from ot_dist.models.families.full_checkpoint import file_components, load_file_components
from ot_dist.models.families.single_file_keys import read_safetensors_header
from ot_dist.models.load_dtype import float32_build_of, load_dtype_of, own_tensors, pipeline_from_pretrained


def load_transformer_file(path: Path, config_folder: str | None, family, from_original: Callable,
                          validate_file: Callable, model_config=None):
    """A pipeline whose denoiser comes from `path` (checked key by key against the folder's transformer config
    before any tensor is read), the components `model_config.component_files` names from their files, and the
    others from `config_folder`."""
    import diffusers
    from safetensors.torch import load_file

    from ot_dist.models.families.component_files import check_component_files, load_component_files

    if config_folder is None:
        raise InputFileError(f"model.config: {path.name} holds only the {family.name} transformer; name a diffusers "
                             f"{family.pipeline_class} folder that supplies the VAE, text encoders and tokenizers")
    folder = Path(config_folder)
    config_file = folder / family.denoiser / "config.json"
    if not config_file.is_file():
        raise InputFileError(f"model.config: {folder} has no {family.denoiser}/config.json (not a diffusers "
                             f"{family.pipeline_class} folder)")
    config = json.loads(config_file.read_text())
    validate_file(path, config)  # InputFileError naming the missing / unexpected / wrong-shaped keys
    overrides = getattr(model_config, "component_files", None) or {}
    if overrides:
        check_component_files(family, model_config)  # every file's header, before any tensor is read
    # In the file's own width (models/load_dtype.py), into a model built without weights: a Flux.1 file read in
    # float32 into a randomly initialised float32 model held four copies of the transformer at once (~95 GB).
    dtype = load_dtype_of([path])
    state = own_tensors(from_original(load_file(path), config), dtype)
    denoiser = float32_build_of(getattr(diffusers, config["_class_name"]), config)
    missing, unexpected = denoiser.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise InputFileError(f"model.path: {path} does not fit {config_file}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    given = load_component_files(family, model_config) if overrides else {}
    passed = {**family.folder_components(Path(folder)), family.denoiser: denoiser, **given}
    # the components the file replaces are read from the folder as before (float32): the file's values go into them
    replaced = file_components(read_safetensors_header(path), family.full_checkpoint, skip=set(given))
    index = json.loads((folder / "model_index.json").read_text()) if (folder / "model_index.json").is_file() else {}
    try:
        pipeline = pipeline_from_pretrained(family.pipeline_cls(), folder,
                                            {k: v for k, v in index.items() if k not in replaced}, passed,
                                            use_safetensors=True, local_files_only=True)
    except Exception as err:  # diffusers raises many kinds; the user needs the folder and the reason
        raise InputFileError(f"model.config: could not load the other components from {folder}: {err}") from None
    # A full checkpoint's own text encoders and VAE replace the folder's (ot_dist's exports of a run that trained
    # text encoders, Stability's SD3 files with their CLIPs, ComfyUI-saved checkpoints).
    # A component named in model.component_files is the user's explicit choice: the file's own copy is not read.
    load_file_components(path, pipeline, family.full_checkpoint, skip=set(given))
    return pipeline


def write_transformer_file(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                           metadata: dict[str, str] | None = None) -> None:
    """Write an original-layout state dict as one safetensors file, atomically, readable per the umask, with
    `metadata` (the ModelSpec header) beside `format`."""
    from safetensors.torch import save_file

    from ot_dist.checkpoint.export import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt", **(metadata or {})})
