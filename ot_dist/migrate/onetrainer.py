"""`ot-dist import onetrainer CONFIG.json`: a OneTrainer training config (its JSON as the UI saves it, config versions
0-11, or a preset that stores only what differs from the defaults) as an ot_dist config that validates.

Every OneTrainer field either maps to an ot_dist key with the same meaning (ot_dist uses OneTrainer's names and
counts: optimizer and scheduler names, warmup in OneTrainer's steps, `stop_training_after`), or is listed with the
reason it is not honoured, in the written file and on stderr. Nothing is dropped without a line."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.onetrainer_layers import import_layer_filter
from ot_dist.migrate.onetrainer_parts import import_parts
from ot_dist.models.families.registry import get_family
from ot_dist.optim.registry import SCHEDULE_FREE

FAMILIES = {  # OneTrainer model_type -> (model.family, inpainting)
    "STABLE_DIFFUSION_15": ("sd1", False), "STABLE_DIFFUSION_15_INPAINTING": ("sd1", True),
    "STABLE_DIFFUSION_20": ("sd2", False), "STABLE_DIFFUSION_20_BASE": ("sd2", False),
    "STABLE_DIFFUSION_21": ("sd2", False), "STABLE_DIFFUSION_21_BASE": ("sd2", False),
    "STABLE_DIFFUSION_20_INPAINTING": ("sd2", True),
    "STABLE_DIFFUSION_XL_10_BASE": ("sdxl", False), "STABLE_DIFFUSION_XL_10_BASE_INPAINTING": ("sdxl", True),
    "STABLE_DIFFUSION_3": ("sd3", False), "STABLE_DIFFUSION_35": ("sd3", False),
    "FLUX_DEV_1": ("flux", False), "CHROMA_1": ("chroma", False),
    "PIXART_ALPHA": ("pixart_alpha", False), "PIXART_SIGMA": ("pixart_sigma", False),
    "STABLE_CASCADE_1": ("stable_cascade", False), "WUERSTCHEN_2": ("wuerstchen_v2", False),
}
METHODS = {"FINE_TUNE": "full", "LORA": "lora", "EMBEDDING": "embedding"}
DTYPES = {"FLOAT_32": "float32", "TFLOAT_32": "float32", "FLOAT_16": "float16", "BFLOAT_16": "bfloat16",
          "FLOAT_8": "float8"}
# Every part section OneTrainer has stored (TrainConfig's TrainModelPartConfig fields).
PART_SECTIONS = ("unet", "prior", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4",
                 "vae", "effnet_encoder", "decoder", "decoder_text_encoder", "decoder_vqgan")
TIMESTEP_DISTRIBUTIONS = {"UNIFORM": "uniform", "LOGIT_NORMAL": "logit_normal"}
MINUTES = {"SECOND": 1 / 60, "MINUTE": 1, "HOUR": 60}


@dataclass
class Imported:
    config: dict  # the raw ot_dist config
    not_honoured: list[str] = field(default_factory=list)  # "field: reason"
    notes: list[str] = field(default_factory=list)  # mapped, but worth knowing


WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def is_windows_path(value: str) -> bool:
    return os.name != "nt" and ("\\" in value or bool(WINDOWS_DRIVE.match(value)))


def local_path(value: str, key: str, out: Imported) -> str:
    """A path as this machine reads it. OneTrainer configs saved on Windows write backslashes: a relative path is
    converted; an absolute one (C:\\..., \\\\server\\...) names a file on that machine and is listed."""
    if not value or not is_windows_path(value):
        return value
    windows = PureWindowsPath(value)
    if windows.drive or windows.root:
        out.not_honoured.append(f"{key}: {value} is a Windows path; replace it with this machine's path")
        return value
    return windows.as_posix()


def read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"{what}: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputFileError(f"{what}: {path} is not JSON ({err})") from None


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


def import_onetrainer(path: str | Path, concepts_path: str | None = None, samples_path: str | None = None) -> Imported:
    path = Path(path)
    raw = read_json(path, "CONFIG")
    if not isinstance(raw, dict):
        raise InputFileError(f"CONFIG: {path} is not a OneTrainer training config (a JSON object)")
    version = raw.get("__version", 0)
    ot = {**defaults.TRAIN, **upgrade(raw)}
    out = Imported({})
    c = out.config
    skip = out.not_honoured.append

    model_type = ot["model_type"]
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type: {model_type} is not trained by ot_dist (it trains "
                          f"{', '.join(sorted(FAMILIES))})")
    family, inpainting = FAMILIES[model_type]
    if ot["training_method"] not in METHODS:
        raise ConfigError(f"training_method: {ot['training_method']} is not an ot_dist method (FINE_TUNE, LORA, "
                          "EMBEDDING)")
    method = METHODS[ot["training_method"]]
    c["model"] = {"family": family, "path": local_path(ot["base_model_name"], "base_model_name", out)}
    if inpainting:
        c["model"]["inpainting"] = True
    if "/" in c["model"]["path"] and not is_windows_path(c["model"]["path"]) and not Path(c["model"]["path"]).exists():
        out.notes.append(f"base_model_name: {c['model']['path']} is read as a local path; ot_dist does not download "
                         "(give a diffusers folder or a single file)")
    c["method"] = method
    destination = local_path(ot["output_model_destination"], "output_model_destination", out)
    destination = PureWindowsPath(destination) if is_windows_path(destination) else Path(destination)
    c["output_dir"] = str(destination.with_suffix(""))
    out.notes.append(f"output_model_destination: {destination} -> output_dir {c['output_dir']} (ot_dist writes "
                     "model/ + model.safetensors, lora.safetensors or embedding.safetensors inside it)")

    if not ot.get("aspect_ratio_bucketing", True):
        skip("aspect_ratio_bucketing: false (every image cropped square) is not supported: ot_dist always buckets by "
             "aspect ratio")
    c["resolution"] = _resolution(str(ot["resolution"]).replace(" ", ""), family, skip)
    for key in ("batch_size", "gradient_accumulation_steps", "epochs", "learning_rate", "clip_grad_norm"):
        c[key] = ot[key]
    c["train_dtype"] = _dtype(ot, "train_dtype", skip) or "float16"
    if ot["train_dtype"] == "TFLOAT_32":
        c["tf32"] = True
    c["output_dtype"] = _dtype(ot, "output_dtype", skip) or "float32"

    import_parts(ot, c, family, method, skip)
    _layer_skip(ot, c, family, skip)
    if family in ("stable_cascade", "wuerstchen_v2") and (ot.get("decoder") or {}).get("model_name"):
        c["model"]["decoder"] = local_path(ot["decoder"]["model_name"], "decoder.model_name", out)
    _optimizer(ot, c, skip)
    _scheduler(ot, c, skip)
    _ema(ot, c)
    _loss(ot, c, skip)
    if method == "lora":
        c["lora"] = {"rank": ot["lora_rank"], "alpha": ot["lora_alpha"], "dropout": ot["dropout_probability"]}
        import_layer_filter(ot, c["lora"], family, get_family(family).denoiser, out)
        _lora_variant(ot, c["lora"], skip)
        if ot.get("lora_weight_dtype") not in (None, "FLOAT_32"):
            skip(f"lora_weight_dtype: {ot['lora_weight_dtype']} (adapters train in float32) is not supported")
        if ot["lora_model_name"]:  # OneTrainer continues training this LoRA file
            if c["lora"].get("variant", "lora") == "lora":
                c["lora"]["init_from"] = local_path(ot["lora_model_name"], "lora_model_name", out)
            else:
                skip(f"lora_model_name: {ot['lora_model_name']}: ot_dist continues plain LoRA files only")
    if method == "embedding":
        _embedding(ot, c, skip)
    if ot.get("additional_embeddings"):
        skip("additional_embeddings: training extra embeddings beside a LoRA / finetune is not supported")

    crop_jitter = _concepts(ot, c, path, concepts_path, out)
    _samples(ot, c, path, samples_path, out)
    _saving(ot, c, skip)
    from ot_dist.data.augment import AUGMENTATION_FIELDS

    augmented = [e["path"] for e in c.get("data", {}).get("concepts", []) if any(e.get(k) for k in AUGMENTATION_FIELDS)]
    if ot["latent_caching"] and augmented:
        out.notes.append(f"latent_caching: off, because {augmented[0]} augments its images (OneTrainer caches "
                         "image_variations copies; ot_dist encodes each step's augmented image)")
    elif ot["latent_caching"] and inpainting:
        out.notes.append("latent_caching: off, because an inpainting model is trained (ot_dist encodes each step's "
                         "masked image, OneTrainer caches image_variations copies of it)")
    elif ot["latent_caching"]:
        c.setdefault("data", {})["cache_latents"] = True
    if any(crop_jitter) and c["data"].get("cache_latents"):
        out.notes.append("enable_crop_jitter: the cached latents hold the centre crop (OneTrainer caches one randomly "
                         "cropped copy per image)")
    elif any(crop_jitter):  # OneTrainer's default: the crop offset drawn per epoch
        c["data"]["crop"] = "random"
        if not all(crop_jitter):
            skip("concepts[].image.enable_crop_jitter: off for some concepts; ot_dist's data.crop (random) is one "
                 "setting for all")
    _scale_learning_rates(ot, c, out)
    c["mlflow"] = {"run_name": destination.stem}
    out.notes.insert(0, f"imported from {path.name} (OneTrainer config version {version})")
    return out


def _resolution(value: str, family: str, skip) -> int | list[int]:
    """OneTrainer's `resolution`: sides of square-area buckets ("512" or "512,768"), or one fixed size "WxH" (mgds'
    AspectBucketing) that every image is cropped to."""
    if "x" in value and "," not in value:
        width, height = (int(side) for side in value.split("x"))
        step = get_family(family).bucket_step
        side = max(step, round((width * height) ** 0.5 / step) * step)
        skip(f"resolution: {value} (every image cropped to {width}x{height}) is not supported: ot_dist buckets by "
             f"aspect ratio at the area of a {side} px square")
        return side
    try:
        resolutions = [int(r) for r in value.split(",") if r]
    except ValueError:
        raise ConfigError(f"resolution: {value!r} is not OneTrainer's '512', '512,768' or '768x512'") from None
    return resolutions[0] if len(resolutions) == 1 else resolutions


def _embedding(ot: dict, c: dict, skip) -> None:
    embedding = {**defaults.EMBEDDING, **(ot.get("embedding") or {})}
    c["embedding"] = {"token": embedding["placeholder"], "vectors": embedding["token_count"] or 1,
                      "init_text": embedding["initial_embedding_text"] or "*"}
    if ot["embedding_learning_rate"]:
        c["embedding"]["learning_rate"] = ot["embedding_learning_rate"]
    if embedding["token_count"] is None:  # OneTrainer's "auto": one vector per token of the initial text
        skip(f"embedding.token_count: null: OneTrainer makes one vector per token of "
             f"{embedding['initial_embedding_text']!r}; set embedding.vectors to that count (1 is written)")
    if embedding["model_name"]:
        skip(f"embedding.model_name: {embedding['model_name']} (continuing an existing embedding) is not supported; "
             "it starts from embedding.init_text")
    if embedding["stop_training_after"] is not None and embedding["stop_training_after_unit"] != "NEVER":
        skip(f"embedding.stop_training_after: {embedding['stop_training_after']} "
             f"{embedding['stop_training_after_unit']} is not supported (the embedding trains to the end)")
    if embedding["is_output_embedding"]:
        skip("embedding.is_output_embedding: true (an embedding of the text encoder's output) is not supported")
    if ot["preserve_embedding_norm"]:
        skip("preserve_embedding_norm: true is not supported")
    if ot["embedding_weight_dtype"] not in ("FLOAT_32", None):
        skip(f"embedding_weight_dtype: {ot['embedding_weight_dtype']} (the vectors train in float32) is not supported")


def _dtype(ot: dict, key: str, skip) -> str | None:
    value = ot.get(key)
    if value is None:
        return None
    if value not in DTYPES:
        skip(f"{key}: {value} is not an ot_dist dtype (float32, float16, bfloat16, float8); the default is used")
        return None
    if key in ("train_dtype", "output_dtype") and value == "FLOAT_8":
        skip(f"{key}: FLOAT_8 is a storage dtype in ot_dist (weight_dtype), not a {key}; the default is used")
        return None
    return DTYPES[value]


def _layer_skip(ot: dict, c: dict, family: str, skip) -> None:
    fam = get_family(family)
    for key in ("text_encoder_layer_skip", "text_encoder_2_layer_skip"):  # clip skip, OneTrainer's names
        if ot.get(key):
            if key.removesuffix("_layer_skip") in fam.layer_skip_encoders:
                c["model"][key] = ot[key]
            else:
                skip(f"{key}: {ot[key]}: {family} takes no layer skip for that encoder")
    for key in ("text_encoder_3_layer_skip", "text_encoder_4_layer_skip"):
        if ot.get(key):
            skip(f"{key}: {ot[key]}: {family} takes no layer skip for that encoder")


def _optimizer(ot: dict, c: dict, skip) -> None:
    from ot_dist.config.optim import OPTIMIZER_NAMES
    from ot_dist.optim.registry import SPECS

    settings = {**defaults.OPTIMIZER, **(ot.get("optimizer") or {})}
    name = settings.pop("optimizer")
    if name not in OPTIMIZER_NAMES:
        skip(f"optimizer: {name} is not in ot_dist's optimizer stack; ADAMW is written instead")
        c["optimizer"] = {"name": "ADAMW"}
        return
    options = {"name": name}
    lacking = defaults.OPTIMIZER_OPTIONS_NOT_IN_OT_DIST.get(name, {})
    for key, value in settings.items():
        if value is None or key.startswith("__"):
            continue
        if key in SPECS[name].defaults:
            options[key] = value
        elif key in lacking and value == lacking[key]:
            continue  # OneTrainer's default of an option ot_dist's implementation does not have: the same update
        elif key not in lacking and _unset_optimizer_option(key, value):
            continue  # a UI-saved section holds every optimizer's options; one this optimizer has not is unset
        else:
            skip(f"optimizer.{key}: {value!r} is not an option of ot_dist's {name}")
    c["optimizer"] = options


def _unset_optimizer_option(key: str, value) -> bool:
    """TrainOptimizerConfig's default value: None, False, {} or the few True ones."""
    return value is False or value == {} or (value is True and key in defaults.OPTIMIZER_UNSET_TRUE)  # 0.0 is set


