"""A diffusers example script's dataset as ot_dist's `data.concepts`, resolution and batch size.

- text_to_image scripts: `--train_data_dir` (or a local `--dataset_name` folder) is a datasets `imagefolder`: images
  and a metadata.jsonl / metadata.csv whose `file_name` names each image and whose `--caption_column` (default
  `text`) holds its caption. ot_dist reads a caption file beside each image, so the captions are written, with a
  link to each image, into a new folder the user names (`--captions_folder`; kohya_metadata writes it).
- DreamBooth scripts: `--instance_data_dir` with one `--instance_prompt` for every image (repeated `--repeats`
  times); with `--with_prior_preservation` the `--class_data_dir` images with `--class_prompt` (DreamBoothDataset:
  an epoch has max(instance, class) items, each one instance and one class image, so a step trains
  train_batch_size of each; the loss is the instance half's mean + prior_loss_weight x the class half's mean).
- textual_inversion.py: `--train_data_dir`'s images, each caption one of the script's templates around the token.
- edit scripts (Flux Kontext, FLUX.2 img2img): `--dataset_name` (a local imagefolder) whose `--cond_image_column`
  holds each row's reference image. datasets makes an image column C of a metadata key `C_file_name` (a path under
  the folder, as `file_name` is the `image` column's), so the import writes the captions folder as above and, beside
  it, a folder of links to the references named as their images' links: the concept's `reference_path`, paired by
  relative path (docs/data.md). A folder of images (`--instance_data_dir`) has no such column: refused.

A Hub dataset (`--dataset_name org/name`) cannot be read offline: refused, naming the argument."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.common import Imported, local_path
from ot_dist.migrate.diffusers_args import DiffusersArgs
from ot_dist.migrate.kohya_metadata import IMAGE_EXTENSIONS, write_caption_folder

# textual_inversion.py's imagenet_templates_small / imagenet_style_templates_small ({} is the placeholder token)
OBJECT_TEMPLATES = (
    "a photo of a {}", "a rendering of a {}", "a cropped photo of the {}", "the photo of a {}", "a photo of a clean {}",
    "a photo of a dirty {}", "a dark photo of the {}", "a photo of my {}", "a photo of the cool {}",
    "a close-up photo of a {}", "a bright photo of the {}", "a cropped photo of a {}", "a photo of the {}",
    "a good photo of the {}", "a photo of one {}", "a close-up photo of the {}", "a rendition of the {}",
    "a photo of the clean {}", "a rendition of a {}", "a photo of a nice {}", "a good photo of a {}",
    "a photo of the nice {}", "a photo of the small {}", "a photo of the weird {}", "a photo of the large {}",
    "a photo of a cool {}", "a photo of a small {}")
STYLE_TEMPLATES = (
    "a painting in the style of {}", "a rendering in the style of {}", "a cropped painting in the style of {}",
    "the painting in the style of {}", "a clean painting in the style of {}", "a dirty painting in the style of {}",
    "a dark painting in the style of {}", "a picture in the style of {}", "a cool painting in the style of {}",
    "a close-up painting in the style of {}", "a bright painting in the style of {}",
    "a cropped painting in the style of {}", "a good painting in the style of {}",
    "a close-up painting in the style of {}", "a rendition in the style of {}", "a nice painting in the style of {}",
    "a small painting in the style of {}", "a weird painting in the style of {}",
    "a large painting in the style of {}")


def import_dataset(args: DiffusersArgs, c: dict, kind: str, out: Imported, captions_folder: str | None) -> None:
    c["resolution"] = args["resolution"]
    c["batch_size"] = args["train_batch_size"]
    c["data"] = {"crop": "center" if args["center_crop"] else "random"}
    if args["aspect_ratio_buckets"] or args["use_aspect_ratio_buckets"]:
        how = (f"covers and crops each image to the nearest of its buckets {args['aspect_ratio_buckets']}"
               if args["aspect_ratio_buckets"]  # the Qwen-Image script's explicit list (needs use_aspect_ratio_buckets)
               else "buckets by aspect ratio with buckets of its own, computed from resolution")
        out.not_honoured.append(f"resolution {args['resolution']}: diffusers {how}; ot_dist buckets by aspect ratio "
                                "with OneTrainer's buckets (the same area, the nearest of its aspects)")
    elif kind == "textual_inversion" and not args["center_crop"]:
        out.not_honoured.append(f"resolution {args['resolution']}: diffusers resizes each image to resolution x "
                                "resolution, squashing it; ot_dist buckets by aspect ratio (the same area, the image's "
                                "own shape)")
    else:  # the script's square: the shorter side scaled to resolution, a square cropped (centred or at random)
        c["data"]["bucket_assignment"] = "square"
        out.notes.append("data.bucket_assignment: square, as the script crops every image to a square; "
                         "rounded_aspect would train each image at its own shape (aspect buckets)")
    if kind == "textual_inversion":
        concepts = [_textual_inversion(args, out)]
    elif kind == "edit":
        concepts = [_edit_pairs(args, out, captions_folder)]
    elif kind == "dreambooth" and args["instance_data_dir"]:
        concepts = _dreambooth(args, c, out)
    else:
        concepts = [_imagefolder(args, out, captions_folder, kind)]
    flip = 0.5 if kind == "textual_inversion" or args["random_flip"] else 0.0  # textual_inversion.py always flips
    empty = args["proportion_empty_prompts"]  # train_text_to_image_sdxl.py: captions replaced by "" at this rate
    for concept in concepts:
        if flip:
            concept["flip_probability"] = flip
        if empty:
            concept["caption_dropout_probability"] = empty
    if args["caption_dropout"]:  # the Qwen-Image script: instance captions become "" at this rate, class ones never
        concepts[0]["caption_dropout_probability"] = args["caption_dropout"]
    c["data"]["concepts"] = concepts
    if args["dataloader_num_workers"]:
        c["data"]["loader_workers"] = args["dataloader_num_workers"]
    interpolation = args["image_interpolation_mode"]
    if interpolation not in (None, "lanczos"):
        out.not_honoured.append(f"image_interpolation_mode: {interpolation}: ot_dist resizes with its own filter")
    if args["max_train_samples"]:
        out.not_honoured.append(f"max_train_samples: {args['max_train_samples']}: every image trains (ot_dist has "
                                "no cap on the dataset)")


def _folder(value, key: str, out: Imported) -> Path:
    path = Path(local_path(str(value), key, out))
    if not path.is_dir():
        raise InputFileError(f"{key}: {path} is not a folder here")
    return path


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in IMAGE_EXTENSIONS)


def _imagefolder(args: DiffusersArgs, out: Imported, captions_folder: str | None, kind: str) -> dict:
    """A datasets imagefolder (train_data_dir, or dataset_name when it is a local folder) as one concept."""
    name, data_dir = args["dataset_name"], args["train_data_dir"]
    if name:
        if not Path(local_path(str(name), "dataset_name", out)).is_dir():
            raise ConfigError(f"dataset_name: {name} is a Hugging Face Hub dataset; ot_dist trains offline from local "
                              "folders (download it, save it as an image folder with a metadata.jsonl of file_name "
                              "and the caption column, and give that folder as --dataset_name or --train_data_dir)")
        key, folder = "dataset_name", _folder(name, "dataset_name", out)
        if args["dataset_config_name"]:
            out.not_honoured.append(f"dataset_config_name: {args['dataset_config_name']}: a local image folder has "
                                    "no configurations")
    elif data_dir:
        key, folder = "train_data_dir", _folder(data_dir, "train_data_dir", out)
    else:
        need = "--instance_data_dir or --dataset_name" if kind == "dreambooth" else "--dataset_name or --train_data_dir"
        raise ConfigError(f"{need.split(' or ')[0][2:]}: no dataset ({args.script} needs {need})")
    column = args["caption_column"]
    if kind == "dreambooth" and not column:  # the DreamBooth scripts' dataset_name without captions
        return {"path": str(folder), "caption_source": "text", "caption_text": _instance_prompt(args)} | _repeats(args)
    metadata = _read_metadata(folder, key)
    if args.given("image_column") and args["image_column"] != "image":
        out.not_honoured.append(f"image_column: {args['image_column']}: an image folder's images are its `image` "
                                "column (metadata file_name)")
    captions = []
    for row in metadata:
        if column not in row:
            raise ConfigError(f"caption_column: {column!r} is not a column of {key}'s metadata "
                              f"({', '.join(row)})")
        image = folder / str(row.get("file_name", ""))
        if image.is_file():
            captions.append((str(row["file_name"]), image, str(row[column])))
        else:
            raise InputFileError(f"{key}: metadata names {row.get('file_name')!r}, which is not a file in {folder}")
    if captions_folder is None:
        raise ConfigError(f"{key}: {folder}'s captions are in its metadata file; ot_dist reads a caption file beside "
                          "each image: give `--captions_folder DIR` to write a link to each image with its caption "
                          "there (the image folder is not touched)")
    target = Path(captions_folder) / folder.name
    out.after_validation.append(lambda: write_caption_folder(target, captions))
    out.notes.append(f"{key}: {len(captions)} images and their {column!r} captions -> {target} (a link to each image "
                     "and a .txt caption beside it)")
    out.origins["data.concepts[0]"] = f"{key} {folder}"
    return {"path": str(target), "caption_extension": ".txt"} | (_repeats(args) if kind == "dreambooth" else {})


def _edit_pairs(args: DiffusersArgs, out: Imported, captions_folder: str | None) -> dict:
    """An edit script's dataset: a local imagefolder's rows of image, caption and reference image (cond_image_column),
    as one concept with a reference_path."""
    column = args["cond_image_column"]
    if not column:
        raise ConfigError(f"cond_image_column: not set: {args.script} then trains from the captions alone ("
                          f"{'the FLUX.2 img2img scripts stop' if 'img2img' in args.script else 'text-to-image'}); "
                          "ot_dist's edit training needs a reference image for every image: give the column of "
                          "reference images (or import the text-to-image script's command)")
    if args["instance_data_dir"] or not args["dataset_name"]:
        raise ConfigError("cond_image_column: the script reads reference images from --dataset_name's columns only; "
                          "a folder of images (--instance_data_dir) has none. Give --dataset_name a local image folder "
                          f"whose metadata.jsonl names each image's reference in a `{column}_file_name` key")
    if not args["caption_column"]:
        raise ConfigError("caption_column: not set; with cond_image_column the script needs each edit's instruction "
                          "from a column (it stops too)")
    name, caption_column = args["dataset_name"], args["caption_column"]
    if not Path(local_path(str(name), "dataset_name", out)).is_dir():
        raise ConfigError(f"dataset_name: {name} is a Hugging Face Hub dataset; ot_dist trains offline from local "
                          f"folders (save it as an image folder whose metadata.jsonl has file_name, {column}_file_name "
                          "and the caption column, and give that folder)")
    folder = _folder(name, "dataset_name", out)
    if args["dataset_config_name"]:
        out.not_honoured.append(f"dataset_config_name: {args['dataset_config_name']}: a local image folder has no "
                                "configurations")
    if args.given("image_column") and args["image_column"] != "image":
        out.not_honoured.append(f"image_column: {args['image_column']}: an image folder's training images are its "
                                "`image` column (metadata file_name)")
    captions, references = [], []
    for row in _read_metadata(folder, "dataset_name"):
        for key in ("file_name", f"{column}_file_name", caption_column):
            if key not in row:
                raise ConfigError(_missing_column(key, column, caption_column, row))
        image, reference = folder / str(row["file_name"]), folder / str(row[f"{column}_file_name"])
        for path in (image, reference):
            if not path.is_file():
                raise InputFileError(f"dataset_name: metadata names {path.relative_to(folder)}, which is not a file "
                                     f"in {folder}")
        captions.append((str(row["file_name"]), image, str(row[caption_column])))
        references.append(reference)
    if captions_folder is None:
        raise ConfigError(f"dataset_name: {folder}'s captions and reference images are in its metadata file; ot_dist "
                          "reads a caption file beside each image and a folder of references: give `--captions_folder "
                          "DIR` to write links to them there (the image folder is not touched)")
    target = Path(captions_folder) / folder.name
    reference_folder = Path(captions_folder) / f"{folder.name}-{column}"
    out.after_validation.append(lambda: _write_pairs(target, reference_folder, captions, references))
    out.notes.append(f"dataset_name: {len(captions)} images, their {caption_column!r} captions and {column!r} "
                     f"reference images -> {target} and {reference_folder} (links, paired by name)")
    out.origins["data.concepts[0]"] = f"dataset_name {folder}"
    return {"path": str(target), "caption_extension": ".txt", "reference_path": str(reference_folder)} | _repeats(args)


def _missing_column(key: str, column: str, caption_column: str, row: dict) -> str:
    keys = ", ".join(row)
    if key == "file_name":
        return f"dataset_name: the metadata has no file_name key (the training image; keys: {keys})"
    if key == caption_column:
        return f"caption_column: {caption_column!r} is not a key of the metadata (keys: {keys})"
    if column in row:
        return (f"cond_image_column: {column!r} is a text column of the metadata; datasets makes an image column "
                f"{column!r} of a `{column}_file_name` key (a path under the folder), the reference image the script "
                "loads")
    return (f"cond_image_column: the metadata has no {column}_file_name key (datasets' image column {column!r}: the "
            f"reference image; keys: {keys})")


def _write_pairs(target: Path, reference_folder: Path, captions: list, references: list[Path]) -> None:
    """The captions folder, then a link to each reference named as its image's link (its own extension)."""
    names = write_caption_folder(target, captions)
    if reference_folder.exists() and any(reference_folder.iterdir()):
        raise InputFileError(f"--captions_folder: {reference_folder} exists and is not empty (remove it, or name "
                             "another)")
    reference_folder.mkdir(parents=True, exist_ok=True)
    for name, reference in zip(names, references):
        (reference_folder / (Path(name).stem + reference.suffix)).symlink_to(reference.resolve())


