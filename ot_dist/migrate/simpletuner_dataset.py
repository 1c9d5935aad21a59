"""SimpleTuner's dataloader config (multidatabackend.json: a list of backends, helpers/data_backend/config/image.py)
as ot_dist's concepts and data settings.

Each enabled local image backend is a concept: instance_data_dir (read with its sub-folders, as SimpleTuner lists a
folder), the caption_strategy (filename, textfile, instanceprompt; the backend's, else the argument's), instance_prompt
with prepend_instance_prompt / only_instance_prompt, repeats (SimpleTuner shows an image repeats + 1 times per epoch),
is_regularisation_data (a LoRA's regularisation images are trained towards the base model's prediction: ot_dist's
prior_prediction; a full finetune trains them as they are: prior_preservation) and the global
caption_dropout_probability. The resolution (pixel_area: a square's side of the same area, ot_dist's own meaning;
area: megapixels; pixel: the shorter edge) is ot_dist's training resolution (several datasets at several: ot_dist's
multi-resolution list, drawn per step for all of them). text_embeds / image_embeds backends
are caches: ot_dist keeps its caches in the shard set. For an edit model (Flux Kontext) a backend's conditioning_data
names its reference backend (conditioning_type reference_strict / reference_loose, images paired by file name): its
instance_data_dir is the concept's reference_path, and the reference backend is no concept of its own. Several
reference backends with conditioning_multidataset_sampling combined (FLUX.2, Qwen-Image-Edit-2509) are a list of
reference folders, one reference of each image from each."""

from __future__ import annotations

import math
from pathlib import Path

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import Imported, local_path, read_json
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs, parse_value

CAPTIONS = {"filename": {"caption_source": "filename"},
            "textfile": {"caption_source": "txt", "caption_extension": ".txt"}}
# backend keys that change where SimpleTuner keeps its caches and how it scans, not what trains
NO_EFFECT = {"cache_dir_vae", "cache_dir", "vae_cache_clear_each_epoch", "skip_file_discovery",
             "preserve_data_backend_cache", "metadata_backend", "hash_filenames", "text_embeds", "image_embeds",
             "vae_cache_ondemand", "vae_cache_disable", "compress_cache", "delete_unwanted_images",
             "delete_problematic_images", "default", "id", "type", "dataset_type", "disabled", "disable"}
READ = {"instance_data_dir", "caption_strategy", "instance_prompt", "prepend_instance_prompt", "only_instance_prompt",
        "repeats", "is_regularisation_data", "is_regularization_data", "probability", "resolution", "resolution_type",
        "crop", "crop_style", "crop_aspect", "minimum_image_size", "maximum_image_size", "target_downsample_size",
        "disable_multiline_split", "conditioning_data"}


REFERENCE_TYPES = ("reference_strict", "reference_loose")


