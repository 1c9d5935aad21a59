"""`ot-dist train ARGS...` (as a user runs it, its output unchanged) that records what each rank trained: per batch
the sample ids and the pixel batch's shape, in BATCH_REPORT_DIR/rank<r>.json. Run under torchrun."""

import json
import os
import sys

from ot_dist.cli import main
from ot_dist.train.trainer import Trainer

batches = []
original_epoch_batches = Trainer.epoch_batches


def recording_epoch_batches(self, epoch):
    for batch in original_epoch_batches(self, epoch):
        batches.append({"epoch": epoch, "sample_id": batch["sample_id"].tolist(), "shape": list(batch["pixels"].shape)})
        yield batch


Trainer.epoch_batches = recording_epoch_batches
code = main(sys.argv[1:])
with open(os.path.join(os.environ["BATCH_REPORT_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(batches, f)
from ot_dist.parallel.runtime import exit_process  # noqa: E402

exit_process(code)  # see exit_process: a rank's library teardown must not fail a finished run
