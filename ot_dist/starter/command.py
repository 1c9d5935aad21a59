"""`ot-dist init`: argument parsing and writing the file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ot_dist.errors import ConfigError
from ot_dist.models.families.registry import FAMILY_NAMES


def add_init_parser(sub) -> None:
    init = sub.add_parser("init", help="write a commented starting config that fits your GPU memory")
    init.add_argument("--family", required=True, choices=list(FAMILY_NAMES))
    init.add_argument("--method", required=True, choices=["lora", "full", "embedding"])
    init.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="memory of one GPU, in GiB")
    init.add_argument("--gpus", type=int, default=1, help="GPUs the run will use (all nodes together; default 1)")
    init.add_argument("--data", required=True, help="the image folder (images with same-name .txt captions)")
    init.add_argument("--model", default="/path/to/base-model", help="the base model (diffusers folder or single file)")
    init.add_argument("--output-dir", default=None, help="the run's output_dir (default: runs/<family>-<method>)")
    init.add_argument("--out", default=None, help="the config file to write (default: print it)")
    init.add_argument("--force", action="store_true", help="replace --out when it exists")


def run_init(args: argparse.Namespace) -> int:
    import yaml

    from ot_dist.config.load import validate
    from ot_dist.models.families.registry import get_family
    from ot_dist.starter.choose import choose
    from ot_dist.starter.render import render

    if args.gpu_memory <= 0 or args.gpus < 1:
        raise ConfigError("--gpu-memory and --gpus must be positive")
    family = get_family(args.family)
    choice = choose(family, args.method, args.gpu_memory, args.gpus)
    text = render(family, args.method, choice, args.model, args.data, args.output_dir or f"runs/{family.name}-{args.method}",
                  args.gpu_memory, args.gpus)
    validate(yaml.safe_load(text))  # what we write validates like any config a user writes, or nothing is written
    print(f"chosen: '{choice.setup.label}', strategy {choice.strategy}: {choice.table_gib:.2f} GiB in the memory table "
          f"({choice.reference}), about {choice.need_gib:.1f} GiB per GPU with activations", file=sys.stderr)
    if args.out is None:
        print(text, end="")
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"--out: {out} exists (--force replaces it)")
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0
