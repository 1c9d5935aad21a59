"""OneTrainer's own migrations of its training config, so the import reads every config version (0-11) in the newest
layout. Apart from the mapping because they are OneTrainer's history, not ot_dist's meaning: each step mirrors one
of OneTrainer's version upgrades of the fields the import reads."""

from __future__ import annotations

from ot_dist.migrate.onetrainer_common import PART_SECTIONS


def upgrade(data: dict) -> dict:
    """OneTrainer's own migrations of the fields read here, keyed on the old fields being there (a built-in preset has
    no `__version` and is the newest layout): the flat keys of versions 0-1, version 2's min_snr_gamma, version 3's
    noising_weight, the renames of 5 and 7, version 8's prior -> transformer, and the global weight_dtype (version 9)
    and gradient_checkpointing (version 10) fanned out to the parts."""
    data = dict(data)
    version = data.get("__version", 0)  # absent: version 0, or a built-in preset (then no old field is there)
    if isinstance(data.get("optimizer"), str):  # version 0: optimizer_<option> keys beside the optimizer's name
        options = {key.removeprefix("optimizer_"): data.pop(key) for key in list(data)
                   if key.startswith("optimizer_") and key != "optimizer_defaults"}
        data["optimizer"] = {"optimizer": data["optimizer"], **options}
    for part in ("unet", "prior", "text_encoder", "text_encoder_2", "vae", "effnet_encoder", "decoder",
                 "decoder_text_encoder", "decoder_vqgan"):
        nested = dict(data.get(part) or {})
        for flat, key in ((f"train_{part}", "train"), (f"{part}_learning_rate", "learning_rate"),
                          (f"{part}_weight_dtype", "weight_dtype"), (f"{part}_model_name", "model_name")):
            if flat in data:
                nested[key] = data.pop(flat)
        if f"train_{part}_epochs" in data:
            nested["stop_training_after"], nested["stop_training_after_unit"] = data.pop(f"train_{part}_epochs"), "EPOCH"
        if nested:
            data[part] = nested
    if "min_snr_gamma" in data:  # version 2
        gamma = data.pop("min_snr_gamma")
        if gamma:
            data["loss_weight_fn"], data["loss_weight_strength"] = "MIN_SNR_GAMMA", gamma
    if version < 3 and "noising_weight" in data and "timestep_distribution" not in data:  # 3: a weight was a sigmoid
        weight = data["noising_weight"]
        data["timestep_distribution"] = "SIGMOID" if weight else "UNIFORM"
        data["noising_bias"] = data.get("noising_bias", 0.5) - 0.5 if weight else 0.0
    if isinstance(data.get("gradient_checkpointing"), bool):  # version 4
        data["gradient_checkpointing"] = "ON" if data["gradient_checkpointing"] else "OFF"
    for old, new in (("save_after", "save_every"), ("save_after_unit", "save_every_unit"),  # version 5
                     ("lora_layers", "layer_filter"), ("lora_layer_preset", "layer_filter_preset")):  # version 7
        if old in data:
            data[new] = data.pop(old)
    if data.get("layer_filter_preset", "") is None:  # version 6: an old bug saved None
        data["layer_filter_preset"] = "full"
    if version < 8 and "prior" in data and "transformer" not in data and data.get("model_type") not in (
            "STABLE_CASCADE_1", "WUERSTCHEN_2"):
        data["transformer"] = data["prior"]  # version 8: the transformer models kept their settings in `prior`
    parts = [p for p in PART_SECTIONS if isinstance(data.get(p), dict)]
    if "weight_dtype" in data:  # version 9: NONE in a part meant the global weight dtype
        global_dtype = data.pop("weight_dtype")
        for p in parts:
            if data[p].get("weight_dtype") == "NONE":
                data[p] = {**data[p], "weight_dtype": global_dtype}
    if "gradient_checkpointing" in data:  # version 10: one setting for every part
        mode = data.pop("gradient_checkpointing")
        offloaded = mode == "CPU_OFFLOADED"
        per_part = {"gradient_checkpointing": mode != "OFF",
                    "activation_offloading": offloaded and data.pop("enable_activation_offloading", True),
                    "offload_fraction": data.pop("layer_offload_fraction", 0.0) if offloaded else 0.0}
        data.update({p: {**(data.get(p) or {}), **per_part} for p in PART_SECTIONS})
    return data