def _scheduler(ot: dict, c: dict, skip) -> None:
    name = ot["learning_rate_scheduler"]
    warmup = ot["learning_rate_warmup_steps"]
    scheduler = {"name": name, "warmup_steps": int(warmup) if float(warmup).is_integer() and warmup > 1 else warmup}
    if name not in ("CONSTANT", "ADAFACTOR", "CUSTOM"):  # the decaying schedules take a floor
        scheduler["min_factor"] = ot["learning_rate_min_factor"]
    if "RESTARTS" in name:  # the only schedules with cycles (OneTrainer stores the field for all of them)
        scheduler["cycles"] = ot["learning_rate_cycles"]
    optimizer = c["optimizer"]["name"]
    if name == "ADAFACTOR" and not (optimizer == "ADAFACTOR" and c["optimizer"].get("relative_step")):
        # transformers' AdafactorSchedule only reports the step size: without Adafactor's relative steps it is the
        # learning rate, constant, and OneTrainer adds no warmup to it
        skip(f"learning_rate_scheduler: ADAFACTOR reports Adafactor's relative step size; with {optimizer}"
             f"{' relative_step false' if optimizer == 'ADAFACTOR' else ''} the learning rate stays constant: CONSTANT "
             "without warmup is written")
        scheduler = {"name": "CONSTANT", "warmup_steps": 0}
    elif name == "ADAFACTOR":
        scheduler["warmup_steps"] = 0  # Adafactor's schedule has its own warmup (optimizer.warmup_init)
    if optimizer in SCHEDULE_FREE:
        # OneTrainer forces a schedule-free optimizer's schedule to CONSTANT and gives SCHEDULE_FREE_ADAMW / _SGD the
        # warmup as their own, in optimizer steps (a fraction of 1 or less is then no warmup)
        if name != "CONSTANT":
            skip(f"learning_rate_scheduler: {name}: OneTrainer schedules {optimizer} constantly (CONSTANT is written)")
        own = optimizer != "PRODIGY_PLUS_SCHEDULE_FREE" and warmup > 1
        scheduler = {"name": "CONSTANT",
                     "warmup_steps": int(warmup) * c["gradient_accumulation_steps"] if own else 0}
    if name == "CUSTOM":
        scheduler["class_name"] = ot["custom_learning_rate_scheduler"]
        scheduler["params"] = {p["key"]: p["value"] for p in ot["scheduler_params"] or []}
        skip("custom_learning_rate_scheduler: importing a scheduler class runs its code; set scheduler."
             "allow_custom_code: true after reading it")
    c["scheduler"] = scheduler


