"""Video clips as training samples (a video family: Wan): decoding with PyAV (`ot-dist[video]`, ffmpeg bundled) and the
choice of the frames a clip trains on.

The frame conventions are musubi-tuner's (docs/dataset_config.md, dataset/image_video_dataset.py), which Wan LoRA
trainers know:
- `data.video_frames` frames (musubi's `target_frames`, one value): a video VAE with temporal compression k (Wan: 4)
  needs k n + 1 of them; another count is a config error (musubi truncates it silently).
- `data.video_fps` (the model's rate: Wan trains at 16): frames are skipped (never blended) so that the frames taken
  are 1 / video_fps apart, from a clip at its container's rate or at `data.video_source_fps` when given (musubi's
  `source_fps`: the rate the clips are taken to have). Without video_fps every frame is taken in turn (musubi's
  default: the clip's own rate, whatever it is). The frames so taken are the clip's *timeline*.
- `data.video_frame_extraction` (musubi's `frame_extraction`) picks windows of video_frames frames on the timeline of
  T frames, each window a sample of its own (clip_windows): `head` the first (musubi's default), `chunk` the
  consecutive windows that fit (0, F, 2F, ...), `slide` one every `data.video_frame_stride` frames (0, s, 2s, ...
  while it fits), `uniform` `data.video_frame_sample` starts spread evenly over [0, T - F] (numpy's linspace, cut to
  integers; a start given twice is one window), `full` the whole timeline cut to k n + 1 frames and to video_frames
  (musubi's `max_frames`).
A clip with fewer frames than a window needs is an unreadable sample, named at `shard build` (never trained
shorter); so is one that does not decode.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
from PIL import Image

from ot_dist.errors import ConfigError, InputFileError

# Video containers: a clip in a concept folder (a sample when data.video_frames is set for a video family)
VIDEO_EXTENSIONS = {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".wmv", ".flv"}
FRAME_EXTRACTIONS = ("head", "chunk", "slide", "uniform", "full")
# `full` cuts a clip to k n + 1 frames with musubi-tuner's k, 4 for every architecture it trains (vae_frame_stride);
# check_clip_settings refuses it for a VAE of another temporal compression.
FULL_FRAME_MULTIPLE = 4


class UnreadableClip(InputFileError):
    """A clip that cannot be a sample: it does not decode, or it is shorter than the frames it must give."""


def require_av():
    try:
        import av
    except ImportError:
        raise ConfigError("data.video_frames: video clips are decoded with PyAV: install ot-dist[video] "
                          "(pip install av)") from None
    return av


def source_indices(frames: int, source_fps: float | None, fps: float | None, start: int = 0) -> list[int]:
    """The clip's frame numbers (from its first, 0) of frames start .. start + frames - 1 of its timeline at `fps`:
    every frame in turn without a rate, else timeline frame k is the last one shown at time k / fps (frames are
    skipped, musubi-tuner's source_fps)."""
    if fps is None or source_fps is None:
        return list(range(start, start + frames))
    # + 1e-6: 30 fps at 15 gives 0, 2, 4, ... not 0, 1.99..., by float error
    return [math.floor(k * source_fps / fps + 1e-6) for k in range(start, start + frames)]


def timeline_length(source_frames: int, source_fps: float | None, fps: float | None) -> int:
    """How many frames the timeline of a clip of `source_frames` frames has at `fps` (source_indices below it)."""
    if fps is None or source_fps is None:
        return source_frames
    count = 0
    while source_indices(1, source_fps, fps, count)[0] < source_frames:
        count += 1
    return count


def clip_windows(length: int, frames: int, extraction: str = "head", stride: int = 1,
                 sample: int = 1) -> list[tuple[int, int]]:
    """The windows (start, frame count) on a timeline of `length` frames that `extraction` makes samples of, as
    musubi-tuner's cache_latents picks them (its crop_pos_and_frames); [] when the clip is too short for one."""
    if extraction == "full":  # the whole clip, cut to k n + 1 frames and to `frames` (musubi's max_frames)
        count = (min(length, frames) - 1) // FULL_FRAME_MULTIPLE * FULL_FRAME_MULTIPLE + 1
        return [(0, count)] if length >= 1 else []
    if length < frames:
        return []
    if extraction == "head":
        starts = [0]
    elif extraction == "chunk":
        starts = list(range(0, length - frames + 1, frames))
    elif extraction == "slide":
        starts = list(range(0, length - frames + 1, stride))
    elif extraction == "uniform":  # np.linspace(0, T - F, n, dtype=int), a start given twice taken once
        starts = list(dict.fromkeys(int(s) for s in np.linspace(0, length - frames, sample, dtype=int)))
    else:
        raise ValueError(f"data.video_frame_extraction: {extraction!r} is not one of {', '.join(FRAME_EXTRACTIONS)}")
    return [(start, frames) for start in starts]


def _open(av, data: bytes | Path, where: str):
    try:
        container = av.open(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data))
    except (av.error.FFmpegError, OSError, ValueError) as err:
        raise UnreadableClip(f"data: clip {where} could not be opened: {err}") from None
    if not container.streams.video:
        container.close()
        raise UnreadableClip(f"data: clip {where} has no video stream")
    return container


