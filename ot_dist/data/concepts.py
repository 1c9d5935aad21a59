"""Concepts: folders of images with their captions, optional masks and reference images (edit models: a folder
paired by file name, `reference_path`), scanned into a sample list.

Errors name the file and the config key of the concept, so a user can fix the data before any
shard is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ot_dist.config.schema import ConceptConfig, DataConfig
from ot_dist.data import images as image_files
from ot_dist.data.images import HEIF_EXTENSIONS, UnreadableImage, open_image
from ot_dist.data.unreadable import check_unreadable
from ot_dist.data.video import VIDEO_EXTENSIONS, UnreadableClip, scan_clip
from ot_dist.errors import InputFileError

MASK_SUFFIX = "-masklabel.png"
# OneTrainer's collector leaves out every image whose name before the extension ends in one of these, whatever the
# extension (mgds CollectPaths, exclude_postfix): its masks (read only as `<stem>-masklabel.png`) and its custom
# conditioning images (`<stem>-condlabel.png`). They are not samples; -> why ot_dist does not use them.
# Video containers: without data.video_frames a clip in a concept folder is not training data; a video family refuses
# it (check_video_clips) rather than leave it out with the other unused files. With it, clips are samples (video.py).
VIDEO_REASON = "a video clip (ot_dist trains on images only)"
NOT_SAMPLES = {"-masklabel": "a mask that is not a PNG (masks are <image name>-masklabel.png)",
               "-condlabel": "OneTrainer's conditioning image of its image (custom_conditioning_image), not a sample"}
# Files that sit beside photos and are not samples: not listed as unused.
SIDECAR_NAMES = {".ds_store", "thumbs.db", "desktop.ini"}
SIDECAR_SUFFIXES = {".xmp", ".aae"}  # editing sidecars (Lightroom / darktable, iPhone edits)
# macOS AppleDouble files: `._<name>` beside every file macOS copies to a USB disk, a network share or a Finder zip
# (`._photo.jpg` holds photo.jpg's metadata, not an image).
SIDECAR_PREFIX = "._"


def is_sidecar(path: Path) -> bool:
    return (path.name.lower() in SIDECAR_NAMES or path.suffix.lower() in SIDECAR_SUFFIXES
            or path.name.startswith(SIDECAR_PREFIX))


@dataclass(frozen=True)
class SourceSample:
    concept: int  # index into the concept list
    image: Path
    caption: str  # one or more captions, one per line; the prefix is already applied
    mask: Path | None
    size: tuple[int, int]  # (width, height) of the image file (of a clip: of its first frame)
    number: int = 0  # position in the list of every concept's images (concept, then path): names the sample
    reference: Path | None = None  # the concept's reference_path partner (edit models' conditioning image)
    more_references: tuple[Path, ...] = ()  # its second, third ... (numbered partners: `a_0.png`, `a_1.png`)
    # a video clip's window (start, frame count) on its timeline (video.py clip_windows): each window is a sample
    window: tuple[int, int] | None = None


def concept_name(concept: ConceptConfig) -> str:
    return concept.name or Path(concept.path).name


@dataclass
class Scan:
    """What a scan of the concept folders found: the samples, the unreadable images (bad samples, counted
    against data.max_bad_fraction) and every other file that is not used, each with its reason."""

    samples: list[SourceSample]  # a clip gives one per window (data.video_frame_extraction)
    bad: list[tuple[Path, str]]  # (image, error)
    unused: list[tuple[Path, str]]  # (file, reason)

    def files(self) -> int:
        """The images and clips read (a clip's windows counted once), the unreadable ones too."""
        return len({s.image for s in self.samples}) + len(self.bad)

    def unused_line(self) -> str:
        """`3 files not used: a.heic (install ot-dist[heic]), notes.pdf (not an image)`, or '' when none."""
        if not self.unused:
            return ""
        files = ", ".join(f"{path} ({reason})" for path, reason in self.unused)
        return f"{len(self.unused)} file{'s' if len(self.unused) != 1 else ''} not used: {files}"


def scan_concepts(data: DataConfig, log=print) -> list[SourceSample]:
    """Every usable image of every concept, in a stable order (concept, then path); see `scan_folders`."""
    return scan_folders(data, log).samples


def scan_folders(data: DataConfig, log=print, part: tuple[int, int] | None = None, workers: int = 1) -> Scan:
    """Decode every image once (upright size), so a broken file is found before any shard is written.
    Unreadable images (broken, empty, over data.max_image_pixels) are named; more of them than
    data.max_bad_fraction of the images stops the build (exit 3), fewer are skipped with a warning.
    `part` (i, n): only the i-th of n contiguous ranges of the image list (`ot-dist shard build --part`); the
    limit on unreadable images is then checked over all parts when they are merged (shard_parts.py). `workers`:
    processes that decode the images (`ot-dist shard build --workers`)."""
    from ot_dist.data.images import parse_colour

    samples: list[SourceSample] = []
    bad: list[tuple[Path, str]] = []
    unused: list[tuple[Path, str]] = []
    background = parse_colour(data.image_background)
    listed: list[tuple[int, ConceptConfig, Path]] = []
    partners: dict[tuple[int, Path], list[Path]] = {}  # per concept: two may share a folder of images
    for index, (label, concept) in enumerate(data.concept_list()):
        images, skipped = classify_files(label, concept, clips=data.video_frames is not None)
        unused += skipped
        listed += [(index, concept, image) for image in images]
        # stat only: a missing one stops before any decoding
        partners |= {(index, image): found for image, found in reference_partners(label, concept, images).items()}
    start, stop = part_range(len(listed), *(part or (0, 1)))
    probe = SizeProbe(data.max_image_pixels, background, clip_selection(data))
    sizes = map_over_workers(probe, [listed[number][2] for number in range(start, stop)], workers)
    for number, size in zip(range(start, stop), sizes):
        index, concept, image = listed[number]
        if isinstance(size, str):
            bad.append((image, size))
            continue
        references = partners.get((index, image), [])
        size, windows = (size.size, size.windows) if isinstance(size, ClipSize) else (size, [None])
        caption = read_caption(concept, image)
        samples += [SourceSample(index, image, caption, mask_of(image), size, number,
                                 references[0] if references else None, tuple(references[1:]), window)
                    for window in windows]
    scan = Scan(samples, bad, unused)
    if part is None:
        check_bad_fraction(data, bad, scan.files(), log)
    return scan


@dataclass(frozen=True)
class ClipSize:
    """What SizeProbe finds of a clip: its first frame's (width, height) and its windows (video.py clip_windows)."""

    size: tuple[int, int]
    windows: list[tuple[int, int]]


class SizeProbe:
    """Callable on an image path -> its upright (width, height), or the error text naming it; picklable. A clip: a
    ClipSize, after decoding the frames that decide its windows (a clip too short for one is named here)."""

    def __init__(self, max_pixels, background, clips: dict | None = None):
        self.max_pixels, self.background, self.clips = max_pixels, background, clips

    def __call__(self, image: Path) -> tuple[int, int] | str:
        try:
            if self.clips is not None and image.suffix.lower() in VIDEO_EXTENSIONS:
                return ClipSize(*scan_clip(image, self.clips, str(image)))
            return open_image(image, self.max_pixels, self.background).size
        except (UnreadableImage, UnreadableClip) as err:
            return str(err)


def clip_selection(data: DataConfig) -> dict | None:
    """How clips' frames are chosen, from data.video_* (video.py: frames, rates, extraction and its stride / sample
    count); None when clips are not samples. The latent cache's key holds it."""
    if data.video_frames is None:
        return None
    return {"frames": data.video_frames, "fps": data.video_fps, "source_fps": data.video_source_fps,
            "extraction": data.video_frame_extraction, "stride": data.video_frame_stride,
            "sample": data.video_frame_sample}


def map_over_workers(function, items: list, workers: int) -> list:
    """[function(item) for item in items], over `workers` forked processes when above 1 (in order)."""
    if workers <= 1 or len(items) < 2:
        return [function(item) for item in items]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    chunk = max(1, min(64, len(items) // (4 * workers)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return list(pool.map(function, items, chunksize=chunk))
        except BrokenProcessPool:
            raise RuntimeError("shard build: a worker process died while scanning the images (killed or out of "
                               "memory); run the build again") from None


def part_range(images: int, part: int, parts: int) -> tuple[int, int]:
    """[start, stop) of the part-th of `parts` contiguous, near-equal ranges of `images` images."""
    return part * images // parts, (part + 1) * images // parts


def check_bad_fraction(data: DataConfig, bad: list[tuple], total: int, log=print) -> None:
    """Stop (exit 3) when more than data.max_bad_fraction of the `total` images are unreadable; warn for fewer."""
    check_unreadable([str(error) for _, error in bad], total, data.max_bad_fraction, "images", log)


def list_images(label: str, concept: ConceptConfig) -> list[Path]:
    return classify_files(label, concept)[0]


def classify_files(label: str, concept: ConceptConfig, clips: bool = False) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The images of a concept folder (`clips`: and its video clips, data.video_frames), and every other file that is
    neither an image, a caption, a mask nor a known sidecar, with the reason it is not used. Errors when the folder
    has no image."""
    root = Path(concept.path)
    if not root.is_dir():
        raise InputFileError(f"{label}: {root.resolve()} is not a folder")
    pattern = "**/*" if concept.include_subdirectories else "*"
    found = sorted(root.glob(pattern))
    files = [p for p in found if p.is_file()]
    extensions = image_files.image_extensions() | (VIDEO_EXTENSIONS if clips else set())
    images = [p for p in files if p.suffix.lower() in extensions and not p.stem.endswith(tuple(NOT_SAMPLES))
              and not is_sidecar(p)]
    known = set(images) | {p.with_name(p.stem + MASK_SUFFIX) for p in images}
    if concept.caption_source == "txt":
        known |= {p.with_suffix(concept.caption_extension) for p in images}
    # a link whose file is gone (an unmounted store, a moved folder) is no file, but it was meant to be one
    unused = [(p.relative_to(root), "a link to a missing file") for p in found if p.is_symlink() and not p.exists()]
    for path in files:
        if path in known or is_sidecar(path):
            continue
        if path.suffix.lower() in HEIF_EXTENSIONS and not image_files.heif_available():
            reason = "install ot-dist[heic]"
        elif path.name.endswith(MASK_SUFFIX):
            reason = "a mask without its image"
        elif path.stem.endswith(tuple(NOT_SAMPLES)):
            reason = next(why for ending, why in NOT_SAMPLES.items() if path.stem.endswith(ending))
        elif concept.caption_source == "txt" and path.suffix == concept.caption_extension:
            reason = "a caption without its image"
        elif path.suffix.lower() in VIDEO_EXTENSIONS:
            reason = VIDEO_REASON
        else:
            reason = "not an image"
        unused.append((path.relative_to(root), reason))
    if not images:
        raise InputFileError(f"{label}: no images (any format Pillow reads: png, jpg, webp, avif, tiff, gif, ...) in "
                             f"{root.resolve()}" + (f"; not used: {', '.join(f'{p} ({r})' for p, r in unused)}"
                                                    if unused else ""))
    return images, unused


def reference_partners(label: str, concept: ConceptConfig, images: list[Path]) -> dict[Path, list[Path]]:
    """image -> its reference images: the file at the image's path relative to the concept folder under
    concept.reference_path, with the same extension or, when there is none such, the one image file of that name
    with any extension (a PNG edit beside a JPEG source); or, where no file has the image's name, its numbered ones
    `<name>_0`, `<name>_1`, ... (`_0000` too) in number order (musubi-tuner's control_directory layout for several
    control images: FLUX.2 and Qwen-Image-Edit-2509 read them as their image list). A list of folders gives one
    partner by name from each, in list order (ai-toolkit's control_path list, SimpleTuner's conditioning datasets).
    Every image must have its partner, and a concept's images as many as its image with the most: the images without
    (a number missing from 0 up), or with two candidates, are named in one error. {} without reference_path."""
    if concept.reference_path is None:
        return {}
    if isinstance(concept.reference_path, str):
        return folder_partners(f"{label}.reference_path", concept, Path(concept.reference_path), images)
    per_folder = [folder_partners(f"{label}.reference_path[{k}]", concept, Path(folder), images, numbered=False)
                  for k, folder in enumerate(concept.reference_path)]
    return {image: [partners[image][0] for partners in per_folder] for image in images}


def folder_partners(where: str, concept: ConceptConfig, folder: Path, images: list[Path],
                    numbered: bool = True) -> dict[Path, list[Path]]:
    """image -> its partners in one reference folder (reference_partners); `numbered` false: the partner named as the
    image only (one folder of a list)."""
    root = Path(concept.path)
    if not folder.is_dir():
        raise InputFileError(f"{where}: {folder.resolve()} is not a folder")
    if folder.resolve() == root.resolve():
        raise InputFileError(f"{where} is the concept's own folder {root.resolve()}: every image would "
                             "be its own reference; give the folder of the reference images")
    extensions = image_files.image_extensions()
    pattern = "**/*" if concept.include_subdirectories else "*"
    by_name: dict[str, list[Path]] = {}
    for path in sorted(folder.glob(pattern)):
        if path.is_file() and path.suffix.lower() in extensions and not is_sidecar(path):
            by_name.setdefault(path.relative_to(folder).with_suffix("").as_posix(), []).append(path)
    numbered_names = numbered_partners(by_name) if numbered else {}
    partners, missing, ambiguous = {}, [], []
    for image in images:
        relative = image.relative_to(root)
        name = relative.with_suffix("").as_posix()
        found, unclear = [], []
        for candidates in [by_name[name]] if name in by_name else numbered_names.get(name, []):
            same = [c for c in candidates if c.suffix == image.suffix]
            if same or len(candidates) == 1:
                found.append((same or candidates)[0])
            else:
                unclear.append(", ".join(c.name for c in candidates))
        if unclear:
            ambiguous.append(f"{relative} ({'; '.join(unclear)})")
        elif found:
            partners[image] = found
        else:
            missing.append(str(relative))
    most = max((len(found) for found in partners.values()), default=0)
    fewer = [f"{image.relative_to(root)} ({len(found)})" for image, found in partners.items() if len(found) < most]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of {len(images)} images have no reference image (the same relative path, "
                        f"any image extension, under {folder.resolve()}"
                        f"{', or numbered from `_0` up' if numbered else ''}): {names_shown(missing)}")
    if fewer:
        problems.append(f"{len(fewer)} images have fewer numbered reference images than the {most} of others (a "
                        f"number missing from _0 up): {names_shown(fewer)}")
    if ambiguous:
        problems.append(f"{len(ambiguous)} images have more than one candidate reference: {names_shown(ambiguous)}")
    if problems:
        raise InputFileError(f"{where}: " + "; ".join(problems))
    return partners


NUMBERED = re.compile(r"(.+)_(\d+)")


def numbered_partners(by_name: dict[str, list[Path]]) -> dict[str, list[list[Path]]]:
    """name -> the candidates of `<name>_0`, `<name>_1`, ... in number order, up to the first number missing (a gap
    leaves the later ones out, so the image reads as having fewer: named by reference_partners)."""
    numbers: dict[str, dict[int, list[Path]]] = {}
    for name, candidates in by_name.items():
        match = NUMBERED.fullmatch(name)
        if match:
            numbers.setdefault(match[1], {}).setdefault(int(match[2]), []).extend(candidates)
    out = {}
    for name, by_number in numbers.items():
        run = []
        while len(run) in by_number:
            run.append(by_number[len(run)])
        if run:
            out[name] = run
    return out


def names_shown(names: list[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def mask_of(image: Path) -> Path | None:
    mask = image.with_name(image.stem + MASK_SUFFIX)
    return mask if mask.is_file() else None


def read_caption(concept: ConceptConfig, image: Path) -> str:
    if concept.caption_source == "filename":
        captions = [image.stem]
    elif concept.caption_source == "text":  # one caption per line, as in a file, each with the prefix
        captions = caption_lines(concept.caption_text or "")
    else:
        caption_file = image.with_suffix(concept.caption_extension)
        if not caption_file.is_file():
            raise InputFileError(
                f"data: {image} has no caption file {caption_file.name} (caption_source txt, "
                f"caption_extension {concept.caption_extension})"
            )
        try:
            # utf-8-sig: a byte order mark (Notepad's UTF-8) is no part of the caption; read as text it would become
            # three extra tokens in front of it and a first tag that matches no keep / special tag.
            text = caption_file.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as err:
            raise InputFileError(f"data: caption {caption_file} is not UTF-8 text: {err}") from None
        captions = caption_lines(text)
    return "\n".join(framed(concept, c) for c in captions)


def framed(concept: ConceptConfig, caption: str) -> str:
    """The caption between the concept's prefix and suffix, as kohya's process_caption joins them before any dropout
    or shuffling (the validators put the spaces in); an empty caption gets no space before the suffix."""
    text = (concept.caption_prefix + caption).rstrip()
    return text + concept.caption_suffix if text else concept.caption_suffix.lstrip()


def caption_lines(text: str) -> list[str]:
    """The captions of a text, one per non-blank line, stripped (OneTrainer's LoadMultipleTexts); [""] when none."""
    return [line.strip() for line in text.splitlines() if line.strip()] or [""]


def check_clip_batches(manifest: dict, batch_size: int) -> None:
    """A set of clips and images, or of clips of several lengths (extraction full), trains with batch_size 1 only: a
    clip's (3, F, H, W) pixels and an image's (3, H, W) cannot stack into one micro batch (padded to one length, the
    padding frames would be attended: WanTransformer3DModel takes no attention mask), and the epoch plan groups
    samples by bucket, not by frame count as musubi-tuner's batches do (checked before the model loads, rather than
    at the first mixed batch)."""
    clips, total = manifest.get("clip_samples", 0), manifest.get("sample_count", 0)
    if 0 < clips < total and batch_size > 1:
        raise InputFileError(f"data: the shard set holds {clips} video clips and {total - clips} images, which cannot "
                             f"share a micro batch (batch_size {batch_size}): an image's latent has 1 frame, a clip's "
                             "more, and Wan's transformer takes no mask to pad them to one length, while the epoch "
                             "plan groups samples by bucket, not by frame count; train them in separate runs, or with "
                             "batch_size 1 (gradient_accumulation_steps for a larger global batch)")
    counts = manifest.get("clip_frame_counts", [])
    if len(counts) > 1 and batch_size > 1:
        raise InputFileError(f"data: the shard set's clips have {len(counts)} frame counts ({', '.join(map(str, counts))}: "
                             "data.video_frame_extraction full keeps each clip's length), whose frames cannot share a "
                             f"micro batch (batch_size {batch_size}); train with batch_size 1, or with clips of at least "
                             "data.video_frames frames, or another extraction")


def check_video_clips(manifest: dict, family) -> None:
    """A video family (Wan) refuses video clips left out of its concepts (no data.video_frames): they were surely
    meant as training data, and would otherwise be left out with a line in the unused-files report."""
    if not family.video_model:
        return
    clips = [entry["file"] for entry in manifest.get("unused_files", []) if entry.get("reason") == VIDEO_REASON]
    if clips:
        shown = ", ".join(clips[:5]) + (f" and {len(clips) - 5} more" if len(clips) > 5 else "")
        raise InputFileError(f"model.family {family.name}: the concepts hold {len(clips)} video clip"
                             f"{'s' if len(clips) != 1 else ''} ({shown}); ot_dist trains {family.name} on images as "
                             + ("one-frame videos unless data.video_frames is set: set it (and data.video_fps) to train "
                                "on the clips (docs/data.md#video-clips), or move them out of the concept folders"
                                if family.temporal_compression else
                                "one-frame videos and cannot train on video clips yet: extract frames as images or move "
                                "the clips out of the concept folders"))