def _scale_learning_rates(ot: dict, c: dict, out: Imported) -> None:
    """OneTrainer's learning_rate_scaler multiplies every parameter group's learning rate by sqrt(scale) (its
    NamedParameterGroup); the GLOBAL_ ones also count the GPUs, one here."""
    scaler = ot["learning_rate_scaler"]
    if scaler in (None, "NONE"):
        return
    batch, accumulation = c["batch_size"], c["gradient_accumulation_steps"]
    scale = {"BATCH": batch, "GLOBAL_BATCH": batch, "GRADIENT_ACCUMULATION": accumulation, "BOTH": batch * accumulation,
             "GLOBAL_BOTH": batch * accumulation}[scaler]
    factor = scale ** 0.5
    for section in (c, *(c.get(p) for p in PART_SECTIONS), c.get("embedding")):
        if section and section.get("learning_rate"):
            section["learning_rate"] = section["learning_rate"] * factor
    out.notes.append(f"learning_rate_scaler: {scaler}: the learning rates are multiplied by sqrt({scale})")
    if scaler.startswith("GLOBAL"):
        out.not_honoured.append(f"learning_rate_scaler: {scaler} also counts the GPUs: for N of them multiply the "
                                "learning rates by sqrt(N)")


def _ema(ot: dict, c: dict) -> None:
    if ot["ema"] == "OFF":
        return
    c["ema"] = {"enabled": True, "decay": ot["ema_decay"], "update_step_interval": ot["ema_update_step_interval"],
                "device": "cpu" if ot["ema"] == "CPU" else "accelerator"}


