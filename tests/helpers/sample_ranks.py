"""Under torchrun: train CONFIG_JSON (a raw config dict) with sampling on, and write which prompts each
rank generated (RESULT_DIR/rank-<r>.json: the prompt texts in the order this rank generated them)."""

import json
import sys
from pathlib import Path

from ot_dist.config.load import validate
from ot_dist.parallel.runtime import start_runtime, exit_process
from ot_dist.train.sampling import Sampler
from ot_dist.train.trainer import Trainer

raw = json.loads(Path(sys.argv[1]).read_text())
result_dir = Path(sys.argv[2])
generated = []
original_generate = Sampler.generate


def recording_generate(self, pipeline, prompt):
    generated.append(prompt.prompt)
    return original_generate(self, pipeline, prompt)


Sampler.generate = recording_generate
runtime = start_runtime(5, needs_group=True)
trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
trainer.train()
trainer.close()
(result_dir / f"rank-{runtime.rank}.json").write_text(json.dumps(generated))
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
