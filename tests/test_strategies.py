"""Every strategy, for real: 2 gloo processes on CPU against 1 process with the same global batch, compared on the
exported weights. Launched the way users launch: `ot-dist launch` (which goes through `accelerate launch`) and a
user's own accelerate config (one spawn, with a failing rank: what the launcher does then); the strategy variants
are forked ranks (tests/forked_ranks.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forked_ranks import run_ranks
import torch
import yaml
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import apply_override, validate
from ot_dist.errors import ConfigError
from ot_dist.launcher import reconcile_with_launcher
from ot_dist.ports import free_port
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
LR = 1e-5  # Adam turns float-noise-sized gradient differences into up to lr-sized steps; keep lr modest
TOLERANCE = 1e-5
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

# name -> (strategy, extra --set overrides)
# (gradient checkpointing rides along on zero2 here, on fsdp and zero3 in tests/test_family_strategies.py: it must
# compose with every strategy and change nothing)
STRATEGIES = {
    "fsdp-shard_grad_op": ("fsdp", ["fsdp.sharding=shard_grad_op"]),
    "fsdp-hybrid": ("fsdp", ["fsdp.sharding=hybrid_shard"]),
    "zero2": ("zero2", ["gradient_checkpointing=true"]),
    "zero3-offload": ("zero3", ["deepspeed.offload_optimizer=true", "deepspeed.offload_params=true"]),
    # the fp32 master partition on the CPU beside the weights: its own tensor, not a view of them (helpers/zero_master.py)
    "zero2-offload": ("zero2", ["deepspeed.offload_optimizer=true"]),
}
# The LoRA cases train an additional embedding too (pivotal tuning: its vectors shard and gather with the text encoder
# under fsdp), bundled into lora.safetensors so that the comparison covers them; its token is in every caption.
TOKEN = "<tok>"
# Method embedding's case is an output embedding (tests/test_output_embeddings.py): its vectors are in the text
# encoder's root unit under fsdp, and the hook that puts them into the encoder's output runs between its gathers.
METHOD_EXTRA = {"full": {"text_encoder.train": True},
                "lora": {"lora.rank": 4, "lora.alpha": 8, "bundle_additional_embeddings": True,
                         "additional_embeddings": [{"token": TOKEN, "vectors": 2}]},
                "embedding": {"embedding": {"token": TOKEN, "vectors": 2, "output_embedding": True}}}
BUNDLED = f"bundle_emb.{TOKEN}.string_to_param.*"


def method_config(model, data, out: Path, method: str, **settings) -> dict:
    raw = base_config(model, data, out, method=method, **settings)
    if method == "lora":
        raw["data"] = {"concepts": [{"path": str(data), "caption_prefix": TOKEN}], "shards": raw["data"]["shards"]}
    return raw


def exported_weights(out: Path, method: str) -> dict[str, torch.Tensor]:
    if method == "full":
        weights = load_file(out / "model" / "unet" / "diffusion_pytorch_model.safetensors")
        text = load_file(out / "model" / "text_encoder" / "model.safetensors")
        return {**{f"unet.{k}": v for k, v in weights.items()}, **{f"te.{k}": v for k, v in text.items()}}
    return load_file(out / ("embedding.safetensors" if method == "embedding" else "lora.safetensors"))


def write_config(path: Path, raw: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def run(cmd: list[str], timeout: float = 420, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=kwargs.pop("env", ENV), capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def references(small_sd1, shapes_data, tmp_path_factory):
    """One process, batch 4: the result every 2-rank run (batch 2 each) must reproduce."""
    refs = {}
    for method in METHOD_EXTRA:
        out = tmp_path_factory.mktemp(f"ref-{method}")
        raw = method_config(small_sd1, shapes_data, out, method, batch_size=4, max_steps=STEPS,
                            learning_rate=LR, **METHOD_EXTRA[method])
        Trainer(validate(raw), log=lambda *_: None).train()
        refs[method] = exported_weights(out, method)
    return refs


def two_rank_config(model, shapes_data, out: Path, method: str, **overrides) -> Path:
    settings = {"batch_size": 2, "max_steps": STEPS, "learning_rate": LR, **METHOD_EXTRA[method], **overrides}
    raw = method_config(model, shapes_data, out, method, **settings)
    return write_config(out.parent / f"{out.name}.yaml", raw)


def assert_matches(reference: dict, got: dict):
    assert reference.keys() == got.keys()
    diffs = torch.cat([(reference[k] - got[k]).abs().flatten() for k in reference])
    assert diffs.max() <= TOLERANCE, f"max abs diff {diffs.max():.3g} > {TOLERANCE}"
    # Float noise touches a few elements (Adam magnifies near-zero gradients); a real divergence,
    # e.g. a rank training on its half of the batch alone, moves most of them by ~lr (mean ~1e-5 here).
    assert diffs.mean() <= 1e-8, f"mean abs diff {diffs.mean():.3g}"


# The plain strategies (ddp, fsdp, zero1, zero2, zero3: full finetune with the text encoder, LoRA, accumulation,
# clipping) are compared with one process by tests/test_family_strategies.py (SD 1.x and the transformer families,
# plain SGD, so a gradient summed instead of averaged fails there). Here: the variants (sharding modes, hybrid mesh,
# offload), and zero2 with gradient checkpointing, with Adam.
CASES = [("fsdp-shard_grad_op", "full"), ("fsdp-shard_grad_op", "lora"), ("fsdp-shard_grad_op", "embedding"),
         ("fsdp-hybrid", "full"), ("zero2", "full"), ("zero3-offload", "full"), ("zero2-offload", "full")]


def case_config(model, shapes_data, out: Path, name: str, method: str, **overrides) -> dict:
    strategy, extra = STRATEGIES[name]
    settings = {"batch_size": 2, "max_steps": STEPS, "learning_rate": LR, "strategy": strategy, **METHOD_EXTRA[method],
                **overrides}
    raw = method_config(model, shapes_data, out, method, **settings)
    for override in extra:  # as `--set` applies them
        apply_override(raw, override)
    return raw


def test_two_ranks_equal_one_process(references, small_sd1, shapes_data, tmp_path):
    """The strategy variants x method in one 2-process launch, which pays the process start-up once; each case
    is compared with one process on its exported weights."""
    cases = {f"{name}-{method}": case_config(small_sd1, shapes_data, tmp_path / f"{name}-{method}", name, method)
             for name, method in CASES}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = run_ranks(REPO / "tests" / "helpers" / "family_cases.py", tmp_path / "cases.json", timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for case in cases:
        method = case.rsplit("-", 1)[1]
        got = exported_weights(tmp_path / case, method)
        assert_matches(references[method], got)
        # The comparison can fail: training moved the weights far more than the tolerance.
        base = exported_weights_of_base(small_sd1, method, got)
        moved = max((base[k] - got[k]).abs().max().item() for k in base)
        assert moved > 2 * TOLERANCE, case
        if method == "lora":  # the embedding trained too
            assert (base[BUNDLED] - got[BUNDLED]).abs().max() > 2 * TOLERANCE, case


def test_ot_dist_launch_trains_under_accelerate(references, small_sd1, shapes_data, tmp_path):
    """The user's path: `ot-dist launch` -> accelerate launch -> torchrun, equal to one process."""
    out = tmp_path / "out"
    config = two_rank_config(small_sd1, shapes_data, out, "full")
    done = run([sys.executable, "-m", "ot_dist", "launch", str(config), "--nproc-per-node", "2", "--strategy", "fsdp",
                "--set", "gradient_checkpointing=true"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "strategy fsdp, global batch 4 (batch_size 2 x accumulation 1 x 2 processes)" in done.stdout
    assert_matches(references["full"], exported_weights(out, "full"))


def exported_weights_of_base(model_dir: Path, method: str, like: dict) -> dict:
    if method == "full":
        unet = load_file(model_dir / "unet" / "diffusion_pytorch_model.safetensors")
        text = load_file(model_dir / "text_encoder" / "model.safetensors")
        return {**{f"unet.{k}": v for k, v in unet.items()}, **{f"te.{k}": v for k, v in text.items()}}
    from transformers import CLIPTextModel, CLIPTokenizer

    if method == "embedding":  # OneTrainer's start of an output embedding: the encoder's output of "*" + "**"
        ids = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")(["***"], return_tensors="pt").input_ids
        with torch.no_grad():
            start = CLIPTextModel.from_pretrained(model_dir / "text_encoder")(ids).last_hidden_state[0, 1:3]
        return {"emp_params": torch.zeros_like(start), "emp_params_out": start}
    # LoRA starts with B = 0: the product B @ A is what must have moved; the embedding starts at the row of "*"

    (row,) = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")("*", add_special_tokens=False).input_ids
    text = load_file(model_dir / "text_encoder" / "model.safetensors")
    (table,) = [v for k, v in text.items() if k.endswith("token_embedding.weight")]
    base = {BUNDLED: table[row].expand(2, -1)}
    return {**base, **{k: torch.zeros_like(v) for k, v in like.items() if "lora_B" in k or "lora_up" in k}}


@pytest.fixture(scope="module")
def users_failing_launch(small_sd1, shapes_data, tmp_path_factory):
    """`accelerate launch --config_file THEIRS.yaml` of the CLI with no strategy in the YAML, rank 1 raising at its
    third optimizer step (tests/helpers/fail_at_step.py): one spawn for what the user's accelerate config selects and
    for how a failing rank ends the launch (accelerate's multi-process launch is torchrun's agent, so the failure
    summary is torchrun's). The selected strategy training to the end is test_two_ranks_equal_one_process's
    fsdp-shard_grad_op-lora case (the settings this accelerate config selects). -> (result, seconds, output_dir)"""
    root = tmp_path_factory.mktemp("users-accelerate")
    accelerate_config = write_config(root / "user_accelerate.yaml", {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2, "num_machines": 1,
        "machine_rank": 0, "main_process_ip": "127.0.0.1", "main_process_port": free_port(), "mixed_precision": "no",
        "use_cpu": False, "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False},
    })
    config = two_rank_config(small_sd1, shapes_data, root / "out", "lora", max_steps=4,
                             **{"distributed.timeout_minutes": 1})
    start = time.monotonic()
    done = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
                str(REPO / "tests" / "helpers" / "fail_at_step.py"), "train", str(config)],
               env={**ENV, "FAIL_RANK": "1", "FAIL_STEP": "3"}, timeout=300)
    return done, time.monotonic() - start, root / "out"


