"""OneTrainer's per-part sections (`unet` / `transformer` / `prior`, `text_encoder`..., `vae`, ...) as ot_dist's part
sections, its frozen storage (`weight_dtype`, `<part>.weight_dtype`, `vae_weight_dtype`), `trained_weight_dtype` and
`gradient_checkpointing`.

Since config version 9 OneTrainer stores the weight dtype of each part, and since version 11 its gradient
checkpointing; a preset names only what differs from TrainConfig's defaults, in which every part trains and the text
encoders stop after 30 epochs. ot_dist stores each frozen part as OneTrainer does; it has one dtype for the trained
weights, so trained parts that differ are listed with the dtype used instead."""

from __future__ import annotations

from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import local_path
from ot_dist.models.families.registry import get_family

DENOISERS = ("unet", "transformer", "prior")
# The frozen components besides the denoiser and text encoders, by ot_dist family (OneTrainer's model_parts()).
FROZEN_EXTRA = {"stable_cascade": ("effnet_encoder", "decoder", "decoder_vqgan"),
                "wuerstchen_v2": ("effnet_encoder", "decoder", "decoder_text_encoder", "decoder_vqgan"),
                "ideogram4": ("vae", "unconditional_transformer")}
STORAGE = {"FLOAT_32": "float32", "TFLOAT_32": "float32", "BFLOAT_16": "bfloat16", "FLOAT_16": "float16",
           "FLOAT_8": "float8", "NFLOAT_4": "nf4", "INT_W8A8": "int8"}
# The setups that read transformer.attention_mask (apply_attention_mask: FluxBaseSetup, BaseStableDiffusion3Setup,
# BaseHiDreamSetup, which zeroes T5's and Llama's outputs at the padding); Chroma and PixArt always mask, Z-Image
# always cuts each caption to its tokens, the others never read it
MASK_SWITCH_FAMILIES = ("flux", "sd3", "hidream")
# a tie between the frozen parts' dtypes: the more precise
WIDEST_FIRST = ("float32", "bfloat16", "float16", "int8", "float8", "nf4")
STORAGE_NAMES = {value: key for key, value in STORAGE.items() if key != "TFLOAT_32"}
# OneTrainer's other formats of the same size: float8 weights with float8 matmuls keep one byte per weight
NEAREST_STORAGE = {"FLOAT_W8A8": ("float8", "float8 weights computing in float8 matmuls")}
LATENT_ENCODERS = ("vae", "effnet_encoder")  # ot_dist's vae_weight_dtype


def part_settings(ot: dict, part: str) -> dict:
    """A part as OneTrainer reads it: TrainModelPartConfig's defaults, TrainConfig's for that part, the file's."""
    return {**defaults.PART, **defaults.PART_OVERRIDES.get(part, {}), **(ot.get(part) or {})}


def import_parts(ot: dict, c: dict, family: str, method: str, out) -> None:
    skip = out.not_honoured.append
    fam = get_family(family)
    parts = (fam.denoiser, *fam.text_encoders)  # OneTrainer's key of each is ot_dist's section name
    settings = {part: part_settings(ot, part) for part in (*parts, *FROZEN_EXTRA.get(family, ("vae",)))}
    trains, active = {}, {}
    for part in parts:
        entry = _train_entry(part, settings[part], method, skip)
        if entry:
            c[part] = entry
        active[part] = entry.get("train", False)
        trains[part] = active[part] and method == "full"
        if not settings[part]["include"]:
            skip(f"{part}.include: false (the model without its {part}) is not supported; it is loaded")
        if settings[part]["dropout_probability"]:
            skip(f"{part}.dropout_probability: {settings[part]['dropout_probability']} (OneTrainer drops this "
                 "encoder's output) is not supported; data.concepts[].caption_dropout_probability drops whole captions")
        if method == "embedding" and not settings[part]["train_embedding"] and part in fam.embedding_keys:
            skip(f"{part}.train_embedding: false: ot_dist trains the embedding in every encoder that takes one")
    for part, value in settings.items():
        if part == fam.denoiser and value["model_name"] and _denoiser_file(value["model_name"], fam, c, out):
            continue
        if value["model_name"] and not (part == "decoder" and family in FROZEN_EXTRA):
            skip(f"{part}.model_name: {value['model_name']} (a separately loaded {part}) is not supported"
                 + ("; put effnet_encoder.safetensors into model.path" if part == "effnet_encoder" else ""))
    guidance = settings[fam.denoiser]["guidance_scale"]
    if family in ("flux", "flux2", "hunyuan_video") and guidance != 1.0:  # the guidance-distilled transformers
        c["model"]["guidance_scale"] = guidance
    if settings[fam.denoiser]["attention_mask"] and family in MASK_SWITCH_FAMILIES:
        skip(f"{fam.denoiser}.attention_mask: true (masking the padded text tokens) is not supported for {family}")
    _storage_dtypes(settings, trains, c, skip, parts)
    _checkpointing(settings, active, trains, fam, c, out)


