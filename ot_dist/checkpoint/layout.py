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
from ot_dist.file_modes import share_with_umask

MARKER = "COMMITTED"
LATEST = "latest"
TRAINER_FILE = "trainer.json"  # rank 0's: position, schedule, what the run was (checkpoint/training_state.py)
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
    return _NAME.match(folder.name) is not None and damage(folder) is None


def damage(folder: Path) -> str | None:
    """Why a `step-N` folder is not a committed checkpoint (None: it is). Commit renames a folder to `step-N` only
    after its marker is written, so for such a folder any answer means it was damaged after the commit."""
    marker = folder / MARKER
    if not marker.is_file():
        return f"it has no {MARKER} marker"
    try:
        listed = json.loads(marker.read_text())["files"]
        items = list(listed.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MARKER} marker is unreadable"
    for name, size in items:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, the {MARKER} marker lists {size} (truncated or replaced)"
    return None


def commit(partial: Path, root: Path, step: int, keep_last: int | None, run_id: str | None = None) -> Path:
    """Rank 0, after every rank finished writing into `partial`: mark, rename, move `latest`, prune (only the
    checkpoints of `run_id` when given)."""
    for path in partial.iterdir():
        share_with_umask(path)  # safetensors writes 0600
        fsync_path(path)
    files = {p.name: p.stat().st_size for p in sorted(partial.iterdir())}
    write_file_durably(partial / MARKER, json.dumps({"step": step, "run_id": run_id, "files": files}, indent=1).encode())
    fsync_path(partial)
    target = root / final_name(step)
    if target.exists():  # a folder of the same step (a run resumed past a damaged one saving again; an explicit
        # earlier resume moved its later history aside already: checkpoint/rewind.py)
        # Renamed out of the way, not deleted in place: deleting a checkpoint of many GB takes seconds, and a kill
        # meanwhile would leave a half-deleted `step-N` that `latest` names (a damaged checkpoint, exit 3 at the
        # next --resume auto). As a partial folder it is never read and is swept below or at the next commit.
        replaced = partial_dir(root, step).with_name(f".{target.name}.replaced.partial")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(target, replaced)
    os.replace(partial, target)
    fsync_path(root)
    write_file_durably(root / LATEST, (target.name + "\n").encode())
    fsync_path(root)
    prune(root, keep_last, keep=target, run_id=run_id)
    return target


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_committed(p)]
    return sorted(found, key=lambda p: p.name)


def run_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def prune(root: Path, keep_last: int | None, keep: Path, run_id: str | None = None) -> None:
    """Delete partial folders and committed checkpoints beyond the newest `keep_last` (never `keep`); with
    `run_id`, only that run's checkpoints count and are deleted (another run's are never touched)."""
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(".") and path.name.endswith(".partial"):
            shutil.rmtree(path, ignore_errors=True)
    if keep_last is None:
        return
    committed = committed_checkpoints(root)
    if run_id is not None:
        committed = [p for p in committed if run_of(p) == run_id]
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


def damaged_after(root: Path, found: Path | None) -> list[tuple[Path, str]]:
    """The `step-N` folders newer than `found` that are damaged (newest first), with why."""
    if not root.is_dir():
        return []
    newer = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (found is None or p.name > found.name)]
    return [(p, why) for p in sorted(newer, reverse=True) if (why := damage(p)) is not None]


def latest_undamaged(root: Path, allow_damaged: bool, log=print, what: str = "--resume auto") -> Path | None:
    """The latest committed checkpoint, refusing (exit 3) when a newer one is damaged unless `allow_damaged`."""
    found = latest_checkpoint(root)
    damaged = damaged_after(root, found)
    if damaged:
        folder, why = damaged[0]
        previous = f"the previous one, {found.name}" if found else "none (no earlier committed checkpoint)"
        message = (f"{what}: the latest checkpoint {folder.resolve()} is damaged: {why}. The newest undamaged one is "
                   f"{previous}")
        if not allow_damaged:
            raise InputFileError(message + "; to continue from it set checkpoint.resume_past_damaged: true (or pass "
                                 "that checkpoint explicitly), or repair / restore the damaged folder")
        log(f"warning: {message}; continuing from it (checkpoint.resume_past_damaged)")
    return found


def resolve_resume(resume: str | None, output_dir: str | Path, allow_damaged: bool = False, log=print,
                   command: str = "--resume") -> Path | None:
    """`--resume`: None (start fresh), "auto" (the latest committed checkpoint in output_dir, if any), or a
    path: a checkpoint folder, or a checkpoints folder / output_dir whose latest is taken. A damaged checkpoint
    newer than the one found is an error naming it and why, or with `allow_damaged` a warning. `command` starts
    the messages about a path (`ot-dist export` is given no --resume)."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_undamaged(checkpoints_dir(output_dir), allow_damaged, log)
    path = Path(resume)
    if (path / MARKER).exists() or (_NAME.match(path.name) and path.is_dir()):
        why = damage(path)
        if why:
            raise InputFileError(f"{command} {path.resolve()}: the checkpoint is damaged or incomplete ({why}); "
                                 "use an earlier one")
        return path
    for root in (path, checkpoints_dir(path)):
        found = latest_undamaged(root, allow_damaged, log, f"{path}") if root.is_dir() else None
        if found:
            return found
    raise InputFileError(f"{command} {path.resolve()}: not a committed checkpoint (no {MARKER} marker), and no "
                         "committed checkpoint found under it")
