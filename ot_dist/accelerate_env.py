"""What a user's accelerate config asks for, read from the environment `accelerate launch` gives each worker
(accelerate 1.15 `utils/launch.py`: prepare_multi_gpu_env, prepare_deepspeed_cmd_env), as ot_dist settings.

Each request names the accelerate field it came from, so a contradiction with the ot_dist YAML can name both.
accelerate writes every field of its questionnaire, defaults included, and the environment cannot tell a default
from a choice: a field at accelerate's default is no request (as mixed_precision "no" never was); any other value is
adopted when the YAML leaves the key unset, and refused when the YAML sets another value (launcher.py). A value
ot_dist cannot honour is refused here, by its field, before any process group starts.

Read but not requests, because ot_dist decides them itself (docs/parallel.md): the wrap policy (fsdp_auto_wrap_policy,
fsdp_transformer_layer_cls_to_wrap, fsdp_min_num_params: ot_dist wraps each family's blocks), fsdp_state_dict_type
(ot_dist's checkpoints are its own; exports are always full weights), fsdp_cpu_ram_efficient_loading /
fsdp_sync_module_states (every rank loads the same files), fsdp_use_orig_params / fsdp_backward_prefetch /
fsdp_forward_prefetch (FSDP1 knobs; ot_dist runs FSDP2 and prefetches one block ahead), zero3_save_16bit_model
(exports gather the full weights)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ot_dist.errors import ConfigError
from ot_dist.parallel.deepspeed_file import read_deepspeed_json

# accelerate's FSDP sharding strategies (utils/constants.py FSDP_SHARDING_STRATEGY; 1-based as torch's enum)
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
OT_DIST_SHARDING = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "HYBRID_SHARD": "hybrid_shard"}
PRECISION = {"no": None, "bf16": "bfloat16", "fp16": "float16"}
ANY_ZERO_STAGE = "zero"  # a DeepSpeed file that names no stage: the ot_dist config's zero strategy decides


@dataclass(frozen=True)
class Request:
    key: str  # the ot_dist config key, dotted
    value: Any
    field: str  # the accelerate config field (and its environment variable) that asked for it


def truthy(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").strip().lower() in ("true", "1", "yes")


def fsdp1_strategy(value: str, field: str) -> str | None:
    """An FSDP1 sharding strategy by name or number, or None when the value is not one (a bool, under FSDP2)."""
    name = value.strip().upper()
    if name.isdigit() and 1 <= int(name) <= len(FSDP1_STRATEGIES):
        name = FSDP1_STRATEGIES[int(name) - 1]
    if name not in FSDP1_STRATEGIES:
        return None
    if name not in OT_DIST_SHARDING:
        hint = ("no sharding is DDP: use distributed_type MULTI_GPU (ot_dist strategy ddp)" if name == "NO_SHARD" else
                "ot_dist's hybrid_shard reshards after forward within the node; use HYBRID_SHARD")
        raise ConfigError(f"accelerate config {field}: {name} is not supported ({hint})")
    return OT_DIST_SHARDING[name]


def fsdp_requests(env: Mapping[str, str]) -> list[Request]:
    version = env.get("FSDP_VERSION", "1").strip()  # accelerate's default is FSDP1
    requests = []
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true")
    reshard_field = "fsdp_config.fsdp_reshard_after_forward (FSDP_RESHARD_AFTER_FORWARD)"
    strategy_field = "fsdp_config.fsdp_sharding_strategy (FSDP_SHARDING_STRATEGY)"
    # ot_dist runs FSDP2; a version-1 config is read by FSDP1's meaning of its fields. FSDP1's fsdp_reshard_after_forward
    # names a sharding strategy (what `accelerate config` writes for version 1), FSDP2's is a bool.
    sharding = None
    if reshard.strip().lower() == "false":
        sharding = ("shard_grad_op", reshard_field)
    elif (named := fsdp1_strategy(reshard, reshard_field)) is not None:
        if version == "2":
            raise ConfigError(f"accelerate config {reshard_field}: {reshard} is an FSDP1 sharding strategy; with "
                              "fsdp_version 2 it is true or false")
        sharding = (named, reshard_field)
    strategy = fsdp1_strategy(env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD"), strategy_field)
    if strategy not in (None, "full_shard"):  # FULL_SHARD is accelerate launch's default for this field
        if sharding and sharding[0] != strategy:
            raise ConfigError(f"accelerate config: {sharding[1]} asks for {sharding[0]}, {strategy_field} for "
                              f"{strategy}; keep one")
        sharding = (strategy, strategy_field)
    if sharding and sharding[0] != "full_shard":
        requests.append(Request("fsdp.sharding", sharding[0], sharding[1]))
    if truthy(env, "FSDP_OFFLOAD_PARAMS"):
        requests.append(Request("fsdp.cpu_offload", True, "fsdp_config.fsdp_offload_params (FSDP_OFFLOAD_PARAMS)"))
    if truthy(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        requests.append(Request("gradient_checkpointing", True,
                                "fsdp_config.fsdp_activation_checkpointing (FSDP_ACTIVATION_CHECKPOINTING)"))
    if truthy(env, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"):
        raise ConfigError("accelerate config fsdp_config.fsdp_activation_checkpointing_offload: not supported (ot_dist "
                          "recomputes activations, gradient_checkpointing, but keeps them on the device); set it false")
    requests += parallelism_requests(env)
    return requests


def parallelism_requests(env: Mapping[str, str]) -> list[Request]:
    """accelerate's FSDP2 parallelism_config: data parallel replicate x shard is ot_dist's hybrid_shard when the
    shard size is the node's process count (ot_dist shards within a node); tensor / context / sequence parallelism
    it does not do."""
    if not truthy(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        return []
    sizes = {name: int(env.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or 1)
             for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    for name in ("tp", "cp", "sp"):
        if sizes[name] > 1:
            raise ConfigError(f"accelerate config parallelism_config.parallelism_config_{name}_size: {sizes[name]} is "
                              "not supported (ot_dist shards data parallel only); set it to 1")
    if sizes["dp_replicate"] <= 1:
        return []
    per_node = env.get("LOCAL_WORLD_SIZE")
    if per_node is not None and sizes["dp_shard"] != int(per_node):
        raise ConfigError(
            f"accelerate config parallelism_config: dp_replicate_size {sizes['dp_replicate']} x dp_shard_size "
            f"{sizes['dp_shard']}; ot_dist's hybrid_shard shards within a node ({per_node} processes here): set "
            f"dp_shard_size to {per_node}")
    return [Request("fsdp.sharding", "hybrid_shard",
                    "parallelism_config.parallelism_config_dp_replicate_size (PARALLELISM_CONFIG_DP_REPLICATE_SIZE)")]


def offload_request(env: Mapping[str, str], name: str, key: str, field: str) -> list[Request]:
    device = env.get(name, "none").strip().lower()
    if device == "cpu":
        return [Request(key, True, f"{field} ({name})")]
    if device not in ("none", ""):
        raise ConfigError(f"accelerate config {field} ({name}): {device} is not supported (ot_dist offloads to the "
                          "cpu or not at all: cpu or none)")
    return []


def deepspeed_requests(env: Mapping[str, str]) -> tuple[str, list[Request]]:
    """-> (zero1 / zero2 / zero3, or ANY_ZERO_STAGE, and the requests)."""
    requests = []
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    stage_field = "deepspeed_config.zero_stage (ACCELERATE_DEEPSPEED_ZERO_STAGE)"
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file:
        file_field = "deepspeed_config.deepspeed_config_file (ACCELERATE_DEEPSPEED_CONFIG_FILE)"
        requests.append(Request("deepspeed.config_file", config_file, file_field))
        if stage is None:  # accelerate passes the stage only without a file: it is the file's
            stage = read_deepspeed_json(config_file, f"accelerate config {file_field}").get(
                "zero_optimization", {}).get("stage")
            stage_field = f"zero_optimization.stage of {config_file}"
            if stage is None:
                return ANY_ZERO_STAGE, requests + offload_and_steps(env, None)
    stage = str(stage if stage is not None else 2)  # accelerate's DeepSpeedPlugin default
    if stage not in ("1", "2", "3"):
        raise ConfigError(f"accelerate config {stage_field}: {stage} is not supported (ot_dist runs ZeRO stages 1, 2 "
                          "and 3; stage 0 is DDP: use distributed_type MULTI_GPU, ot_dist strategy ddp)")
    return f"zero{stage}", requests + offload_and_steps(env, stage)


def offload_and_steps(env: Mapping[str, str], stage: str | None) -> list[Request]:
    requests = offload_request(env, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "deepspeed.offload_optimizer",
                               "deepspeed_config.offload_optimizer_device")
    params = offload_request(env, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "deepspeed.offload_params",
                             "deepspeed_config.offload_param_device")
    if params and stage not in ("3", None):
        raise ConfigError(f"accelerate config {params[0].field}: cpu with zero_stage {stage}; only ZeRO-3 offloads "
                          "parameters: set it to none or zero_stage to 3")
    requests += params
    steps = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1").strip()
    steps_field = "deepspeed_config.gradient_accumulation_steps (ACCELERATE_GRADIENT_ACCUMULATION_STEPS)"
    if not steps.isdigit() or int(steps) < 1:
        raise ConfigError(f"accelerate config {steps_field}: {steps} is not a whole number of at least 1")
    if int(steps) != 1:
        requests.append(Request("gradient_accumulation_steps", int(steps), steps_field))
    clipping = env.get("ACCELERATE_GRADIENT_CLIPPING")
    if clipping is not None:
        clipping_field = "deepspeed_config.gradient_clipping (ACCELERATE_GRADIENT_CLIPPING)"
        try:
            norm = float(clipping)
        except ValueError:
            raise ConfigError(f"accelerate config {clipping_field}: {clipping} is not a number") from None
        requests.append(Request("clip_grad_norm", norm if norm > 0 else None, clipping_field))  # DeepSpeed: 0 is off
    if truthy(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT") and stage == "3":
        raise ConfigError("accelerate config deepspeed_config.zero3_init_flag (ACCELERATE_DEEPSPEED_ZERO3_INIT): not "
                          "supported (ot_dist loads the whole model on every rank, then ZeRO-3 partitions it; it does "
                          "not build the model inside deepspeed.zero.Init); set it false")
    return requests


def precision_requests(env: Mapping[str, str]) -> list[Request]:
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in PRECISION:
        raise ConfigError(f"accelerate config mixed_precision (ACCELERATE_MIXED_PRECISION): {precision} is not "
                          "supported (ot_dist trains in bf16, fp16 or no mixed precision: float32)")
    dtype = PRECISION[precision]
    return [Request("train_dtype", dtype, "mixed_precision (ACCELERATE_MIXED_PRECISION)")] if dtype else []


def strategy_from_environment(env: Mapping[str, str]) -> tuple[str | None, list[Request]]:
    """The strategy accelerate's environment selects (None when no launcher set one) and the settings it asks for."""
    if truthy(env, "ACCELERATE_USE_FSDP"):
        return "fsdp", fsdp_requests(env) + precision_requests(env)
    if truthy(env, "ACCELERATE_USE_DEEPSPEED"):
        strategy, requests = deepspeed_requests(env)
        return strategy, requests + precision_requests(env)
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return "ddp", precision_requests(env)
    return None, []
