"""Which rank files a resume reads: rank files of a small synthetic state written in one of three layouts, loaded by
every rank of a launch through shards.for_this_rank, counting each rank's reads of rank-*.json (shards.read_json).

    shard_reads.py FOLDER LAYOUT RESULT_JSON      (under run_ranks: load at the launch's world size)

`save(folder, layout, world_size)` writes the checkpoint's rank files in one process (the tests call it). Layouts,
as the strategies split the trained parameters (parallel/ownership.py):
  fsdp: every parameter split by rows, FSDP2's way (a 1-row parameter leaves the later ranks an empty piece);
  zero: one flat partition per rank, every parameter after the other, cut at arbitrary offsets (ZeRO-1/2);
  ddp:  every rank owns every whole parameter; only rank 0 writes them (the others' files hold no owned state).
Every element of the full weights, the EMA and the elementwise optimizer state has a value of its own, so a piece
copied from the wrong place shows."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from ot_dist.checkpoint import shards
from ot_dist.errors import UserError
from ot_dist.parallel.ownership import Fragment, Owned, Ownership

SHAPES = {"unet.a.weight": (6, 4), "unet.b.bias": (10,), "unet.c.gamma": (1, 3), "unet.d.weight": (5, 2)}


def full_values(name: str, kind: str) -> torch.Tensor:
    """The full parameter `name`'s saved values of `kind` (w, ema, exp_avg), distinct across names and kinds."""
    base = {"w": 0.0, "ema": 1000.0, "exp_avg": 2000.0}[kind] + 100.0 * list(SHAPES).index(name)
    return torch.arange(math.prod(SHAPES[name]), dtype=torch.float32) + base


def owned_pieces(layout: str, world_size: int, rank: int) -> list[tuple[list[Fragment], int]]:
    """This rank's owned tensors as (fragments, numel)."""
    if layout == "ddp":
        return [([Fragment(name, 0, 0, math.prod(shape))], math.prod(shape)) for name, shape in SHAPES.items()]
    if layout == "fsdp":
        pieces = []
        for name, shape in SHAPES.items():
            rows, width = shape[0], math.prod(shape[1:])
            per = math.ceil(rows / world_size)
            first, end = min(rank * per, rows), min((rank + 1) * per, rows)
            pieces.append(([Fragment(name, first * width, 0, (end - first) * width)], (end - first) * width))
        return pieces
    assert layout == "zero", layout
    total = sum(math.prod(s) for s in SHAPES.values())
    per = math.ceil(total / world_size)
    start, end, fragments, at = rank * per, (rank + 1) * per, [], 0
    for name, shape in SHAPES.items():
        numel = math.prod(shape)
        first, last = max(start, at), min(end, at + numel)
        if first < last:
            fragments.append(Fragment(name, first - at, first - start, last - first))
        at += numel
    return [(fragments, per)]  # the partition's padding past the last parameter stays unwritten


def expected(fragments: list[Fragment], numel: int, kind: str) -> torch.Tensor:
    out = torch.full((numel,), -1.0)
    for f in fragments:
        out[f.local_offset:f.local_offset + f.numel] = full_values(f.name, kind)[f.param_offset:f.param_offset + f.numel]
    return out


def rank_setup(layout: str, world_size: int, rank: int, filled: bool):
    """(ownership, optimizer, ema) of a rank: holding the expected values (`filled`, to save) or -1 (to load into)."""
    owned, ema_values, optimizer = [], [], SimpleNamespace(state={})
    for fragments, numel in owned_pieces(layout, world_size, rank):
        param = expected(fragments, numel, "w") if filled else torch.full((numel,), -1.0)
        owned.append(Owned(param, fragments))
        ema_values.append(expected(fragments, numel, "ema") if filled else torch.full((numel,), -1.0))
        if filled:
            optimizer.state[param] = {"exp_avg": expected(fragments, numel, "exp_avg"), "step": torch.tensor(3.0)}
    ownership = Ownership(owned, {name: torch.Size(shape) for name, shape in SHAPES.items()})
    return ownership, optimizer, SimpleNamespace(values=ema_values)


def save(folder: Path, layout: str, world_size: int) -> None:
    """The rank files `world_size` ranks of `layout` write (as Checkpointer.save's rank_state / write_rank_state)."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        ownership, optimizer, ema = rank_setup(layout, world_size, rank, filled=True)
        tensors, meta = shards.rank_state(ownership, optimizer, ema, layout != "ddp" or rank == 0, {},
                                          {"rng": {}, "world_size": world_size}, lambda t: t.detach().clone())
        shards.write_rank_state(folder, rank, tensors, meta)


def load_here(folder: Path, layout: str, runtime) -> dict:
    """Load this rank's share, counting its reads of rank files; what it read and whether every value is right."""
    reads = []
    original = shards.read_json

    def counting(path):
        if path.name.startswith("rank-"):
            reads.append(path.name)
        return original(path)

    shards.read_json = counting
    try:
        ownership, optimizer, ema = rank_setup(layout, runtime.world_size, runtime.rank, filled=False)
        saved = shards.for_this_rank(folder, ownership, runtime)
        shards.load_rank_state(saved, ownership, optimizer, ema, "ADAMW")
    except UserError as err:  # recorded: the test checks every rank raised the same one
        return {"reads": reads, "wrong": [], "rank_meta": False, "error": str(err)}
    finally:
        shards.read_json = original
    wrong = []
    for i, owned in enumerate(ownership.owned):
        numel = owned.param.numel()
        covered = torch.zeros(numel, dtype=torch.bool)
        for f in owned.fragments:
            covered[f.local_offset:f.local_offset + f.numel] = True
        checks = {"w": owned.param, "ema": ema.values[i], "exp_avg": optimizer.state.get(owned.param, {}).get("exp_avg")}
        for kind, got in checks.items():
            want = expected(owned.fragments, numel, kind)
            if got is None or not torch.equal(got.reshape(-1)[covered], want[covered]):
                wrong.append(f"{kind} of owned {i}")
        step = optimizer.state.get(owned.param, {}).get("step")
        if owned.fragments and (step is None or step.item() != 3.0):
            wrong.append(f"step of owned {i}")
    return {"reads": reads, "wrong": wrong, "rank_meta": saved.rank_meta(runtime.rank) is not None, "error": None}


if __name__ == "__main__":
    from ot_dist.parallel.runtime import exit_process, gather_objects, start_runtime

    folder, layout, result = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    runtime = start_runtime(5)
    mine = load_here(folder, layout, runtime)
    everyone = gather_objects(mine) if runtime.distributed else [mine]
    if runtime.is_main:
        result.write_text(json.dumps(everyone))
    runtime.shutdown()
    exit_process(0)
