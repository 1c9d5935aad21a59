"""The output folder of a run: checked before anything heavy loads, and never shared by two runs.

    output_dir/run.json     {"run_id": ..., "started_at": ...}: written when a run starts from step 0

A run is identified by its run id; every checkpoint it commits carries it (the COMMITTED marker and
trainer.json), and a resumed run keeps its checkpoint's id. `keep_last` only prunes checkpoints with
the current id, so whatever else is in `checkpoints/` is never deleted by another run.

Starting from step 0 in a folder that holds a run (run.json, checkpoints or exports) is refused with exit
code 2, naming the folder and the choices: `--resume auto`, another output_dir, or `--overwrite`, which
moves the old folder aside to `<output_dir>.old-<time>` (nothing is deleted).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.rewind import abandon_later_history
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.parallel.runtime import gather_objects

RUN_FILE = "run.json"
LOCK_FILE = ".ot_dist.lock"  # held (flock) by rank 0 of the run training in the folder
# What a run leaves in output_dir (the methods' exports, their EMA twins, checkpoints, snapshots).
RUN_ENTRIES = (RUN_FILE, "checkpoints", "snapshots", "exports", "model", "model.safetensors", "lora.safetensors",
               "embedding.safetensors", "model_ema", "model_ema.safetensors", "lora_ema.safetensors",
               "embedding_ema.safetensors", "embeddings", "embeddings_ema")
EXPORTS = RUN_ENTRIES[5:]
# How long a rank waits to see the checkpoint rank 0 resumes from. A network filesystem's attribute cache holds a
# directory's listing up to a minute (NFS acdirmax, 60 s by default): right after a restart, a checkpoint committed just
# before the failure can still be invisible on another node. Past this, it is not a cache but storage the rank does not
# share.
MARKER_WAIT_S = 120.0


def resolved(output_dir: str | Path) -> Path:
    return Path(output_dir).expanduser().resolve()


def earlier_run(output_dir: str | Path) -> list[str]:
    """The entries of `output_dir` that show a run was there (empty: none). `launch/` (written by `ot-dist
    launch` before the workers start), MLflow's local store and outbox and sample images do not count."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for name in RUN_ENTRIES:
        path = out / name
        if name == "checkpoints":
            if path.is_dir() and any(path.iterdir()):
                found.append("checkpoints/")
        elif path.exists():
            found.append(name + ("/" if path.is_dir() else ""))
    # run.json alone: a run stopped before it saved or exported anything (bad input found by the checks after the
    # folder was prepared: a mistyped model.path, unreadable images). It has nothing to lose, and refusing the
    # corrected command as "already holds a run" would send the user to --overwrite for nothing.
    return [] if found == [RUN_FILE] else found


def refusal(output_dir: str | Path, found: list[str], why: str = "") -> ConfigError:
    return ConfigError(
        f"output_dir {resolved(output_dir)} already holds a run ({', '.join(found)}){why}; starting again would "
        "overwrite it. Choose one: --resume auto (continue it), another output_dir, or --overwrite (moves the old "
        f"folder aside to {resolved(output_dir).name}.old-<time>)"
    )