def test_users_accelerate_config_selects_the_strategy(users_failing_launch):
    """`accelerate launch --config_file THEIRS.yaml -m ot_dist train CONFIG` with no strategy in the YAML (the
    CLI's entry, run by tests/helpers/fail_at_step.py as `-m ot_dist` runs it)."""
    done, _, _ = users_failing_launch
    assert "strategy fsdp, global batch 4" in done.stdout, (done.stdout + done.stderr)[-4000:]


def test_launcher_environment_is_reconciled_with_the_yaml(small_sd1, shapes_data, tmp_path):
    raw = base_config(small_sd1, shapes_data, tmp_path)
    fsdp_env = {"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false", "WORLD_SIZE": "2"}
    adopted = reconcile_with_launcher(validate(raw), fsdp_env)
    assert adopted.strategy == "fsdp" and adopted.fsdp.sharding == "shard_grad_op"
    ds_env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
              "ACCELERATE_MIXED_PRECISION": "bf16", "WORLD_SIZE": "2"}
    adopted = reconcile_with_launcher(validate(raw), ds_env)
    assert adopted.strategy == "zero3" and adopted.train_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="config says zero2, but the launcher selected fsdp"):
        reconcile_with_launcher(validate({**raw, "strategy": "zero2"}), fsdp_env)
    with pytest.raises(ConfigError, match="train_dtype: the config says float16"):
        reconcile_with_launcher(validate({**raw, "train_dtype": "float16"}), ds_env)
    with pytest.raises(ConfigError, match="single"):
        reconcile_with_launcher(validate({**raw, "strategy": "single"}), {"WORLD_SIZE": "2"})
    # plain torchrun with an explicit sharding strategy keeps it
    assert reconcile_with_launcher(validate({**raw, "strategy": "zero2"}), {"WORLD_SIZE": "2"}).strategy == "zero2"


