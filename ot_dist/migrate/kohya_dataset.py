"""kohya's dataset (the `--dataset_config` TOML: [general], [[datasets]], [[datasets.subsets]]; or the DreamBooth
folders of `--train_data_dir` / `--reg_data_dir`, `<repeats>_<class tokens>` each) as ot_dist's `data.concepts`,
resolution, batch size and bucket step.

A subset's setting comes from the subset, else its dataset, else [general], else the training arguments, else
kohya's default (config_util's fallbacks). Captions: kohya reads the first line of `<image><caption_extension>`
(default .caption) and, for an image without one, the subset's class_tokens (or an empty caption); the folders are
read here to choose ot_dist's caption source. Regularisation subsets (is_reg) are ot_dist's prior_preservation
concepts, weighted by prior_loss_weight; kohya repeats them to as many samples per epoch as the training subsets
give (images x repeats)."""

from __future__ import annotations

from pathlib import Path

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import Imported, local_path, read_toml
from ot_dist.migrate.kohya_args import KohyaArgs
from ot_dist.migrate.kohya_defaults import ARGS
from ot_dist.migrate.kohya_metadata import finetuning_concept

# The dataset and subset keys kohya's config_util reads, with the defaults of its *Params dataclasses where they are
# not the training arguments' (argparse names differ for two: train_batch_size, dataset_repeats).
DATASET_DEFAULTS = {"resolution": None, "batch_size": 1, "enable_bucket": False, "min_bucket_reso": 256,
                    "max_bucket_reso": 1024, "bucket_reso_steps": 64, "bucket_no_upscale": False,
                    "network_multiplier": 1.0, "validation_split": 0.0, "validation_seed": None,
                    "resize_interpolation": None}
SUBSET_DEFAULTS = {"image_dir": None, "num_repeats": 1, "is_reg": False, "class_tokens": None,
                   "caption_extension": ".caption", "shuffle_caption": False, "caption_separator": ",",
                   "keep_tokens": 0, "keep_tokens_separator": None, "secondary_separator": None,
                   "enable_wildcard": False, "color_aug": False, "flip_aug": False, "face_crop_aug_range": None,
                   "random_crop": False, "caption_prefix": None, "caption_suffix": None, "caption_dropout_rate": 0.0,
                   "caption_dropout_every_n_epochs": 0, "caption_tag_dropout_rate": 0.0, "token_warmup_min": 1,
                   "token_warmup_step": 0, "custom_attributes": None, "cache_info": False, "alpha_mask": False,
                   "metadata_file": None, "conditioning_data_dir": None}
ARGPARSE_NAMES = {"batch_size": "train_batch_size", "num_repeats": "dataset_repeats"}
# Subset settings that change the samples and that ot_dist has no counterpart for, with what they do in kohya.
UNSUPPORTED = {
    "color_aug": "a hue shift of up to 8/180 or a gamma in [0.95, 1.05], a third of the time",
    "face_crop_aug_range": "crops around a face",
    "token_warmup_step": "captions that grow over the first steps", "token_warmup_min": "captions that grow",
    "alpha_mask": "the image's alpha as the loss mask", "custom_attributes": "custom attributes",
    "conditioning_data_dir": "conditioning images",
    "resize_interpolation": "the resize filter", "validation_split": "a validation split",
    "network_multiplier": "a LoRA multiplier per dataset", "bucket_no_upscale": "small images kept small (ot_dist "
    "scales every image to cover its bucket)",
}


class Lookup:
    """One subset's settings through kohya's fallbacks: subset, dataset, [general], training arguments, default."""

    def __init__(self, args: KohyaArgs, general: dict, dataset: dict, subset: dict):
        self.args, self.chain = args, (subset, dataset, general)

    def __getitem__(self, key: str):
        for level in self.chain:
            if key in level:
                return level[key]
        name = ARGPARSE_NAMES.get(key, key)
        if name in ARGS:
            return self.args[name]
        return {**DATASET_DEFAULTS, **SUBSET_DEFAULTS}[key]


