"""Per-rank model-state bytes of a Flux.1 dev / SD3.5 Large full finetune under fsdp at 8 and 64 ranks, and the
largest single all-gather as a fraction of the model, with the family's block-level sharding units vs whole
block lists as units.

The transformers are built on the meta device from the published configs (ot_dist.memory.table: FLUX_DEV,
SD35_LARGE); sizes come from parameter shapes (ot_dist.memory.sharding: FSDP2's dim-0 chunking with its
padding). Model state = float32 weights + gradients + the 2 AdamW moments, sharded per parameter, on rank 0 (the
largest shard). Gathered = bfloat16 compute copies (MixedPrecisionPolicy param_dtype): the largest single
all-gather, and the peak held at once (the root's parameters, which FSDP2 keeps gathered through the step, +
the unit computing + the one prefetched). Not counted: activations, the transient unsharded gradients of one
unit before its reduce-scatter, text encoders and VAE (cached text and latents). Exact, not timed.

    python tests/benchmarks/bench_family_sharding.py [--json FILE]

Targets: every block-level unit <= 5 % of the model; rank-0 state within 0.1 % of 16 bytes x parameters / N.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3
RANKS = (8, 64)
# What the families declare (issue 15); used only when the family module cannot be imported.
FALLBACK_UNITS = {"flux": ("transformer_blocks", "single_transformer_blocks"), "sd3": ("transformer_blocks",)}
MODELS = {"Flux.1 dev": "flux", "SD3.5 Large": "sd3"}


def unit_patterns(family: str) -> tuple[tuple[str, ...], str]:
    """The family's shard_units for its transformer, and where they came from."""
    try:
        from ot_dist.models.families.registry import get_family

        return tuple(get_family(family).shard_units["transformer"]), f"ot_dist family `{family}`.shard_units"
    except Exception as error:  # the family module is missing or broken: the patterns of issue 15
        return FALLBACK_UNITS[family], f"fallback patterns (family `{family}` not importable: {error!r})"


def build_transformer(model: str):
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from ot_dist.memory.table import FLUX_DEV, SD35_LARGE

    with torch.device("meta"):
        if model == "Flux.1 dev":
            return FluxTransformer2DModel(**FLUX_DEV)
        return SD3Transformer2DModel(**SD35_LARGE)


def measure() -> tuple[list[dict], dict[str, str]]:
    from ot_dist.memory.sharding import STATE_BYTES, sharding

    rows, sources = [], {}
    for model, family in MODELS.items():
        transformer = build_transformer(model)
        patterns, sources[model] = unit_patterns(family)
        for granularity, per_block in (("per block (shard_units)", True), ("whole block lists", False)):
            s = sharding(transformer, patterns, per_block)
            for n in RANKS:
                rows.append(dict(
                    model=model, units=granularity, patterns=list(patterns), unit_count=len(s.unit_parameters),
                    parameters=s.parameters, root_parameters=s.root_parameters, largest_unit=s.largest,
                    largest_fraction=s.largest_fraction, ranks=n, state_bytes=s.state_bytes_per_rank(n),
                    even_state_bytes=STATE_BYTES * s.parameters / n, largest_gather_bytes=s.largest_gather_bytes(n),
                    gather_peak_bytes=s.gather_peak_bytes(n),
                ))
    return rows, sources


def table(rows: list[dict]) -> str:
    lines = ["| model | units | count | ranks | state GiB/rank | 16·P/N GiB | largest all-gather GiB | largest / model "
             "| gathered peak GiB | state + peak GiB/rank |", "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['units']} | {r['unit_count']} | {r['ranks']} | {r['state_bytes'] / GIB:.2f} "
            f"| {r['even_state_bytes'] / GIB:.2f} | {r['largest_gather_bytes'] / GIB:.2f} "
            f"| {100 * r['largest_fraction']:.2f} % | {r['gather_peak_bytes'] / GIB:.2f} "
            f"| {(r['state_bytes'] + r['gather_peak_bytes']) / GIB:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    rows, sources = measure()
    for model, source in sources.items():
        print(f"{model}: units from {source}: {rows[[r['model'] for r in rows].index(model)]['patterns']}")
    for model in MODELS:
        r = next(r for r in rows if r["model"] == model)
        print(f"{model}: {r['parameters']:,} parameters, root remainder {r['root_parameters']:,} "
              f"({100 * r['root_parameters'] / r['parameters']:.2f} %)")
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "unit_sources": sources}, indent=1))
    failures = [f"{r['model']}: largest unit {100 * r['largest_fraction']:.2f} % > 5 %" for r in rows
                if r["units"].startswith("per block") and r["largest_fraction"] > 0.05]
    failures += [f"{r['model']} @ {r['ranks']}: state {r['state_bytes']} vs {r['even_state_bytes']:.0f}" for r in rows
                 if abs(r["state_bytes"] / r["even_state_bytes"] - 1) > 1e-3]
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
