"""Save and restore everything a run needs to continue as if it had never stopped.

A checkpoint folder holds, besides the per-rank shards (shards.py) and RNG states (rng.py),
`trainer.json` from rank 0: the position (optimizer steps, epoch, the data reader's place, samples
seen), the scheduler, the optimizer's group settings (learning rates, Prodigy's d), the MLflow run id,
what the run was (strategy, world size, parameter shapes, groups) and its resolved config. JSON and
safetensors only: nothing in a checkpoint can execute code when it is read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.rng import capture_rng, restore_rng
from ot_dist.checkpoint.shards import for_this_rank, jsonable, load_rank_state, rank_state, read_json
from ot_dist.checkpoint.staging import HostCopies
from ot_dist.checkpoint.writer import BackgroundWriter, Ranks, RankFiles, write_and_commit
from ot_dist.errors import InputFileError
from ot_dist.optim.registry import SPECS
from ot_dist.optim.schedule_free import resume_training_mode

FORMAT = 1


# Optimizer group settings that choose how the step is computed, not what it computes: this run chose them for its
# own device and strategy (a checkpoint of a CPU run holds foreach, an fsdp run on CUDA wants fused), so a resume keeps
# them instead of the saved ones.
KERNEL_CHOICES = frozenset({"foreach", "fused", "capturable", "differentiable"})


@dataclass
class Position:
    """Where training stands: `step` optimizer steps are done; the reader continues in `epoch`."""

    step: int = 0
    epoch: int = 0
    tracking_run_id: str | None = None
    resumed_from: Path | None = None


def read_trainer_state(folder: Path) -> dict:
    state = read_json(folder / layout.TRAINER_FILE)
    if state.get("format") != FORMAT:
        raise InputFileError(f"checkpoint {folder}: format {state.get('format')!r}, this ot_dist reads format {FORMAT}")
    return state


class Checkpointer:
    """The trainer's checkpoints: `save` (a collective: every rank calls it at the same step) and
    `load` (a collective too: every rank reads what its layout owns, shards.for_this_rank)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.root = layout.checkpoints_dir(trainer.config.output_dir)
        run = getattr(trainer, "run", None)
        self.run_id: str | None = run.run_id if run is not None else None  # keep_last prunes only this run's
        self.last_saved_step: int | None = None
        self.last_save_time = time.monotonic()
        self.background = (BackgroundWriter(trainer.runtime, trainer.config.distributed.timeout_minutes)
                           if trainer.config.checkpoint.write_in_background else None)

    # -- saving -------------------------------------------------------------------------------------
    def save(self, step: int, epoch: int, reason: str) -> Path:
        """Every rank calls this at the same step. The state is copied at this step; in the background the files
        are written and committed while training goes on (`wait` for the commit), otherwise before this returns."""
        t, runtime = self.trainer, self.trainer.runtime
        if self.background is not None:
            self.background.wait()  # the previous checkpoint is committed (or its failure raised) first
        copies = HostCopies(independent=self.background is not None)
        rng_tensors, rng_json = capture_rng()
        with t.averaged_weights():  # schedule-free: the average is saved (the groups say so; load turns it back)
            tensors, meta = rank_state(t.ownership, t.optimizer, t.ema, t.strategy.writes_checkpoint_shards(),
                                       rng_tensors, {"rng": rng_json, "world_size": runtime.world_size}, copies)
            trainer_json = json.dumps(self.trainer_state(step, epoch, reason), indent=1) if runtime.is_main else None
        files = RankFiles(step, runtime.rank, tensors, meta, trainer_json, copies.ready())
        self.last_saved_step, self.last_save_time = step, time.monotonic()

        def write(ranks: Ranks) -> None:
            folder = write_and_commit(files, self.root, t.config.checkpoint.keep_last, self.run_id, ranks)
            t.log(f"checkpoint: saved step {step} ({reason}) to {folder}")

        if self.background is not None:
            self.background.start(write)
        else:
            write(Ranks(runtime.distributed, runtime.world_size))
        return self.folder_of(step)

    def wait(self) -> None:
        """Until the checkpoint being written in the background is committed; raises what made it fail."""
        if self.background is not None:
            self.background.wait()

    def folder_of(self, step: int) -> Path:
        return self.root / layout.final_name(step)

    def trainer_state(self, step: int, epoch: int, reason: str) -> dict:
        t = self.trainer
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "step": step,
            "epoch": epoch,
            "samples_seen": step * t.global_batch,
            "data": t.reader.state_dict(),
            "scheduler": jsonable(t.scheduler.state_dict(), "scheduler state"),
            "optimizer_groups": jsonable([{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups],
                                          "optimizer group settings"),
            "tracking_run_id": t.tracker.run_id,
            # the run may not exist yet (its sender creates it in the background): its outbox names it later
            "tracking_outbox": str(t.tracker.outbox.path) if hasattr(t.tracker, "outbox") else None,
            "world_size": t.runtime.world_size,
            "strategy": t.strategy.name,
            "method": t.config.method,
            "family": t.config.model.family,
            "optimizer": t.config.optimizer.name,
            "groups": [g.name for g in t.groups],
            "shapes": {name: list(shape) for name, shape in t.ownership.shapes.items()},
            "ema": t.ema is not None,
            "reason": reason,
            "saved_at": time.time(),
            # the run's start (run.json): `ot-dist export` dates the files' ModelSpec header as training did
            "run_started_at": getattr(getattr(t, "run", None), "started_at", None),
            "config": t.config.model_dump(mode="json"),
        }

    # -- loading ------------------------------------------------------------------------------------
    def load(self, folder: Path) -> Position:
        t = self.trainer
        state = read_trainer_state(folder)
        check_compatible(state, t, folder)
        saved = for_this_rank(folder, t.ownership, t.runtime)  # a collective: every rank loads here
        load_rank_state(saved, t.ownership, t.optimizer, t.ema, t.config.optimizer.name)
        t.strategy.after_checkpoint_load()
        for group, settings in zip(t.optimizer.param_groups, state["optimizer_groups"], strict=True):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in settings.items()
                          if k not in KERNEL_CHOICES})
        resume_training_mode(t.optimizer, SPECS[t.config.optimizer.name].schedule_free)
        t.scheduler.load_state_dict(state["scheduler"])
        t.reader.load_state_dict(state["data"])
        own = saved.rank_meta(t.runtime.rank)
        if own is not None and state["world_size"] == t.runtime.world_size:
            file = saved.rank_file(t.runtime.rank)
            rng_tensors = {k: saved.tensor(file, k) for k in ("rng/torch", "rng/cuda", "rng/numpy") if saved.has(file, k)}
            restore_rng(rng_tensors, own["rng"])
        else:
            t.log(f"checkpoint: saved with {state['world_size']} processes, now {t.runtime.world_size}: the global "
                  "random streams restart from the seed (per-sample noise, timesteps and order are unaffected)")
        for line in config_changes(state["config"], t.config.model_dump(mode="json")):
            t.log(f"checkpoint: {line}")
        t.log(f"checkpoint: resumed from {folder} at step {state['step']} (epoch {state['data']['epoch']}, "
              f"{state['samples_seen']} samples seen; saved by {state['world_size']} x {state['strategy']})")
        run_id = state["tracking_run_id"]
        if run_id is None and state.get("tracking_outbox"):
            from ot_dist.tracking.outbox import remembered_run

            run_id = remembered_run(Path(state["tracking_outbox"]))
        if folder.resolve() == self.folder_of(state["step"]).resolve():
            # This run's own checkpoint of this step holds this very state: a resume that trains no further step
            # (a finished run resumed, a stop before the first step) must not write and commit it again in place.
            self.last_saved_step = state["step"]
        return Position(state["step"], t.reader.epoch, run_id, folder)  # the next epoch where the data changed


