"""Load a base model, from a diffusers folder or a single-file checkpoint, into a LoadedModel."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ot_dist.config.schema import ModelConfig
from ot_dist.errors import InputFileError
from ot_dist.models.families.base import Family
from ot_dist.models.families.registry import get_family
from ot_dist.models.inpainting import as_inpainting_pipeline, check_inpainting_option
from ot_dist.models.load_dtype import pipeline_from_pretrained, reading_in_files_dtype
from ot_dist.models.objectives import Objective


@dataclass
class LoadedModel:
    family: Family
    pipeline: object  # the diffusers pipeline; it holds the very modules that train
    objective: Objective  # noise / timesteps / target, with the family's convention

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.family.denoiser)

    @property
    def vae(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.family.latent_encoder)

    @property
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        return {name: getattr(self.pipeline, name) for name in self.family.text_encoders}

    @property
    def tokenizers(self) -> dict[str, object]:
        return {name: getattr(self.pipeline, name) for name in self.family.tokenizers}

    @property
    def inpainting(self) -> bool:
        """An inpainting denoiser: its input is noisy latent + mask + masked-image latent (the family's layout)."""
        return self.family.is_inpainting(self.denoiser)

    @property
    def depth_conditioned(self) -> bool:
        """A depth-conditioned denoiser (SD 2.0 depth): its input is noisy latent + the image's depth map."""
        return self.family.is_depth_conditioned(self.denoiser)

    def part(self, name: str) -> torch.nn.Module:
        """A trainable part by config name: the denoiser ("unet" / "transformer") or a text encoder."""
        return getattr(self.pipeline, name)

    def parts(self) -> dict[str, torch.nn.Module]:
        """The parts that can train, by config name: the denoiser, then the text encoders."""
        return {self.family.denoiser: self.denoiser, **self.text_encoders}

    def sampling_modules(self) -> list[torch.nn.Module]:
        """Frozen modules only sampling uses (a family's decoder stages, when model.decoder loaded them)."""
        return self.family.sampling_modules(self.pipeline)

    def modules(self) -> list[torch.nn.Module]:
        """Every component with weights: the parts, the VAE and the sampling-only modules."""
        return [module for _, module in self.named_components()]

    def named_components(self) -> list[tuple[str, torch.nn.Module]]:
        """`modules()` with the names the config's settings use: the parts' (`unet`, `text_encoder_2`), `vae` for
        the latent encoder, `sampling` for the sampling-only modules."""
        return [(self.family.denoiser, self.denoiser), ("vae", self.vae), *self.text_encoders.items(),
                *(("sampling", m) for m in self.sampling_modules())]


def load_model(config: ModelConfig, given: dict[str, torch.nn.Module] | None = None,
               in_files_dtype: bool = False) -> LoadedModel:
    """`given`: modules that stand in for components of a diffusers folder, which are then not read from it (a full
    export takes the frozen components from model.path and passes the trained ones: a Flux transformer is not
    loaded a second time, 48 GB in float32); the pipeline's config still names the folder's classes. Single files
    and families with their own folder loader load every component (the caller puts its modules in).
    `in_files_dtype`: each component in the narrowest dtype that holds its files exactly (models/load_dtype.py), for
    a caller that casts every weight to its storage before computing with it (the trainer); else float32."""
    with reading_in_files_dtype(in_files_dtype):
        return _load_model(config, given)


def _load_model(config: ModelConfig, given: dict[str, torch.nn.Module] | None) -> LoadedModel:
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()  # one bar per component is noise in a training log
    family = get_family(config.family).configure(config)
    path = Path(config.path)
    # Offline by default: a training job must never stall on, or silently depend on, a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path.is_dir():
        if config.component_files:  # every file checked before any is read
            from ot_dist.models.families.component_files import check_component_files, load_component_files

            check_component_files(family, config)
            given = {**load_component_files(family, config), **(given or {})}
        pipeline = family.complete_pipeline(_load_folder(family, path, given or {}), path, config)
    elif path.is_file():
        pipeline = family.load_single_file(path, config.config, config)
    else:
        raise InputFileError(f"model.path: {path.resolve()} does not exist (expected a diffusers folder or a .safetensors file)")
    denoiser = getattr(pipeline, family.denoiser)
    if family.inpaint_pipeline_class:
        check_inpainting_option(config.inpainting, denoiser, family)
        if family.is_inpainting(denoiser):
            pipeline = as_inpainting_pipeline(pipeline, family.inpaint_pipeline_class)
    return LoadedModel(family=family, pipeline=pipeline, objective=family.objective(pipeline, config))


def _load_folder(family: Family, path: Path, given: dict[str, torch.nn.Module]):
    index = path / "model_index.json"
    if not index.is_file() and (path / "modular_model_index.json").is_file():
        index = path / "modular_model_index.json"  # a modular pipeline's folder: the family's load_folder reads it
    if not index.is_file():
        raise InputFileError(f"model.path: {path} is not a diffusers model folder (no model_index.json)")
    try:
        content = json.loads(index.read_text())
        found = content.get("_class_name")
    except json.JSONDecodeError as err:
        raise InputFileError(f"model.path: {index} is not valid JSON: {err}") from None
    if found not in family.pipeline_classes():
        raise InputFileError(
            f"model.path: {path} holds a {found}, but model.family {family.name} expects a "
            f"{' or '.join(family.pipeline_classes())}"
        )
    import diffusers

    try:
        pipeline = family.load_folder(path, content)
        if pipeline is not None:
            return pipeline
        # each component in the narrowest dtype that holds its files exactly (load_dtype.py): what trains and what
        # is stored is the float32 load's, the peak is what the files hold
        pipeline = pipeline_from_pretrained(getattr(diffusers, found), path, content,
                                            {**family.folder_components(path, frozenset(given)), **given},
                                            use_safetensors=True, local_files_only=True)
        # diffusers registers a given module's own class (a strategy's wrapper class, say): keep the folder's
        pipeline.register_to_config(**{name: content[name] for name in given})
        return pipeline
    except Exception as err:  # diffusers raises many kinds; the user needs the folder and the reason
        raise InputFileError(f"model.path: could not load the diffusers folder {path}: {err}") from None
