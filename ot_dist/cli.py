"""`ot-dist`: the command line. Config is validated before anything heavy is imported or built."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys

from ot_dist.errors import ConfigError, UserError, exit_code_of, storage_refusal
from ot_dist.models.families.registry import FAMILY_NAMES


def _quiet_libraries() -> None:
    # Library chatter (progress bars per component, optional-backend notices) drowns the training log.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # bitsandbytes (imported by peft) warns about an optional 4-bit CPU kernel we never use.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ot-dist", description="Train diffusion models on one GPU, one node or many.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="training config (YAML)")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY.PATH=VALUE",
            help="override a config key (value parsed as YAML); repeatable",
        )

    train = sub.add_parser("train", help="train from a config")
    add_config_args(train)
    add_resume_arg(train)
    add_overwrite_arg(train)

    config = sub.add_parser("config", help="check a config or print the config reference")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a config and print it resolved")
    add_config_args(check)
    config_sub.add_parser("reference", help="print the config reference (Markdown)")

    launch = sub.add_parser("launch", help="train on several processes / nodes through accelerate launch")
    add_config_args(launch)
    launch.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) on this node")
    launch.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    launch.add_argument("--node-rank", type=int, default=0, help="rank of this node (0 .. nnodes-1)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the node-rank-0 host")
    launch.add_argument("--rdzv-backend", default="static", choices=["static", "c10d"],
                        help="static: nodes given their rank; c10d: torchrun's elastic rendezvous assigns them")
    launch.add_argument("--max-restarts", type=int, default=0, help="times torchrun restarts failed workers")
    launch.add_argument("--strategy", default=None, choices=["single", "ddp", "fsdp", "zero1", "zero2", "zero3"])
    add_resume_arg(launch)
    add_overwrite_arg(launch)
    launch.add_argument("--dry-run", action="store_true", help="only print the command and the accelerate config")

    k8s = sub.add_parser("k8s", help="render Kubernetes manifests that run `ot-dist launch` for a config")
    add_config_args(k8s)
    k8s.add_argument("--nodes", type=int, default=1, help="number of nodes (pods)")
    k8s.add_argument("--gpus-per-node", type=int, default=1, help="GPUs (processes) per node")
    k8s.add_argument("--image", required=True, help="container image with ot_dist installed (k8s/Dockerfile)")
    k8s.add_argument("--flavor", default="pytorchjob", choices=["pytorchjob", "indexed-job"],
                     help="Kubeflow PyTorchJob (elastic, c10d) or an operator-free Indexed Job + headless Service")
    k8s.add_argument("--name", default=None, help="job name (default: ot-dist-<config file name>)")
    k8s.add_argument("--grace-seconds", type=int, default=None, metavar="S", help="how long Kubernetes lets a "
                     "training pod write its checkpoint after SIGTERM before it kills it (default 900; Kubernetes' own "
                     "default of 30 s is too short for a full finetune's state)")
    k8s.add_argument("--shard-parts", type=int, default=None, metavar="N", help="instead of training: build the "
                     "config's shard set in N parts, an Indexed Job of N CPU pods (shard build --part) and a merge "
                     "Job, on the training pods' volume")
    k8s.add_argument("--shard-workers", type=int, default=4, metavar="W", help="encoder processes (and CPUs "
                     "requested) per shard part pod (default 4)")
    k8s.add_argument("--out", default=None, metavar="DIR", help="write one file per manifest + kustomization.yaml "
                     "here (default: print to stdout)")

    schedule = sub.add_parser("schedule", help="preview the learning rate of every parameter group at every step")
    add_config_args(schedule)
    schedule.add_argument("--steps", type=int, default=None, help="total optimizer steps (default: counted from "
                          "the data folder, epochs, batch and max_steps, as training does)")
    schedule.add_argument("--world-size", type=int, default=1, help="processes the run will use (default 1)")
    schedule.add_argument("--csv", default=None, metavar="FILE", help="write the table here instead of printing it")
    schedule.add_argument("--plot", default=None, metavar="FILE.png", help="draw the curves into this PNG")

    shard = sub.add_parser("shard", help="build webdataset shard sets (aspect buckets) from the data concepts")
    shard_sub = shard.add_subparsers(dest="shard_command", required=True)
    build = shard_sub.add_parser("build", help="write the shards and manifest, print the bucket report")
    add_config_args(build)
    build.add_argument("--out", default=None, metavar="DIR", help="shard set folder (default: data.shards, else "
                       "<cache folder>/shards/<name>, see docs/data.md)")
    build.add_argument("--world-size", type=int, default=1, help="processes the bucket report assumes (default 1)")
    build.add_argument("--workers", type=int, default=1, help="processes that encode the images (default 1; the "
                       "shards are byte-identical with any number)")
    build.add_argument("--part", default=None, metavar="I/N", help="build only the I-th of N disjoint parts of the "
                       "set (one machine or pod each) into OUT/part-I-of-N/; a finished part is skipped; then "
                       "`ot-dist shard merge` (docs/data.md)")
    merge = shard_sub.add_parser("merge", help="write the manifest of a set built in parts (shard build --part), "
                                 "over the parts' shards, without rewriting them")
    add_config_args(merge)
    merge.add_argument("--out", default=None, metavar="DIR", help="the shard set folder the parts were built in "
                       "(default: as for shard build)")
    merge.add_argument("--parts", type=int, default=None, metavar="N", help="the number of parts (default: from "
                       "the part folders in DIR)")
    merge.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait up to this long for parts "
                       "still building (a merge pod started beside the part pods)")
    merge.add_argument("--world-size", type=int, default=1, help="processes the bucket report assumes (default 1)")
    from ot_dist.data.external_command import add_index_parser

    add_index_parser(shard_sub)
    for name, helps in (("list", "show the shard sets in the cache folder: size, samples, status, last use"),
                        ("prune", "remove the stale and incomplete shard sets of the cache folder")):
        command = shard_sub.add_parser(name, help=helps)
        command.add_argument("config", nargs="?", default=None, help="a training config: its cache folder "
                             "(data.cache_dir, else OT_DIST_CACHE, else ot_dist-cache beside output_dir)")
        command.add_argument("--cache", default=None, metavar="DIR", help="the cache folder (instead of a config)")
        if name == "prune":
            command.add_argument("--unused-days", type=float, default=None, metavar="N",
                                 help="also remove the sets no training run used for N days")
            command.add_argument("--dry-run", action="store_true", help="only say what would be removed")

    export = sub.add_parser("export", help="write the exports (diffusers, single file, LoRA, embedding) of a checkpoint")
    export.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step-N), or an output_dir / "
                        "checkpoints folder: its latest committed checkpoint")
    export.add_argument("--format", dest="formats", action="append", default=None,
                        choices=["diffusers", "single-file", "lora", "embedding"],
                        help="what to write (repeatable; default: all the method writes at the end of training)")
    export.add_argument("--ema", action="store_true", help="export the EMA weights (files named *_ema)")
    export.add_argument("--out", default=None, metavar="DIR", help="default: OUTPUT_DIR/exports/step-N")

    from ot_dist.bench.command import add_bench_parser
    from ot_dist.lora_tools.command import add_lora_parser
    from ot_dist.migrate.command import add_import_parser
    from ot_dist.starter.command import add_init_parser

    add_lora_parser(sub)
    add_init_parser(sub)
    add_import_parser(sub)
    add_bench_parser(sub)

    demo = sub.add_parser("demo", help="the embedded demo")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    prepare = demo_sub.add_parser("prepare", help="create the tiny model(s) and the shapes dataset")
    prepare.add_argument("--root", default="demo_out", help="where to create them (default: demo_out)")
    prepare.add_argument("--family", nargs="+", default=["sd1"], choices=list(FAMILY_NAMES))
    return parser


def add_resume_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="continue from a checkpoint: auto = the latest committed one in output_dir (or start fresh "
                   "if there is none), or a checkpoint folder (an earlier one than the newest: the later checkpoints move "
                   "to OUTPUT_DIR/abandoned/, so auto continues the new line). A restarted worker group (torchrun "
                   "--max-restarts) always resumes auto.")


def add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="output_dir holds an earlier run: move it aside to OUTPUT_DIR.old-<time> and start a new run "
                   "(without this, or --resume, starting over an earlier run is refused)")


def restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def overwrite_choice(args: argparse.Namespace) -> bool:
    # The first attempt's --overwrite already moved the old run aside; a restarted group continues the new run
    # (resume_choice gives it `auto`), which --overwrite together with `auto` is refused as contradictory.
    return bool(args.overwrite) and not restarted_by_torchrun()


def resume_choice(args: argparse.Namespace, output_dir: str | None = None) -> str | None:
    # torchrun restarts the whole worker group after a failure: it must continue, not start over. With --resume PATH
    # too: the first attempt resumed from PATH (and moved any later history aside); a restart that took PATH again
    # would throw away the steps trained since and move them aside in turn. Only while output_dir holds no committed
    # checkpoint yet (PATH lies elsewhere, nothing saved since) is PATH still the place to continue from.
    # Each rank decides this before the process group exists, from its own listing, which a network filesystem's
    # cache can make differ between nodes: the trainer takes rank 0's decision and its checkpoint on every rank
    # (checkpoint/run_folder.py agreed_start).
    if not restarted_by_torchrun():
        return args.resume
    if args.resume in (None, "auto") or output_dir is None:
        return "auto"
    from ot_dist.checkpoint.layout import checkpoints_dir, committed_checkpoints

    return "auto" if committed_checkpoints(checkpoints_dir(output_dir)) else args.resume


def run(args: argparse.Namespace) -> int:
    from ot_dist.config.load import dump_config, load_config

    if args.command == "config" and args.config_command == "reference":
        from ot_dist.config.reference import render_reference

        print(render_reference())
        return 0
    if args.command == "config":
        from ot_dist.early_checks import check_input_paths, setup_warnings

        config = load_config(args.config, args.overrides)
        check_input_paths(config)
        print(dump_config(config), end="")
        for warning in setup_warnings(config, int(os.environ.get("WORLD_SIZE", "1"))):
            print(f"warning: {warning}", file=sys.stderr)
        return 0
    if args.command == "launch":
        from ot_dist.launcher import run_launch

        return run_launch(args)
    if args.command == "k8s":
        from ot_dist.kube import run_k8s

        return run_k8s(args)
    if args.command == "train":
        from ot_dist.launcher import reconcile_with_launcher

        # Validated (and reconciled with what a launcher selected) before anything heavy starts.
        config = reconcile_with_launcher(load_config(args.config, args.overrides))
        from ot_dist.train.trainer import train

        result = train(config, resume=resume_choice(args, config.output_dir), overwrite=overwrite_choice(args))
        if int(os.environ.get("RANK", "0")) == 0 and not result.stopped_by:  # a stop was reported by the trainer
            print(f"done: {result.steps} steps, final loss {result.losses[-1]:.4f}" if result.losses else "done")
        return 0
    if args.command == "export":
        from ot_dist.checkpoint.export_command import export_checkpoint

        export_checkpoint(args.checkpoint, args.formats, args.ema, args.out)
        return 0
    if args.command == "schedule":
        from ot_dist.optim.preview import schedule_command

        schedule_command(load_config(args.config, args.overrides), args.steps, args.world_size, args.csv, args.plot)
        return 0
    if args.command == "shard" and args.shard_command == "index":
        from ot_dist.data.external_command import run_index

        return run_index(args)
    if args.command == "shard" and args.shard_command in ("list", "prune"):
        return shard_cache_command(args)
    if args.command == "shard":
        from ot_dist.data.shards import build_shard_set
        from ot_dist.data.training_data import report_for, shard_dir_of

        config = load_config(args.config, args.overrides)
        if not config.data.concept_list():
            raise ConfigError("data: shard build needs data.path or data.concepts (the image folders)")
        out = args.out or shard_dir_of(config)
        from ot_dist.checkpoint.run_folder import check_writable

        if args.shard_command != "merge":  # a merge writes into the parts' folder, which exists or is named missing
            check_writable(out, "--out" if args.out else "the shard set folder")  # before any image is read
        if args.shard_command == "merge":
            from ot_dist.data.shard_parts import merge_parts

            if args.parts is not None and args.parts < 1:
                raise ConfigError(f"shard merge: --parts must be at least 1, got {args.parts}")
            merge_parts(config, out, args.parts, config_path=str(args.config), wait=args.wait)
        elif args.workers < 1:
            raise ConfigError(f"shard build: --workers must be at least 1, got {args.workers}")
        elif args.part is not None:
            from ot_dist.data.shard_parts import build_part, parse_part

            build_part(config, out, parse_part(args.part), workers=args.workers)
            return 0
        else:
            build_shard_set(config, out, config_path=str(args.config), workers=args.workers)
        print("\n".join(report_for(config, out, args.world_size)))
        return 0
    if args.command == "import":
        from ot_dist.migrate.command import run_import

        return run_import(args)
    if args.command == "init":
        from ot_dist.starter.command import run_init

        return run_init(args)
    if args.command == "bench":
        from ot_dist.bench.command import run_bench_command

        return run_bench_command(args)
    if args.command == "lora":
        from ot_dist.lora_tools.command import run_lora

        return run_lora(args)
    if args.command == "demo":
        from ot_dist.demo import prepare_demo

        for name, path in prepare_demo(args.root, args.family).items():
            print(f"{name}: {path}")
        return 0
    raise AssertionError(args)


def shard_cache_command(args: argparse.Namespace) -> int:
    """`ot-dist shard list | prune [CONFIG | --cache DIR]`."""
    from pathlib import Path

    from ot_dist.config.load import load_config
    from ot_dist.data import shard_cache

    in_use = None
    if args.cache:
        root = Path(args.cache)
    elif args.config:
        from ot_dist.data.training_data import shard_dir_of

        config = load_config(args.config, [])
        root = shard_cache.cache_root(config)
        in_use = shard_dir_of(config) if config.data.shards or config.data.concept_list() else None
    elif os.environ.get(shard_cache.CACHE_ENV):
        root = Path(os.environ[shard_cache.CACHE_ENV])
    else:
        raise ConfigError(f"shard {args.shard_command}: give a training config (its cache folder) or --cache DIR "
                          f"(or set {shard_cache.CACHE_ENV})")
    if args.shard_command == "list":
        lines = shard_cache.list_lines(root, in_use)
    else:
        lines = shard_cache.prune(root, args.unused_days, args.dry_run, keep=in_use)
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    # A rank killed by a fatal signal (a native abort or segfault in a library) prints each thread's Python stack
    # before it dies, so the log says which code it died in.
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file descriptor
        pass
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, name the failing rank and its error in the launcher's summary.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UserError as err:
        print(f"ot-dist: error: {err}", file=sys.stderr)
        return exit_code_of(err)
    except KeyboardInterrupt as err:
        print("ot-dist: interrupted", file=sys.stderr)
        return exit_code_of(err)
    except BrokenPipeError:  # `ot-dist schedule ... | head`: the reader is gone, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 141
    except Exception as err:  # noqa: BLE001 - only the storage's refusals are answered here
        refused = storage_refusal(err)
        if refused is None:
            raise
        # An export or any other write at the end: committed checkpoints stay as they were (the commit protocol
        # names its own failures, checkpoint/writer.py).
        print(f"ot-dist: error: a write failed: {refused} (free space, quota or file size limit); the committed "
              "checkpoints are as they were", file=sys.stderr)
        return exit_code_of(err)


def entry() -> None:
    """The `ot-dist` command and `python -m ot_dist`: main(), then an exit that a rank's library teardown cannot
    turn into a crash (see exit_process). main() itself returns, for callers in the same process."""
    try:
        code = main()
    except SystemExit as stop:  # argparse's usage errors and --help
        code = 0 if stop.code is None else stop.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # Only a process that imported the runtime can have started a process group. Importing it here would cost the
    # commands that never touch torch (`ot-dist launch`, which waits for its workers; `config check`, `k8s`) ~2.6 s.
    runtime = sys.modules.get("ot_dist.parallel.runtime")
    if runtime is not None:
        runtime.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
