"""Where checkpoints live and how one becomes official.

    output_dir/checkpoints/
        step-00000012/          a committed checkpoint: its COMMITTED marker lists every file and size
        .step-00000018.partial/ being written (or left by a crash): never read, removed at the next commit
        latest                  the name of the newest committed checkpoint, replaced atomically

Every rank writes its files into the partial folder; after a barrier rank 0 checks them, writes the
marker, renames the folder and only then moves `latest` and deletes checkpoints beyond `keep_last`.
A crash at any point leaves the previous checkpoint committed, `latest` pointing at it, and loadable.
The folder must be on storage every rank sees (a cluster volume for multi-node runs), as exports are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ot_dist.errors import InputFileError

MARKER = "COMMITTED"
LATEST = "latest"
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def final_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{final_name(step)}.partial"


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk: a commit must not point at lost writes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_committed(folder: Path) -> bool:
    """A checkpoint counts only if its marker exists and every file it lists has the listed size."""
    marker = folder / MARKER
    if not _NAME.match(folder.name) or not marker.is_file():
        return False
    try:
        listed = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in listed.items())


def commit(partial: Path, root: Path, step: int, keep_last: int | None) -> Path:
    """Rank 0, after every rank finished writing into `partial`: mark, rename, move `latest`, prune."""
    for path in partial.iterdir():
        fsync_path(path)
    files = {p.name: p.stat().st_size for p in sorted(partial.iterdir())}
    write_file_durably(partial / MARKER, json.dumps({"step": step, "files": files}, indent=1).encode())
    fsync_path(partial)
    target = root / final_name(step)
    if target.exists():  # a committed checkpoint of the same step (e.g. a resumed run saving again)
        shutil.rmtree(target)
    os.replace(partial, target)
    fsync_path(root)
    write_file_durably(root / LATEST, (target.name + "\n").encode())
    fsync_path(root)
    prune(root, keep_last, keep=target)
    return target


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_committed(p)]
    return sorted(found, key=lambda p: p.name)


def prune(root: Path, keep_last: int | None, keep: Path) -> None:
    """Delete partial folders and committed checkpoints beyond the newest `keep_last` (never `keep`)."""
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(".") and path.name.endswith(".partial"):
            shutil.rmtree(path, ignore_errors=True)
    if keep_last is None:
        return
    committed = committed_checkpoints(root)
    for old in committed[: max(0, len(committed) - keep_last)]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names if it is committed, else the newest committed one (a crash between
    the rename and the pointer update leaves `latest` one behind)."""
    pointer = root / LATEST
    committed = committed_checkpoints(root)
    newest = committed[-1] if committed else None
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.is_dir() and is_committed(named) and (newest is None or named.name >= newest.name):
            return named
    return newest


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """`--resume`: None (start fresh), "auto" (the latest committed checkpoint in output_dir, if any), or a
    path: a checkpoint folder, or a checkpoints folder / output_dir whose latest is taken."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoints_dir(output_dir))
    path = Path(resume)
    if (path / MARKER).exists():
        if not is_committed(path):
            raise InputFileError(f"--resume {path}: the checkpoint is incomplete (its {MARKER} marker does not match "
                                 "its files); use an earlier one")
        return path
    for root in (path, checkpoints_dir(path)):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found:
            return found
    raise InputFileError(f"--resume {path}: not a committed checkpoint (no {MARKER} marker), and no committed "
                         "checkpoint found under it")