def _loss(ot: dict, c: dict, skip) -> None:
    from ot_dist.config.loss import LossConfig

    loss = {}
    if ot["offset_noise_weight"]:
        loss["offset_noise_weight"] = ot["offset_noise_weight"]
    if ot["generalized_offset_noise"]:
        _mapped_if_known(loss, LossConfig, "generalized_offset_noise", True, skip)
    if ot["perturbation_noise_weight"]:
        loss["input_perturbation"] = ot["perturbation_noise_weight"]
    _timesteps(ot, c, loss, skip)
    weight_fn, strength = ot["loss_weight_fn"], ot["loss_weight_strength"]
    if weight_fn == "MIN_SNR_GAMMA":
        loss["min_snr_gamma"] = strength
    elif weight_fn != "CONSTANT":
        _mapped_if_known(loss, LossConfig, "weight_fn", weight_fn, skip)
        if "weight_fn" in loss:
            loss["weight_strength"] = strength
    for key, off in (("mae_strength", 0.0), ("log_cosh_strength", 0.0), ("huber_strength", 0.0),
                     ("mse_strength", 1.0)):
        if ot.get(key, off) != off:
            skip(f"{key}: {ot[key]} (ot_dist trains with the MSE loss only)")
    if c["model"]["family"] in ("pixart_alpha", "pixart_sigma") and ot["vb_loss_strength"] != 1.0:
        loss["vb_loss_strength"] = ot["vb_loss_strength"]  # the learned-variance loss only PixArt has
    if ot["loss_scaler"] not in (None, "NONE"):
        skip(f"loss_scaler: {ot['loss_scaler']} is not supported")
    if ot["rescale_noise_scheduler_to_zero_terminal_snr"]:
        skip("rescale_noise_scheduler_to_zero_terminal_snr: true is not supported")
    for key, prediction in (("force_v_prediction", "v_prediction"), ("force_epsilon_prediction", "epsilon")):
        if ot[key] and c["model"]["family"] in ("sd1", "sd2", "sdxl", "pixart_alpha", "pixart_sigma"):
            c["model"]["prediction_type"] = prediction  # OneTrainer overrides the noise scheduler's the same way
        elif ot[key]:
            skip(f"{key}: true: {c['model']['family']} has a fixed target")
    if ot.get("custom_conditioning_image"):
        skip("custom_conditioning_image: true (an inpainting model's conditioning image from a file) is not supported")
    if loss:
        c["loss"] = loss
    if ot["masked_training"]:
        c["masked_training"] = {"enabled": True, "unmasked_probability": ot["unmasked_probability"],
                                "unmasked_weight": ot["unmasked_weight"],
                                "normalize_masked_area_loss": ot["normalize_masked_area_loss"]}
        prior = ot.get("masked_prior_preservation_weight") or 0.0
        if prior and c.get("method") == "lora":
            c["masked_training"]["prior_preservation_weight"] = prior
        elif prior:
            skip(f"masked_prior_preservation_weight: {prior}: OneTrainer uses it with LORA only (the prior is the "
                 "model without the LoRA)")


