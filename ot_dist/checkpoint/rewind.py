"""Going back to an earlier checkpoint: the later line of history is moved aside, never deleted.

`--resume PATH` names a checkpoint of step N while output_dir holds later ones (a user retrains from step 6 with
another learning rate). Left in place, the old step-12 would stay the newest folder: `--resume auto` (every
Kubernetes pod passes it, a restarted worker group uses it) would jump back to it, and `keep_last` would prune the
retrained checkpoints first. So before training starts rank 0 moves, into

    output_dir/abandoned/<YYYYmmdd-HHMMSS>-resumed-from-step-N/{checkpoints,snapshots,exports}/

every checkpoint folder of step N or later other than the chosen one (committed or damaged: a damaged later one
would stop `--resume auto` too), and the snapshots and `ot-dist export` folders of steps after N. Then `latest`
names the chosen checkpoint. `auto`, `latest` and `keep_last` see only the chosen line from then on.

A kill at any point leaves a folder `--resume auto` continues from the old newest checkpoint or the chosen one,
nothing else: the checkpoints move one `os.replace` each (same file system: atomic), oldest first, so the old newest
stays until the last move (and `latest` naming it wins meanwhile); once it is gone, `latest` names a missing folder
and the newest committed one left is the chosen one (it is rewritten to name it right after).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from ot_dist.checkpoint import layout

ABANDONED = "abandoned"
_STEP = re.compile(r"^step-(\d+)$")  # checkpoints and `ot-dist export` folders are zero-padded, snapshots are not


def step_of(checkpoint: Path) -> int:
    try:
        return int(json.loads((checkpoint / layout.MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(_STEP.match(checkpoint.name).group(1))


def _steps(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def later_history(output_dir: Path, chosen: Path) -> list[Path]:
    """What a resume from `chosen` leaves behind, in the order it is moved: snapshots and exports of later steps
    first (`auto` never reads them), then the checkpoints oldest first."""
    step = step_of(chosen)
    keep = chosen.resolve()
    side = [p for name in ("snapshots", "exports") for s, p in _steps(output_dir / name) if s > step]
    checkpoints = [p for s, p in _steps(layout.checkpoints_dir(output_dir)) if s >= step and p.resolve() != keep]
    return side + checkpoints


def abandon_later_history(output_dir: str | Path, chosen: Path, log=print) -> Path | None:
    """Rank 0, holding the output_dir lock, before training: move the history after `chosen` aside (module
    docstring). Returns the folder it went to, or None when there was none."""
    output_dir = Path(output_dir)
    later = later_history(output_dir, chosen)
    if not later:
        _point_latest_at(output_dir, chosen)  # a move a kill interrupted after its last folder
        return None
    step = step_of(chosen)
    target = output_dir / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-resumed-from-step-{step}"
    base, n = target, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}.{n}")
    for path in later:
        (target / path.parent.name).mkdir(parents=True, exist_ok=True)
        os.replace(path, target / path.parent.name / path.name)
        layout.fsync_path(path.parent)
    _point_latest_at(output_dir, chosen)
    names = ", ".join(f"{p.parent.name}/{p.name}" for p in later)
    log(f"--resume {chosen}: moved the later history aside (nothing deleted) to {target}: {names}; --resume auto and "
        f"checkpoint.keep_last now follow step {step} onward")
    return target


def _point_latest_at(output_dir: Path, chosen: Path) -> None:
    """`latest` names the chosen checkpoint when it lies in output_dir (one elsewhere: the first commit names its
    successor)."""
    root = layout.checkpoints_dir(output_dir)
    pointer = root / layout.LATEST
    if chosen.parent.resolve() != root.resolve():
        return
    if pointer.is_file() and pointer.read_text().strip() == chosen.name:
        return
    layout.write_file_durably(pointer, (chosen.name + "\n").encode())
    layout.fsync_path(root)
