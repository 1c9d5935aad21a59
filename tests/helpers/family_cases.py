"""Under torchrun: train every case of CASES_JSON, one after another, in one process group (one launch pays
the process start-up once for many strategy x method cases). Each case exports to its own output_dir; the
test compares those exports with a single process.

CASES_JSON: {"case name": raw config dict, ...}."""

import json
import sys

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime
from ot_dist.train.trainer import Trainer

cases = json.loads(open(sys.argv[1]).read())
runtime = start_runtime(5, needs_group=True)
for name, raw in cases.items():
    Trainer(validate(raw), runtime=runtime, log=lambda *_: None).train()
    if runtime.is_main:
        print(f"case done: {name}", flush=True)
runtime.shutdown()
