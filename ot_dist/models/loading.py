"""Load a base model, from a diffusers folder or a single-file checkpoint, into a LoadedModel."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ot_dist.config.schema import ModelConfig
from ot_dist.errors import InputFileError
from ot_dist.models.inpainting import as_inpainting_pipeline, check_inpainting_option, is_inpainting_unet
from ot_dist.models.specs import ModelSpec, get_spec


@dataclass
class LoadedModel:
    spec: ModelSpec
    pipeline: object  # the diffusers pipeline; it holds the very modules that train
    noise_scheduler: object  # DDPMScheduler with the model's betas and prediction type

    @property
    def unet(self) -> torch.nn.Module:
        return self.pipeline.unet

    @property
    def vae(self) -> torch.nn.Module:
        return self.pipeline.vae

    @property
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        return {name: getattr(self.pipeline, name) for name in self.spec.text_encoders}

    @property
    def tokenizers(self) -> dict[str, object]:
        return {name: getattr(self.pipeline, name) for name in self.spec.tokenizers}

    @property
    def inpainting(self) -> bool:
        """A 9-channel inpainting UNet: its input is noisy latent + mask + masked-image latent."""
        return is_inpainting_unet(self.unet)

    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    def part(self, name: str) -> torch.nn.Module:
        """A trainable part by config name: "unet", "text_encoder", "text_encoder_2"."""
        return getattr(self.pipeline, name)


def load_model(config: ModelConfig) -> LoadedModel:
    from diffusers import DDPMScheduler
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()  # one bar per component is noise in a training log
    spec = get_spec(config.family)
    path = Path(config.path)
    # Offline by default: a training job must never stall on, or silently depend on, a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path.is_dir():
        pipeline = _load_folder(spec, path)
    elif path.is_file():
        from ot_dist.models.single_file import load_single_file

        prediction = None if config.prediction_type == "auto" else config.prediction_type
        pipeline = load_single_file(path, spec.family, config.config, prediction_type=prediction)
    else:
        raise InputFileError(f"model.path: {path} does not exist (expected a diffusers folder or a .safetensors file)")
    check_inpainting_option(config.inpainting, pipeline.unet)
    if is_inpainting_unet(pipeline.unet):
        pipeline = as_inpainting_pipeline(pipeline, spec.inpaint_pipeline_class)
    scheduler_config = dict(pipeline.scheduler.config)
    if config.prediction_type != "auto":
        scheduler_config["prediction_type"] = config.prediction_type
    noise_scheduler = DDPMScheduler.from_config(scheduler_config)
    return LoadedModel(spec=spec, pipeline=pipeline, noise_scheduler=noise_scheduler)


def _load_folder(spec: ModelSpec, path: Path):
    index = path / "model_index.json"
    if not index.is_file():
        raise InputFileError(f"model.path: {path} is not a diffusers model folder (no model_index.json)")
    try:
        found = json.loads(index.read_text()).get("_class_name")
    except json.JSONDecodeError as err:
        raise InputFileError(f"model.path: {index} is not valid JSON: {err}") from None
    if found not in (spec.pipeline_class, spec.inpaint_pipeline_class):
        raise InputFileError(
            f"model.path: {path} holds a {found}, but model.family {spec.family} expects a {spec.pipeline_class} "
            f"or {spec.inpaint_pipeline_class}"
        )
    import diffusers

    try:
        return getattr(diffusers, found).from_pretrained(
            path, dtype=torch.float32, use_safetensors=True, local_files_only=True
        )
    except Exception as err:  # diffusers raises many kinds; the user needs the folder and the reason
        raise InputFileError(f"model.path: could not load the diffusers folder {path}: {err}") from None