FLOW_FAMILIES = ("sd3", "flux", "chroma")  # shifted by OneTrainer's timestep_shift; Flux also dynamically


def _timesteps(ot: dict, c: dict, loss: dict, skip) -> None:
    """OneTrainer's draw: a continuous t in [N min_noising_strength, N max_noising_strength), floored (N: the
    scheduler's 1000 steps; 10000 for Würstchen / Stable Cascade's continuous time); LOGIT_NORMAL is
    sigmoid(N(noising_bias, noising_weight + 1)); then t is shifted by timestep_shift (Flux: by the resolution with
    dynamic_timestep_shifting; the DDPM / Würstchen setups ignore that switch)."""
    family = c["model"]["family"]
    distribution = ot["timestep_distribution"]
    if distribution in TIMESTEP_DISTRIBUTIONS:
        loss["timestep_distribution"] = TIMESTEP_DISTRIBUTIONS[distribution]
    else:
        skip(f"timestep_distribution: {distribution} (ot_dist draws uniform or logit_normal)")
    if distribution == "LOGIT_NORMAL" and (ot["noising_bias"] or ot["noising_weight"]):
        loss["logit_normal_mean"], loss["logit_normal_std"] = ot["noising_bias"], ot["noising_weight"] + 1.0
    steps = 10000 if family in ("stable_cascade", "wuerstchen_v2") else 1000
    if ot["min_noising_strength"] or ot["max_noising_strength"] < 1:
        loss["min_timestep"] = int(steps * ot["min_noising_strength"])
        loss["max_timestep"] = int(steps * ot["max_noising_strength"]) - 1  # ot_dist's bound is inclusive
    shift = ot["timestep_shift"]
    if family == "flux" and ot["dynamic_timestep_shifting"]:  # OneTrainer's SD3 / Chroma setups ignore it
        loss["dynamic_timestep_shifting"] = True  # and then ignore timestep_shift
    elif family in FLOW_FAMILIES:
        loss["timestep_shift"] = shift  # 1.0 included: unshifted, where the family's scheduler would shift
    elif shift != 1.0:  # DDPM and Würstchen's discretized continuous draw: 1.0 is unshifted there as ot_dist's auto
        loss["timestep_shift"] = shift


