"""OneTrainer's concepts (inline or in their concept file) as ot_dist's `data.concepts`, with their captions, tag
options, augmentations and cached variations, the validation interval of its validation concepts, and the latent
caching and crop settings that depend on what the concepts augment."""

from __future__ import annotations

import re
from pathlib import Path

from ot_dist.data.captions import CAPS_MODES, SPECIAL_TAG_FILES, special_patterns, special_tags
from ot_dist.data.concepts import caption_lines
from ot_dist.errors import ConfigError
from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import Imported, local_path, read_json


CONCEPT_TYPES = {"STANDARD": "standard", "VALIDATION": "validation", "PRIOR_PREDICTION": "prior_prediction"}


def import_concepts(ot: dict, c: dict, config_path: Path, concepts_path: str | None,
                    out: Imported) -> list[bool]:
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
        if concept["type"] == "PRIOR_PREDICTION" and c.get("method") != "lora":
            # OneTrainer stops at the first step there (its prior_model: "only available with LoRA training")
            out.not_honoured.append(f"{label}.type: PRIOR_PREDICTION trains towards the model without its LoRA; "
                                    f"OneTrainer has it for LORA only, this config trains {c.get('method')}: not "
                                    "imported")
            continue
        if concept["type"] not in CONCEPT_TYPES:
            out.not_honoured.append(f"{label}.type: {concept['type']} is not an ot_dist concept type; not imported")
            continue
        entry = {"path": local_path(concept["path"], f"{label}.path", out), "balancing": concept["balancing"],
                 "balancing_strategy": str(concept["balancing_strategy"]).lower()}
        if concept["type"] != "STANDARD":
            entry["type"] = CONCEPT_TYPES[concept["type"]]
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
            lines = caption_lines(prompt_file.read_text(encoding="utf-8")) if prompt_file.is_file() else [""]
            if lines != [""]:  # one line drawn per image and epoch, as OneTrainer draws one of the file's lines
                entry["caption_source"], entry["caption_text"] = "text", "\n".join(lines)
            elif prompt_file.is_file():
                out.not_honoured.append(f"{label}.text.prompt_path: {prompt_file} has no text (OneTrainer trains "
                                        "with an empty caption); captions from .txt files")
            else:
                out.not_honoured.append(f"{label}.text.prompt_path: {prompt_file} not found; captions from .txt files")
        _import_tag_options(text, entry, label, out)
        image = concept.get("image") or {}
        mapped = {"enable_random_flip": ("flip_probability", lambda: 0.5),  # OneTrainer flips half the time
                  "enable_random_rotate": ("rotation_degrees", lambda: image.get("random_rotate_max_angle", 0.0)),
                  "enable_random_brightness": ("brightness", lambda: image.get("random_brightness_max_strength", 0.0)),
                  "enable_random_contrast": ("contrast", lambda: image.get("random_contrast_max_strength", 0.0)),
                  "enable_random_saturation": ("saturation", lambda: image.get("random_saturation_max_strength", 0.0)),
                  # mgds RandomHue turns the hue by up to half its max strength (clamped to half a turn);
                  # ot_dist's `hue` is the turn itself
                  "enable_random_hue": ("hue", lambda: min(0.5, image.get("random_hue_max_strength", 0.0) / 2))}
        for key, off in defaults.CONCEPT_IMAGE_OFF.items():
            if image.get(key, off) == off:
                continue
            if key.startswith("enable_fixed_") and image.get(key.replace("_fixed_", "_random_")):
                continue  # mgds applies the fixed transform only when its random one is off
            if key in mapped:
                entry[mapped[key][0]] = mapped[key][1]()
            else:
                out.not_honoured.append(f"{label}.image.{key}: not supported (ot_dist's augmentations are random flip, "
                                        "rotation and colour jitter)")
        if concept["loss_weight"] != 1.0:
            entry["loss_weight"] = concept["loss_weight"]
        for key in ("image_variations", "text_variations"):  # the versions its latent / text cache holds
            if concept[key] != 1:
                entry[key] = max(1, int(concept[key]))
        converted.append(entry)
        if concept["type"] == "STANDARD":
            crop_jitter.append(bool(image.get("enable_crop_jitter", True)))
    if not any(e.get("type") != "validation" for e in converted):
        raise ConfigError("concepts: no enabled standard concept to import (ot_dist needs at least one image folder)")
    c.setdefault("data", {})["concepts"] = converted
    _validation(ot, c, out)
    return crop_jitter


