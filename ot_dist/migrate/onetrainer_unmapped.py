"""OneTrainer's top-level settings that no other part of the import reads: those that change what trains are listed
when they differ from OneTrainer's default, the quantization filter becomes quantization.layer_filter, multi-GPU
training becomes strategy ddp, and the ones about OneTrainer's
own machinery (folders, TensorBoard, devices, its cloud runner) are left out on purpose (NO_EFFECT). In the nested
sections (parts, quantization, embeddings) a key config version 11 lacks is listed.

Source: OneTrainer modules/util/config/TrainConfig.py `default_values()` (config version 11): every top-level key is
read by the import, listed here, or named in NO_EFFECT (tests/test_import_onetrainer.py checks the last two against
each other and the import's files)."""

from __future__ import annotations

from ot_dist.migrate.onetrainer_optim import import_fused_reduce, import_reduce_precision

# key -> (OneTrainer's default, why ot_dist does not do it)
CHANGES_TRAINING = {
    "force_circular_padding": (False, "circular padding of the convolutions (tileable textures) is not supported"),
    "fallback_train_dtype": ("BFLOAT_16", "ot_dist has no second compute dtype for the layers float16 is unstable in"),
    "lora_decompose_norm_epsilon": (True, "ot_dist's DoRA (peft's) always adds the epsilon to the weight norm"),
    "lokr_dora_on_output": (True, "ot_dist's LoKr is peft's, with its own DoRA axis"),
    "lokr_vec_trick": (True, "ot_dist's LoKr is peft's (no vec-trick option)"),
    "sample_image_format": ("JPG", "ot_dist writes samples as PNG"),
}
# OneTrainer's `quantization` section: which layers of the quantized denoiser are quantized (and SVDQuant's options)
QUANTIZATION_DEFAULTS = {"layer_filter": "", "layer_filter_preset": "full", "layer_filter_regex": False,
                         "svd_dtype": "NONE", "svd_rank": 16, "cache_dir": None}
NO_EFFECT = frozenset({
    "debug_mode", "debug_dir", "workspace_dir", "cache_dir", "huggingface_cache_dir", "offline_mode", "tensorboard",
    "tensorboard_expose", "tensorboard_always_on", "tensorboard_port", "continue_last_backup", "prevent_overwrites",
    "include_train_config", "device_indexes", "fused_gradient_reduce", "async_offloading", "clear_cache_before_training",
    "dataloader_threads", "train_device", "temp_device", "enable_autocast_cache", "only_cache", "cloud",
    "sample_video_format", "sample_audio_format", "samples_to_tensorboard", "backup_before_save", "secrets", "frames",
})


def import_unmapped(ot: dict, c: dict, out) -> None:
    for key, (default, why) in CHANGES_TRAINING.items():
        if key in ot and ot[key] != default:
            out.not_honoured.append(f"{key}: {ot[key]}: {why}")
    _unknown_nested_keys(ot, out)
    _quantization(ot.get("quantization") or {}, c, out)
    if ot.get("multi_gpu"):
        c["strategy"] = "ddp"
        out.notes.append("multi_gpu: true -> strategy ddp (one process per GPU: launch with `ot-dist launch`, "
                         "torchrun or accelerate, docs/parallel.md)")
        import_reduce_precision(ot, c, out)
        if (c.get("optimizer") or {}).get("fused_back_pass"):
            import_fused_reduce(ot, c, out)


def _quantization(section: dict, c: dict, out) -> None:
    """OneTrainer's quantization filter (applied to the denoiser only, as its model loaders pass it) as
    quantization.layer_filter, where the denoiser is stored quantized; SVDQuant is listed."""
    from ot_dist.config.schema import QUANTIZED_STORAGE
    from ot_dist.migrate.onetrainer_layers import filter_patterns
    from ot_dist.models.families.registry import get_family

    section = {**QUANTIZATION_DEFAULTS, **section}
    if section["svd_dtype"] not in (None, "NONE"):
        out.not_honoured.append(f"quantization.svd_dtype: {section['svd_dtype']} (SVDQuant, rank {section['svd_rank']}: "
                                "a low-rank float correction beside the quantized weight) is not supported")
    patterns = filter_patterns(section["layer_filter"])
    if not any(patterns):
        return  # every layer, ot_dist's default
    denoiser = get_family(c["model"]["family"]).denoiser
    storage = c.get(denoiser, {}).get("weight_dtype") or c.get("weight_dtype", "float32")
    if storage in QUANTIZED_STORAGE:
        c["quantization"] = {"layer_filter": patterns, **({"layer_filter_regex": True}
                                                          if section["layer_filter_regex"] else {})}


def nested_sections(ot: dict):
    """(name, section, the keys OneTrainer's config version 11 has in it) of each nested section the file holds: the
    part sections, the quantization filter, the embedding and each additional embedding."""
    from ot_dist.migrate import onetrainer_defaults as defaults
    from ot_dist.migrate.onetrainer_common import PART_SECTIONS

    embedding = {*defaults.EMBEDDING, "uuid"}
    for name in PART_SECTIONS:
        yield name, ot.get(name), set(defaults.PART)
    yield "quantization", ot.get("quantization"), set(QUANTIZATION_DEFAULTS)
    yield "embedding", ot.get("embedding"), embedding
    for i, entry in enumerate(ot.get("additional_embeddings") or []):
        yield f"additional_embeddings[{i}]", entry, embedding


def _unknown_nested_keys(ot: dict, out) -> None:
    """A key OneTrainer's config version 11 does not have in a nested section (a newer OneTrainer's setting, or an
    edit by hand) is read by no part of the import: listed, never dropped without a word."""
    for name, section, known in nested_sections(ot):
        if isinstance(section, dict):
            for key in sorted(k for k in set(section) - known if not k.startswith("__")):
                out.not_honoured.append(f"{name}.{key}: {section[key]!r} is not a setting of OneTrainer's config "
                                        "version 11, which the import reads; it is not applied")
