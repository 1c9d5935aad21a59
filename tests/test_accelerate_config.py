"""A user's own accelerate config (`accelerate launch --config_file THEIRS.yaml -m ot_dist train CONFIG`) and DeepSpeed
JSON: each field reaches the ot_dist config or is refused by name, before any process group starts. The environment
each YAML gives the workers is made by the installed accelerate's own launch code, in this process (no spawn):
its argument parser, the defaults it fills from the YAML, and prepare_multi_gpu_env / prepare_deepspeed_cmd_env."""

from __future__ import annotations

import json
import os

import pytest
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from test_config import MINIMAL

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.launcher import reconcile_with_launcher, render_accelerate_config
from ot_dist.parallel.deepspeed import deepspeed_config
from ot_dist.ports import free_port


def write_accelerate_config(path, **fields) -> str:
    """A YAML as accelerate's own config classes write it (what `accelerate config` saves)."""
    base = dict(compute_environment="LOCAL_MACHINE", num_processes=2, num_machines=1, machine_rank=0,
                main_process_ip="127.0.0.1", main_process_port=free_port(), use_cpu=False, debug=False,
                mixed_precision="no")
    ClusterConfig(**{**base, **fields}).to_yaml_file(str(path))
    return str(path)


def worker_environment(accelerate_yaml: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file accelerate_yaml -m ot_dist train x.yaml` gives each worker
    (torchrun's own variables aside), as accelerate's launch_command builds it."""
    args = launch_command_parser().parse_args(["--config_file", accelerate_yaml, "-m", "ot_dist", "train", "x.yaml"])
    args, defaults, precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    launched = {k: v for k, v in env.items() if os.environ.get(k) != v}
    return {**launched, "WORLD_SIZE": str(args.num_processes), "LOCAL_WORLD_SIZE": args.nproc_per_node}


def reconciled(tmp_path, ours: dict | None = None, **accelerate_fields):
    env = worker_environment(write_accelerate_config(tmp_path / "theirs.yaml", **accelerate_fields))
    return reconcile_with_launcher(validate({**MINIMAL, **(ours or {})}), env)


def test_deepspeed_fields_of_the_accelerate_config_reach_the_config(tmp_path):
    """gradient_accumulation_steps, gradient_clipping and the offload devices were dropped: the run accumulated 1 micro
    batch, clipped at 1.0 and kept the optimizer state on the GPU."""
    fields = dict(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu",
                  gradient_accumulation_steps=4, gradient_clipping=0.5, zero3_init_flag=False)
    config = reconciled(tmp_path, distributed_type=DistributedType.DEEPSPEED, mixed_precision="bf16",
                        deepspeed_config=fields)
    assert (config.strategy, config.train_dtype) == ("zero3", "bfloat16")
    assert (config.gradient_accumulation_steps, config.clip_grad_norm) == (4, 0.5)
    assert config.deepspeed.offload_optimizer and config.deepspeed.offload_params
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: the config says 2, the accelerate config "
                                          r"deepspeed_config.gradient_accumulation_steps .* 4"):
        reconciled(tmp_path, {"gradient_accumulation_steps": 2}, distributed_type=DistributedType.DEEPSPEED,
                   deepspeed_config=fields)
    with pytest.raises(ConfigError, match=r"clip_grad_norm: the config says null, .*gradient_clipping .* 0.5"):
        reconciled(tmp_path, {"clip_grad_norm": None}, distributed_type=DistributedType.DEEPSPEED,
                   deepspeed_config=fields)


@pytest.mark.parametrize(("fields", "named"), [
    (dict(zero_stage=2, offload_optimizer_device="nvme"), "deepspeed_config.offload_optimizer_device .*nvme"),
    (dict(zero_stage=2, offload_param_device="cpu"), "deepspeed_config.offload_param_device .*zero_stage 2"),
    (dict(zero_stage=3, zero3_init_flag=True), "deepspeed_config.zero3_init_flag"),
    (dict(zero_stage=0), "deepspeed_config.zero_stage .*: 0 is not supported"),
])
def test_deepspeed_fields_ot_dist_cannot_honour_are_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ConfigError, match=named):
        reconciled(tmp_path, distributed_type=DistributedType.DEEPSPEED, deepspeed_config=fields)


def test_fp8_mixed_precision_is_refused_not_trained_in_float32():
    with pytest.raises(ConfigError, match="mixed_precision .*fp8 is not supported"):
        reconcile_with_launcher(validate(MINIMAL), {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "fp8",
                                                    "WORLD_SIZE": "2"})


def test_fsdp_fields_of_the_accelerate_config_reach_the_config(tmp_path):
    """fsdp_activation_checkpointing was dropped; FSDP1's sharding strategy, which `accelerate config` writes into
    fsdp_reshard_after_forward, was read as FSDP2's bool (full_shard); FSDP1's NO_SHARD became full_shard."""
    fsdp2 = dict(fsdp_version=2, fsdp_reshard_after_forward=True, fsdp_offload_params=True,
                 fsdp_activation_checkpointing=True, fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                 fsdp_transformer_layer_cls_to_wrap="BasicTransformerBlock", fsdp_state_dict_type="SHARDED_STATE_DICT")
    config = reconciled(tmp_path, distributed_type=DistributedType.FSDP, mixed_precision="bf16", fsdp_config=fsdp2)
    assert (config.strategy, config.fsdp.sharding, config.fsdp.cpu_offload) == ("fsdp", "full_shard", True)
    assert config.gradient_checkpointing and config.train_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="gradient_checkpointing: the config says False, .*activation_checkpointing"):
        reconciled(tmp_path, {"gradient_checkpointing": False}, distributed_type=DistributedType.FSDP,
                   fsdp_config=fsdp2)
    fsdp1 = dict(fsdp_version=1, fsdp_reshard_after_forward="SHARD_GRAD_OP", fsdp_use_orig_params=True)
    assert reconciled(tmp_path, distributed_type=DistributedType.FSDP, fsdp_config=fsdp1).fsdp.sharding == "shard_grad_op"
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward .*NO_SHARD is not supported"):
        reconciled(tmp_path, distributed_type=DistributedType.FSDP,
                   fsdp_config={**fsdp1, "fsdp_reshard_after_forward": "NO_SHARD"})
    with pytest.raises(ConfigError, match="fsdp_activation_checkpointing_offload"):
        reconciled(tmp_path, distributed_type=DistributedType.FSDP,
                   fsdp_config={**fsdp2, "fsdp_activation_checkpointing_offload": True})


def test_fsdp2_parallelism_config_is_hybrid_shard_or_refused(tmp_path):
    fsdp = dict(distributed_type=DistributedType.FSDP, num_processes=4, fsdp_config=dict(fsdp_version=2))
    hybrid = dict(parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=4)
    # one node of 4: replicate 2 x shard 2 is not ot_dist's shard-within-the-node
    with pytest.raises(ConfigError, match="parallelism_config: dp_replicate_size 2 x dp_shard_size 2; .*set "
                                          "dp_shard_size to 4"):
        reconciled(tmp_path, parallelism_config={**hybrid, "parallelism_config_dp_shard_size": 2}, **fsdp)
    # 2 nodes of 2 processes (what each node's worker sees)
    env = worker_environment(write_accelerate_config(tmp_path / "a.yaml", num_machines=2, main_process_ip="10.0.0.1",
                                                     parallelism_config={**hybrid, "parallelism_config_dp_shard_size": 2},
                                                     **fsdp))
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert reconcile_with_launcher(validate(MINIMAL), env).fsdp.sharding == "hybrid_shard"
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward .* asks for fsdp.sharding shard_grad_op, "
                                          "parallelism_config.* for hybrid_shard"):
        reconcile_with_launcher(validate(MINIMAL), {**env, "FSDP_RESHARD_AFTER_FORWARD": "false"})
    with pytest.raises(ConfigError, match="parallelism_config_tp_size: 2 is not supported"):
        reconciled(tmp_path, parallelism_config={"parallelism_config_tp_size": 2}, **fsdp)


HF_STYLE = {  # transformers' documented ZeRO-2 template: "auto" = the trainer's own value
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_auto_values_of_a_deepspeed_json_take_ot_dists_values(tmp_path):
    """Left in, DeepSpeed 0.19 stopped on the first "auto" with `TypeError: '>' not supported between instances of
    'str' and 'int'`, and bf16 / fp16 "enabled": "auto" (truthy) enabled both engines."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_STYLE))
    raw = {**MINIMAL, "strategy": "zero2", "batch_size": 3, "gradient_accumulation_steps": 2, "clip_grad_norm": 0.7,
           "deepspeed": {"config_file": str(path)}}
    for dtype, mode, engine in (("bfloat16", "autocast", {}), ("bfloat16", "engine", {"bf16": True}),
                                ("float16", "engine", {"fp16": True}), ("float32", "auto", {})):
        config = validate({**raw, "train_dtype": dtype, "deepspeed": {**raw["deepspeed"], "mixed_precision": mode}})
        ds = deepspeed_config(config, 2, world_size=4)
        assert '"auto"' not in json.dumps(ds)
        assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 2, 24)
        assert ds["gradient_clipping"] == 0.7 and ds["zero_optimization"]["reduce_bucket_size"] == 200_000_000
        assert {k: ds[k].get("enabled", False) for k in ("bf16", "fp16")} == {"bf16": False, "fp16": False, **engine}
        assert ("torch_autocast" in ds) == (mode == "autocast")
        assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize(("theirs", "named"), [
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "sets 'optimizer': ot_dist hands DeepSpeed its own"),
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, "sets 'scheduler'"),
    ({"gradient_accumulation_steps": 4, "train_batch_size": 16}, "sets gradient_accumulation_steps 4, the ot_dist "
                                                                 r"config gives 1 \(gradient_accumulation_steps\)"),
    ({"train_micro_batch_size_per_gpu": 8}, r"sets train_micro_batch_size_per_gpu 8, the ot_dist config gives 1 \(batch_size\)"),
    ({"zero_optimization": {"stage": 3}}, "sets zero_optimization.stage 3, the ot_dist config strategy zero2"),
])
def test_what_the_training_loop_cannot_follow_is_refused_before_the_process_group(tmp_path, theirs, named):
    """An optimizer section was ignored and a scheduler one overwrote ot_dist's learning rates at each step; another
    accumulation made DeepSpeed step on boundaries the loop does not take; another stage broke the engine's layout."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(theirs))
    config = validate({**MINIMAL, "strategy": "zero2", "deepspeed": {"config_file": str(path)}})
    with pytest.raises(ConfigError, match=f"deepspeed.config_file: {path} {named}"):
        reconcile_with_launcher(config, {"WORLD_SIZE": "2"})  # no process group exists here


def test_a_deepspeed_file_without_a_stage_takes_the_configs_zero_strategy(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": False}}))
    fields = dict(distributed_type=DistributedType.DEEPSPEED, deepspeed_config={"deepspeed_config_file": str(path)})
    assert reconciled(tmp_path, {"strategy": "zero3"}, **fields).strategy == "zero3"
    with pytest.raises(ConfigError, match="sets no zero_optimization.stage and the config says single"):
        reconciled(tmp_path, **fields)


@pytest.mark.parametrize("ours", [
    {"strategy": "fsdp", "fsdp": {"sharding": "shard_grad_op", "cpu_offload": True}, "gradient_checkpointing": True},
    {"strategy": "fsdp", "fsdp": {"sharding": "hybrid_shard"}, "train_dtype": "bfloat16"},
    {"strategy": "zero3", "gradient_accumulation_steps": 3, "clip_grad_norm": 0.25,
     "deepspeed": {"offload_optimizer": True, "offload_params": True}},
    {"strategy": "zero2", "clip_grad_norm": None, "deepspeed": {"config_file": "ds.json"}},
])
def test_ot_dist_launch_renders_an_accelerate_config_its_workers_read_back_unchanged(tmp_path, monkeypatch, ours):
    """`ot-dist launch`'s own accelerate config, through accelerate's launch, agrees with the YAML it came from."""
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(HF_STYLE))
    config = validate({**MINIMAL, **ours})
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump(render_accelerate_config(config, 2)))
    again = reconcile_with_launcher(config, worker_environment(str(path)))
    assert again.model_dump() == config.model_dump()


def test_a_multi_node_rendezvous_endpoint_without_a_port_is_refused(tmp_path):
    """Without a port each node's `ot-dist launch` wrote a free port of its own machine: the nodes never met."""
    config = validate({**MINIMAL, "strategy": "ddp"})
    with pytest.raises(ConfigError, match="--rdzv-endpoint: node0.cluster needs HOST:PORT"):
        render_accelerate_config(config, 2, nnodes=2, node_rank=1, rdzv_endpoint="node0.cluster")
    rendered = render_accelerate_config(config, 2, nnodes=2, node_rank=1, rdzv_endpoint="[fd00::1]:29400")
    assert (rendered["main_process_ip"], rendered["main_process_port"]) == ("[fd00::1]", 29400)
