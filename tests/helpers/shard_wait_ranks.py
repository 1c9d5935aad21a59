"""Under 2 gloo ranks whose process group times out after 2 s: the main process builds the shard set, slowed to 6 s,
while rank 1 waits for it in ensure_shards; each rank writes the folder it got to OUT_DIR/rank<R>.txt
(tests/test_data_shards.py). A build or a merge of parts can take hours where the group's timeout is minutes.

    shard_wait_ranks.py CONFIG_JSON OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

from ot_dist.config.load import validate
from ot_dist.data import training_data
from ot_dist.parallel.runtime import start_runtime

config = validate(json.loads(Path(sys.argv[1]).read_text()))
runtime = start_runtime(timeout_minutes=2 / 60)
build = training_data.build_shard_set


def slow_build(*args, **kwargs):
    time.sleep(6)
    return build(*args, **kwargs)


training_data.build_shard_set = slow_build
folder = training_data.ensure_shards(config, runtime, log=print)
Path(sys.argv[2], f"rank{runtime.rank}.txt").write_text(str(folder))
runtime.shutdown()