def import_dataset(args: KohyaArgs, c: dict, family: str, dataset_config: str | None, out: Imported,
                   captions_folder: str | None = None) -> None:
    skip = out.not_honoured.append
    path = args["dataset_config"]  # read either way: an option given here wins over it
    path = dataset_config or path
    if path:
        toml = read_toml(Path(local_path(str(path), "dataset_config", out)), "dataset_config")
        general = toml.get("general", {})
        datasets = toml.get("datasets") or []
        for key in ("train_data_dir", "reg_data_dir", "in_json"):
            if args[key]:
                out.notes.append(f"{key}: ignored, as kohya ignores it when dataset_config is given")
    elif args["in_json"]:  # kohya's fine-tuning dataset: one subset, its images under train_data_dir
        general, datasets = {}, [{"subsets": [{"image_dir": args["train_data_dir"], "metadata_file": args["in_json"]}]}]
        if args["reg_data_dir"]:
            out.not_honoured.append("reg_data_dir: kohya does not read it with in_json (a fine-tuning dataset)")
    elif args.script == "fine_tune.py":
        raise ConfigError("in_json: fine_tune.py trains a fine-tuning dataset only (the metadata JSON, or a "
                          "dataset_config whose subsets have metadata_file)")
    elif args["train_data_dir"]:
        general, datasets = {}, [{"subsets": _dreambooth_folders(args, out)}]
    else:
        raise ConfigError("dataset_config / train_data_dir: no dataset (give kohya's dataset TOML or the DreamBooth "
                          "folder)")
    if not datasets:
        raise ConfigError(f"dataset_config: {path} has no [[datasets]]")
    lookups = [[Lookup(args, general, d, s) for s in d.get("subsets") or []] for d in datasets]
    if not any(lookups):
        raise ConfigError("dataset_config: no [[datasets.subsets]] (no image folder)")
    first = lookups[0][0] if lookups[0] else Lookup(args, general, datasets[0], {})
    _dataset_settings(first, c, family, out)
    for i in range(1, len(datasets)):
        for key in ("resolution", "batch_size", "enable_bucket", "bucket_reso_steps"):
            if Lookup(args, general, datasets[i], {})[key] != first[key]:
                skip(f"datasets[{i}].{key}: {Lookup(args, general, datasets[i], {})[key]}: ot_dist trains every "
                     f"concept at one {key} (the first dataset's, {first[key]})")
    concepts, train_samples, regs = [], 0, []
    for d, subsets in enumerate(lookups):
        for s, sub in enumerate(subsets):
            label = f"datasets[{d}].subsets[{s}]"
            entry, samples = _subset(sub, label, args, out, captions_folder, len(concepts))
            if entry is None:
                continue
            out.origins[f"data.concepts[{len(concepts)}]"] = f"{label}, image_dir {entry['path']}"
            concepts.append(entry)
            if sub["is_reg"]:
                regs.append((entry, samples))
            else:
                train_samples += samples or 0
    _regularisation(regs, train_samples, args, out)
    if not any(e.get("type") != "prior_preservation" for e in concepts):
        listed = [line for line in out.not_honoured if "metadata_file" in line]
        raise ConfigError("dataset: no training subset (only regularisation images)" if not listed else
                          f"dataset: no training subset: {listed[0]}")
    crops = {bool(sub["random_crop"]) for subsets in lookups for sub in subsets}
    c["data"]["concepts"] = concepts
    if True in crops:
        c["data"]["crop"] = "random"
        if False in crops:
            skip("random_crop: on for some subsets only; ot_dist's data.crop (random) is one setting for all")
    _caches(args, c, out)


def _dataset_settings(first: Lookup, c: dict, family: str, out: Imported) -> None:
    skip = out.not_honoured.append
    resolution = first["resolution"]
    if resolution is None:
        raise ConfigError("resolution: not set (kohya needs it: 512, or width,height)")
    sides = [int(v) for v in (str(resolution).split(",") if isinstance(resolution, str) else
                              resolution if isinstance(resolution, (list, tuple)) else [resolution])]
    width, height = (sides[0], sides[0]) if len(sides) == 1 else sides[:2]
    step = first["bucket_reso_steps"]
    if width == height:
        c["resolution"] = width
    else:  # kohya's buckets hold at most width x height pixels; ot_dist's the area of a square's
        side = max(step, round((width * height) ** 0.5 / step) * step)
        c["resolution"] = side
        skip(f"resolution: {width},{height}: ot_dist buckets by the area of a {side} px square; the width and "
             "height themselves are not kept")
    c["batch_size"] = first["batch_size"]
    c["data"] = {"bucket_step": step}  # kohya's default 64 included (ot_dist's is the family's: 8 for SD 1.x / 2.x)
    if not first["enable_bucket"] and width == height:  # kohya scales each image to cover the square and crops it
        c["data"]["bucket_assignment"] = "square"
    elif not first["enable_bucket"]:
        skip(f"enable_bucket: false with resolution {width},{height} (kohya crops every image to that rectangle) is "
             "not supported: ot_dist crops to squares (data.bucket_assignment: square) or buckets by aspect ratio")
    for key in ("min_bucket_reso", "max_bucket_reso"):
        if first[key] != DATASET_DEFAULTS[key]:
            skip(f"{key}: {first[key]}: ot_dist's buckets have no side limit")
    for key in ("bucket_no_upscale", "network_multiplier", "validation_split", "resize_interpolation"):
        if first[key] not in (DATASET_DEFAULTS[key], None):
            skip(f"{key}: {first[key]}: {UNSUPPORTED[key]} is not supported")


