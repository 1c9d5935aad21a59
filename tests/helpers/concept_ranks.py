"""Under torchrun: train each case of CASES_JSON in one process group; every rank writes RESULTS/rank<r>.json with,
per case, its validation history, its optimizer steps, the micro batches it trained and the sample ids it read.

CASES_JSON: {"case name": raw config dict, ...}."""

import json
import sys
from pathlib import Path

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import exit_process, start_runtime
from ot_dist.train.trainer import Trainer

cases = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
runtime = start_runtime(5, needs_group=True)
results = {}
for name, raw in cases.items():
    trainer = Trainer(validate(raw), runtime=runtime, log=print if runtime.is_main else (lambda *_: None))
    micro, seen = [0], []
    epoch_batches = trainer.epoch_batches

    def counting(epoch, epoch_batches=epoch_batches):
        for batch in epoch_batches(epoch):
            micro[0] += 1
            seen.append([epoch, batch["sample_id"].tolist()])
            yield batch

    trainer.epoch_batches = counting
    result = trainer.train()
    trainer.close()
    results[name] = {"validation": trainer.validation.history, "steps": result.steps, "micro_batches": micro[0],
                     "seen": seen, "losses": result.losses, "report": trainer.bucket_report}
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{runtime.rank}.json").write_text(json.dumps(results))
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