def _mapped_if_known(section: dict, model, key: str, value, skip) -> None:
    if key in model.model_fields:
        section[key] = value
    else:
        skip(f"{key}: {value} is not supported by this ot_dist version")


def _concepts(ot: dict, c: dict, config_path: Path, concepts_path: str | None, out: Imported) -> list[bool]:
    """Converts the concepts into c["data"]; returns each imported training concept's enable_crop_jitter."""
    concepts = ot["concepts"]
    if concepts is None or concepts_path:  # --concepts wins over concepts stored in the config
        file = Path(concepts_path or local_path(ot["concept_file_name"], "concept_file_name", out))
        if not file.is_absolute() and not file.exists():
            file = config_path.parent / file
        concepts = read_json(file, "--concepts" if concepts_path else "concept_file_name")
    converted, crop_jitter = [], []
    for i, concept in enumerate(concepts):
        concept = {**defaults.CONCEPT, **_upgrade_concept(concept)}
        label = f"concepts[{i}] ({concept['name'] or concept['path']})"
        if not concept["enabled"]:
            out.notes.append(f"{label}: disabled in OneTrainer, not imported")
            continue
        if concept["type"] not in ("STANDARD", "VALIDATION"):
            out.not_honoured.append(f"{label}.type: {concept['type']} (the base model's prediction as the target) is "
                                    "not supported; not imported (type prior_preservation trains class images with "
                                    "their loss_weight, DreamBooth's way)")
            continue
        entry = {"path": local_path(concept["path"], f"{label}.path", out), "balancing": concept["balancing"],
                 "balancing_strategy": str(concept["balancing_strategy"]).lower()}
        if concept["type"] == "VALIDATION":
            entry["type"] = "validation"
        if concept["name"]:
            entry["name"] = concept["name"]
        if concept["include_subdirectories"]:
            entry["include_subdirectories"] = True
        text = {**defaults.CONCEPT_TEXT, **(concept.get("text") or {})}
        source = text["prompt_source"]
        if source == "sample":
            entry["caption_source"] = "txt"
        elif source == "filename":
            entry["caption_source"] = "filename"
        elif source == "concept":
            prompt_file = Path(local_path(text["prompt_path"], f"{label}.text.prompt_path", out))
            if prompt_file.is_file():
                lines = [line.strip() for line in prompt_file.read_text(encoding="utf-8").splitlines() if line.strip()]
                entry["caption_source"], entry["caption_text"] = "text", lines[0] if lines else ""
                if len(lines) > 1:
                    out.not_honoured.append(f"{label}.text.prompt_path: {len(lines)} lines, drawn per step in "
                                            "OneTrainer; the first is used for every image")
            else:
                out.not_honoured.append(f"{label}.text.prompt_path: {prompt_file} not found; captions from .txt files")
        if text.get("enable_tag_shuffling"):
            entry["tag_shuffling"] = True
        if text.get("enable_tag_shuffling") or text.get("tag_dropout_enable"):
            entry["tag_delimiter"] = text.get("tag_delimiter", ",") or ","
            entry["keep_tags_count"] = text.get("keep_tags_count", 1)
        if text.get("tag_dropout_enable"):
            mode = text.get("tag_dropout_mode", "FULL")
            if mode in ("FULL", "RANDOM") and text.get("tag_dropout_special_tags_mode", "NONE") == "NONE":
                entry["tag_dropout_probability"] = text.get("tag_dropout_probability", 0.0)
                entry["tag_dropout_mode"] = mode.lower()
            else:
                out.not_honoured.append(f"{label}.text.tag_dropout_mode: {mode} / special tags (ot_dist has "
                                        "OneTrainer's FULL and RANDOM modes, without special tags)")
        if text.get("caps_randomize_enable"):
            out.not_honoured.append(f"{label}.text.caps_randomize_enable: caps randomisation is not supported")
        image = concept.get("image") or {}
        mapped = {"enable_random_flip": ("flip_probability", lambda: 0.5),  # OneTrainer flips half the time
                  "enable_random_rotate": ("rotation_degrees", lambda: image.get("random_rotate_max_angle", 0.0)),
                  "enable_random_brightness": ("brightness", lambda: image.get("random_brightness_max_strength", 0.0)),
                  "enable_random_contrast": ("contrast", lambda: image.get("random_contrast_max_strength", 0.0)),
                  "enable_random_saturation": ("saturation", lambda: image.get("random_saturation_max_strength", 0.0)),
                  "enable_random_hue": ("hue", lambda: image.get("random_hue_max_strength", 0.0))}
        for key, off in defaults.CONCEPT_IMAGE_OFF.items():
            if image.get(key, off) == off:
                continue
            if key in mapped:
                entry[mapped[key][0]] = mapped[key][1]()
            else:
                out.not_honoured.append(f"{label}.image.{key}: not supported (ot_dist's augmentations are random flip, "
                                        "rotation and colour jitter)")
        if concept["loss_weight"] != 1.0:
            entry["loss_weight"] = concept["loss_weight"]
        for key in ("image_variations", "text_variations"):
            if concept[key] != 1:
                out.not_honoured.append(f"{label}.{key}: {concept[key]} cached variations are not supported")
        converted.append(entry)
        if concept["type"] == "STANDARD":
            crop_jitter.append(bool(image.get("enable_crop_jitter", True)))
    if not any(e.get("type") != "validation" for e in converted):
        raise ConfigError("concepts: no enabled standard concept to import (ot_dist needs at least one image folder)")
    c.setdefault("data", {})["concepts"] = converted
    _validation(ot, c, out)
    return crop_jitter