def _import_tag_options(text: dict, entry: dict, label: str, out: Imported) -> None:
    """OneTrainer's tag shuffling, tag dropout (its modes and special tags) and caps options (mgds DropTags,
    CapitalizeTags, ShuffleTags), which ot_dist applies in the same order."""
    dropout = text.get("tag_dropout_enable") and text.get("tag_dropout_probability", 0.0) > 0
    caps = text.get("caps_randomize_enable") and text.get("caps_randomize_probability", 0.0) > 0
    if text.get("enable_tag_shuffling"):
        entry["tag_shuffling"] = True
    if text.get("enable_tag_shuffling") or dropout or caps:
        entry["tag_delimiter"] = text.get("tag_delimiter", ",") or ","
        entry["keep_tags_count"] = text.get("keep_tags_count", 1)
    if dropout:
        mode = text.get("tag_dropout_mode", "FULL")
        if mode in ("FULL", "RANDOM", "RANDOM WEIGHTED"):
            entry["tag_dropout_probability"] = text["tag_dropout_probability"]
            entry["tag_dropout_mode"] = mode.lower().replace(" ", "_")
            _import_special_tags(text, entry, label, out)
        else:  # mgds DropTags drops nothing in a mode it does not know
            out.not_honoured.append(f"{label}.text.tag_dropout_mode: {mode} is no OneTrainer mode (FULL, RANDOM, "
                                    "RANDOM WEIGHTED); OneTrainer drops no tag with it, nor does this config")
    if caps:
        modes = [m.strip() for m in str(text.get("caps_randomize_mode", "")).split(",")]
        known = [m for m in modes if m in CAPS_MODES]
        if known:
            entry["caps_randomize_probability"] = text["caps_randomize_probability"]
            entry["caps_randomize_mode"] = known
        if len(known) < len(modes):  # mgds leaves a tag as it is when it draws a name it does not know
            out.not_honoured.append(f"{label}.text.caps_randomize_mode: {', '.join(m for m in modes if m not in known)}"
                                    f" not among {', '.join(CAPS_MODES)} (OneTrainer leaves the tag as it is when it "
                                    "draws one); " + ("left out" if known else "caps randomisation not imported"))
    if text.get("caps_randomize_lowercase"):  # mgds CapitalizeTags lowercases even with randomisation off
        entry["lowercase_caption"] = True


def _import_special_tags(text: dict, entry: dict, label: str, out: Imported) -> None:
    """tag_dropout_special_tags: a .txt / .csv file when one is there, otherwise (as mgds DropTags reads it) tags
    split at the delimiter, written as a list so that a name ending in .txt stays a tag."""
    mode = str(text.get("tag_dropout_special_tags_mode", "NONE"))
    value = text.get("tag_dropout_special_tags", "") or ""
    if mode not in ("WHITELIST", "BLACKLIST"):
        return
    delimiter = entry["tag_delimiter"]
    if value.endswith(SPECIAL_TAG_FILES) and Path(local_path(value, f"{label}.text.tag_dropout_special_tags", out)).is_file():
        tags = local_path(value, f"{label}.text.tag_dropout_special_tags", out)
    else:
        tags = [t.strip() for t in value.split(delimiter) if t.strip()]
    if not tags:
        out.notes.append(f"{label}.text.tag_dropout_special_tags_mode: {mode} without special tags (OneTrainer drops "
                         "as without them)")
        return
    regex = bool(text.get("tag_dropout_special_tags_regex"))
    try:
        special_patterns(special_tags(tags, delimiter), regex)
    except re.error as err:
        out.not_honoured.append(f"{label}.text.tag_dropout_special_tags: {err.pattern!r} is no regular expression "
                                "(OneTrainer compares it as a plain tag); special tags not imported")
        return
    entry["tag_dropout_special_tags_mode"] = mode.lower()
    entry["tag_dropout_special_tags"] = tags
    if regex:
        entry["tag_dropout_special_tags_regex"] = True


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


def import_latent_caching(ot: dict, c: dict, inpainting: bool, crop_jitter: list[bool], out: Imported) -> None:
    """OneTrainer's latent_caching and the concepts' enable_crop_jitter: ot_dist caches a latent only when no step
    changes the image it encodes, so this is decided after the concepts (and listed after the other sections)."""
    skip = out.not_honoured.append
    from ot_dist.data.augment import AUGMENTATION_FIELDS

    # an augmenting concept with image_variations 1 would train one augmented version for ever in OneTrainer; ot_dist
    # refuses that, and encodes each step's augmented image instead. With more, the cache holds its versions.
    augmented = [e["path"] for e in c.get("data", {}).get("concepts", [])
                 if any(e.get(k) for k in AUGMENTATION_FIELDS) and e.get("image_variations", 1) == 1]
    if ot["latent_caching"] and augmented:
        out.notes.append(f"latent_caching: off, because {augmented[0]} augments its images with image_variations 1 "
                         "(OneTrainer caches one augmented version and trains it every epoch; ot_dist encodes each "
                         "step's augmented image; image_variations > 1 caches that many versions)")
    elif ot["latent_caching"] and inpainting:
        out.notes.append("latent_caching: off, because an inpainting model is trained (ot_dist encodes each step's "
                         "masked image, OneTrainer caches image_variations copies of it)")
    elif ot["latent_caching"]:
        c.setdefault("data", {})["cache_latents"] = True
    varied = [e["path"] for e in c.get("data", {}).get("concepts", []) if e.get("text_variations", 1) > 1]
    if varied:  # OneTrainer caches text beside the latents when the text encoders are frozen
        out.notes.append(f"text_variations: {varied[0]}'s versions of its captions are cached with data.cache_text, "
                         "which the import leaves off (set it with frozen text encoders)")
    if any(crop_jitter) and c["data"].get("cache_latents"):
        out.notes.append("enable_crop_jitter: the cached latents hold the centre crop (OneTrainer caches a randomly "
                         "cropped copy per image and image variation)")
    elif any(crop_jitter):  # OneTrainer's default: the crop offset drawn per epoch
        c["data"]["crop"] = "random"
        if not all(crop_jitter):
            skip("concepts[].image.enable_crop_jitter: off for some concepts; ot_dist's data.crop (random) is one "
                 "setting for all")
