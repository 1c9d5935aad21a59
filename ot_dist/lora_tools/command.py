"""`ot-dist lora merge | merge-loras | resize | extract`: the argument parsing and dispatch (the work is in the
modules beside)."""

from __future__ import annotations

import argparse

from ot_dist.errors import ConfigError
from ot_dist.models.families.registry import FAMILY_NAMES

DTYPE_CHOICES = ("float16", "bfloat16", "float32")
DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative")  # lowrank.dynamic_rank's (not imported here: no torch)


def add_lora_parser(sub) -> None:
    lora = sub.add_parser("lora", help="merge a LoRA into a model, resize a LoRA, extract a LoRA from a finetune")
    tools = lora.add_subparsers(dest="lora_command", required=True)

    merge = tools.add_parser("merge", help="add LoRA files (kohya or diffusers layout, any trainer's) into a base "
                             "model and write the merged model")
    merge.add_argument("base", help="the base model: a diffusers folder or a single-file .safetensors")
    merge.add_argument("loras", nargs="+", metavar="LORA", help="LoRA .safetensors file(s), merged in order")
    merge.add_argument("--family", required=True, choices=list(FAMILY_NAMES))
    merge.add_argument("--weight", type=float, action="append", default=None,
                       help="strength per LoRA file, in order (default 1.0 each); repeatable")
    merge.add_argument("--out", required=True, help="the merged model: a folder (diffusers) or a .safetensors file")
    merge.add_argument("--format", choices=["diffusers", "single-file"], default=None,
                       help="default: single-file when --out ends in .safetensors, else diffusers")
    merge.add_argument("--config", default=None, metavar="FOLDER",
                       help="for a single-file base: the diffusers folder with its component configs (as model.config)")
    merge.add_argument("--dtype", choices=DTYPE_CHOICES, default="float16", help="dtype of the written weights")

    together = tools.add_parser("merge-loras", help="several LoRA files as one, at a given rank (SVD of the summed "
                                "changes, as kohya's svd_merge_lora.py)")
    together.add_argument("loras", nargs="+", metavar="LORA", help="LoRA .safetensors files of one layout")
    together.add_argument("--weight", type=float, action="append", default=None,
                          help="strength per LoRA file, in order (default 1.0 each); repeatable")
    together.add_argument("--rank", type=int, required=True, help="the merged file's rank")
    together.add_argument("--conv-rank", type=int, default=None,
                          help="the rank of convolutions with a kernel above 1x1 (kohya's --new_conv_rank); "
                               "default --rank")
    together.add_argument("--out", required=True, help="the merged LoRA file")

    resize = tools.add_parser("resize", help="re-approximate every module of a LoRA at another rank (SVD)")
    resize.add_argument("lora", help="LoRA .safetensors file (kohya or diffusers layout)")
    resize.add_argument("--rank", type=int, required=True,
                        help="the new rank (with --dynamic-method: the largest rank a module may get)")
    resize.add_argument("--conv-rank", type=int, default=None,
                        help="the rank of Conv2d modules (3x3 and 1x1; kohya's --new_conv_rank); default --rank")
    resize.add_argument("--dynamic-method", choices=list(DYNAMIC_METHODS), default=None,
                        help="choose each module's rank from its singular values as kohya's resize_lora.py does: "
                             "sv_ratio (largest / kept above PARAM), sv_fro (PARAM of the Frobenius norm), "
                             "sv_cumulative (PARAM of the sum of singular values)")
    resize.add_argument("--dynamic-param", type=float, default=None, help="the dynamic method's target")
    resize.add_argument("--out", required=True, help="the resized LoRA file (same layout and names)")

    extract = tools.add_parser("extract", help="a LoRA (the family's layout) from a full finetune and its base")
    extract.add_argument("base", help="the base model (diffusers folder or single file)")
    extract.add_argument("tuned", help="the finetuned model (same family and architecture)")
    extract.add_argument("--family", required=True, choices=list(FAMILY_NAMES))
    extract.add_argument("--rank", type=int, required=True)
    extract.add_argument("--conv-rank", type=int, default=None,
                         help="the rank of convolutions with a kernel above 1x1 (kohya's --conv_dim); default --rank")
    extract.add_argument("--out", required=True, help="the LoRA .safetensors file")
    extract.add_argument("--min-change", type=float, default=1e-6,
                         help="skip modules whose change is below this fraction of the weight's norm (default 1e-6)")
    extract.add_argument("--dtype", choices=DTYPE_CHOICES, default="float16", help="dtype of the LoRA matrices")


def run_lora(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ot_dist.checkpoint.run_folder import check_writable

    # The folder --out goes into, before any model loads (a file in its way was a traceback after the work).
    check_writable(Path(args.out).expanduser().resolve().parent, f"--out {args.out}: its folder")
    if args.lora_command == "merge":
        from ot_dist.lora_tools.merge import merge_command

        weights = args.weight or [1.0] * len(args.loras)
        if len(weights) != len(args.loras):
            raise ConfigError(f"--weight: {len(weights)} given for {len(args.loras)} LoRA files (one each, in order)")
        fmt = args.format or ("single-file" if args.out.endswith(".safetensors") else "diffusers")
        merge_command(args.base, args.family, args.loras, weights, args.out, fmt, args.config, args.dtype)
    elif args.lora_command == "merge-loras":
        from ot_dist.lora_tools.merge_loras import merge_loras_command

        merge_loras_command(args.loras, args.weight or [1.0] * len(args.loras), args.rank, args.out,
                            conv_rank=args.conv_rank)
    elif args.lora_command == "resize":
        from ot_dist.lora_tools.resize import resize_command

        resize_command(args.lora, args.rank, args.out, conv_rank=args.conv_rank, dynamic_method=args.dynamic_method,
                       dynamic_param=args.dynamic_param)
    else:
        from ot_dist.lora_tools.extract import extract_command

        extract_command(args.base, args.tuned, args.family, args.rank, args.out, args.min_change, args.dtype,
                        conv_rank=args.conv_rank)
    return 0
