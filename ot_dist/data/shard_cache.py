"""Where shard sets live when data.shards is not set, and `ot-dist shard list | prune`.

The cache folder is data.cache_dir, else the environment's OT_DIST_CACHE, else `ot_dist-cache` beside output_dir
(in output_dir's parent: shared by the runs kept there, and on the storage every node of a run already shares).
Shard sets go to <cache>/shards/<name>-<hash of the folders and build settings>; a change of settings builds a new
set beside the old one, and the old one stays until it is pruned.

A set's status: `current` (its source files are as they were when it was built), `sources changed` (an image,
caption or mask was added, removed or edited since: a training run would rebuild it), `sources missing` (a concept
folder is gone), `incomplete` (no manifest: a build that failed or is still running) or `unknown` (its manifest
is from another ot_dist version). `prune` removes the changed, missing and incomplete ones (incomplete only when
nothing in it changed for an hour: it may be a build under way), and with --unused-days N also the sets no training
run used for N days. Training touches `<set>/last_used` at start.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ot_dist.errors import UserError

CACHE_ENV = "OT_DIST_CACHE"
LAST_USED = "last_used"
BUILD_GRACE_SECONDS = 3600  # an incomplete set changed more recently than this may be a build under way


def cache_root(config) -> Path:
    if config.data.cache_dir:
        return Path(config.data.cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(config.output_dir).parent / "ot_dist-cache"


def sets_dir(root: Path) -> Path:
    return Path(root) / "shards"


def mark_used(shard_dir: Path) -> None:
    """Record that a run trains from this set (for `prune --unused-days`); a read-only set is left alone."""
    try:
        (Path(shard_dir) / LAST_USED).write_text(f"{time.time():.0f}\n")
    except OSError:
        pass


@dataclass
class SetInfo:
    path: Path
    bytes: int
    samples: int | None
    status: str
    last_used: float | None  # seconds since the epoch
    changed: float  # the newest file's mtime
    built_from: str | None

    @property
    def stale(self) -> bool:
        return self.status in ("sources changed", "sources missing")


def set_status(path: Path) -> tuple[str, dict | None]:
    """(status, manifest or None) of one shard set folder."""
    from ot_dist.config.schema import ConceptConfig
    from ot_dist.data.shards import FORMAT, MANIFEST, fingerprint_of

    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return "incomplete", None
    if manifest.get("format") != FORMAT:  # an earlier ot_dist's set: this version does not read it
        return "unknown", manifest
    settings = {k: v for k, v in manifest.get("built_from", {}).items() if k != "config"}
    try:
        concepts = [(f"concepts[{i}]", ConceptConfig(**c)) for i, c in enumerate(settings["concepts"])]
    except (KeyError, TypeError, ValueError):
        return "unknown", manifest
    try:
        fingerprint = fingerprint_of(settings, concepts)
    except UserError:  # a folder gone, or without images
        return "sources missing", manifest
    return ("current" if fingerprint == manifest.get("fingerprint") else "sources changed"), manifest


def scan_sets(root: Path) -> list[SetInfo]:
    folder = sets_dir(root)
    if not folder.is_dir():
        return []
    infos = []
    for path in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = [f for f in path.rglob("*") if f.is_file()]
        status, manifest = set_status(path)
        used = path / LAST_USED
        infos.append(SetInfo(
            path=path, bytes=sum(f.stat().st_size for f in files),
            samples=manifest.get("sample_count", len(manifest.get("samples", []))) if manifest else None, status=status,
            last_used=used.stat().st_mtime if used.is_file() else None,
            changed=max((f.stat().st_mtime for f in files), default=path.stat().st_mtime),
            built_from=(manifest or {}).get("built_from", {}).get("config")))
    return infos


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds)) if seconds else "never"


def list_lines(root: Path, in_use: Path | None = None) -> list[str]:
    infos = scan_sets(root)
    if not infos:
        return [f"no shard sets in {sets_dir(root)}"]
    lines = [f"shard sets in {sets_dir(root)}:"]
    for info in infos:
        mark = "  <- this config" if in_use is not None and info.path.resolve() == Path(in_use).resolve() else ""
        samples = f"{info.samples} samples" if info.samples is not None else "-"
        lines.append(f"  {info.path.name:<28} {human_size(info.bytes):>9} {samples:>14}  {info.status:<15} last used "
                     f"{when(info.last_used)}" + (f"  built from {info.built_from}" if info.built_from else "") + mark)
    stale = [i for i in infos if i.stale or i.status == "incomplete"]
    total = f"  total {human_size(sum(i.bytes for i in infos))} in {len(infos)} set(s)"
    if stale:
        total += (f"; {len(stale)} stale or incomplete ({human_size(sum(i.bytes for i in stale))}): "
                  f"ot-dist shard prune --cache {root}")
    return lines + [total]


def prune(root: Path, unused_days: float | None = None, dry_run: bool = False, keep: Path | None = None,
          now: float | None = None) -> list[str]:
    """Remove the stale and incomplete sets (and with `unused_days` those unused that long); the lines to print."""
    now = time.time() if now is None else now
    removed, lines = 0, []
    for info in scan_sets(root):
        if keep is not None and info.path.resolve() == Path(keep).resolve():
            continue
        reason = None
        if info.stale:
            reason = info.status
        elif info.status == "incomplete" and now - info.changed > BUILD_GRACE_SECONDS:
            reason = "incomplete"
        elif unused_days is not None and now - (info.last_used or info.changed) > unused_days * 86400:
            reason = f"unused for {unused_days:g} days"
        if reason is None:
            continue
        if not dry_run:
            shutil.rmtree(info.path)
        removed += info.bytes
        lines.append(f"{'would remove' if dry_run else 'removed'} {info.path} ({human_size(info.bytes)}, {reason})")
    lines.append(f"{'would free' if dry_run else 'freed'} {human_size(removed)}" if lines else
                 f"nothing to prune in {sets_dir(root)}")
    return lines
