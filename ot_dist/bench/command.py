"""`ot-dist bench`: its arguments and what it prints."""

from __future__ import annotations

import argparse

from ot_dist.bench.architectures import BENCH_MODELS


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="time training steps of a real-size (or tiny) model with random weights: "
                           "images/s, step time, peak memory, MFU")
    bench.add_argument("--model", required=True, choices=list(BENCH_MODELS))
    bench.add_argument("--method", default="lora", choices=["full", "lora"])
    bench.add_argument("--lora-rank", type=int, default=16)
    bench.add_argument("--resolution", type=int, default=1024, help="square side in pixels (default 1024)")
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    bench.add_argument("--gradient-checkpointing", action="store_true")
    bench.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                       help="autocast compute dtype; trained weights stay float32 (default bf16)")
    bench.add_argument("--optimizer", default="ADAMW", type=str.upper, help="an optimizer.name (default ADAMW)")
    bench.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    bench.add_argument("--peak-tflops", type=float, default=None,
                       help="the device's peak TFLOP/s for MFU (default: a table of GPUs; none on CPU)")
    bench.add_argument("--no-flops", dest="count_flops", action="store_false",
                       help="skip the FLOP count (no MFU)")
    bench.add_argument("--performance", action="append", default=[], metavar="KEY=VALUE",
                       help="a performance option of the config (repeatable), e.g. compile=true, "
                       "attention_backend=flash, checkpoint_every_n_blocks=2 (configs/REFERENCE.md)")
    bench.add_argument("--profile", dest="profile_steps", type=int, default=0, metavar="N",
                       help="after the timed steps, run N more under torch.profiler and write where their time went "
                       "(<run>_profile.md: time per op category, device busy %%, top ops) and a trace (default 0)")
    bench.add_argument("--weight-dtype", default=None,
                       choices=["float32", "bfloat16", "float16", "float8", "nf4", "int8"], help="storage of the frozen weights (a LoRA's base): default the compute dtype; int8 computes in "
                       "int8 matmuls (weight_dtype in configs/REFERENCE.md)")
    bench.add_argument("--offload-fraction", type=float, default=0.0, metavar="F",
                       help="stream the weights of the denoiser's last blocks, this fraction of their bytes, from CPU "
                       "memory: a LoRA's frozen ones, a full finetune's trained ones too (<denoiser>.offload_fraction; "
                       "needs --gradient-checkpointing, and --fused-back-pass for a full finetune)")
    bench.add_argument("--fused-back-pass", action="store_true",
                       help="optimizer.fused_back_pass (each weight stepped in backward; clip_grad_norm off): what a "
                       "full finetune's --offload-fraction needs (its trained weights stream too)")
    bench.add_argument("--trained-weight-dtype", default="float32", choices=["float32", "bfloat16"],
                       help="storage of the trained weights (trained_weight_dtype; default float32 masters)")
    bench.add_argument("--activation-offloading", action="store_true",
                       help="the checkpointed blocks' inputs in CPU memory (activation_offloading; needs "
                       "--gradient-checkpointing)")
    bench.add_argument("--out", default="bench_out", metavar="DIR",
                       help="write <run>.json and append the row to DIR/bench.md (default bench_out)")


def run_bench_command(args: argparse.Namespace) -> int:
    from ot_dist.bench.report import HEADER, RULE, markdown_row, write_report
    from ot_dist.bench.run import run_bench
    from ot_dist.bench.setup import BenchOptions
    from ot_dist.errors import ConfigError

    for name in ("lora_rank", "resolution", "batch_size", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be at least 1 (got {getattr(args, name)})")
    if args.profile_steps < 0:
        raise ConfigError(f"--profile: must be at least 0 steps (got {args.profile_steps})")
    if args.warmup < 0:
        raise ConfigError(f"--warmup: must be at least 0 (got {args.warmup})")
    performance = []
    for item in args.performance:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--performance: {item!r} is not KEY=VALUE (e.g. compile=true)")
        performance.append((key.strip(), value.strip()))
    options = BenchOptions(
        model=args.model, method=args.method, lora_rank=args.lora_rank, resolution=args.resolution,
        batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
        gradient_checkpointing=args.gradient_checkpointing, dtype=args.dtype, optimizer=args.optimizer,
        device=args.device, peak_tflops=args.peak_tflops, count_flops=args.count_flops,
        performance=tuple(performance), profile_steps=args.profile_steps, weight_dtype=args.weight_dtype,
        offload_fraction=args.offload_fraction, fused_back_pass=args.fused_back_pass,
        trained_weight_dtype=args.trained_weight_dtype, activation_offloading=args.activation_offloading)
    result = run_bench(options, args.out)
    json_path, table = write_report(result, args.out)
    print(HEADER)
    print(RULE)
    print(markdown_row(result))
    print(f"wrote {json_path} and {table}")
    return 0
