"""`ot-dist launch`: render an accelerate config for the chosen strategy, print the exact
`accelerate launch` command, run it. And the other direction: when a user starts
`accelerate launch --config_file THEIRS.yaml -m ot_dist train CONFIG`, read the strategy their
accelerate config selected from the environment accelerate sets, and reconcile it with the YAML.

accelerate is the front door only: it spawns the processes (through torchrun) and sets their
environment; the strategies themselves call torch FSDP2 / DeepSpeed directly, which also run on CPU.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from ot_dist.accelerate_env import ANY_ZERO_STAGE, strategy_from_environment
from ot_dist.config.load import validate
from ot_dist.config.schema import TrainConfig
from ot_dist.errors import ConfigError
from ot_dist.ports import free_port

MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def render_accelerate_config(
    config: TrainConfig,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "static",
) -> dict:
    """`rdzv_backend` static: each node is told its rank and the rank-0 node's address; c10d: torchrun's
    elastic rendezvous at the endpoint assigns node ranks (what a PyTorchJob's elastic policy runs)."""
    for flag, value, least in (("--nproc-per-node", nproc_per_node, 1), ("--nnodes", nnodes, 1)):
        if value < least:
            raise ConfigError(f"{flag}: must be at least {least}, got {value}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank: must be in 0 .. {nnodes - 1} (--nnodes {nnodes}), got {node_rank}")
    host, colon, port = (rdzv_endpoint or "").rpartition(":")  # the last colon: an IPv6 [host] has its own
    if not colon:
        host, port = rdzv_endpoint or "", ""
    if nnodes > 1 and not rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1 (the node-rank-0 machine)")
    if (nnodes > 1 and not port) or (port and not port.isdigit()):
        # Without one each node would pick a free port of its own, and the nodes would never meet.
        raise ConfigError(f"--rdzv-endpoint: {rdzv_endpoint} needs HOST:PORT with a port number (every node the same)")
    backend = rdzv_backend if nnodes > 1 else "static"  # one node has no other node to meet
    strategy = config.strategy
    world = nproc_per_node * nnodes
    if strategy == "single" and world > 1:
        raise ConfigError(f"strategy single runs one process; processes per node x nodes is {world}")
    rendered = {
        "compute_environment": "LOCAL_MACHINE",
        "num_processes": world,
        "num_machines": nnodes,
        "machine_rank": node_rank,
        "main_process_ip": host or "127.0.0.1",
        "main_process_port": int(port) if port else free_port(),
        "rdzv_backend": backend,
        # accelerate passes a static rendezvous as master address/port, any other as torchrun's rdzv endpoint.
        "same_network": backend == "static",
        "mixed_precision": MIXED_PRECISION[config.train_dtype],
        # Not use_cpu even on CPU machines: accelerate's CPU path starts one process; its multi-GPU
        # path is torchrun, which runs gloo ranks on CPU just as well.
        "use_cpu": False,
        "distributed_type": "NO" if world == 1 else "MULTI_GPU",
    }
    if strategy == "fsdp":
        rendered["distributed_type"] = "FSDP"
        rendered["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": config.fsdp.sharding != "shard_grad_op",
            "fsdp_sharding_strategy": "HYBRID_SHARD" if config.fsdp.sharding == "hybrid_shard" else "FULL_SHARD",
            "fsdp_offload_params": config.fsdp.cpu_offload,
            "fsdp_auto_wrap_policy": "NO_WRAP",  # ot_dist wraps block by block from the family spec
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": config.gradient_checkpointing,
        }
    elif strategy.startswith("zero"):
        rendered["distributed_type"] = "DEEPSPEED"
        if config.deepspeed.config_file:
            rendered["deepspeed_config"] = {"deepspeed_config_file": str(Path(config.deepspeed.config_file).resolve())}
        else:
            rendered["deepspeed_config"] = {
                "zero_stage": int(strategy[-1]),
                "offload_optimizer_device": "cpu" if config.deepspeed.offload_optimizer else "none",
                "offload_param_device": "cpu" if config.deepspeed.offload_params else "none",
                "gradient_accumulation_steps": config.gradient_accumulation_steps,
                "zero3_init_flag": False,
            }
            if config.clip_grad_norm is not None:
                rendered["deepspeed_config"]["gradient_clipping"] = config.clip_grad_norm
    return rendered


def launch_command(
    accelerate_config: Path, config_path: str, overrides: list[str], max_restarts: int = 0, resume: str | None = None
) -> list[str]:
    command = ["accelerate", "launch", "--config_file", str(accelerate_config)]
    if max_restarts:
        command += ["--max_restarts", str(max_restarts)]  # torchrun restarts the node's worker group
    command += ["-m", "ot_dist", "train", config_path]
    for override in overrides:
        command += ["--set", override]
    if resume:
        command += ["--resume", resume]
    return command


def node_launch_command(
    config_path: str,
    nproc_per_node: str,
    nnodes: str,
    node_rank: str,
    rdzv_endpoint: str,
    rdzv_backend: str = "static",
    max_restarts: str = "0",
) -> list[str]:
    """The `ot-dist launch` command one node of a multi-node run executes. Values are strings so a
    caller can pass placeholders that are filled in on the node (Kubernetes `$(VAR)` references).
    It resumes from the latest committed checkpoint: a rescheduled pod must continue the run."""
    return [
        "ot-dist", "launch", config_path,
        "--nproc-per-node", nproc_per_node,
        "--nnodes", nnodes,
        "--node-rank", node_rank,
        "--rdzv-endpoint", rdzv_endpoint,
        "--rdzv-backend", rdzv_backend,
        "--max-restarts", max_restarts,
        "--resume", "auto",
    ]  # fmt: skip


def run_launch(args, log=print) -> int:
    from ot_dist.config.load import load_config

    overrides = list(args.overrides) + ([f"strategy={args.strategy}"] if args.strategy else [])
    config = load_config(args.config, overrides)
    rendered = render_accelerate_config(
        config, args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_backend
    )
    if config.strategy.startswith("zero"):
        from ot_dist.parallel.deepspeed_file import check_against_config

        check_against_config(config, args.nproc_per_node * args.nnodes)  # refused here, not in every worker
    if args.node_rank == 0 and not args.dry_run:  # the other nodes' workers check again, together
        check_output_dir(config, args.resume, getattr(args, "overwrite", False), log)
    launch_dir = Path(config.output_dir) / "launch"
    launch_dir.mkdir(parents=True, exist_ok=True)
    accelerate_config = launch_dir / f"accelerate_{config.strategy}_node{args.node_rank}.yaml"
    # Written under a temporary name and renamed: nodes sharing output_dir (a cluster volume) may write the
    # same file while another node's accelerate reads it.
    with tempfile.NamedTemporaryFile("w", dir=launch_dir, prefix=".accelerate", delete=False) as partial:
        partial.write(yaml.safe_dump(rendered, sort_keys=False))
    os.replace(partial.name, accelerate_config)
    command = launch_command(accelerate_config, args.config, overrides, args.max_restarts, args.resume)
    log(f"# accelerate config: {accelerate_config}")
    log(shlex.join(command))
    if args.dry_run:
        log(accelerate_config.read_text(), end="")
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # `python -m accelerate.commands.launch` is `accelerate launch` from this interpreter's environment.
    runnable = [sys.executable, "-m", "accelerate.commands.launch"] + command[2:]
    from ot_dist.worker_group import run_worker_group

    return run_worker_group(runnable, env, log)


def check_output_dir(config: TrainConfig, resume: str | None, overwrite: bool, log=print) -> None:
    """Before any process starts: an earlier run is not started over (or, --overwrite, is moved aside here, so
    the workers find a fresh folder), the latest checkpoint is not damaged, the folder is writable."""
    from ot_dist.checkpoint.run_folder import check_before_start, check_writable, move_aside

    _, move = check_before_start(config.output_dir, resume, overwrite, config.checkpoint.resume_past_damaged,
                                 log=lambda *_: None)  # the workers warn when they resume
    if move:
        log(f"--overwrite: moved the earlier run to {move_aside(config.output_dir)}")
    check_writable(config.output_dir)


# --------------------------------------------------------------------------------------------------
# Reading what a launcher chose
# --------------------------------------------------------------------------------------------------


def explicit_value(config: TrainConfig, key: str) -> tuple[bool, object]:
    """Whether the YAML (or --set) sets `key` (dotted), and the value the config holds."""
    node, parts = config, key.split(".")
    for part in parts[:-1]:
        if part not in node.model_fields_set:
            return False, None
        node = getattr(node, part)
    return parts[-1] in node.model_fields_set, getattr(node, parts[-1])


def agrees(key: str, ours, theirs) -> bool:
    if key == "deepspeed.config_file":  # `ot-dist launch` writes it resolved into the accelerate config
        return Path(ours).expanduser().resolve() == Path(theirs).expanduser().resolve()
    return ours == theirs


def reconcile_with_launcher(config: TrainConfig, env: Mapping[str, str] = os.environ) -> TrainConfig:
    """Adopt the launcher's strategy and what its accelerate config asks for where the YAML leaves them unset; refuse
    a contradiction, naming both (ot_dist/accelerate_env.py: which accelerate fields are requests)."""
    strategy, requests = strategy_from_environment(env)
    world = int(env.get("WORLD_SIZE", "1"))
    explicit = "strategy" in config.model_fields_set
    if strategy is None:
        return config
    if strategy == ANY_ZERO_STAGE:
        if not config.strategy.startswith("zero"):
            raise ConfigError(f"strategy: the accelerate config's DeepSpeed file ({env['ACCELERATE_DEEPSPEED_CONFIG_FILE']}) "
                              f"sets no zero_optimization.stage and the config says {config.strategy}; set the stage "
                              "in the file or strategy zero1 / zero2 / zero3 in the config")
        strategy = config.strategy
    if explicit and config.strategy != strategy:
        compatible = strategy == "ddp" and config.strategy != "single"  # a plain torchrun / multi-GPU launch
        if not compatible:
            raise ConfigError(
                f"strategy: the config says {config.strategy}, but the launcher selected {strategy} "
                f"(accelerate config / environment); make them agree or drop one"
            )
        requests = [r for r in requests if r.key == "train_dtype"]  # the settings of another strategy do not apply
    if config.strategy == "single" and world > 1 and explicit:
        raise ConfigError(f"strategy: single runs one process, but the launcher started {world}")
    for first, second in zip(requests, requests[1:]):
        if first.key == second.key and first.value != second.value:  # two fields of the accelerate config disagree
            raise ConfigError(f"accelerate config: {first.field} asks for {first.key} {first.value}, {second.field} for "
                              f"{second.value}; keep one")
    raw = config.model_dump(exclude_unset=True)
    if not (explicit and strategy == "ddp"):
        raw["strategy"] = strategy
    for request in requests:
        is_set, value = explicit_value(config, request.key)
        if is_set and not agrees(request.key, value, request.value):
            shown = "null" if value is None else value
            raise ConfigError(f"{request.key}: the config says {shown}, the accelerate config "
                              f"{request.field} {request.value}; make them agree or drop one")
        if is_set:
            continue  # the YAML's own spelling of the same value
        section = raw
        *parents, last = request.key.split(".")
        for part in parents:
            section = section.setdefault(part, {})
        section[last] = request.value
    reconciled = validate(raw, source="config + launcher environment")
    if reconciled.strategy.startswith("zero"):
        from ot_dist.parallel.deepspeed_file import check_against_config

        check_against_config(reconciled, world)  # the DeepSpeed config and the user's JSON, before the process group
    return reconciled
