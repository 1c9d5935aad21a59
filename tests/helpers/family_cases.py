"""Under torchrun: train every case of CASES_JSON, one after another, in one process group (one launch pays
the process start-up once for many strategy x method cases). Each case exports to its own output_dir; the
test compares those exports with a single process.

CASES_JSON: {"case name": raw config dict, ...}; a dict may carry "_overflow_at_step": N or
"_inf_gradient_element_at_step": N (tests/helpers/overflow.py), "_record_denoiser_inputs": PATH (rank 0 writes
the dtypes the denoiser's forward received there: tests/helpers/denoiser_inputs.py), "_fp16_engine_on_cpu": true
(DeepSpeed's CPU accelerator reports float16 for this case: engine_reference.py `fp16_reported`), "_undone": [CHANGE,
...] (trained with these fast-path changes undone: tests/benchmarks/fast_path_levers.py) and "_record_block_casts":
PATH (each rank writes how active the block casts were: tests/helpers/block_casts_record.py)."""

import gc
import json
import os
import sys

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime, exit_process
from ot_dist.train.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from block_casts_record import fast_path_undone, recording_block_casts  # noqa: E402
from denoiser_inputs import record_denoiser_inputs  # noqa: E402
from engine_reference import fp16_reported  # noqa: E402
from overflow import inject  # noqa: E402
from zero_master import assert_master_shares_the_weights  # noqa: E402

cases = json.loads(open(sys.argv[1]).read())
runtime = start_runtime(5, needs_group=True)
for name, raw in cases.items():
    print(f"case start: {name}", flush=True)  # every rank: the case a failed launch's summary shows each one in
    overflow_at = raw.pop("_overflow_at_step", None)
    poisoned_at = raw.pop("_inf_gradient_element_at_step", None)
    inputs_record = raw.pop("_record_denoiser_inputs", None)
    casts_record = raw.pop("_record_block_casts", None)
    with fp16_reported(raw.pop("_fp16_engine_on_cpu", False)), fast_path_undone(raw.pop("_undone", None)):
        trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
    inject(trainer, overflow_at, poisoned_at)
    if inputs_record and runtime.is_main:
        record_denoiser_inputs(trainer, inputs_record)
    with recording_block_casts(trainer, casts_record, runtime.rank):
        result = trainer.train()
    assert_master_shares_the_weights(trainer)  # zero1/2 over float32 weights: no second copy of them
    trainer.close()  # ends with a full collection: what survives it stays alive
    gc.freeze()  # a closed ZeRO-3 trainer's objects, not walked again by later collections (optimizers_under_strategy.py)
    if runtime.is_main:
        print(f"case done: {name}; overflowed steps: {result.overflowed_steps}", flush=True)
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
