"""The ModelSpec header: the `modelspec.*` keys every LoRA, single-file checkpoint and textual-inversion file ot_dist
writes carries beside its other metadata (kohya's `ss_*`, `ot_dist_lora`, `token`, ...).

Stability AI's model metadata spec (github.com/Stability-AI/ModelSpec, version 1.0.1) is what kohya sd-scripts
(library/sai_model_spec.py) writes into every file it saves, ComfyUI into its saved checkpoints and OneTrainer into
its exports; SwarmUI sorts models by `modelspec.architecture` (its default resolution from `modelspec.resolution`)
and shows the title, author, description and date. The spec's rules this module keeps:

- MUST: `sai_model_spec` (the spec's version), `architecture` (the base model's id, a file kind after a `/`:
  `/lora`, `/textual-inversion`), `implementation` (the codebase whose names the file's keys follow), `title`, and
  for image models `resolution` as `<width>x<height>`.
- SHOULD: `date`, ISO-8601. CAN: `prediction_type` (`epsilon` / `v`; `v-zsnr` for a zero-terminal-SNR schedule,
  SwarmUI's value, without which SwarmUI samples such a model on the ordinary schedule; left out for flow matching,
  as kohya leaves it out for Flux), `timestep_range` (`<min>,<max>`, when a run trained a part of them),
  `encoder_layer` (clip skip), `author`, `description`, `license`, `tags`, `merged_from`.
- every value is a string (a safetensors header's metadata holds strings only).

The family declares its identity (`modelspec_architecture_of`, `modelspec_implementation`, ...:
ot_dist/models/families/base.py); this module adds what the file kind and the run say. The date is the run's start
(run.json), so `ot-dist export` of a checkpoint writes the header the end of training wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

SPEC_VERSION = "1.0.1"  # the spec's current version, which kohya writes
# file kind -> the architecture id's suffix (the spec's `<base>/lora`, `<base>/textual-inversion`)
KIND_SUFFIXES = {"checkpoint": "", "lora": "/lora", "embedding": "/textual-inversion"}
PREDICTION_NAMES = {"epsilon": "epsilon", "v_prediction": "v"}  # diffusers' name -> the spec's
# SwarmUI's word for v-prediction on a zero-terminal-SNR schedule: it reads `modelspec.prediction_type` into ComfyUI's
# ModelSamplingDiscrete(sampling, zsnr) node (WorkflowGeneratorModelSupport.cs), so "v" there would put such a model
# on the ordinary schedule (overriding ComfyUI's own `ztsnr` marker detection); "v-zsnr" sets zsnr.
V_ZERO_TERMINAL_SNR = "v-zsnr"
DIFFUSERS = "diffusers"


@dataclass(frozen=True)
class FileFacts:
    """What the header says about how the file came to be (the run, or an `ot-dist lora` tool)."""

    title: str
    resolution: int  # the side of the square the model was trained at (the largest of several)
    created: float  # seconds since the epoch
    timesteps: tuple[int, int | None] | None = None  # (min, max or None = the schedule's last) when a run limited them
    encoder_layer: int | None = None  # A1111's clip skip (1 = the last layer), when a run moved it
    author: str | None = None
    description: str | None = None
    license: str | None = None
    tags: str | None = None
    merged_from: str | None = None


def run_facts(config, created: float | None = None, suffix: str = "") -> FileFacts:
    """The facts of a training run's exports: `created` is the run's start (None: now), `suffix` the export's
    ("_ema"), added to the title as to the file's name (the spec wants a title unique to the model)."""
    loss, meta = config.loss, config.metadata
    limited = loss.min_timestep > 0 or loss.max_timestep is not None
    skip = config.model.text_encoder_layer_skip
    return FileFacts(
        title=(meta.title or Path(config.output_dir).name) + suffix,
        resolution=max(config.resolutions()),
        created=time.time() if created is None else created,
        timesteps=(loss.min_timestep, loss.max_timestep) if limited else None,
        encoder_layer=skip + 1 if skip else None,
        author=meta.author, description=meta.description, license=meta.license, tags=meta.tags)


