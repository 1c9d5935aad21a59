"""Under torchrun (gloo): each rank caches latents and text for the shard sets given (each: folder and config json),
in chunks of CHUNK_SIZE samples, counting the samples it encoded. Rank r writes {set: {"latents": [...], "text":
[...]}} (the sample ids it loaded pixels / captions of) to OUT_DIR/rank{r}.json."""

import json
import os
import sys
import time

from ot_dist.config.load import validate
from ot_dist.data.caches import attach_latent_cache, attach_text_cache
from ot_dist.data.reader import ShardDataset
from ot_dist.models.loading import load_model
from ot_dist.parallel.runtime import exit_process, start_runtime

out_dir, chunk_size, sets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
# CACHE_TIMEOUT_MINUTES: the default group's timeout; SLOW_RANK_SECONDS: rank 1 encodes that much longer (a slower node)
runtime = start_runtime(float(os.environ.get("CACHE_TIMEOUT_MINUTES", 5)), needs_group=True)
slow = float(os.environ.get("SLOW_RANK_SECONDS", 0)) if runtime.rank == 1 else 0
counted = {}
for folder, config_json in zip(sets[::2], sets[1::2]):
    cfg = validate(json.loads(config_json))
    dataset = ShardDataset(folder, cfg)
    loads, captions = [], []
    load, caption = dataset.load, dataset.captions
    dataset.load = lambda i, *a, use_cache=True, **k: (loads.append(i) if not use_cache else None) or load(i, *a, use_cache=use_cache, **k)
    if slow:  # its first load waits: the other rank is done with its chunks that much earlier
        dataset.load = (lambda load, first=[True]: lambda *a, **k: (first and (first.clear() or time.sleep(slow)))
                        or load(*a, **k))(dataset.load)
    dataset.captions = lambda i: captions.append(i) or caption(i)
    model = load_model(cfg.model)
    attach_latent_cache(dataset, model.vae, runtime, chunk_size=chunk_size)
    attach_text_cache(dataset, model, runtime, chunk_size=chunk_size)
    counted[folder] = {"latents": loads, "text": captions}
with open(f"{out_dir}/rank{runtime.rank}.json", "w") as f:
    json.dump(counted, f)
runtime.barrier()
runtime.shutdown()
exit_process(0)
