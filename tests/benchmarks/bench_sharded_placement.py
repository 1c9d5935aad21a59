"""What one GPU holds of a full finetune's trained denoiser while fsdp starts, at 8 ranks, before and after the
trainer stopped moving it whole (Strategy.shards_while_placing, 2026-11-28).

Before: the float32 masters were placed whole, then sharded: the device held the whole model. Now FSDP2 moves each
unit's parameters to the device and keeps this rank's shard before the next unit moves: the device holds the shards
placed so far and one unit whole, at most (rank 0's shards + the largest unit, ot_dist.memory.sharding: FSDP2's dim-0
chunks with their padding). Denoisers built on the meta device from the published configs (ot_dist.memory.table),
the family's sharding units; text encoders and VAE left out (cached text and latents). Exact, not timed.

    python tests/benchmarks/bench_sharded_placement.py [--ranks 8]
"""

from __future__ import annotations

import argparse

GIB = 1024**3
MASTER_BYTES = 4  # float32 masters (trained_weight_dtype's default)
MODELS = ("SDXL", "SD3.5 Large", "Flux.1 dev", "Wan 2.1 T2V 14B", "HiDream-I1", "Qwen-Image", "FLUX.2 dev")


def measure(ranks: int) -> list[dict]:
    from ot_dist.memory.sharding import sharded_numel, sharding
    from ot_dist.memory.table import DENOISERS, build_components

    rows = []
    for model in MODELS:
        denoiser, _, units = DENOISERS[model]
        module = build_components(model)[denoiser]
        split = sharding(module, tuple(units))
        shards = sum(sharded_numel(p.shape, ranks) for p in split.all_params)
        rows.append({"model": model, "parameters": split.parameters,
                     "before_gib": split.parameters * MASTER_BYTES / GIB,
                     "after_gib": (shards + split.largest) * MASTER_BYTES / GIB,
                     "largest_unit_fraction": split.largest_fraction})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    ranks = parser.parse_args().ranks
    print(f"| denoiser (full finetune, float32 masters) | parameters | device at start-up, before | now, {ranks} ranks "
          "| largest unit |")
    print("|---|---|---|---|---|")
    for row in measure(ranks):
        print(f"| {row['model']} | {row['parameters'] / 1e9:.2f} B | {row['before_gib']:.1f} GiB | "
              f"{row['after_gib']:.1f} GiB | {100 * row['largest_unit_fraction']:.1f} % |")


if __name__ == "__main__":
    main()
