"""Issue 21's GPU rows and the levers that may close their gaps, side by side in one process on one GPU, within a
time budget: one lent machine's short lease measures as much as it can, and what it could not reach is listed.

    python tests/benchmarks/bench_gpu_levers.py --out OUT --budget 540

Each entry is one `ot-dist bench` run (the same `run_bench`), except that the FLOP count of a (model, method,
batch) is made once and reused, and that the entry may undo one change to compare against it
(tests/benchmarks/fast_path_levers.py: peft's float32 copy of each LoRA layer's input, the fused up projection, the
block-wise casts of the adapter weights or of a full finetune's weights). An entry whose estimated cost no longer fits the budget is skipped. Writes OUT/bench.md (rows), OUT/levers.jsonl (one JSON
per run, with its profile summary) and OUT/profiles.md (where the profiled rows' time went).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

from fast_path_levers import undone

# (label, options, estimated seconds on an H100 / H200 including the build, undo) in the order they run: the rows
# of the table first, then the cheap levers, then the ones that compile.
PLAN = [
    ("sdxl lora", dict(model="sdxl", method="lora", batch_size=8, profile_steps=2), 40, None),
    ("sdxl lora peft-copies", dict(model="sdxl", method="lora", batch_size=8), 35, "lora_input_copies"),
    ("sdxl lora per-layer-casts", dict(model="sdxl", method="lora", batch_size=8), 35, "lora_block_casts"),
    ("sdxl lora own-down-projections", dict(model="sdxl", method="lora", batch_size=8), 35, "lora_shared_down"),
    ("sdxl full ckpt per-layer-casts", dict(model="sdxl", method="full", batch_size=8, gradient_checkpointing=True),
     45, "weight_block_casts"),
    ("flux lora", dict(model="flux-dev", method="lora", batch_size=1, profile_steps=2), 45, None),
    ("sdxl full ckpt", dict(model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
                            profile_steps=2), 45, None),
    ("sdxl lora cuda-graphs", dict(model="sdxl", method="lora", batch_size=8,
                                   performance=(("compile", "true"), ("compile_mode", "reduce-overhead")),
                                   profile_steps=2), 200, None),
    ("flux lora compile", dict(model="flux-dev", method="lora", batch_size=1,
                               performance=(("compile", "true"),), profile_steps=2), 150, None),
    ("sdxl lora compile", dict(model="sdxl", method="lora", batch_size=8,
                               performance=(("compile", "true"),), profile_steps=2), 200, None),
    ("sdxl full ckpt every-2nd-block", dict(model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
                                            performance=(("checkpoint_every_n_blocks", "2"),)), 40, None),
    ("flux lora b2", dict(model="flux-dev", method="lora", batch_size=2), 40, None),
    ("flux lora peft-copies", dict(model="flux-dev", method="lora", batch_size=1), 40, "lora_input_copies"),
    ("flux lora per-layer-casts", dict(model="flux-dev", method="lora", batch_size=1), 40, "lora_block_casts"),
    ("flux lora own-down-projections", dict(model="flux-dev", method="lora", batch_size=1), 40, "lora_shared_down"),
    ("flux lora b2 compile", dict(model="flux-dev", method="lora", batch_size=2,
                                  performance=(("compile", "true"),)), 90, None),
    ("sdxl full ckpt every-2nd-block cuda-graphs", dict(
        model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
        performance=(("checkpoint_every_n_blocks", "2"), ("compile", "true"), ("compile_mode", "reduce-overhead"))),
        200, None),
    ("sdxl full ckpt channels-last-off", dict(model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
                                              performance=(("channels_last", "off"),)), 40, None),
    ("flux lora float8 compile", dict(model="flux-dev", method="lora", batch_size=1,
                                      performance=(("compile", "true"), ("float8_matmuls", "true"))), 120, None),
    # Flux compiled kept the device 88 % busy (2026-11-27 profile): CUDA graphs may take the rest of the host's share
    ("flux lora cuda-graphs float8", dict(model="flux-dev", method="lora", batch_size=1,
                                          performance=(("compile", "true"), ("compile_mode", "reduce-overhead"),
                                                       ("float8_matmuls", "true"))), 150, None),
    ("flux lora b2 float8 compile", dict(model="flux-dev", method="lora", batch_size=2,
                                         performance=(("compile", "true"), ("float8_matmuls", "true"))), 150, None),
    # The frozen-base storages OneTrainer's low-memory presets use, and layer offloading (session 23): speed and peak
    ("flux lora int8", dict(model="flux-dev", method="lora", batch_size=1, weight_dtype="int8"), 50, None),
    ("sdxl lora int8", dict(model="sdxl", method="lora", batch_size=8, weight_dtype="int8"), 40, None),
    ("flux lora nf4", dict(model="flux-dev", method="lora", batch_size=1, weight_dtype="nf4"), 50, None),
    # Queued after the third lease of 2026-11-27: what may close the SDXL gaps, and int8 with its passes fused
    ("sdxl lora b12 cuda-graphs", dict(model="sdxl", method="lora", batch_size=12,
                                       performance=(("compile", "true"), ("compile_mode", "reduce-overhead"))), 200, None),
    ("sdxl full every-2nd-block compile", dict(model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
                                               performance=(("checkpoint_every_n_blocks", "2"), ("compile", "true"))),
     200, None),
    ("sdxl full ckpt every-3rd-block", dict(model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
                                            performance=(("checkpoint_every_n_blocks", "3"),)), 40, None),
    ("flux lora int8 compile", dict(model="flux-dev", method="lora", batch_size=1, weight_dtype="int8",
                                    performance=(("compile", "true"),)), 150, None),
    ("sdxl lora int8 compile", dict(model="sdxl", method="lora", batch_size=8, weight_dtype="int8",
                                    performance=(("compile", "true"),)), 200, None),
    # Queued in session 30: float8 matmuls where SDXL's linear layers are most of the FLOPs (~60 % of a 1024 px step:
    # attention projections and GEGLU feed-forwards over 4096 and 1024 tokens at batch 8), beside what each row's best
    # lever is now
    ("sdxl lora cuda-graphs float8", dict(model="sdxl", method="lora", batch_size=8,
                                          performance=(("compile", "true"), ("compile_mode", "reduce-overhead"),
                                                       ("float8_matmuls", "true"))), 280, None),
    ("sdxl full every-2nd-block compile float8", dict(
        model="sdxl", method="full", batch_size=8, gradient_checkpointing=True,
        performance=(("checkpoint_every_n_blocks", "2"), ("compile", "true"), ("float8_matmuls", "true"))), 280, None),
    ("flux lora ckpt", dict(model="flux-dev", method="lora", batch_size=1, gradient_checkpointing=True), 45, None),
    ("flux lora ckpt offload-0.5", dict(model="flux-dev", method="lora", batch_size=1, gradient_checkpointing=True,
                                        offload_fraction=0.5), 60, None),
    # Queued in session 25: compile beside streamed blocks, and a full finetune that streams its trained blocks
    # (OneTrainer's FINE_TUNE presets: bfloat16 weights, Adafactor with the fused back pass)
    ("flux lora ckpt offload-0.5 compile", dict(model="flux-dev", method="lora", batch_size=1,
                                                gradient_checkpointing=True, offload_fraction=0.5,
                                                performance=(("compile", "true"),)), 150, None),
    ("flux full adafactor fused", dict(model="flux-dev", method="full", batch_size=1, gradient_checkpointing=True,
                                       optimizer="ADAFACTOR", fused_back_pass=True, trained_weight_dtype="bfloat16"),
     60, None),
    ("flux full adafactor fused offload-0.5", dict(model="flux-dev", method="full", batch_size=1,
                                                   gradient_checkpointing=True, optimizer="ADAFACTOR",
                                                   fused_back_pass=True, trained_weight_dtype="bfloat16",
                                                   offload_fraction=0.5), 90, None),
    ("flux lora b2 ckpt activation-offloading", dict(model="flux-dev", method="lora", batch_size=2,
                                                     gradient_checkpointing=True, activation_offloading=True), 60, None),
    ("flux lora b2 ckpt", dict(model="flux-dev", method="lora", batch_size=2, gradient_checkpointing=True), 50, None),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole plan")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated labels, run in this order (default: the plan)")
    parser.add_argument("--no-profile", action="store_true", help="no profiled steps (where the profiler fails)")
    parser.add_argument("--tiny", action="store_true", help="the tiny models at 64 px, batch 2 (a CPU smoke run)")
    args = parser.parse_args()
    start = time.monotonic()

    import torch

    from ot_dist.bench.flops import peak_flops
    from ot_dist.bench.report import HEADER, RULE, markdown_row
    from ot_dist.bench.run import run_bench
    from ot_dist.bench.setup import DTYPE_NAMES, BenchOptions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path("/tmp/bench_levers_runs")  # per-run files and traces stay on the machine
    table = out / "bench.md"
    table.write_text(f"{HEADER[:-1]}| entry |\n{RULE}---|\n")
    flops_of: dict[tuple, float] = {}
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    entries = {entry[0]: entry for entry in PLAN}
    unknown = [label for label in only if label not in entries]
    if unknown:
        parser.error(f"--only: no entry {unknown} in the plan")
    skipped = []
    # --only also sets the order: a short lease runs the entries that matter most first
    for label, settings, estimate, change in [entries[label] for label in only] if only else PLAN:
        left = args.budget - (time.monotonic() - start)
        if estimate > left:
            skipped.append(f"{label} (needs ~{estimate} s, {left:.0f} s left)")
            continue
        if args.no_profile:
            settings = {key: value for key, value in settings.items() if key != "profile_steps"}
        if args.tiny:
            settings = settings | {"model": f"tiny-{settings['model']}", "batch_size": 2}
        options = BenchOptions(resolution=64 if args.tiny else 1024, dtype="bf16", steps=args.steps,
                               warmup=args.warmup, **settings)
        key = (options.model, options.method, options.lora_rank, options.batch_size, options.gradient_checkpointing)
        options = replace(options, count_flops=key not in flops_of)
        began = time.monotonic()
        print(f"== {label} ({left:.0f} s left)", flush=True)
        try:
            with undone(change):
                result = run_bench(options, str(runs_dir))
        except Exception as err:  # out of memory, a compile failure: recorded, and the plan goes on
            traceback.print_exc()
            with (out / "levers.jsonl").open("a") as f:
                f.write(json.dumps({"entry": label, "error": f"{type(err).__name__}: {err}"[:2000]}) + "\n")
            with table.open("a") as f:
                f.write(f"| {label}: FAILED {type(err).__name__} |\n")
        else:
            if result["flops_train_per_step"] is None:  # counted by an earlier entry
                step_flops = flops_of[key]
                peak = peak_flops(torch.device(result["device"]), DTYPE_NAMES[options.dtype], None)
                result |= {"flops_train_per_step": step_flops,
                           "tflops_train_per_image": step_flops / options.batch_size / 1e12,
                           "achieved_tflops": step_flops / result["step_time_median_s"] / 1e12,
                           "mfu": step_flops / result["step_time_median_s"] / peak if peak else None}
            flops_of[key] = result["flops_train_per_step"]
            result |= {"entry": label, "undone": change, "entry_seconds": time.monotonic() - began}
            row = markdown_row(result)[:-1] + f"| {label} |"
            print(row, flush=True)
            with table.open("a") as f:
                f.write(row + "\n")
            with (out / "levers.jsonl").open("a") as f:
                f.write(json.dumps(result) + "\n")
            if result.get("profile"):
                text = Path(result["profile"]["files"][0]).read_text()
                with (out / "profiles.md").open("a") as f:
                    f.write(f"## {label}\n\n{text}\n\n")
        finally:
            torch._dynamo.reset()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    with table.open("a") as f:
        f.write(f"\n{time.monotonic() - start:.0f} s in all; not run: {'; '.join(skipped) or 'none'}\n")
    print(table.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
