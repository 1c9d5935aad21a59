"""Video clips as training samples (a video family: Wan): decoding with PyAV (`ot-dist[video]`, ffmpeg bundled) and the
choice of the frames a clip trains on.

The frame conventions are musubi-tuner's (docs/dataset_config.md), which Wan LoRA trainers know:
- `data.video_frames` frames (musubi's `target_frames`, one value): a video VAE with temporal compression k (Wan: 4)
  needs k n + 1 of them; another count is a config error (musubi truncates it silently).
- `frame_extraction: head`: the first frames of the clip (musubi's default and only one-window-per-clip mode).
- `data.video_fps` (the model's rate: Wan trains at 16): frames are skipped (never blended) so that the frames taken
  are 1 / video_fps apart, from a clip at its container's rate or at `data.video_source_fps` when given (musubi's
  `source_fps`: the rate the clips are taken to have). Without video_fps every frame is taken in turn (musubi's
  default: the clip's own rate, whatever it is).
A clip with fewer frames than the selection needs is an unreadable sample, named at `shard build` (never trained
shorter).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from PIL import Image

from ot_dist.errors import ConfigError, InputFileError

# Video containers: a clip in a concept folder (a sample when data.video_frames is set for a video family)
VIDEO_EXTENSIONS = {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".wmv", ".flv"}
FRAME_EXTRACTIONS = ("head",)


class UnreadableClip(InputFileError):
    """A clip that cannot be a sample: it does not decode, or it is shorter than the frames it must give."""


def require_av():
    try:
        import av
    except ImportError:
        raise ConfigError("data.video_frames: video clips are decoded with PyAV: install ot-dist[video] "
                          "(pip install av)") from None
    return av


def source_indices(frames: int, source_fps: float | None, fps: float | None) -> list[int]:
    """The clip's frame numbers (from its first, 0) that give `frames` frames at `fps`: every frame in turn without a
    rate, else frame k is the last one shown at time k / fps (frames are skipped, musubi-tuner's source_fps)."""
    if fps is None or source_fps is None:
        return list(range(frames))
    # + 1e-6: 30 fps at 15 gives 0, 2, 4, ... not 0, 1.99..., by float error
    return [math.floor(k * source_fps / fps + 1e-6) for k in range(frames)]


def clip_frames(data: bytes | Path, frames: int, fps: float | None = None, source_fps: float | None = None,
                where: str = "clip") -> list[Image.Image]:
    """The `frames` RGB frames of a clip (its bytes or its file) the selection takes, decoded up to the last one
    needed. Raises UnreadableClip naming `where` when it does not decode or is too short."""
    av = require_av()
    try:
        container = av.open(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else str(data))
    except (av.error.FFmpegError, OSError, ValueError) as err:
        raise UnreadableClip(f"data: clip {where} could not be opened: {err}") from None
    with container:
        if not container.streams.video:
            raise UnreadableClip(f"data: clip {where} has no video stream")
        stream = container.streams.video[0]
        rate = source_fps or (float(stream.average_rate) if stream.average_rate else None)
        if fps is not None and rate is None:
            raise UnreadableClip(f"data: clip {where} has no frame rate in its container; set data.video_source_fps")
        wanted = source_indices(frames, rate, fps)
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
        raise UnreadableClip(f"data: clip {where} is too short: {frames} frames{at} need its first {last + 1} frames, "
                             f"it has {seen} (data.video_frames, data.video_fps)")
    return [taken[number] for number in wanted]


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
    if (data.video_frames - 1) % k:
        low = (data.video_frames - 1) // k * k + 1
        raise ConfigError(f"data.video_frames: {data.video_frames} frames; {family.name}'s VAE compresses time "
                          f"{k}x and needs {k}n + 1 frames (e.g. {low} or {low + k})")