def _upgrade_concept(concept: dict) -> dict:
    """ConceptConfig's migrations: `repeats` became `balancing` (version 1), `validation_concept` `type` (2)."""
    concept = dict(concept)
    if "repeats" in concept:
        concept.setdefault("balancing", concept.pop("repeats"))
    if "validation_concept" in concept:
        validation = concept.pop("validation_concept")
        concept.setdefault("type", "VALIDATION" if validation else "STANDARD")
    return concept


def _validation(ot: dict, c: dict, out: Imported) -> None:
    """OneTrainer's validation / validate_after / validate_after_unit: the interval of the validation loss."""
    if not ot.get("validation") or not any(e.get("type") == "validation" for e in c["data"]["concepts"]):
        return
    every, unit = ot.get("validate_after", 1), str(ot.get("validate_after_unit", "EPOCH"))
    if unit in ("STEP", "EPOCH") and float(every).is_integer() and every >= 1:
        key = "every_n_steps" if unit == "STEP" else "every_n_epochs"
        c["validation"] = {key: int(every)} | ({"every_n_epochs": None} if unit == "STEP" else {})
    else:
        out.not_honoured.append(f"validate_after: {every} {unit}: ot_dist validates every N steps or epochs; "
                                "validation.every_n_epochs 1 is used")


def _samples(ot: dict, c: dict, config_path: Path, samples_path: str | None, out: Imported) -> None:
    samples = ot["samples"]
    if samples is None or samples_path:  # --samples wins over samples stored in the config
        file = Path(samples_path or local_path(ot["sample_definition_file_name"], "sample_definition_file_name", out))
        if not file.is_absolute() and not file.exists():
            file = config_path.parent / file
        if not file.exists():
            if samples_path:
                raise InputFileError(f"--samples: {file} does not exist")
            return  # OneTrainer's default samples file is optional too
        samples = read_json(file, "--samples" if samples_path else "sample_definition_file_name")
    family = c["model"]["family"]
    prompts, samplers = [], []
    for i, sample in enumerate(samples):
        sample = {**defaults.SAMPLE, **defaults.SAMPLE_BY_FAMILY.get(family, {}), **sample}
        if not sample["enabled"]:
            continue
        if not sample["prompt"].strip():
            out.not_honoured.append(f"samples[{i}]: an empty prompt is not sampled by ot_dist")
            continue
        if sample["random_seed"]:
            out.not_honoured.append(f"samples[{i}].random_seed: true: ot_dist samples with a fixed seed "
                                    f"({sample['seed']}), the same image for the same weights")
        prompts.append({"prompt": sample["prompt"], "negative_prompt": sample["negative_prompt"] or "",
                        "seed": sample["seed"], "width": sample["width"], "height": sample["height"],
                        "steps": sample["diffusion_steps"], "guidance_scale": sample["cfg_scale"]})
        samplers.append(str(sample["noise_scheduler"]))
    if prompts and family in SAMPLERS_FROM_NOISE_SCHEDULER:  # the others sample with their own scheduler only
        _sampler(samplers, c, out)
    if not prompts:
        return
    sampling = {"prompts": prompts}
    unit, every = ot["sample_after_unit"], ot["sample_after"]
    if unit == "STEP":
        sampling["every_n_steps"] = every
    elif unit == "EPOCH":
        sampling["every_n_epochs"] = every
    elif unit != "NEVER":
        out.not_honoured.append(f"sample_after_unit: {unit} (ot_dist samples every N steps or epochs, and at the end)")
    c["sampling"] = {**c.get("sampling", {}), **sampling}


SAMPLERS_FROM_NOISE_SCHEDULER = ("sd1", "sd2", "sdxl", "pixart_alpha", "pixart_sigma")
NOISE_SCHEDULERS = {"DDIM": "ddim", "EULER": "euler", "EULER_A": "euler_a", "DPMPP": "dpmpp_2m", "UNIPC": "unipc"}


