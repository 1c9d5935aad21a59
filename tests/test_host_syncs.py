"""Blocking host syncs in the training step, counted on the CPU (issue 21; tests/helpers/host_syncs.py).

On a GPU each `.item()` / `.tolist()` / `bool(tensor)` ... of a device tensor stalls the host until the device
has caught up, so the next step's kernels are not queued in time. The step path keeps at most one: the step
guard's combined flags (stop, save, non-finite loss: one all-reduce, one read); losses and gradient norms are
read once per log window."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from conftest import base_config

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from host_syncs import count_trainer_syncs  # noqa: E402


def _counted(raw):
    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    from ot_dist.tracking.utilization import UtilizationMeter

    trainer = Trainer(validate(raw), log=lambda *_: None)
    # MFU counting on, as on a GPU with a known peak: its FLOP counting must add no sync either
    trainer.utilization = UtilizationMeter(trainer.device, "float32", False, peak=lambda device, dtype: 1e12)
    try:
        return count_trainer_syncs(trainer)
    finally:
        trainer.close()


def _listing(syncs) -> str:
    return "\n".join(f"{n} x {kind} at {where}" for (kind, where), n in Counter((s.kind, s.where) for s in syncs).items())


def test_at_most_one_host_sync_per_optimizer_step(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", batch_size=1, gradient_accumulation_steps=2,
                      max_steps=4, log_every_steps=2, clip_grad_norm=1.0, gradient_checkpointing=True,
                      **{"ema.enabled": True, "checkpoint.at_end": False,
                         # the performance options on the CPU add no sync either
                         "performance.checkpoint_every_n_blocks": 2, "performance.channels_last": "on",
                         "performance.attention_backend": "math"})
    counter, result = _counted(raw)
    assert result.steps == 4
    step_syncs, log_syncs = counter.in_phase("step"), counter.in_phase("log")
    assert len(step_syncs) <= result.steps, f"{len(step_syncs)} host syncs in {result.steps} steps:\n{_listing(step_syncs)}"
    windows = 2  # log_every_steps 2 of 4 steps
    assert len(log_syncs) <= windows, f"{len(log_syncs)} host syncs in {windows} log windows:\n{_listing(log_syncs)}"
    assert len(result.losses) == 4  # the window still delivers every step's loss
