"""Under torchrun (or forked_ranks.run_ranks): train CONFIG_JSON (a raw config dict with sampling.prompts, sampled at
the end), then sample the same step again with the gathered weights kept as they arrive (`sampling.arrival_cast`
switched off) into RESULT_DIR/plain. Writes RESULT_DIR/rank-<r>.json: per inference copy this rank built, its phase
("cast": the run's own samples, "plain": the second sampling), the bytes its parameters hold, what they would hold in
float32, its `.dtype` and its first parameter's dtype."""

import json
import sys
from pathlib import Path

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import exit_process, start_runtime
from ot_dist.train import sampling
from ot_dist.train.trainer import Trainer

raw = json.loads(Path(sys.argv[1]).read_text())
result_dir = Path(sys.argv[2])
copies = []
phase = "cast"
original_copy = sampling.inference_copy


def measured_copy(template, state, device, *stored_from):
    module = original_copy(template, state, device, *stored_from)
    params = list(module.parameters())
    copies.append({
        "phase": phase, "bytes": sum(p.numel() * p.element_size() for p in params),
        "float32_bytes": sum(p.numel() * 4 for p in params if p.is_floating_point()),
        "dtype": str(module.dtype), "first": str(params[0].dtype),
    })
    return module


sampling.inference_copy = measured_copy
runtime = start_runtime(5, needs_group=True)
trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
steps = trainer.train().steps
phase = "plain"
sampling.arrival_cast = lambda keys, dtype: None
trainer.sampler.output_dir = result_dir / "plain"
trainer.sampler.sample(trainer, steps)
trainer.close()
(result_dir / f"rank-{runtime.rank}.json").write_text(json.dumps(copies))
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
