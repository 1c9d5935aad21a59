"""The `checkpoint` section: when training state is saved, how many checkpoints are kept, and what a
non-finite loss does. What a checkpoint holds and how it is committed: ot_dist/checkpoint/."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ot_dist.config.section import Section


class CheckpointConfig(Section):
    """Resumable training state (OneTrainer's backups), written by every rank under
    output_dir/checkpoints/step-<N>/ and committed atomically."""

    every_n_steps: int | None = Field(default=None, ge=1, description="Save every N optimizer steps; null = off.")
    every_n_epochs: int | None = Field(default=None, ge=1, description="Save at the end of every N-th epoch; null = off.")
    every_n_minutes: float | None = Field(
        default=30, gt=0,
        description="Save when this many minutes passed since the last save (rank 0's clock decides for all); "
        "null = off.",
    )
    at_cycle_lows: bool = Field(
        default=False, description="Save at the bottom of every cycle of a cyclic scheduler (see scheduler)."
    )
    at_end: bool = Field(default=True, description="Save when training ends (before the export).")
    on_signal: bool = Field(
        default=True,
        description="On SIGTERM / SIGINT (preemption, Ctrl-C) finish the current optimizer step, save and exit 0; "
        "a second SIGINT interrupts at once.",
    )
    keep_last: int | None = Field(
        default=3, ge=1,
        description="Keep the newest N committed checkpoints; older ones are deleted only after a new one "
        "committed. null = keep all.",
    )
    write_in_background: bool = Field(
        default=True,
        description="Write checkpoints while training goes on: the state is copied to host memory at the save step "
        "(from a GPU without making the host wait) and a thread writes and commits it, the same files as a blocking "
        "write. Costs host memory for one copy of each rank's state while it is written; the next save and the end "
        "of training wait for the commit. false = training waits until the checkpoint is committed.",
    )
    resume_past_damaged: bool = Field(
        default=False,
        description="--resume auto when the latest checkpoint is damaged (a file truncated or missing, no marker): "
        "false = stop with exit 3 naming it and why; true = warn the same way and continue from the newest "
        "undamaged checkpoint.",
    )
    on_nonfinite_loss: Literal["stop", "skip_step"] = Field(
        default="stop",
        description="A NaN / inf loss on any rank. stop: save the weights as they are (the bad step is not "
        "applied) and exit with code 4; skip_step: drop that step's gradients and go on (under zero1-3 only with "
        "step_guard: lagged, whose engine owns the step). How it is checked: step_guard.",
    )
    step_guard: Literal["auto", "lagged", "blocking"] = Field(
        default="auto",
        description="How ranks agree on stop signals, time-based saves and non-finite losses each optimizer step. "
        "lagged: no host sync per step; a non-finite step is skipped on the device (fused ADAM / ADAMW / SGD, "
        "PRODIGY, also under zero1-3; not with train_dtype float16, DeepSpeed's CPU offload or fused_back_pass) "
        "and counts as a step (schedule and EMA advance, the weights and moments do not change); a stop signal or time-based save acts one step later. "
        "blocking: the flags are read on the host before each step (one host sync per step), a non-finite step "
        "is not counted. auto: lagged where the run allows it, blocking otherwise (the startup log says which).",
    )