def _denoiser_file(name: str, fam, c: dict, out) -> bool:
    """OneTrainer's `transformer.model_name`: the transformer from that single file (diffusers' from_single_file with
    the base model's config), the other components from the base model. ot_dist's single-file loading does the same
    with model.path the file and model.config the base. Whether it was taken."""
    if not (fam.single_file and fam.denoiser == "transformer"):
        return False
    key = f"{fam.denoiser}.model_name"
    if name.startswith(("http://", "https://")):
        out.not_honoured.append(f"{key}: {name} is a URL (ot_dist does not download): download the file, then set "
                                "model.path to it; model.config stays the base model")
        return True
    base = c["model"]["path"]
    c["model"]["path"], c["model"]["config"] = local_path(name, key, out), base
    out.notes.append(f"{key}: {name} -> model.path (the transformer from that file), base_model_name -> model.config "
                     "(the other components, and the transformer's config)")
    return True


def _train_entry(part: str, settings: dict, method: str, skip) -> dict:
    """The part's section (LoRA trains adapters on the part, its own weights stay frozen)."""
    if method == "embedding":
        return {}  # OneTrainer's EMBEDDING trains the embedding only, whatever the parts' train flags say
    unit, after = settings["stop_training_after_unit"], settings["stop_training_after"]
    entry = {"train": bool(settings["train"]) and unit != "ALWAYS"}  # ALWAYS: stopped from the start
    if settings["learning_rate"] is not None:
        entry["learning_rate"] = settings["learning_rate"]
    if not entry["train"]:
        return entry
    if after is not None and unit in ("EPOCH", "STEP"):
        entry["stop_training_after"], entry["stop_training_after_unit"] = after, unit.lower()
    elif after is not None and unit != "NEVER":
        skip(f"{part}.stop_training_after_unit: {unit} (ot_dist counts epochs or steps)")
    return entry


def _storage_dtypes(settings: dict, trains: dict, c: dict, skip, parts: tuple[str, ...]) -> None:
    """OneTrainer's per-part weight dtypes as ot_dist's (`parts`: the denoiser first): weight_dtype is the frozen
    denoiser's (a LoRA's base), else the frozen parts' most common; the parts that differ get their own
    `<part>.weight_dtype` / vae_weight_dtype."""
    frozen = {}
    for part, s in settings.items():
        if trains.get(part):
            continue
        value = s["weight_dtype"]
        if value in STORAGE:
            frozen[part] = STORAGE[value]
        elif value in NEAREST_STORAGE:
            frozen[part], why = NEAREST_STORAGE[value]
            skip(f"{part}.weight_dtype: {value} ({why}) is not supported; stored as {frozen[part]}, as many bytes")
        else:
            skip(f"{part}.weight_dtype: {value} is not an ot_dist storage dtype ({', '.join(WIDEST_FIRST)}); "
                 "stored in weight_dtype")
    if frozen:
        counts = {d: list(frozen.values()).count(d) for d in WIDEST_FIRST}
        chosen = frozen.get(parts[0]) or max(WIDEST_FIRST, key=lambda d: (counts[d], -WIDEST_FIRST.index(d)))
        c["weight_dtype"] = chosen
        for part, value in frozen.items():
            if value == chosen:
                continue
            if part in LATENT_ENCODERS:
                c["vae_weight_dtype"] = value
            elif part in parts:
                c.setdefault(part, {})["weight_dtype"] = value
            else:  # a decoder stage loaded for samples
                skip(f"{part}.weight_dtype: {STORAGE_NAMES[value]}: ot_dist stores the modules it loads for samples "
                     f"in weight_dtype ({chosen})")
    trained = {part: settings[part]["weight_dtype"] for part, on in trains.items() if on}
    kinds = {STORAGE.get(value, value) for value in trained.values()}
    if kinds == {"bfloat16"} and c["train_dtype"] == "bfloat16":
        c["trained_weight_dtype"] = "bfloat16"
        return
    for part, value in trained.items():
        if STORAGE.get(value) == "float32":
            continue
        if value != "BFLOAT_16":
            why = "ot_dist trains float32 or bfloat16 weights"
        elif c["train_dtype"] != "bfloat16":
            why = "bfloat16 weights need train_dtype BFLOAT_16 in ot_dist"
        else:
            why = "ot_dist has one trained_weight_dtype and another trained part is float32"
        skip(f"{part}.weight_dtype: {value} (a trained part): {why}; float32 master weights instead")


