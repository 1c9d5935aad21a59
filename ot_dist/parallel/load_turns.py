"""The ranks of a node load the model a few at a time (`distributed.load_ranks_per_node`).

Every rank reads the whole model into CPU memory before placing it (in its files' dtype, models/load_dtype.py; a full
finetune's float32 masters are made from it): Flux.1 dev with its T5-XXL is ~34 GB a rank in bfloat16 (68 GB when it
was read in float32), so 4 ranks on a 128 GB workstation or 8 on a 512 GB node could run out of memory before the
first step. What a rank keeps afterwards is small (its device holds the model; the frozen weights that stay in CPU
memory are held once per node, memory/node_shared.py), so loading in turns bounds the node's peak at what the ranks
loading at once read. kohya sd-scripts loads one process at a time the same way.

`auto` lets as many ranks load at once as the node's available memory holds (the machine's MemAvailable, and the
container's cgroup limit where one is set, whichever is less), from the size of the model's safetensors files as read
(and of a full finetune's float32 masters); the ranks agree on the smallest count any of them computed. Turns are
barriers every rank passes the same number of times, so a rank never waits on a collective that another rank does
not make."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed as dist

from ot_dist.models.load_dtype import FLOATING, exact_dtype, loaded_files, tensor_entries
from ot_dist.parallel.runtime import gather_objects, ranks_on_this_node

MEMORY_SHARE = 0.9  # of the available memory the loads may take (the loader workers, the page cache need some)


def load_bytes_of(path: str | Path, grown: dict[str, int] | None = None) -> int:
    """What loading `path` (a diffusers folder, or one .safetensors file) takes in CPU memory: each component's
    floating tensors at the width it is read in (models/load_dtype.py: its files' own where that holds them exactly,
    else float32), the rest as stored. `grown`: component (subfolder) -> the bytes per weight its trained weights
    are then held in (a full finetune's float32 masters), where that is more; a single file's whole content counts
    so when any is given. Read from the files' headers alone."""
    path, grown = Path(path), grown or {}
    if path.is_file():
        return _bytes_in(path, max([exact_dtype([path]).itemsize, *grown.values()]))
    files = loaded_files(sorted(path.rglob("*.safetensors")))
    by_component: dict[Path, list[Path]] = {}
    for file in files:
        by_component.setdefault(file.parent, []).append(file)
    total = 0
    for folder, component_files in by_component.items():
        width = max(exact_dtype(component_files).itemsize, grown.get(folder.name, 0) if folder != path else 0)
        total += sum(_bytes_in(file, width) for file in component_files)
    return total


def master_widths(config) -> dict[str, int]:
    """The parts a full finetune trains whole -> the bytes per weight of their masters (trained_weight_dtype): what
    they grow to after loading. Other methods train small added tensors only."""
    if config.method != "full":
        return {}
    width = 4 if config.trained_weight_dtype == "float32" else 2
    return {part: width for part in config.part_names() if config.part_trains(part)}


def _bytes_in(file: Path, float_width: int) -> int:
    """The file's floating tensors at `float_width` bytes each, the others as stored; 0 where it is unreadable."""
    entries = tensor_entries(file) or {}
    return sum(math.prod(e["shape"]) * float_width if e["dtype"] in FLOATING
               else e["data_offsets"][1] - e["data_offsets"][0] for e in entries.values())


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this node can still give: MemAvailable, or less where a cgroup (v2 memory.max, v1
    memory.limit_in_bytes) limits the container. None where neither can be read."""
    found = []
    try:
        with open(meminfo) as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    for limit_name, usage_name in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path(cgroup, limit_name).read_text().strip()
            usage = int(Path(cgroup, usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max", or v1's huge number: no limit
            found.append(max(int(limit) - usage, 0))
        break
    return min(found) if found else None


def ranks_at_once(load_bytes: int, available: int | None, ranks_on_node: int) -> int:
    """How many ranks of a node may load together: all where the memory is unknown or the model size is."""
    if available is None or load_bytes <= 0:
        return ranks_on_node
    return max(1, min(ranks_on_node, int(available * MEMORY_SHARE // load_bytes)))


@contextlib.contextmanager
def load_turn(setting: int | str, model_path: str, local_rank: int,
              log: Callable[[str], None] = print, grown: dict[str, int] | None = None) -> Iterator[int]:
    """Run the body (loading and placing the model) in this rank's turn. Every rank of the group enters it, and the
    body gets the number of turns (1: every rank of a node loads at once).
    `grown`: the components whose trained weights are held wider than they are read (load_bytes_of)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield 1
        return
    on_node = ranks_on_this_node(dist.get_world_size())
    if setting == "auto":
        load_bytes = load_bytes_of(model_path, grown)
        available = available_memory()
        mine = (ranks_at_once(load_bytes, available, on_node), on_node, load_bytes, available)
    else:
        mine = (min(int(setting), on_node), on_node, None, None)
    everyone = gather_objects(mine)
    at_once = min(entry[0] for entry in everyone)  # one count for all: the turns below are collectives
    turns = math.ceil(max(entry[1] for entry in everyone) / at_once)
    if turns > 1:
        _, _, load_bytes, available = mine
        where = (f" ({load_bytes / 2**30:.1f} GiB a rank, {available / 2**30:.1f} GiB available on this "
                 "node)" if available is not None else "")
        log(f"loading: {at_once} of the {on_node} ranks of a node at a time, {turns} turns{where}")
    turn = local_rank // at_once
    for _ in range(turn):
        dist.barrier()
    yield turns
    for _ in range(turn, turns):
        dist.barrier()
