"""Under torchrun: train every optimizer of the stack for 2 steps in one process group, under each of
the strategies given (comma-separated, one launch for all), and write what happened per strategy and
optimizer to RESULT_JSON (rank 0). An optimizer the config refuses under a strategy is recorded with the
refusal's message.

    optimizers_under_strategy.py MODEL DATA OUT STRATEGIES RESULT_JSON COMPARED [NAMES]

STRATEGIES: a strategy may name the optimizers it trains (`zero1:ADAMW+SGD`); the others' configs are only
validated: refused, or recorded as accepted. COMPARED: comma-separated `strategy/NAME` cases that also save a
checkpoint and export their LoRA (the test compares the export with one process on the same global batch; their
raw config is recorded for that run); NAMES: the optimizers (default: all of the registry)."""

import gc
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from conftest import base_config  # noqa: E402
from test_optimizers import settings  # noqa: E402  (what a user sets to train with each optimizer)
from zero_master import master_copies  # noqa: E402

from ot_dist.config.load import validate  # noqa: E402
from ot_dist.errors import ConfigError  # noqa: E402
from ot_dist.optim.registry import SPECS  # noqa: E402
from ot_dist.parallel.ownership import local as local_shard  # noqa: E402
from ot_dist.parallel.runtime import exit_process, start_runtime  # noqa: E402
from ot_dist.train.trainer import Trainer  # noqa: E402

model_dir, data_dir, out_dir, strategies, result_path, compared = sys.argv[1:7]
compared = set(filter(None, compared.split(",")))
names = sys.argv[7].split(",") if len(sys.argv) > 7 else list(SPECS)
runtime = start_runtime(5)


def local(param: torch.Tensor) -> torch.Tensor:
    """The elements of a parameter this rank holds: an FSDP DTensor's shard, a ZeRO-3 partition (`ds_tensor`;
    the parameter itself is an empty placeholder between forwards), or the tensor."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else local_shard(param)


def run(strategy: str, name: str, train: bool = True) -> dict:
    overrides = {**settings(name), "strategy": strategy}
    method = overrides.pop("method")
    compare = f"{strategy}/{name}" in compared
    # No checkpoint or export at the end (but for the compared cases), and LoRA on two projections only: what is
    # asserted is that the optimizer steps on this strategy's parameters (DTensor shards, flat ZeRO partitions); ~140
    # cases each saving files and propagating DTensor sharding over foreach lists of every LoRA matrix cost minutes.
    # One shard set for all cases (the same images and build settings): building it per case cost ~0.15 s each.
    raw = base_config(model_dir, data_dir, f"{out_dir}/{strategy}/{name}", method=method, max_steps=2, batch_size=2,
                      log_every_steps=100, **{"checkpoint.at_end": compare, "lora.unet_targets": ["to_q", "to_v"],
                                              "data.shards": f"{out_dir}/shards", **overrides})
    try:
        config = validate(raw)
    except ConfigError as err:
        return {"refused": str(err)}
    if not train:
        return {"accepted": True}
    trainer = Trainer(config, runtime=runtime, log=lambda *_: None)
    if not compare:
        trainer.export = lambda *_: []  # the exports are tested elsewhere (test_methods, test_export_roundtrip)
    before = [local(p).detach().clone() for p in trainer.params]
    try:
        result = trainer.train()
    except Exception as err:  # recorded, so one failing optimizer does not hide the others
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    after = [local(p).detach().clone() for p in trainer.params]
    copies = master_copies(trainer)  # zero1/2: the optimizer stepped the weights in place (no second copy kept)
    trainer.close()  # ends with a full collection: what survives it stays alive
    # A closed ZeRO-3 trainer's model stays referenced from DeepSpeed's state (~47 k objects per case, measured with
    # gc.get_objects()), and every later full collection walked them again: the 12th ZeRO-3 case of a rank paid 0.65 s
    # of collections instead of 0.09 s. Frozen, they are skipped, as ot_dist freezes what the first trainer leaves
    # (ot_dist/memory/heap.py); what was garbage is already freed by close's collection.
    gc.freeze()
    changed = sum(not torch.equal(b, a) for b, a in zip(before, after))
    return {
        "losses": result.losses,
        "steps": result.steps,
        "finite": all(math.isfinite(x) for x in result.losses) and all(torch.isfinite(a).all() for a in after),
        "changed": changed,
        "tensors": len(after),
        "master_copies": copies,
        **({"config": raw} if compare else {}),
    }


results = {}
for entry in strategies.split(","):
    strategy, _, trained = entry.partition(":")
    trained = set(trained.split("+")) if trained else set(names)
    results[strategy] = {name: run(strategy, name, train=name in trained) for name in names}
if runtime.is_main:
    with open(result_path, "w") as f:
        json.dump(results, f, indent=1)
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
