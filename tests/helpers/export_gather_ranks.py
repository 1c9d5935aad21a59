"""Under torchrun (tests/test_export_gathers.py): train each case of CASES_JSON one step, then export it twice:
- as the trainer does (`Trainer.export` to <output_dir>/spied): each gathered tensor moved to CPU memory at once and
  kept by the writing rank only, while spies record what the gathers leave alive;
- as every rank holding every gathered tensor of a module at once (the export before that rule, reproduced here by
  `everything_on_every_rank`) to <output_dir>/reference, whose files the test compares with the spied ones byte for
  byte.
Each rank writes RESULT_PREFIX.<rank>.json (see `Spies.report`).

On a CPU the device and CPU memory are one, so the spies watch the gathered tensors' storages themselves: a gathered
tensor (FSDP2's `full_tensor`, ZeRO-3's gathered parameters, the EMA's full parameters) whose storage is still alive
when the next one is gathered was kept (or not yet copied out): the device would hold both. `to_host`'s copies are
storages of their own, which the writing rank keeps and the others never make."""

import gc
import json
import sys
import time
from pathlib import Path

import deepspeed
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

import ot_dist.parallel.deepspeed as zero
import ot_dist.parallel.fsdp as fsdp
import ot_dist.train.trainer as trainer_module
from ot_dist.config.load import validate
from ot_dist.methods.base import kept
from ot_dist.parallel.ownership import Ownership, plain
from ot_dist.parallel.runtime import exit_process, start_runtime
from ot_dist.train.trainer import Trainer

# ZeRO-3's export groups in this launch: several per module of the tiny model, most of them one parameter
GROUP_BYTES = 16 * 1024
WAIT_S = 30.0  # see Spies.alive_settled


class Spies:
    def __init__(self, runtime):
        self.rank = runtime.rank
        self.storages: list[StorageWeakRef] = []  # every gathered tensor's storage, weakly
        self.alive_at_gather: list[int] = []  # at each gather, how many earlier gathered storages were alive
        self.gathers = {"full_tensor": 0, "zero3": 0, "ema": 0}
        self.zero3_groups: list[dict] = []  # each ZeRO-3 gather: its bytes when whole and its parameter count
        self.hosted: list[StorageWeakRef] = []  # to_host's copies
        self.states: list[dict] = []  # each state dict the export code got: write, entries, on the CPU
        self.undo = []
        self.wait_left = WAIT_S

    def alive(self, refs) -> int:
        return sum(not ref.expired() for ref in refs)

    def alive_settled(self) -> int:
        """How many gathered storages are alive, once the collectives' own references are gone: gloo's worker threads
        drop their reference to a finished collective's tensors a moment after the caller's wait returned (longer on a
        busy machine), so a count of 1 or 2 is taken again for up to a second (at most WAIT_S in all: an export that
        keeps what it gathers fails without waiting long; one that keeps them all, at once)."""
        alive = self.alive(self.storages)
        deadline = time.monotonic() + min(1.0, self.wait_left)
        started = time.monotonic()
        while 0 < alive <= 2 and time.monotonic() < deadline:
            time.sleep(0.001)
            alive = self.alive(self.storages)
        self.wait_left -= time.monotonic() - started
        return alive

    def gathered(self, kind: str, tensors) -> None:
        self.alive_at_gather.append(self.alive_settled())
        self.gathers[kind] += 1
        self.storages.extend(StorageWeakRef(t.untyped_storage()) for t in tensors)

    def patch(self, owner, name, value) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def install(self, trainer) -> None:
        spies = self
        full_tensor = DTensor.full_tensor

        def spied_full_tensor(self, *args, **kwargs):
            whole = full_tensor(self, *args, **kwargs)
            spies.gathered("full_tensor", [whole])
            return whole

        gatherer = Ownership.gatherer

        def spied_gatherer(self, values, *args, **kwargs):
            gather = gatherer(self, values, *args, **kwargs)

            def spied_gather(name):
                whole = gather(name)
                spies.gathered("ema", [whole])
                return whole

            return spied_gather

        class SpiedGathered(deepspeed.zero.GatheredParameters):
            def __enter__(self):
                super().__enter__()
                params = self.params if self.enabled else []
                spies.zero3_groups.append({"bytes": sum(p.ds_numel * p.element_size() for p in params),
                                           "params": len(params)})
                if params:
                    spies.gathered("zero3", [p.data for p in params])

        def spied_to_host(t):
            copy = to_host(t)
            spies.hosted.append(StorageWeakRef(copy.untyped_storage()))
            return copy

        export = trainer.method.export

        def spied_export(model, output_dir, state_dict_of, **kwargs):
            def recorded(module, keep=None):
                state = state_dict_of(module, keep=keep)
                spies.states.append({"write": kwargs["write"], "entries": len(state),
                                    "on_cpu": all(v.device.type == "cpu" for v in state.values())})
                return state

            return export(model, output_dir, recorded, **kwargs)

        to_host = fsdp.to_host
        self.patch(DTensor, "full_tensor", spied_full_tensor)
        self.patch(Ownership, "gatherer", spied_gatherer)
        self.patch(deepspeed.zero, "GatheredParameters", SpiedGathered)
        for module in (fsdp, zero, trainer_module):
            self.patch(module, "to_host", spied_to_host)
        self.patch(trainer.method, "export", spied_export)
        self.patch(zero, "EXPORT_GATHER_BYTES", GROUP_BYTES)

    def remove(self) -> None:
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)
        self.undo.clear()

    def report(self) -> dict:
        gc.collect()
        return {"rank": self.rank, "alive_at_gather": self.alive_at_gather, "gathers": self.gathers,
                "zero3_groups": self.zero3_groups, "group_limit": GROUP_BYTES,
                "gathered_alive_after": self.alive(self.storages), "hosted": len(self.hosted),
                "hosted_alive_after": self.alive(self.hosted), "states": self.states}