def check_compatible(state: dict, trainer, folder: Path) -> None:
    """Refuse, naming the field, what a checkpoint cannot continue as."""
    config = trainer.config
    for field, key, now in (("model.family", "family", config.model.family), ("method", "method", config.method),
                            ("optimizer.name", "optimizer", config.optimizer.name)):
        saved = state[key]
        if saved != now:
            raise InputFileError(f"--resume {folder}: {field} is {now}, the checkpoint was trained with {saved}; "
                                 "resume with the same value or start a new run")
    saved_alpha = (state["config"].get("lora") or {}).get("alpha")
    if config.method == "lora" and saved_alpha is not None and saved_alpha != config.lora.alpha:
        # the adapters' tensors resume as saved, so alpha / rank would scale the change training made by the ratio
        # (OneTrainer resumes at the saved alpha, a buffer of each LoRA module)
        raise InputFileError(f"--resume {folder}: lora.alpha is {config.lora.alpha}, the checkpoint was trained with "
                             f"{saved_alpha}: its LoRA's change would be scaled by {config.lora.alpha / saved_alpha:g}; "
                             f"resume with lora.alpha {saved_alpha}, or start a new run from its exported LoRA "
                             "(lora.init_from keeps the change at any alpha)")
    shapes = {name: list(shape) for name, shape in trainer.ownership.shapes.items()}
    if shapes != state["shapes"]:
        missing = sorted(set(state["shapes"]) ^ set(shapes))
        differing = [n for n in shapes if n in state["shapes"] and shapes[n] != state["shapes"][n]]
        what = f"parameter {differing[0]}: {state['shapes'][differing[0]]} saved, {shapes[differing[0]]} now" if differing \
            else f"parameters present in only one of them, e.g. {missing[0]}"
        raise InputFileError(f"--resume {folder}: the trained parameters differ ({what}); other model, LoRA rank / "
                             "targets or trained parts than the checkpoint's")
    groups = [g.name for g in trainer.groups]
    if groups != state["groups"]:
        raise InputFileError(
            f"--resume {folder}: the optimizer's parameter groups are {groups} under {trainer.strategy.name}, the "
            f"checkpoint has {state['groups']} (saved under {state['strategy']}); resume with that strategy family"
        )


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """Settings that differ from the checkpoint's (allowed: epochs, learning rate, ... ; shown to the user)."""
    lines = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key} changed from {a!r} to {b!r}")
    return lines
