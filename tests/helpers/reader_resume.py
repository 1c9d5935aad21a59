"""Under torchrun (gloo): each rank reads the acceptance shard set as its own process: the whole first
epoch, then 7 batches, its state, and a fresh reader resumed from that state. Rank r writes its
sample ids to OUT_DIR/rank{r}.json."""

import json
import sys

from ot_dist.config.load import validate
from ot_dist.data.reader import ShardDataset, ShardReader
from ot_dist.parallel.runtime import start_runtime, exit_process

shards, config_json, out_dir = sys.argv[1:4]
runtime = start_runtime(5, needs_group=True)
cfg = validate(json.loads(config_json))
dataset = ShardDataset(shards, cfg)


def reader():
    return ShardReader(dataset, dataset.table(), 2, 1, runtime.rank, runtime.world_size, 2)


def ids(batches):
    return [b["sample_id"].tolist() for b in batches]


uninterrupted = ids(reader().epoch_batches(0))
first, head = reader(), []
for batch in first.epoch_batches(0):
    head.append(batch["sample_id"].tolist())
    if len(head) == 7:
        break
state = first.state_dict()
resumed = reader()
resumed.load_state_dict(state)
rest = ids(resumed.epoch_batches(0))
with open(f"{out_dir}/rank{runtime.rank}.json", "w") as f:
    json.dump({"uninterrupted": uninterrupted, "head": head, "rest": rest, "state": state}, f)
runtime.barrier()
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