def import_dataset(args: SimpleTunerArgs, c: dict, method: str, backend_file: str | None, out: Imported,
                   references: bool = False, references_optional: bool = False) -> None:
    """`references`: an edit model's import, whose conditioning datasets are its reference images (with
    `references_optional`, FLUX.2's, for the datasets that name one: the others train text-to-image)."""
    path = args.file(backend_file, "data_backend_config", out)
    if path is None:
        raise ConfigError("data_backend_config: not set (SimpleTuner's multidatabackend.json, the datasets)")
    backends = read_json(path, "data_backend_config")
    if not isinstance(backends, list):
        raise ConfigError(f"data_backend_config: {path} is not a list of backends")
    concepts, sides, crops, aspects = [], [], set(), []
    conditioning = {str(b.get("id")): b for b in backends if isinstance(b, dict) and b.get("conditioning_type")}
    for index, backend in enumerate(backends):
        where = f"{path.name}[{backend.get('id', index)}]"
        if backend.get("conditioning_type"):
            _conditioning_backend(backend, where, references, out)
            continue
        concept = _concept(args, backend, where, method, out)
        if concept is None:
            continue
        if references and (backend.get("conditioning_data") or not references_optional):
            concept |= _reference(args, backend, conditioning, where, out)
        elif backend.get("conditioning_data"):
            out.not_honoured.append(f"{where}.conditioning_data: {backend['conditioning_data']}: this model takes no "
                                    "conditioning images")
        out.origins[f"data.concepts[{len(concepts)}]"] = where
        concepts.append(concept)
        sides.append((_side(args, backend, where, out), where))
        crop, aspect = _crop(backend, where, out)
        crops.add(crop)
        aspects.append((aspect, where))
    if not concepts:
        raise ConfigError(f"data_backend_config: {path} has no local image dataset ot_dist can train")
    c["data"] = {"concepts": concepts, "bucket_step": 64}  # SimpleTuner's models align buckets to 64 pixels
    distinct = sorted({side for side, _ in sides})
    c["resolution"] = distinct[0] if len(distinct) == 1 else distinct
    if len(distinct) > 1:  # SimpleTuner's multi-resolution setup: one folder in several datasets
        out.not_honoured.append(f"resolution: the datasets train at {distinct} px, each at its own; ot_dist draws one "
                                "of these resolutions per step for every dataset (resolution: a list)")
    c["data"]["crop"] = "random" if crops == {"random"} else "center"
    if {aspect for aspect, _ in aspects} == {"square"}:  # every image cut to a square: no aspect buckets
        c["data"]["bucket_assignment"] = "square"
    else:
        for aspect, where in aspects:
            if aspect not in (None, "preserve"):
                out.not_honoured.append(f"{where}.crop_aspect: {aspect}: ot_dist keeps each image's aspect (its "
                                        "bucket's)" if aspect != "square" else
                                        f"{where}.crop_aspect: square: the other datasets keep their images' aspects, "
                                        "so ot_dist buckets every dataset by aspect (bucket_assignment is one setting)")
    if len(crops) > 1:
        out.not_honoured.append("crop_style: the datasets crop differently; ot_dist crops every dataset alike "
                                "(center is written)")


def _conditioning_backend(backend: dict, where: str, references: bool, out: Imported) -> None:
    kind = backend["conditioning_type"]
    if references and kind in REFERENCE_TYPES:
        out.notes.append(f"{where}: a conditioning dataset ({kind}): the reference_path of the datasets naming it")
        if kind == "reference_loose":
            out.not_honoured.append(f"{where}.conditioning_type: reference_loose: ot_dist gives the reference its "
                                    "image's bucket, crop and flip (as reference_strict); a reference of another "
                                    "shape is refused")
    else:
        out.not_honoured.append(f"{where}.conditioning_type: {kind}: ot_dist trains no ControlNet or other "
                                "conditioning of this model; dataset left out")


def _reference(args: SimpleTunerArgs, backend: dict, conditioning: dict, where: str, out: Imported) -> dict:
    """{"reference_path": the reference dataset's folder} of an edit dataset, or {} (listed) without one. Several
    reference datasets with conditioning_multidataset_sampling combined (every one shown with each image: FLUX.2's
    and Qwen-Image-Edit-2509's several references) are a list of folders, one reference from each by file name in
    conditioning_data's order; with random (SimpleTuner's default: one dataset drawn per sample) the first is used,
    listed."""
    named = backend.get("conditioning_data") or []
    named = [named] if isinstance(named, str) else list(named)
    found = [conditioning[n] for n in map(str, named) if n in conditioning
             and conditioning[n].get("conditioning_type") in REFERENCE_TYPES]
    if not found:
        out.not_honoured.append(f"{where}: no conditioning_data names a reference dataset; an edit model needs a "
                                "reference image per image (set data.concepts[].reference_path)")
        return {}
    ids = [str(f.get("id")) for f in found]
    sampling = args["conditioning_multidataset_sampling"]  # read with one dataset too: it changes nothing then
    if len(found) > 1 and sampling != "combined":
        out.not_honoured.append(
            f"{where}.conditioning_data: {ids}: conditioning_multidataset_sampling {sampling} draws one of them per "
            f"sample, which ot_dist does not; {ids[0]}'s are used (with combined every one is a reference of each "
            "image: reference_path a list)")
        found = found[:1]
    folders = []
    for dataset in found:
        folder = dataset.get("instance_data_dir")
        if not folder:
            raise ConfigError(f"{where}.conditioning_data: {dataset.get('id')} has no instance_data_dir")
        folders.append(str(args.path(local_path(str(folder), f"{where}.conditioning_data", out))))
    if len(folders) > 1:
        out.notes.append(f"{where}.conditioning_data: {ids} (combined): reference_path lists their folders, one "
                         "reference of each image from each, in this order (Picture 1, 2, ...)")
    return {"reference_path": folders[0] if len(folders) == 1 else folders}