def _read_metadata(folder: Path, key: str) -> list[dict]:
    """imagefolder's metadata: metadata.jsonl (a JSON object a line) or metadata.csv, each row naming file_name."""
    jsonl, table = folder / "metadata.jsonl", folder / "metadata.csv"
    try:
        if jsonl.is_file():
            return [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
        if table.is_file():
            with table.open(encoding="utf-8", newline="") as f:
                return list(csv.DictReader(f))
    except (json.JSONDecodeError, csv.Error, UnicodeDecodeError) as err:
        raise InputFileError(f"{key}: {folder}'s metadata file is not readable ({err})") from None
    raise ConfigError(f"{key}: {folder} has no metadata.jsonl or metadata.csv, so the script has no caption column "
                      "(it stops too)")


def _instance_prompt(args: DiffusersArgs) -> str:
    prompt = args["instance_prompt"]
    if not prompt:
        raise ConfigError(f"instance_prompt: not set ({args.script} needs it: the caption of the instance images)")
    return prompt


def _repeats(args: DiffusersArgs) -> dict:
    repeats = args["repeats"] or 1
    return {"balancing": repeats} if repeats != 1 else {}


def _dreambooth(args: DiffusersArgs, c: dict, out: Imported) -> list[dict]:
    folder = _folder(args["instance_data_dir"], "instance_data_dir", out)
    instance = {"path": str(folder), "caption_source": "text", "caption_text": _instance_prompt(args)}
    instance |= _repeats(args)
    out.origins["data.concepts[0]"] = f"instance_data_dir {folder}"
    if not args["with_prior_preservation"]:
        for key in ("class_data_dir", "class_prompt"):
            if args[key]:
                out.notes.append(f"{key}: ignored without --with_prior_preservation, as the script warns")
        args["prior_loss_weight"], args["num_class_images"]  # read: they belong to prior preservation
        return [instance]
    for key in ("class_data_dir", "class_prompt"):
        if not args[key]:
            raise ConfigError(f"{key}: not set; --with_prior_preservation needs it (the script stops too)")
    class_folder = _folder(args["class_data_dir"], "class_data_dir", out)
    wanted, found = args["num_class_images"], len(_images(class_folder))
    if found < wanted:
        out.not_honoured.append(f"num_class_images: {wanted}: {class_folder} holds {found}; the script generates the "
                                "missing class images with the base model before training, ot_dist does not (generate "
                                "them first, or lower num_class_images)")
    used = min(found, wanted)
    if found > wanted:
        out.not_honoured.append(f"num_class_images: {wanted}: the script trains the first {wanted} of the "
                                f"{found} files it lists in {class_folder} (in directory order); ot_dist trains all")
        used = found
    weight = args["prior_loss_weight"]
    instances = len(_images(folder)) * (args["repeats"] or 1)
    per_epoch = max(instances, used)  # DreamBoothDataset's length: one instance and one class image per item
    instance.pop("balancing", None)
    instance |= {"balancing": per_epoch, "balancing_strategy": "samples", "loss_weight": 2.0}
    regularisation = {"path": str(class_folder), "type": "prior_preservation", "caption_source": "text",
                      "caption_text": args["class_prompt"], "balancing": per_epoch, "balancing_strategy": "samples",
                      "loss_weight": 2.0 * weight}
    out.origins["data.concepts[1]"] = f"class_data_dir {class_folder}"
    c["batch_size"] = 2 * args["train_batch_size"]
    out.notes.append(f"with_prior_preservation: {per_epoch} instance and {per_epoch} class samples per epoch "
                     f"(max of instance images x repeats and class images, as the script), batch_size "
                     f"{c['batch_size']} (train_batch_size of each), loss weights 2 and {2.0 * weight} (the script "
                     "adds the two halves' means: each half of a batch mean counts twice); ot_dist draws the "
                     "concepts into batches at random, so a batch holds about half of each, not exactly")
    return [instance, regularisation]


def _textual_inversion(args: DiffusersArgs, out: Imported) -> dict:
    if not args["train_data_dir"]:
        raise ConfigError("train_data_dir: not set (textual_inversion.py needs the folder of images)")
    folder = _folder(args["train_data_dir"], "train_data_dir", out)
    templates = STYLE_TEMPLATES if args["learnable_property"] == "style" else OBJECT_TEMPLATES
    token = args["placeholder_token"]
    out.origins["data.concepts[0]"] = f"train_data_dir {folder}"
    out.notes.append(f"learnable_property {args['learnable_property']}: the captions are the script's "
                     f"{len(templates)} templates around {token} (a line drawn per image and epoch)")
    return {"path": str(folder), "caption_source": "text",
            "caption_text": "\n".join(t.format(token) for t in templates)} | _repeats(args)