def everything_on_every_rank(trainer, ema: bool):
    """The exports' state_dict_of before the rule (float32 weights: no masters overlay): every rank gathers every
    tensor of a module (FSDP2: `full_tensor` each, all kept; ZeRO-3: every parameter at once, cloned) and the EMA's
    full parameters, all of them, replace the trained ones."""
    strategy = trainer.strategy

    def gathered(module, keep=None):
        state = kept(module.state_dict(), keep)
        if getattr(strategy, "stage", None) == 3 and any(hasattr(p, "ds_id") for p in module.parameters()):
            params = [p for n, p in module.named_parameters() if keep is None or keep(n)]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {k: v.detach().clone() for k, v in kept(module.state_dict(), keep).items()}
        return {k: plain(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}

    if not ema:
        return gathered
    averaged = trainer.ownership.gather_full(trainer.ema.values)
    part_of = {id(module): part for part, module in strategy.trained_modules.items()}

    def overlaid(module, keep=None):
        state, part = gathered(module, keep), part_of.get(id(module))
        return state if part is None else {k: averaged.get(f"{part}.{k}", v) for k, v in state.items()}

    return overlaid


cases = json.loads(open(sys.argv[1]).read())
prefix = sys.argv[2]
runtime = start_runtime(5, needs_group=True)
reports = {}
for name, raw in cases.items():
    trainer = Trainer(validate(raw), runtime=runtime, log=lambda *_: None)
    trainer.train()
    out = Path(raw["output_dir"])
    spies = Spies(runtime)
    spies.install(trainer)
    try:
        trainer.export(out / "spied")
    finally:
        spies.remove()
    reports[name] = spies.report()
    created, write = trainer.run.started_at, runtime.is_main
    with trainer.averaged_weights():
        trainer.method.export(trainer.model, out / "reference", everything_on_every_rank(trainer, False), write=write,
                              created=created)
        trainer.method.export(trainer.model, out / "reference", everything_on_every_rank(trainer, True), write=write,
                              created=created, suffix="_ema")
    runtime.barrier()  # the reference files are written before the next case
    trainer.close()
with open(f"{prefix}.{runtime.rank}.json", "w") as f:
    json.dump(reports, f)
runtime.shutdown()
exit_process(0)  # see exit_process: a rank's library teardown must not fail a finished run