def _concept(args: SimpleTunerArgs, backend: dict, where: str, method: str, out: Imported) -> dict | None:
    skip = out.not_honoured.append
    kind = backend.get("dataset_type", "image")
    if backend.get("disabled", backend.get("disable", False)):
        out.notes.append(f"{where}: disabled, as in SimpleTuner")
        return None
    if kind in ("text_embeds", "image_embeds"):
        out.notes.append(f"{where}: a {kind} cache; ot_dist keeps its caches in the shard set")
        return None
    if kind != "image":
        skip(f"{where}.dataset_type: {kind} datasets are not supported (ot_dist trains on images and captions)")
        return None
    if backend.get("type", "local") != "local":
        skip(f"{where}.type: {backend.get('type')}: ot_dist reads local folders (copy the data here); dataset left out")
        return None
    folder = backend.get("instance_data_dir")
    if not folder:
        raise ConfigError(f"{where}.instance_data_dir: not set (the folder of the images)")
    concept = {"path": str(args.path(local_path(str(folder), f"{where}.instance_data_dir", out))),
               "name": str(backend.get("id", Path(folder).name)), "include_subdirectories": True}
    concept |= _captions(args, backend, where, Path(concept["path"]), out)
    repeats = int(backend.get("repeats") or 0)
    if repeats:
        concept["balancing"] = repeats + 1  # SimpleTuner's repeats are extra passes: 1 shows every image twice
    if backend.get("is_regularisation_data", backend.get("is_regularization_data", False)):
        concept["type"] = "prior_prediction" if method == "lora" else "prior_preservation"
    probability = float(backend.get("probability") or 1.0)
    if probability != 1.0:
        skip(f"{where}.probability: {probability}: ot_dist draws every dataset's samples each epoch (balancing "
             "sets how many)")
    dropout = args["caption_dropout_probability"]
    if dropout:
        concept["caption_dropout_probability"] = dropout
    for key in ("minimum_image_size", "maximum_image_size", "target_downsample_size"):
        value = backend.get(key, args[key])
        if value:
            skip(f"{where}.{key}: {value}: ot_dist scales every image to cover its bucket (skip_small_images leaves "
                 "out images below a quarter of the bucket side)")
    for key, value in backend.items():
        if key not in READ and key not in NO_EFFECT:
            skip(f"{where}.{key}: {value!r} has no ot_dist counterpart")
        elif key in NO_EFFECT - {"id", "type", "dataset_type", "disabled", "disable", "default"}:
            out.notes.append(f"{where}.{key}: ignored (caches and file discovery: it does not change what trains)")
    return concept


