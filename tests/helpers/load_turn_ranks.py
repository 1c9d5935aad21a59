"""Under 2 ranks of one node: when each rank's model loading ran (ot_dist/parallel/load_turns.py); for
tests/test_load_turns.py. Writes RESULT_JSON from rank 0:

    load_turn_ranks.py CONFIG_JSON RESULT_JSON [FSDP_CONFIG_JSON]

- "one" / "two": a body that sleeps 1 s inside load_turn with 1, then 2 ranks at a time: each rank's (start, end).
- "trainer": the trainer built from CONFIG_JSON (distributed.load_ranks_per_node: 1): each rank's window from the
  start of load_model to the end of placing the model, and the lines rank 0 logged.
- "fsdp" (with FSDP_CONFIG_JSON, strategy fsdp): each rank's window from the start of load_model to the end of the
  strategy's wrap, which moves the trained modules to the device as it shards them (Strategy.shards_while_placing)."""

import json
import sys
import time


from ot_dist.config.load import validate
from ot_dist.parallel.load_turns import load_turn
from ot_dist.parallel.runtime import gather_objects, start_runtime
from ot_dist.train import trainer as trainer_module


def window(setting, rank: int) -> tuple[float, float]:
    with load_turn(setting, "/nonexistent", rank, log=lambda *_: None):
        start = time.time()
        time.sleep(1.0)
        end = time.time()
    return start, end


if __name__ == "__main__":
    raw = json.loads(open(sys.argv[1]).read())
    runtime = start_runtime(5, needs_group=True)
    results = {"one": gather_objects(window(1, runtime.local_rank)), "two": gather_objects(window(2, runtime.local_rank))}
    times = {}
    load_model, place = trainer_module.load_model, trainer_module.Trainer._place_modules

    def timed_load(config, **kwargs):
        times["start"] = time.time()
        return load_model(config, **kwargs)

    def timed_place(self, **kwargs):
        place(self, **kwargs)
        time.sleep(0.5)  # so that overlapping windows could not pass as touching ones
        times["end"] = time.time()

    trainer_module.load_model, trainer_module.Trainer._place_modules = timed_load, timed_place
    logged = []
    trainer = trainer_module.Trainer(validate(raw), runtime=runtime, log=logged.append)
    trainer.close()
    results["trainer"] = {"windows": gather_objects((times["start"], times["end"])), "logged": logged}
    if len(sys.argv) > 3:
        from ot_dist.parallel.fsdp import FSDPStrategy

        trainer_module.Trainer._place_modules = place
        wrap = FSDPStrategy.wrap

        def timed_wrap(self, model, groups):
            groups = wrap(self, model, groups)
            time.sleep(0.5)
            times["end"] = time.time()
            return groups

        FSDPStrategy.wrap = timed_wrap
        trainer = trainer_module.Trainer(validate(json.loads(open(sys.argv[3]).read())), runtime=runtime,
                                         log=lambda *_: None)
        trainer.close()
        results["fsdp"] = gather_objects((times["start"], times["end"]))
    if runtime.rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    runtime.shutdown()
