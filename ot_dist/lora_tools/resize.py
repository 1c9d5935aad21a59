"""`ot-dist lora resize LORA --rank R`: each module's change re-approximated at rank R by SVD, in the file's own
layout and names (no model needed), reporting how much of each change is kept."""

from __future__ import annotations

from pathlib import Path

from ot_dist.errors import ConfigError
from ot_dist.lora_tools.files import read_lora_file, write_lora_file
from ot_dist.lora_tools.lowrank import low_rank_pair


def resize_command(path: str, rank: int, out: str, log=print) -> dict[str, float]:
    if rank < 1:
        raise ConfigError(f"--rank: {rank} is not a rank (at least 1)")
    lora = read_lora_file(path, tool="ot-dist lora resize")
    pairs, kept = {}, {}
    for name, pair in lora.pairs.items():
        pairs[name], kept[name] = low_rank_pair(pair.delta(), rank)
    dtype = next(iter(lora.pairs.values())).up.dtype if lora.pairs else None
    # diffusers' adapter metadata names the old rank (its loader would build rank-R adapters from it): left out, as
    # the written file needs none (the scale is in the up matrices, alpha = rank)
    stale = ("ss_network_dim", "ss_network_alpha", "lora_adapter_metadata")
    metadata = {k: v for k, v in lora.metadata.items() if k not in stale}
    if lora.layout == "kohya":
        metadata.update(ss_network_dim=str(rank), ss_network_alpha=str(float(rank)))
    write_lora_file(out, lora.layout, pairs, metadata, dtype)
    values = sorted(kept.values())
    log(f"resized {len(pairs)} modules to rank {rank}: energy kept min {values[0]:.4f}, "
        f"mean {sum(values) / len(values):.4f} (1.0 = the change is unchanged)" if values else "no modules")
    log(f"wrote {Path(out)}")
    return kept
