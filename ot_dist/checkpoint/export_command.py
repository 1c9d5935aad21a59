"""`ot-dist export CHECKPOINT`: the files the end of training writes, from any committed checkpoint, in
one process and without a process group, whatever strategy and world size saved it."""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.checkpoint.layout import resolve_resume
from ot_dist.checkpoint.run_folder import check_writable
from ot_dist.checkpoint.shards import SavedShards, gather_full_from_files
from ot_dist.checkpoint.training_state import read_trainer_state
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.models.load_dtype import hold_as_float32


def export_checkpoint(path: str, formats: list[str] | None, ema: bool, out: str | None, log=print) -> list[Path]:
    from ot_dist.config.load import validate
    from ot_dist.methods.registry import build_method
    from ot_dist.models.loading import load_model

    folder = resolve_resume(path, path, log=log, command="export")  # a damaged newer checkpoint is named
    state = read_trainer_state(folder)
    log(f"exporting step {state['step']} from {folder.resolve()}")
    config = validate(state["config"])  # the run's resolved config, validated like any other
    method = build_method(config)
    chosen = tuple(formats or method.formats)
    unknown = [f for f in chosen if f not in method.formats]
    if unknown:
        raise ConfigError(f"--format {unknown[0]}: a {config.method} checkpoint exports {', '.join(method.formats)}")
    if ema and not state["ema"]:
        raise ConfigError(f"--ema: checkpoint {folder} was trained without EMA (ema.enabled was false)")
    target = Path(out) if out else default_export_dir(folder)
    check_writable(target, "--out" if out else "export folder")  # before the model loads
    # in its files' dtype: the trained weights replace theirs in float32 (load_trained_weights), the frozen ones are
    # the files' values, which the export casts once, as training's export did
    model = load_model(config.model, in_files_dtype=True)
    method.prepare(model)
    trained = gather_full_from_files(SavedShards(folder), state["shapes"], kind="ema" if ema else "w")
    load_trained_weights(model, trained, folder)
    kwargs = {"formats": chosen} if config.method == "full" else {}
    # the run's start, as training dated its exports (checkpoints from before it was recorded: their save time)
    created = state.get("run_started_at") or state.get("saved_at")
    exported = method.export(model, target, suffix="_ema" if ema else "", created=created, **kwargs)
    for p in exported:
        log(f"exported {p}")
    return exported


def default_export_dir(folder: Path) -> Path:
    """RUN/exports/step-N beside RUN/checkpoints/step-N, wherever the run is now: never the output_dir recorded in
    the checkpoint (a copied or moved run would write into the original)."""
    folder = folder.resolve()
    run = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
    return run / "exports" / folder.name


@torch.no_grad()
def load_trained_weights(model, trained: dict[str, torch.Tensor], folder: Path) -> None:
    """Put the full trained tensors ("<part>.<parameter name>") into the freshly prepared model."""
    parts = model.parts()
    params = {f"{part}.{name}": p for part, module in parts.items() for name, p in module.named_parameters()}
    for name, value in trained.items():
        if name not in params:
            raise InputFileError(f"checkpoint {folder}: trained parameter {name} does not exist in the model the "
                                 "checkpoint's config loads (was model.path replaced?)")
        hold_as_float32(params[name], value.view(params[name].shape))