def _checkpointing(settings: dict, active: dict, trains: dict, fam, c: dict, out) -> None:
    """One switch in ot_dist: the denoiser's (it backpropagates whenever anything trains); trained parts that
    differ are listed. OneTrainer's layer offloading: the frozen denoiser's as `<denoiser>.offload_fraction` (with
    gradient checkpointing, which it needs; a trained one needs the fused back pass too: import_optimizer), a frozen
    text encoder's as offload_frozen_components; the denoiser's activation offloading as activation_offloading; a
    text encoder's activation or layer offloading (trained) are listed."""
    skip, denoiser = out.not_honoured.append, fam.denoiser
    c["gradient_checkpointing"] = bool(settings[denoiser]["gradient_checkpointing"])
    for part, on in active.items():
        if on and part != denoiser and bool(settings[part]["gradient_checkpointing"]) != c["gradient_checkpointing"]:
            skip(f"{part}.gradient_checkpointing: {settings[part]['gradient_checkpointing']}: ot_dist's one "
                 f"gradient_checkpointing follows {denoiser}'s ({c['gradient_checkpointing']})")
    for part in active:
        fraction = settings[part]["offload_fraction"]
        if fraction and trains[part] and part != denoiser:
            skip(f"{part}.offload_fraction: {fraction}: the {part} trains; ot_dist streams the denoiser's blocks only "
                 "and keeps a text encoder that trains on the device")
        elif fraction and part == denoiser:  # frozen (a LoRA's base), or trained and stepped in backward
            c.setdefault(part, {})["offload_fraction"] = fraction
            if not c["gradient_checkpointing"]:
                c["gradient_checkpointing"] = True
                out.notes.append(f"{part}.offload_fraction: {fraction} needs gradient checkpointing in ot_dist: "
                                 "gradient_checkpointing: true is written")
        elif fraction and not active[part]:
            c["offload_frozen_components"] = True
            out.notes.append(f"{part}.offload_fraction: {fraction} -> offload_frozen_components: true (every frozen "
                             "text encoder and the VAE in CPU memory, moved to the device block by block)")
        elif fraction:
            skip(f"{part}.offload_fraction: {fraction}: a text encoder that trains stays on the device")
    for part in sorted(settings.keys() - active.keys() - set(LATENT_ENCODERS)):  # the modules only samples run
        fraction = settings[part]["offload_fraction"]
        if fraction and fam.sampling_modules_offloadable:
            c["offload_frozen_components"] = True
            out.notes.append(f"{part}.offload_fraction: {fraction} -> offload_frozen_components: true (it waits in "
                             "CPU memory with the frozen text encoders and the VAE, moved in block by block)")
        elif fraction:
            skip(f"{part}.offload_fraction: {fraction}: ot_dist keeps the modules only samples run on the device")
    offloaded = [p for p in active if settings[p]["activation_offloading"]]
    if denoiser in offloaded:  # the checkpointed blocks' inputs in CPU memory (ot_dist/train/activation_offload.py)
        c["activation_offloading"] = True
        if not c["gradient_checkpointing"]:
            c["gradient_checkpointing"] = True
            out.notes.append(f"{denoiser}.activation_offloading: true offloads what gradient checkpointing keeps: "
                             "gradient_checkpointing: true is written")
    others = [p for p in offloaded if p != denoiser]
    if others:
        skip(f"{', '.join(others)}: activation_offloading (gradient_checkpointing CPU_OFFLOADED before config "
             f"version 11): ot_dist offloads the {denoiser}'s checkpointed activations only; a text encoder's stay "
             "on the device")
