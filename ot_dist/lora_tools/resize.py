"""`ot-dist lora resize LORA --rank R`: each module's change re-approximated at rank R by SVD, in the file's own
layout and names (no model needed), reporting how much of each change is kept. `--conv-rank` gives convolutions
their own rank and `--dynamic-method` / `--dynamic-param` choose each module's rank as kohya sd-scripts'
resize_lora.py does (`--new_conv_rank`, `--dynamic_method`, `--dynamic_param`, `--new_rank` as the upper limit)."""

from __future__ import annotations

import json
from pathlib import Path

from ot_dist.errors import ConfigError
from ot_dist.lora_tools.files import Pair, read_lora_file, shared_alpha, write_lora_file
from ot_dist.lora_tools.lowrank import DYNAMIC_METHODS, low_rank_pair

# Metadata the resized file must not carry over: diffusers' adapter metadata names the old rank (its loader would
# build adapters of that rank from it); the hashes are the old file's (A1111 / Forge take `sshs_model_hash` as the
# LoRA's hash when present, so the resized file would pass for the original in infotexts and hash lookups).
STALE = ("ss_network_dim", "ss_network_alpha", "lora_adapter_metadata", "sshs_model_hash", "sshs_legacy_hash",
         "modelspec.hash_sha256")


def resize_command(path: str, rank: int, out: str, log=print, conv_rank: int | None = None,
                   dynamic_method: str | None = None, dynamic_param: float | None = None) -> dict[str, float]:
    conv_rank = rank if conv_rank is None else conv_rank
    for flag, value in (("--rank", rank), ("--conv-rank", conv_rank)):
        if value < 1:
            raise ConfigError(f"{flag}: {value} is not a rank (at least 1)")
    if (dynamic_method is None) != (dynamic_param is None):
        raise ConfigError("--dynamic-method and --dynamic-param go together")
    if dynamic_method is not None and dynamic_method not in DYNAMIC_METHODS:
        raise ConfigError(f"--dynamic-method: {dynamic_method!r} is not one of {', '.join(DYNAMIC_METHODS)}")
    if dynamic_param is not None and dynamic_param <= 0:
        raise ConfigError(f"--dynamic-param: {dynamic_param} must be above 0")
    dynamic = (dynamic_method, dynamic_param) if dynamic_method is not None else None
    lora = read_lora_file(path, tool="ot-dist lora resize")
    pairs, kept = {}, {}
    for name, pair in lora.pairs.items():
        # the SVD of up @ down without the scale, which stays the module's (alpha = scale x new rank, as kohya's
        # resize_lora.py writes it), so training continued from the resized file runs at the original's scale
        product = Pair(pair.down, pair.up, None).delta()
        resized, kept[name] = low_rank_pair(product, conv_rank if product.dim() == 4 else rank, dynamic)
        pairs[name] = Pair(resized.down, resized.up, pair.scale * resized.rank)
    dtype = next(iter(lora.pairs.values())).up.dtype if lora.pairs else None
    metadata = {k: v for k, v in lora.metadata.items() if k not in STALE}
    if lora.layout == "kohya":
        metadata.update(ss_network_dim="Dynamic" if dynamic else str(rank), ss_network_alpha=str(shared_alpha(pairs)))
    if "ot_dist_lora" in metadata:
        metadata["ot_dist_lora"] = _with_new_rank(metadata["ot_dist_lora"], pairs, dynamic, rank)
    write_lora_file(out, lora.layout, pairs, metadata, dtype)
    values = sorted(kept.values())
    if dynamic and pairs:
        ranks = sorted(p.rank for p in pairs.values())
        log(f"ranks chosen by {dynamic[0]} {dynamic[1]}: min {ranks[0]}, max {ranks[-1]}, "
            f"mean {sum(ranks) / len(ranks):.2f}")
    log(f"resized {len(pairs)} modules to rank {'<= ' if dynamic else ''}{rank}: energy kept min {values[0]:.4f}, "
        f"mean {sum(values) / len(values):.4f} (1.0 = the change is unchanged)" if values else "no modules")
    log(f"wrote {Path(out)}")
    return kept


def _with_new_rank(raw: str, pairs: dict[str, Pair], dynamic, rank: int) -> str:
    """ot_dist's own `ot_dist_lora` record with the resized file's rank and alpha (the old ones were stale)."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if isinstance(record, dict):
        record.update(rank="dynamic" if dynamic else rank, alpha=shared_alpha(pairs))
    return json.dumps(record)