def _dreambooth_folders(args: KohyaArgs, out: Imported) -> list[dict]:
    """kohya's generate_dreambooth_subsets_config_by_subdirs: every sub-folder `<repeats>_<class tokens>` of
    train_data_dir (reg_data_dir: regularisation images) is a subset; a folder without a number is skipped."""
    subsets = []
    for key, is_reg in (("train_data_dir", False), ("reg_data_dir", True)):
        base = args[key]
        if not base:
            continue
        base = Path(local_path(str(base), key, out))
        if not base.is_dir():
            raise InputFileError(f"{key}: {base} is not a folder")
        for folder in sorted(p for p in base.iterdir() if p.is_dir()):
            repeats, _, tokens = folder.name.partition("_")
            try:
                repeats = int(repeats)
            except ValueError:
                out.notes.append(f"{key}: {folder.name} has no `<repeats>_` prefix; kohya skips it, so does this import")
                continue
            if repeats < 1:
                out.notes.append(f"{key}: {folder.name}: {repeats} repeats, skipped as kohya does")
                continue
            subsets.append({"image_dir": str(folder), "num_repeats": repeats, "is_reg": is_reg,
                            "class_tokens": tokens})
    return subsets


def _subset(sub: Lookup, label: str, args: KohyaArgs, out: Imported, captions_folder: str | None,
            index: int) -> tuple[dict | None, int | None]:
    """The concept of one subset, and its samples per epoch (images x repeats; None when its folder is not here)."""
    skip = out.not_honoured.append
    finetuning = bool(sub["metadata_file"])  # kohya: a subset with metadata_file is a fine-tuning one
    if not finetuning and not sub["image_dir"]:
        raise ConfigError(f"{label}: no image_dir and no metadata_file (kohya needs one)")
    repeats = sub["num_repeats"]  # a fine-tuning dataset's from --dataset_repeats (kohya's argparse name)
    if repeats < 1:
        out.notes.append(f"{label}: num_repeats {repeats}: kohya ignores the subset, so does this import")
        return None, None
    if finetuning:
        entry, images = finetuning_concept(sub, label, captions_folder, index, out)
        if entry is None:
            return None, None
        path = entry["path"]
    else:
        path = local_path(str(sub["image_dir"]), f"{label}.image_dir", out)
        entry = {"path": path}  # named by its folder, as kohya names a subset
    if sub["is_reg"]:
        entry["type"] = "prior_preservation"
        if args["prior_loss_weight"] != 1.0:
            entry["loss_weight"] = args["prior_loss_weight"]
    else:
        entry["balancing"] = repeats  # kohya's repeats: every image that many times per epoch
    if not finetuning:
        images = _images(path)
        _captions(sub, entry, images, label, out)
    if sub["shuffle_caption"] or sub["caption_tag_dropout_rate"]:
        entry["tag_delimiter"] = sub["caption_separator"]
        entry["keep_tags_count"] = sub["keep_tokens"]  # kohya's default 0, ot_dist's 1
        if sub["shuffle_caption"]:
            entry["tag_shuffling"] = True
        if sub["caption_tag_dropout_rate"]:  # each tag after the kept ones, alone: ot_dist's random mode
            entry |= {"tag_dropout_probability": sub["caption_tag_dropout_rate"], "tag_dropout_mode": "random"}
    for kohya, ours in (("keep_tokens_separator", "keep_tags_separator"), ("secondary_separator", "secondary_separator"),
                        ("caption_dropout_rate", "caption_dropout_probability"),
                        ("caption_dropout_every_n_epochs", "caption_dropout_every_n_epochs")):
        if sub[kohya]:  # the same rules (docs/data.md: kohya's options in ot_dist's terms)
            entry[ours] = sub[kohya]
    if sub["caption_prefix"]:
        entry["caption_prefix"] = sub["caption_prefix"]  # kohya: prefix, a space, the caption
    if sub["caption_suffix"]:
        entry["caption_suffix"] = sub["caption_suffix"]  # kohya: the caption, a space, suffix
    if sub["flip_aug"]:
        entry["flip_probability"] = 0.5  # kohya flips half the time
    for key, what in UNSUPPORTED.items():
        if key in SUBSET_DEFAULTS and sub[key] not in (SUBSET_DEFAULTS[key], None, False, 0, ""):
            skip(f"{label}.{key}: {sub[key]}: {what} is not supported")
    return entry, None if images is None else len(images) * repeats


