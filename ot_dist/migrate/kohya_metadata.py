"""kohya's fine-tuning datasets: a metadata JSON (`--in_json` with `--train_data_dir`, or a dataset TOML subset's
`metadata_file` with its optional `image_dir`), as kohya's finetune/ scripts write it (merge_captions_to_metadata,
merge_dd_tags_to_metadata, prepare_buckets_latents): image key -> {"caption", "tags", "train_resolution"}; or its
JSONL form, one {"image_path", "caption", "tags", "image_size"} per line.

kohya (FineTuningDataset): a relative key is joined to image_dir, an absolute one is the image; the finetune scripts
write the file's stem as the key unless --full_path, so the image is the key with one of the image extensions. The
caption is `caption`, then caption_separator and `tags` when tags are given (enable_wildcard: each line of the caption
with the tags). ot_dist reads a caption per image from a file beside it only, so the captions are written, with a
link to each image, into a new folder the user names (`--captions_folder`): the user's image folder is not touched.
Sizes (train_resolution, image_size) are not needed: ot_dist measures each image."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ot_dist.errors import InputFileError
from ot_dist.migrate.common import Imported, local_path

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP")
CAPTION_EXTENSION = ".txt"


def read_metadata(path: Path, label: str) -> dict[str, dict]:
    """key -> {caption, tags}: the JSON as is, or the JSONL's lines keyed by image_path (as kohya reads them)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"{label}: {path} does not exist (kohya stops too: no metadata)") from None
    try:
        if path.suffix == ".jsonl":
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            return {line["image_path"]: line for line in lines}
        metadata = json.loads(text)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise InputFileError(f"{label}: {path} is not kohya's metadata JSON ({err})") from None
    if not isinstance(metadata, dict):
        raise InputFileError(f"{label}: {path} is not kohya's metadata JSON (an object of image key -> caption)")
    return metadata


def kohya_caption(entry: dict, separator: str, wildcard: bool) -> str:
    """FineTuningDataset's caption: the caption (or ""), then the separator and the tags when there are tags."""
    caption, tags = entry.get("caption") or "", entry.get("tags")
    if wildcard:  # every line of the caption gets the tags (one line, the separator for its newlines)
        if tags is None:
            return caption
        tags = tags.replace("\n", separator)
        return "\n".join(f"{line}{separator}{tags}" for line in caption.split("\n") if line.strip())
    if tags:
        caption = f"{caption}{separator}{tags}" if caption else tags
    return caption


def image_of(key: str, image_dir: str | None) -> Path | None:
    """The image a key names: the key itself, else the key with an image extension (a stem, as the finetune scripts
    write keys without --full_path)."""
    base = Path(key) if os.path.isabs(key) or image_dir is None else Path(image_dir) / key
    if base.is_file():
        return base
    return next((base.with_name(base.name + ext) for ext in IMAGE_EXTENSIONS
                 if base.with_name(base.name + ext).is_file()), None)


def finetuning_concept(sub, label: str, captions_folder: str | None, index: int,
                       out: Imported) -> tuple[dict | None, list[Path]]:
    """The concept of a fine-tuning subset: a folder (under captions_folder) of links to its images, each with its
    kohya caption in a .txt file beside it, written once the config validates; and the images found (None, [] when
    it cannot be made here)."""
    skip = out.not_honoured.append
    metadata_path = Path(local_path(str(sub["metadata_file"]), f"{label}.metadata_file", out))
    image_dir = local_path(str(sub["image_dir"]), f"{label}.image_dir", out) if sub["image_dir"] else None
    metadata = read_metadata(metadata_path, f"{label}.metadata_file")
    if not metadata:
        out.notes.append(f"{label}: {metadata_path} has no image, the subset is ignored (as kohya does)")
        return None, []
    if image_dir is None and any(not os.path.isabs(key) for key in metadata):
        raise InputFileError(f"{label}: {metadata_path} names images relative to image_dir, and no image_dir (or "
                             "train_data_dir) is given (kohya needs it too)")
    separator, wildcard = sub["caption_separator"], bool(sub["enable_wildcard"])
    found, missing = [], []
    for key, entry in metadata.items():
        image = image_of(key, image_dir)
        (found if image else missing).append((key, image, kohya_caption(entry, separator, wildcard)))
    if missing:
        skip(f"{label}: {len(missing)} of {len(metadata)} images of {metadata_path.name} are not found here "
             f"({missing[0][0]}, ...; kohya trains them from its latent cache); they are left out")
    if not wildcard and any("\n" in caption for *_, caption in found):
        skip(f"{label}: captions with several lines: kohya trains the whole text, ot_dist draws one line per epoch")
    if captions_folder is None:
        skip(f"{label}.metadata_file: {metadata_path}: ot_dist reads captions from a file beside each image; give "
             "`--captions_folder DIR` to write links to the images with their captions there")
        return None, []
    if not found:
        skip(f"{label}: none of the images of {metadata_path.name} is found here; the subset is left out")
        return None, []
    folder = Path(captions_folder) / f"{index}_{metadata_path.stem}"
    out.after_validation.append(lambda: write_caption_folder(folder, found))
    out.notes.append(f"{label}: {len(found)} images of {metadata_path.name} -> {folder} (a link to each image and "
                     f"its caption in a {CAPTION_EXTENSION} file: caption, caption_separator {separator!r}, tags)")
    return {"path": str(folder), "caption_extension": CAPTION_EXTENSION}, [image for _, image, _ in found]


def write_caption_folder(folder: Path, found: list[tuple[str, Path, str]]) -> list[str]:
    """A link to each image with its caption beside it; the links' names, in the order of `found`."""
    if folder.exists() and any(folder.iterdir()):
        raise InputFileError(f"--captions_folder: {folder} exists and is not empty (remove it, or name another)")
    folder.mkdir(parents=True, exist_ok=True)
    names: set[str] = set()
    written = []
    for n, (_, image, caption) in enumerate(found):
        name = image.name if image.stem.lower() not in names else f"{n}_{image.name}"  # two keys, one file name
        names.add(Path(name).stem.lower())
        (folder / name).symlink_to(image.resolve())
        (folder / name).with_suffix(CAPTION_EXTENSION).write_text(caption, encoding="utf-8")
        written.append(name)
    return written
