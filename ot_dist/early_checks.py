"""Checks of a config against the machine, before anything expensive: the model and data paths exist, and
choices that run but cannot do what the user wants are named. `ot-dist config check` runs them, and training
runs them before it builds shards or loads a model. Paths are shown resolved (absolute), as the process sees
them: a relative path is read from the working folder, which is rarely the config's folder."""

from __future__ import annotations

from pathlib import Path

from ot_dist.errors import InputFileError

SHARDING_STRATEGIES = ("fsdp", "zero1", "zero2", "zero3")


def shown(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def check_input_paths(config) -> None:
    """model.path (and model.config when it is a folder) and the image folders exist."""
    model = shown(config.model.path)
    if not model.exists():
        raise InputFileError(f"model.path: {model} does not exist (expected a diffusers folder or a .safetensors file)")
    if model.is_file() and config.model.config is not None:
        folder = config.model.config
        looks_like_repo_id = folder.count("/") == 1 and not folder.startswith((".", "/", "~"))
        if not shown(folder).is_dir() and not looks_like_repo_id:
            raise InputFileError(f"model.config: {shown(folder)} is not a folder (a diffusers-format model folder "
                                 "whose component configs describe the single file's architecture)")
    if config.model.component_files:  # each file exists and holds its component (its header against the config)
        from ot_dist.models.families.component_files import check_component_files
        from ot_dist.models.families.registry import get_family

        check_component_files(get_family(config.model.family), config.model)
    init_from = getattr(config.lora, "init_from", None) if config.method == "lora" else None
    if init_from and not shown(init_from).is_file():
        raise InputFileError(f"lora.init_from: {shown(init_from)} is not a file (a LoRA .safetensors to start from)")
    embedding_from = config.embedding.init_from if config.method == "embedding" else None
    if embedding_from and not shown(embedding_from).is_file():
        raise InputFileError(f"embedding.init_from: {shown(embedding_from)} is not a file (an embedding .safetensors "
                             "to start from)")
    for label, concept in config.data.concept_list():
        if not shown(concept.path).is_dir():
            raise InputFileError(f"{label}: {shown(concept.path)} is not a folder")
    if not config.data.concept_list() and config.data.shards and not shown(config.data.shards).is_dir():
        raise InputFileError(f"data.shards: {shown(config.data.shards)} is not a folder (build it: "
                             "ot-dist shard build CONFIG)")
    # Folders the shard build writes: a file in the way would be a traceback after the images were read.
    for key, folder in (("data.shards", config.data.shards if config.data.concept_list() else None),
                        ("data.cache_dir", config.data.cache_dir)):
        if folder and (blocker := file_in_the_way(shown(folder))) is not None:
            what = "is not a folder" if blocker == shown(folder) else f"cannot be created: {blocker} is not a folder"
            raise InputFileError(f"{key}: {shown(folder)} {what}")


def file_in_the_way(folder: Path) -> Path | None:
    """The path (`folder` itself or its nearest existing parent) that is not a folder, so that `folder` cannot be
    made; None when it can (nothing is created here)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return None if existing.is_dir() else existing


def setup_warnings(config, world_size: int) -> list[str]:
    """Choices that run but do not do what they are for."""
    warnings = []
    if config.strategy in SHARDING_STRATEGIES and world_size == 1:
        warnings.append(
            f"strategy: {config.strategy} on one process shards nothing (one rank holds every shard): it costs the "
            "sharding's gathers and saves no memory; use strategy single, or launch several processes "
            "(ot-dist launch --nproc-per-node N)")
    if config.loss.scaler in ("BATCH", "BOTH") and world_size > 1:
        warnings.append(
            f"loss.scaler: {config.loss.scaler} multiplies the loss by the per-process batch_size (OneTrainer's "
            "rule), so the same global batch trains with another step on another number of processes; "
            f"GLOBAL_{config.loss.scaler} multiplies by the global batch and trains the same at any world size")
    return warnings