def _sampler(samplers: list[str], c: dict, out: Imported) -> None:
    """OneTrainer's per-sample noise_scheduler; ot_dist has one sampling.sampler (the first sample's)."""
    first = samplers[0]
    if first in NOISE_SCHEDULERS:
        c["sampling"] = {"sampler": NOISE_SCHEDULERS[first]}
    else:
        out.not_honoured.append(f"samples[].noise_scheduler: {first} is not an ot_dist sampler (ddim, euler, euler_a, "
                                "dpmpp_2m, unipc); the model's own scheduler samples")
    if len(set(samplers)) > 1:
        out.not_honoured.append(f"samples[].noise_scheduler: {', '.join(sorted(set(samplers)))}: ot_dist samples every "
                                f"prompt with one sampler, the first's ({first})")


def _saving(ot: dict, c: dict, skip) -> None:
    """OneTrainer writes two things on a clock: backups (resumable; backup_after, default every 30 minutes, all kept
    unless rolling_backup keeps rolling_backup_count) and saves (the model, save_every, all kept). ot_dist writes
    resumable checkpoints (`ot-dist export` makes the model files of any of them): one interval of each kind, and a
    save interval keeps every checkpoint."""
    checkpoint = {}
    intervals = (("save_every", ot["save_every_unit"], ot["save_every"]),
                 ("backup_after", ot["backup_after_unit"], ot["backup_after"]))
    for key, unit, every in intervals:
        if unit == "NEVER" or not every:
            continue
        if unit in MINUTES:
            setting, value = "every_n_minutes", every * MINUTES[unit]
        elif unit in ("STEP", "EPOCH"):
            setting, value = f"every_n_{unit.lower()}s", int(every)
        else:
            skip(f"{key}_unit: {unit} is not supported")
            continue
        if setting in checkpoint and checkpoint[setting] != value:
            skip(f"{key}: {every} {unit}: ot_dist has one {setting}; the save interval ({checkpoint[setting]}) is used")
            continue
        checkpoint[setting] = value
    if "every_n_minutes" not in checkpoint:
        checkpoint["every_n_minutes"] = None  # no time-based backups (ot_dist's default is 30 minutes)
    saves = ot["save_every_unit"] != "NEVER" and ot["save_every"]
    checkpoint["keep_last"] = ot["rolling_backup_count"] if ot["rolling_backup"] and not saves else None
    for key in ("save_skip_first", "save_filename_prefix"):
        if ot.get(key):
            skip(f"{key}: {ot[key]!r} is not supported")
    c["checkpoint"] = checkpoint


PEFT_VARIANTS = {"LORA": "lora", "LOHA": "loha", "LOKR": "lokr"}
# TrainConfig's LoKr options (lokr_vec_trick only changes how OneTrainer computes the same product).
LOKR_DEFAULTS = {"lokr_dim": 16, "lokr_decompose_both": False, "lokr_decompose_factor": -1, "lokr_use_tucker": False,
                 "lokr_weight_decompose": False, "lokr_full_matrix": False}


def _lora_variant(ot: dict, lora: dict, skip) -> None:
    """OneTrainer's peft_type / lora_decompose as lora.variant. ot_dist's DoRA (peft's) decomposes on the output
    axis: OneTrainer's default input-axis DoRA is another adapter, so it is listed, and plain LoRA trains instead."""
    peft_type = str(ot.get("peft_type") or "LORA")
    if peft_type not in PEFT_VARIANTS:
        skip(f"peft_type: {peft_type} has no ot_dist variant (lora, dora, loha, lokr); plain LoRA instead")
        return
    variant = PEFT_VARIANTS[peft_type]
    if ot.get("lora_decompose"):
        if variant != "lora":
            skip(f"lora_decompose: DoRA on {peft_type} is not supported ({variant} without it)")
        elif not ot.get("lora_decompose_output_axis"):
            skip("lora_decompose: OneTrainer's DoRA on the input axis (lora_decompose_output_axis false); ot_dist's "
                 "DoRA (peft's) decomposes on the output axis: plain LoRA instead, or set lora.variant: dora")
        else:
            variant = "dora"
    if variant != "lora":
        lora["variant"] = variant
        if variant in ("loha", "lokr") and lora.get("dropout"):
            skip(f"dropout_probability: {lora['dropout']} (peft's {variant} has no input dropout); 0 instead")
            lora["dropout"] = 0.0
    if variant == "lokr":
        lora["rank"] = ot.get("lokr_dim", LOKR_DEFAULTS["lokr_dim"])  # OneTrainer's LoKr rank; lora_rank is not read
        for key, default in LOKR_DEFAULTS.items():
            if key != "lokr_dim" and ot.get(key, default) != default:
                skip(f"{key}: {ot[key]} is not an option of ot_dist's lokr (peft's LoKr: factor -1, w1 whole, no "
                     "Tucker, no weight decomposition)")
