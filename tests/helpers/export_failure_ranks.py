"""Under 2 gloo ranks: the main process's export fails (a full disk, stood in for) while the other rank waits for it.
Each rank writes what its export raised to OUT_DIR/rank<R>.txt (tests/test_runtime_groups.py); a rank still waiting
when the launch ends writes nothing.

    export_failure_ranks.py CONFIG_JSON OUT_DIR
"""

import json
import sys
from pathlib import Path

from ot_dist.config.load import validate
from ot_dist.train.trainer import Trainer

trainer = Trainer(validate(json.loads(Path(sys.argv[1]).read_text())), log=lambda *_: None)
rank = trainer.runtime.rank
if rank == 0:
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    trainer.method.export = full_disk
try:
    trainer.export(Path(sys.argv[2]) / "export")
    outcome = "exported"
except Exception as err:  # noqa: BLE001 - what each rank was told is the result
    outcome = f"{type(err).__name__}: {err}"
Path(sys.argv[2], f"rank{rank}.txt").write_text(outcome)
trainer.close()