def _images(path: str) -> list[Path] | None:
    from ot_dist.config.schema import ConceptConfig
    from ot_dist.data.concepts import list_images

    try:
        return list_images(path, ConceptConfig(path=path))
    except InputFileError:
        return None


def _captions(sub: Lookup, entry: dict, images: list[Path] | None, label: str, out: Imported) -> None:
    """kohya's caption of an image: the first line of its caption file, else class_tokens, else empty."""
    extension, tokens = sub["caption_extension"], sub["class_tokens"]
    if images is None:
        entry["caption_extension"] = extension
        out.notes.append(f"{label}: {entry['path']} is not readable here: captions are read from its {extension} "
                         "files (kohya's class_tokens stand in for a missing one; ot_dist needs each)")
        return
    files = [image.with_suffix(extension) for image in images]
    have = [f for f in files if f.is_file()]
    if not have and tokens:
        entry |= {"caption_source": "text", "caption_text": tokens}  # every image: the class tokens
        return
    entry["caption_extension"] = extension
    if len(have) < len(files):
        out.not_honoured.append(
            f"{label}: {len(files) - len(have)} of {len(files)} images have no {extension} file (kohya trains them "
            f"with {'the class tokens ' + repr(tokens) if tokens else 'an empty caption'}); ot_dist needs a caption "
            "file for each")
    several = [f.name for f in have if len([ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]) > 1]
    if several and not sub["enable_wildcard"]:
        out.not_honoured.append(f"{label}: {len(several)} caption files have several lines ({several[0]}, ...): kohya "
                                "reads the first line only, ot_dist draws one line per epoch")
    elif sub["enable_wildcard"]:
        out.notes.append(f"{label}.enable_wildcard: one line of a caption file drawn per epoch, as ot_dist draws; "
                         "kohya's {a|b} choices inside a line are not expanded")


def _regularisation(regs: list[tuple[dict, int | None]], train_samples: int, args: KohyaArgs, out: Imported) -> None:
    """kohya cycles the regularisation images until they give as many samples per epoch as the training images."""
    if not regs:
        return
    counts = [samples for _, samples in regs]
    if None in counts or not train_samples:
        for entry, _ in regs:
            out.not_honoured.append(f"{entry['path']}: kohya uses as many regularisation samples per epoch as "
                                    "training samples; the folders are not readable here to count them: set its "
                                    "balancing (balancing_strategy samples)")
        return
    total = sum(counts)
    for (entry, samples), share in zip(regs, counts):
        entry |= {"balancing": max(1, round(train_samples * share / total)), "balancing_strategy": "samples"}
    out.notes.append(f"regularisation images: {train_samples} samples per epoch, as many as the training images "
                     "(kohya's rule), split over the regularisation folders by their images x repeats")


def _caches(args: KohyaArgs, c: dict, out: Imported) -> None:
    from ot_dist.data.augment import AUGMENTATION_FIELDS

    data = c["data"]
    if args["cache_latents"]:
        augmented = [e["path"] for e in data["concepts"] if any(e.get(k) for k in AUGMENTATION_FIELDS)]
        if data.get("crop") == "random":  # kohya refuses it too (is_latent_cacheable)
            out.notes.append("cache_latents: off, because random_crop crops each image anew every epoch")
        elif augmented:
            out.notes.append(f"cache_latents: off, because {augmented[0]} flips its images (kohya caches a flipped "
                             "latent beside each; ot_dist encodes each step's image)")
        else:
            data["cache_latents"] = True
    if args["cache_text_encoder_outputs"]:
        trained = [p for p in ("text_encoder", "text_encoder_2", "text_encoder_3") if c.get(p, {}).get("train")]
        changing = ("tag_shuffling", "tag_dropout_probability", "caption_dropout_probability",
                    "caption_dropout_every_n_epochs")
        if trained or c["method"] == "embedding" or any(e.get(k) for e in data["concepts"] for k in changing):
            out.notes.append("cache_text_encoder_outputs: off (text encoders or an embedding trained, or captions "
                             "change per epoch)")
        else:
            data["cache_text"] = True