def tool_facts(family, out: str | Path, merged_from: list[str] | None = None) -> FileFacts:
    """The facts of a file an `ot-dist lora` tool writes now: titled after the file, at the family's native side;
    `merged_from`: the titles of what a merge combined (the spec's comma-separated list)."""
    return FileFacts(title=Path(out).stem, resolution=family.native_resolution, created=time.time(),
                     merged_from=", ".join(merged_from) if merged_from else None)


def trained_prediction(model) -> str | None:
    """What the loaded model's denoiser predicts, in diffusers' words; None for flow matching (the velocity, which
    the spec has no word for; kohya leaves the key out for Flux)."""
    if model.family.objective_kind() == "flow":
        return None
    return getattr(model.objective, "prediction_type", "epsilon")  # Würstchen's cosine schedule: epsilon


def trained_zero_terminal_snr(model) -> bool:
    zero_terminal_snr = getattr(model.objective, "zero_terminal_snr", None)
    return bool(zero_terminal_snr()) if zero_terminal_snr is not None else False


def implementation_of(family, kind: str, lora_layout: str | None) -> str:
    """The codebase whose names the file's keys follow: the original layout's for single files and embeddings (kohya:
    Stability's for SD checkpoints and embeddings), the module paths a kohya-layout LoRA names (diffusers' for SD 1.x /
    2.x, the SGM UNet's for SDXL), diffusers for peft's `transformer.<diffusers path>` layout."""
    if kind != "lora":
        return family.modelspec_implementation
    return family.modelspec_kohya_lora_implementation if lora_layout == "kohya" else DIFFUSERS


def modelspec_header(family, kind: str, denoiser_config, prediction_type: str | None, facts: FileFacts,
                     lora_layout: str | None = None, inpainting: bool = False, num_train_timesteps: int = 1000,
                     zero_terminal_snr: bool = False) -> dict[str, str]:
    """The `modelspec.*` keys of one file. `kind`: checkpoint, lora or embedding; `prediction_type`: diffusers'
    `epsilon` / `v_prediction`, None for flow matching; `zero_terminal_snr`: the schedule ends at SNR 0."""
    if kind not in KIND_SUFFIXES:
        raise ValueError(f"modelspec: unknown file kind {kind!r}; known: {', '.join(KIND_SUFFIXES)}")
    architecture = family.modelspec_architecture_of(denoiser_config, prediction_type, inpainting)
    header = {
        "sai_model_spec": SPEC_VERSION,
        "architecture": architecture + KIND_SUFFIXES[kind],
        "implementation": implementation_of(family, kind, lora_layout),
        "title": facts.title,
        "resolution": f"{facts.resolution}x{facts.resolution}",
        "date": datetime.fromtimestamp(int(facts.created), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if prediction_type == "v_prediction" and zero_terminal_snr:
        header["prediction_type"] = V_ZERO_TERMINAL_SNR
    elif prediction_type is not None:
        header["prediction_type"] = PREDICTION_NAMES.get(prediction_type, prediction_type)
    if facts.timesteps is not None:
        low, high = facts.timesteps
        header["timestep_range"] = f"{low},{num_train_timesteps - 1 if high is None else high}"  # both inclusive
    if facts.encoder_layer is not None:
        header["encoder_layer"] = str(facts.encoder_layer)
    for key in ("author", "description", "license", "tags", "merged_from"):
        if getattr(facts, key) is not None:
            header[key] = getattr(facts, key)
    return {f"modelspec.{key}": str(value) for key, value in header.items()}


def header_for(model, kind: str, facts: FileFacts, lora_layout: str | None = None) -> dict[str, str]:
    """`modelspec_header` for a loaded model (ot_dist/models/loading.py LoadedModel): its family, its denoiser's
    config, what it was trained to predict, whether it inpaints, its schedule's length."""
    scheduler = getattr(model.pipeline, "scheduler", None)
    steps = getattr(getattr(scheduler, "config", None), "get", lambda *_: None)("num_train_timesteps") or 1000
    return modelspec_header(model.family, kind, model.denoiser.config, trained_prediction(model), facts,
                            lora_layout=lora_layout, inpainting=model.inpainting, num_train_timesteps=steps,
                            zero_terminal_snr=trained_zero_terminal_snr(model))