def check_writable(output_dir: str | Path, key: str = "output_dir") -> Path:
    """Create `output_dir` if needed and prove that a file can be written there; exit 3 naming `key` and the
    resolved path."""
    path = resolved(output_dir)
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        what = "is not a folder" if ancestor == path else f"cannot be created: {ancestor} is not a folder"
        raise InputFileError(f"{key} {path} {what}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise InputFileError(f"{key} {path} is not writable: {err.strerror or err}") from None
    return path


def move_aside(output_dir: str | Path) -> Path:
    """`--overwrite`: rename the folder to `<output_dir>.old-<time>` (a number is added when that exists)."""
    path = resolved(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.old-{stamp}-{n}")
    os.replace(path, target)
    return target


def read_started_at(output_dir: str | Path) -> float | None:
    try:
        return float(json.loads((Path(output_dir) / RUN_FILE).read_text())["started_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_run_id(output_dir: str | Path) -> str | None:
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_run_id(folder: Path) -> str | None:
    try:
        return json.loads((folder / layout.MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def check_before_start(output_dir: str | Path, resume: str | None, overwrite: bool,
                       allow_damaged: bool = False, log=print) -> tuple[Path | None, bool]:
    """Read-only: what starting in `output_dir` means. Returns (the checkpoint to resume from, whether the
    folder is to be moved aside). Raises for a run that would be overwritten and for a bad --resume."""
    found = earlier_run(output_dir)
    if overwrite:
        if resume == "auto":
            raise ConfigError("--overwrite starts a new run and --resume auto continues the old one: give one of them")
        if resume is not None and found and resolved(resume).is_relative_to(resolved(output_dir)):
            raise ConfigError(f"--overwrite would move the checkpoint --resume {resume} aside with {resolved(output_dir)}; "
                              "resume without --overwrite, or copy the checkpoint elsewhere first")
    folder = layout.resolve_resume(resume, output_dir, allow_damaged=allow_damaged, log=log) if resume else None
    if overwrite:
        return folder, bool(found)
    if resume is None and found:
        raise refusal(output_dir, found)
    if resume == "auto" and folder is None and any(e.rstrip("/") in EXPORTS for e in found):
        raise refusal(output_dir, found, " but no committed checkpoint to resume from (it finished without one, or "
                      "its checkpoints were deleted)")
    if resume not in (None, "auto") and folder is not None:
        owner, theirs = read_run_id(output_dir), checkpoint_run_id(folder)
        if owner and theirs and owner != theirs:
            raise refusal(output_dir, found, f", another run than the checkpoint {folder} belongs to")
    return folder, False


# The locks this process holds, by folder: a second Trainer on the same folder in one process (tests, notebooks) and
# a rank forked from it share the lock instead of refusing themselves.
_held: dict[Path, object] = {}


def lock_output_dir(out: Path) -> None:
    """Rank 0 holds an exclusive lock on `out` while it trains: a second run started on the same folder (a double
    start, a pod believed dead, two `--resume auto`) is refused, instead of both writing the same checkpoint folders
    and one of them dying at a later save with an error about the other's files. The kernel releases the lock when
    the process ends, however it ends. On storage without locks (some network mounts) nothing is locked."""
    if out in _held:
        return
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return
    file = open(out / LOCK_FILE, "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        file.seek(0)
        holder = file.read().strip()
        file.close()
        if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            raise ConfigError(f"output_dir {out} is in use by another run ({holder or 'a process holds its lock'}); "
                              "two runs in one folder would overwrite each other's checkpoints. Wait for it to end "
                              "(or stop it), or choose another output_dir") from None
        return  # no locks on this storage
    file.seek(0)
    file.truncate()
    file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    _held[out] = file


def release_output_dir(out: str | Path) -> None:
    """The run in `out` is over (its last checkpoint committed): another may start there."""
    file = _held.pop(resolved(out), None)
    if file is not None:
        file.close()


@dataclass
class RunFolder:
    output_dir: Path
    run_id: str
    resume_from: Path | None  # the committed checkpoint to continue from, or None (step 0)
    moved_to: Path | None = None  # --overwrite: where the earlier run went
    started_at: float | None = None  # run.json's: when the run first started (the exports' ModelSpec date)
    abandoned: Path | None = None  # --resume of an earlier checkpoint: where the later history went (rank 0)


def prepare_run_folder(output_dir: str | Path, resume: str | None, overwrite: bool, runtime,
                       allow_damaged: bool = False, log=print) -> RunFolder:
    """Rank 0 checks, and every rank takes its answer (`agreed_start`); then rank 0 moves an old run aside
    (--overwrite), creates the folder and writes run.json, and a resume from an earlier checkpoint than the newest
    moves the later history aside (checkpoint/rewind.py); then every rank proves it can write there."""
    folder, move = agreed_start(output_dir, resume, overwrite, runtime, allow_damaged, log)
    runtime.barrier()  # nobody changes the folder before every rank has looked at it
    moved = abandoned = None
    if runtime.is_main:
        moved = move_aside(output_dir) if move else None
        if moved:
            log(f"--overwrite: moved the earlier run to {moved}")
        out = check_writable(output_dir)
        lock_output_dir(out)  # held before the later history moves: no second run reads it half moved
        if folder is not None and resume != "auto":  # `auto` is the newest already: nothing is later
            abandoned = abandon_later_history(out, folder, log)
        if folder is None or not (out / RUN_FILE).exists():
            run_id = (checkpoint_run_id(folder) if folder else None) or uuid.uuid4().hex
            text = json.dumps({"run_id": run_id, "started_at": time.time()}, indent=1) + "\n"
            layout.write_file_durably(out / RUN_FILE, text.encode())
    runtime.barrier()
    out = check_writable(output_dir)
    run_id = (checkpoint_run_id(folder) if folder else None) or read_run_id(out)
    if run_id is None:
        raise InputFileError(f"output_dir {out}: {RUN_FILE} is unreadable; is output_dir shared by every rank?")
    return RunFolder(out, run_id, folder, moved, read_started_at(out), abandoned)


def agreed_start(output_dir: str | Path, resume: str | None, overwrite: bool, runtime, allow_damaged: bool = False,
                 log=print) -> tuple[Path | None, bool]:
    """`check_before_start` as rank 0 answers it, on every rank (every rank calls this at the same point).

    Resolved by each rank on its own, `--resume auto` could resume the ranks from different steps: on a shared
    filesystem with attribute caching one node can list step 2000 committed while another still lists step 1000 as
    the newest (and cli.resume_choice, deciding between `auto` and PATH on a torchrun restart before the process group
    exists, can differ the same way: rank 0's choice is the one taken). Rank 0's look also replaces N ranks' listings
    of every checkpoint's files. Rank 0's refusal is raised on every rank; a rank that cannot see the checkpoint rank
    0 chose (after waiting MARKER_WAIT_S for its cache) stops every rank with an error naming both."""
    if not runtime.distributed:
        return check_before_start(output_dir, resume, overwrite, allow_damaged, log)

    def rank_0s_look():
        folder, move = check_before_start(output_dir, resume, overwrite, allow_damaged, log)
        return {"folder": None if folder is None else str(folder), "move": move}

    answer = runtime.main_answer(rank_0s_look, f"output_dir {resolved(output_dir)}: checking it")
    folder = None if answer["folder"] is None else Path(answer["folder"])
    # One look per rank at the chosen checkpoint's marker (rank 0 alone listed and checked the checkpoints).
    unseen = None
    if folder is not None and not runtime.is_main and not waits_to_see_committed(folder, log):
        mine = ""
        if resume == "auto":  # the error path only: this rank's own listing, to name what it sees instead
            newest = layout.latest_checkpoint(layout.checkpoints_dir(output_dir))
            mine = f"; the newest committed one this rank sees is {newest or 'none'}"
        unseen = (f"rank {runtime.rank} does not see the checkpoint rank 0 resumes from, {folder} (no "
                  f"{layout.MARKER} marker there after {MARKER_WAIT_S:.0f} s{mine})")
    problems = [p for p in gather_objects(unseen) if p]
    if problems:
        raise InputFileError(f"--resume {resume}: {problems[0]}"
                             f"{f' (and {len(problems) - 1} more ranks)' if len(problems) > 1 else ''}; the ranks would "
                             "resume from different steps. Is output_dir on storage every rank sees, and up to date "
                             "on every node (a network filesystem's attribute cache)?")
    return folder, answer["move"]


def sees_committed(folder: Path) -> bool:
    """Whether this rank sees `folder`'s COMMITTED marker: one stat, not the listing of every file `damage` checks."""
    return (folder / layout.MARKER).is_file()


def waits_to_see_committed(folder: Path, log=print) -> bool:
    """Whether this rank sees `folder`'s marker within MARKER_WAIT_S: looked at again with growing pauses (0.25 s up
    to 4 s), each after listing the folders above it, which makes a network filesystem read them again once its
    cached attributes expire, instead of answering from a cached "no such file"."""
    deadline, pause, told = time.monotonic() + MARKER_WAIT_S, 0.25, False
    while not sees_committed(folder):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not told:
            log(f"waiting up to {MARKER_WAIT_S:.0f} s to see {folder / layout.MARKER}, which rank 0 resumes from "
                "(a network filesystem's cached listing on this node)")
            told = True
        time.sleep(min(pause, left))
        pause = min(4.0, pause * 2)
        for above in (folder.parent, folder):
            try:
                os.listdir(above)
            except OSError:
                pass
    return True


def estimated_free_space_warning(output_dir: str | Path, model_path: str | None, method: str) -> str | None:
    """A full finetune's checkpoint holds float32 weights + two Adam moments (+ EMA): warn when the folder's
    disk has less room than ~3x the model files' size (an estimate made before the model loads)."""
    if method != "full" or not model_path or not Path(model_path).exists():
        return None
    source = Path(model_path)
    size = source.stat().st_size if source.is_file() else sum(
        p.stat().st_size for p in source.rglob("*.safetensors") if p.is_file())
    need = 3 * size
    free = shutil.disk_usage(resolved(output_dir)).free
    if free < need:
        return (f"output_dir {resolved(output_dir)} has {free / 2**30:.1f} GiB free; one checkpoint of this full "
                f"finetune needs about {need / 2**30:.1f} GiB (estimated from {source})")
    return None