def test_dry_run_prints_a_valid_accelerate_command_and_config(small_sd1, shapes_data, tmp_path, capsys):
    """`ot-dist launch --dry-run` (the CLI's main, in this process: a dry run starts nothing)."""
    from accelerate.commands.config.config_args import ClusterConfig

    from ot_dist.cli import main

    config = two_rank_config(small_sd1, shapes_data, tmp_path / "out", "full")
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        capsys.readouterr()
        code = main(["launch", str(config), "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                     "--rdzv-endpoint", "10.0.0.1:29400", "--strategy", strategy, "--dry-run"])
        done = capsys.readouterr()
        assert code == 0, done.err[-2000:]
        command = done.out.splitlines()[1]
        assert command.startswith("accelerate launch --config_file ") and f"--set strategy={strategy}" in command
        path = Path(command.split()[3])
        cluster = ClusterConfig.from_yaml_file(str(path))
        assert cluster.num_processes == 8 and cluster.num_machines == 2 and cluster.machine_rank == 1
        assert cluster.main_process_ip == "10.0.0.1" and cluster.main_process_port == 29400
        expected = {"ddp": "MULTI_GPU", "fsdp": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}[strategy]
        assert str(cluster.distributed_type).endswith(expected)
        if strategy.startswith("zero"):
            assert cluster.deepspeed_config["zero_stage"] == int(strategy[-1])
        assert not (tmp_path / "out" / "model").exists()  # dry run trains nothing


def test_an_exception_in_one_rank_ends_the_launch(users_failing_launch):
    done, seconds, out = users_failing_launch
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "injected failure on rank 1 at step 3" in output
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", output), "the launcher's summary names the failing rank"
    assert seconds < 120
    assert not (out / "lora.safetensors").exists() and not (out / "model").exists()