def _captions(args: SimpleTunerArgs, backend: dict, where: str, folder: Path, out: Imported) -> dict:
    """helpers/prompts.py: filename (the file name, underscores as spaces), textfile (img.txt; its lines are several
    captions), instanceprompt or only_instance_prompt (the instance prompt for every image); prepend_instance_prompt
    puts the instance prompt and a space before each caption."""
    strategy = backend.get("caption_strategy") or args["caption_strategy"]
    prompt = backend.get("instance_prompt", args["instance_prompt"])
    prepend = parse_value("prepend_instance_prompt", backend.get("prepend_instance_prompt",
                                                                  args["prepend_instance_prompt"]))
    only = parse_value("only_instance_prompt", backend.get("only_instance_prompt", args["only_instance_prompt"]))
    if strategy == "instanceprompt" or only:
        if not prompt:
            raise ConfigError(f"{where}.instance_prompt: not set, which caption_strategy instanceprompt / "
                              "only_instance_prompt needs (SimpleTuner refuses it too)")
        return {"caption_source": "text", "caption_text": str(prompt)}
    if strategy not in CAPTIONS:
        raise ConfigError(f"{where}.caption_strategy: {strategy}: ot_dist reads captions from file names, .txt files "
                          "or one prompt (filename, textfile, instanceprompt)")
    captions = dict(CAPTIONS[strategy])
    if prepend:
        if not prompt:
            raise ConfigError(f"{where}.instance_prompt: not set, which prepend_instance_prompt needs")
        captions["caption_prefix"] = str(prompt)
    if strategy == "textfile" and parse_value("disable_multiline_split", backend.get("disable_multiline_split", False)):
        out.not_honoured.append(f"{where}.disable_multiline_split: SimpleTuner trains a caption file's lines as one "
                                "caption; ot_dist draws one line per epoch")
    if strategy == "filename" and _underscored(folder):
        out.not_honoured.append(f"{where}.caption_strategy: filename: SimpleTuner reads the underscores of a file "
                                "name as spaces; ot_dist reads the name as it is (rename the files or write .txt "
                                "captions)")
    return captions


def _underscored(folder: Path) -> bool:
    try:
        return any("_" in image.stem for image in folder.rglob("*") if image.is_file() and image.suffix != ".txt")
    except OSError as err:
        raise InputFileError(f"instance_data_dir: {folder} cannot be read ({err})") from None


def _side(args: SimpleTunerArgs, backend: dict, where: str, out: Imported) -> int:
    """ot_dist's resolution: the side of a square of the bucket's area."""
    resolution = parse_value("resolution", backend.get("resolution", args["resolution"]))
    kind = backend.get("resolution_type", args["resolution_type"])
    if kind == "area":  # megapixels
        side = math.sqrt(float(resolution) * 1_000_000)
    elif kind in ("pixel_area", "pixel"):
        side = float(resolution)
    else:
        raise ConfigError(f"{where}.resolution_type: {kind} is not pixel, area or pixel_area")
    if kind == "pixel":
        out.not_honoured.append(f"{where}.resolution_type: pixel: SimpleTuner scales the shorter edge to "
                                f"{resolution} px; ot_dist's buckets have about {resolution} x {resolution} pixels")
    aligned = max(64, int(round(side / 64)) * 64)  # ot_dist's resolution is a multiple of the bucket step
    if aligned != side:
        out.notes.append(f"{where}.resolution: {resolution} ({kind}) is a square of {side:g} px; {aligned}, the "
                         "nearest multiple of 64 (SimpleTuner's bucket alignment), is written")
    return aligned


def _crop(backend: dict, where: str, out: Imported) -> tuple[str, str | None]:
    """(ot_dist's data.crop, SimpleTuner's crop_aspect or None). crop false: the image is scaled to its bucket
    (ot_dist: covered, the rest cut at the centre); crop true cuts crop_style's part (random, center; corner and face
    are not ot_dist's) at crop_aspect (square: every image a square, ot_dist's bucket_assignment square)."""
    if not parse_value("crop", backend.get("crop", False)):
        return "center", None
    style, aspect = backend.get("crop_style", "random"), backend.get("crop_aspect", "square")
    if style not in ("random", "center", "centre"):
        out.not_honoured.append(f"{where}.crop_style: {style}: ot_dist crops at the centre or at random; center is "
                                "written")
        return "center", aspect
    return ("random" if style == "random" else "center"), aspect