def _rate(stream, source_fps: float | None, fps: float | None, where: str) -> float | None:
    rate = source_fps or (float(stream.average_rate) if stream.average_rate else None)
    if fps is not None and rate is None:
        raise UnreadableClip(f"data: clip {where} has no frame rate in its container; set data.video_source_fps")
    return rate


def clip_frames(data: bytes | Path, frames: int, fps: float | None = None, source_fps: float | None = None,
                where: str = "clip", start: int = 0) -> list[Image.Image]:
    """The RGB frames start .. start + frames - 1 of a clip's timeline (its bytes or its file), decoded up to the last
    one needed. Raises UnreadableClip naming `where` when it does not decode or is too short."""
    av = require_av()
    with _open(av, data, where) as container:
        stream = container.streams.video[0]
        rate = _rate(stream, source_fps, fps, where)
        wanted = source_indices(frames, rate, fps, start)
        last, taken, seen = wanted[-1], {}, 0
        try:
            for number, frame in enumerate(container.decode(stream)):
                seen = number + 1
                if number in wanted:
                    taken[number] = frame.to_image().convert("RGB")
                if number >= last:
                    break
        except (av.error.FFmpegError, ValueError) as err:
            raise UnreadableClip(f"data: clip {where} could not be decoded: {err}") from None
    if seen <= last:
        at = f" at {fps:g} fps from {rate:g}" if fps is not None else ""
        first = f" from frame {start}" if start else ""
        raise UnreadableClip(f"data: clip {where} is too short: {frames} frames{at}{first} need its first {last + 1} "
                             f"frames, it has {seen} (data.video_frames, data.video_fps)")
    return [taken[number] for number in wanted]


def scan_clip(path: Path, selection: dict, where: str) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """(the size of its first frame, its windows) of a clip at `shard build`: `head` decodes the frames it takes (as
    the reader will), the other extractions the whole clip (its length decides the windows). Raises UnreadableClip
    naming `where` when it does not decode or gives no window."""
    frames, fps, source_fps = selection["frames"], selection["fps"], selection["source_fps"]
    extraction = selection.get("extraction", "head")
    if extraction == "head":
        return clip_frames(path, frames, fps, source_fps, where)[0].size, [(0, frames)]
    av = require_av()
    with _open(av, path, where) as container:
        stream = container.streams.video[0]
        rate = _rate(stream, source_fps, fps, where)
        size, count = None, 0
        try:
            for frame in container.decode(stream):  # counted, not converted: only the first is looked at
                size = size or (frame.width, frame.height)
                count += 1
        except (av.error.FFmpegError, ValueError) as err:
            raise UnreadableClip(f"data: clip {where} could not be decoded: {err}") from None
    length = timeline_length(count, rate, fps)
    windows = clip_windows(length, frames, extraction, selection.get("stride", 1), selection.get("sample", 1))
    if not windows:
        at = f" at {fps:g} fps from {rate:g}" if fps is not None else ""
        raise UnreadableClip(f"data: clip {where} is too short: its {count} frames give {length}{at}, a window of "
                             f"{extraction} needs {frames} (data.video_frames, data.video_fps)")
    return size, windows


def check_clip_settings(data, family) -> None:
    """data.video_* against the family: clips only for a video model, and a frame count its VAE takes (k n + 1 for
    temporal compression k). Called before any clip is scanned (shard build) and at train start."""
    if data.video_frames is None:
        return
    if family.temporal_compression is None:
        kind = "trains on images as one-frame videos only" if family.video_model else "is not a video model"
        raise ConfigError(f"data.video_frames: model.family {family.name} {kind}; video clips train wan: remove "
                          "data.video_frames")
    k = family.temporal_compression
    if data.video_frame_extraction == "full" and k != FULL_FRAME_MULTIPLE:
        raise ConfigError(f"data.video_frame_extraction: full cuts clips to {FULL_FRAME_MULTIPLE}n + 1 frames, and "
                          f"{family.name}'s VAE compresses time {k}x; choose head, chunk, slide or uniform")
    if (data.video_frames - 1) % k:
        low = (data.video_frames - 1) // k * k + 1
        raise ConfigError(f"data.video_frames: {data.video_frames} frames; {family.name}'s VAE compresses time "
                          f"{k}x and needs {k}n + 1 frames (e.g. {low} or {low + k})")
