"""`ot-dist` with an injected failure: rank FAIL_RANK raises at optimizer step FAIL_STEP.
Run under torchrun by the failure test; the production code has no fault-injection hooks."""

import os

from ot_dist.train.trainer import Trainer

FAIL_RANK, FAIL_STEP = int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])
original_step = Trainer.optimizer_step
steps_done = 0


def failing_step(self, step):
    global steps_done
    steps_done += 1
    if self.runtime.rank == FAIL_RANK and steps_done == FAIL_STEP:
        raise RuntimeError(f"injected failure on rank {FAIL_RANK} at step {FAIL_STEP}")
    return original_step(self, step)


Trainer.optimizer_step = failing_step

from ot_dist.cli import entry  # noqa: E402

entry()
