"""The transformer families under every strategy: 2 gloo ranks (batch 2 each) against 1 process (batch 4),
full finetune and LoRA, with plain SGD and no clipping, so a gradient that is summed instead of averaged
(or averaged twice) moves the weights by twice (half) the step and fails the comparison. All cases of a
family run in one launch (tests/helpers/family_cases.py) to pay the process start-up once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.models.families.registry import get_family
from ot_dist.parallel.runtime import free_port
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
STEPS = 3
TOLERANCE = 1e-5
FAMILIES = ["sd1", "sd3", "flux"]
STRATEGIES = {"ddp": {}, "fsdp": {"gradient_checkpointing": True}, "zero1": {}, "zero2": {},
              "zero3": {"gradient_checkpointing": True}}
# Gradient accumulation (batch 1 x 2 micro steps x 2 ranks) must average, not sum, the micro steps too.
ACCUMULATION = {"ddp", "fsdp", "zero2"}
METHODS = {"full": {"learning_rate": 0.05}, "lora": {"learning_rate": 0.5, "lora.rank": 4, "lora.alpha": 8}}


def settings(family: str, method: str, **extra) -> dict:
    return {"max_steps": STEPS, "optimizer.name": "SGD", "clip_grad_norm": None, **METHODS[method], **extra}


def exported(out: Path, family: str, method: str) -> dict[str, torch.Tensor]:
    if method == "lora":
        return load_file(out / "lora.safetensors")
    denoiser = get_family(family).denoiser
    return load_file(out / "model" / denoiser / "diffusion_pytorch_model.safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_strategies_equal_one_process(family, family_models, shapes_data, tmp_path):
    model = family_models[family]
    references = {}
    for method in METHODS:
        out = tmp_path / f"ref-{method}"
        raw = base_config(model, shapes_data, out, family=family, method=method, batch_size=4,
                          **settings(family, method))
        Trainer(validate(raw), log=lambda *_: None).train()
        references[method] = exported(out, family, method)
    cases = {f"{strategy}-{method}": base_config(model, shapes_data, tmp_path / f"{strategy}-{method}", family=family,
                                                 method=method, batch_size=2, strategy=strategy,
                                                 **settings(family, method, **extra))
             for strategy, extra in STRATEGIES.items() for method in METHODS}
    cases |= {f"{strategy}+accumulation-full": base_config(
        model, shapes_data, tmp_path / f"{strategy}+accumulation-full", family=family, method="full", batch_size=1,
        strategy=strategy, gradient_accumulation_steps=2, **settings(family, "full")) for strategy in ACCUMULATION}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(REPO / "tests" / "helpers" / "family_cases.py"),
                           str(tmp_path / "cases.json")], env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    base = {"full": load_file(next((model / get_family(family).denoiser).glob("*.safetensors")))}
    for name in cases:
        method = name.rsplit("-", 1)[1]
        reference, got = references[method], exported(tmp_path / name, family, method)
        assert reference.keys() == got.keys(), name
        diff = max((reference[k].float() - got[k].float()).abs().max().item() for k in reference)
        assert diff <= TOLERANCE, f"{family} {name}: max abs diff {diff:.3g} > {TOLERANCE}"
        # The comparison can fail: training moved the weights far more than the tolerance.
        start = base.get(method) or {k: torch.zeros_like(v) for k, v in got.items() if "lora_B" in k or "lora_up" in k}
        moved = max((start[k].float() - got[k].float()).abs().max().item() for k in start)
        assert moved > 100 * TOLERANCE, f"{family} {name}: weights moved only {moved:.3g}"


# strategy -> allowance in units of the measured bf16 noise. DDP and FSDP compute under autocast, as the one
# process does; DeepSpeed's bf16 mode holds weights and gradients in bf16 (norms and softmax in bf16 too, the
# reduction in bf16), a coarser recipe measured at ~5.5x the noise. A 2x gradient error is ~80x.
BF16_STRATEGIES = {"ddp": 4, "fsdp": 4, "zero2": 10, "zero3": 10}


def test_bfloat16_under_every_strategy_matches_one_process(family_models, shapes_data, tmp_path):
    """FSDP's MixedPrecisionPolicy, DeepSpeed's bf16 engine and DDP under autocast, against one bf16 process.
    bf16 rounding makes them differ; the allowance is measured, not guessed: a multiple of the distance between
    the one-process bf16 and float32 runs. A gradient off by 2x moves the weights by ~half an update, far beyond it.
    The exports are the float32 masters (DeepSpeed's modules hold bf16 copies)."""
    family, model = "sd1", family_models["sd1"]

    def one_process(name: str, dtype: str) -> dict[str, torch.Tensor]:
        raw = base_config(model, shapes_data, tmp_path / name, family=family, method="full", batch_size=4,
                          train_dtype=dtype, **settings(family, "full"))
        Trainer(validate(raw), log=lambda *_: None).train()
        return exported(tmp_path / name, family, "full")

    fp32, bf16 = one_process("ref-fp32", "float32"), one_process("ref-bf16", "bfloat16")
    noise = max((fp32[k] - bf16[k]).abs().max().item() for k in fp32)
    base = load_file(next((model / get_family(family).denoiser).glob("*.safetensors")))
    update = max((bf16[k] - base[k]).abs().max().item() for k in bf16)
    assert update > 20 * noise, f"updates ({update:.3g}) must dwarf bf16 noise ({noise:.3g}) for the test to mean anything"
    cases = {strategy: base_config(model, shapes_data, tmp_path / strategy, family=family, method="full", batch_size=2,
                                   strategy=strategy, train_dtype="bfloat16", **settings(family, "full"))
             for strategy in BF16_STRATEGIES}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(REPO / "tests" / "helpers" / "family_cases.py"),
                           str(tmp_path / "cases.json")], env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for strategy in cases:
        got = exported(tmp_path / strategy, family, "full")
        diff = max((bf16[k] - got[k]).abs().max().item() for k in bf16)
        print(f"bf16 {strategy}: max diff {diff:.3g} (fp32 vs bf16 noise {noise:.3g}, update {update:.3g})")
        allowed = BF16_STRATEGIES[strategy] * noise
        assert diff <= allowed, f"{strategy}: bf16 weights differ by {diff:.3g} > {allowed:.3g} (bf16 noise {noise:.3g})"


def test_hybrid_shard_over_two_nodes_of_two_equals_one_process(family_models, shapes_data, tmp_path):
    """A real hybrid mesh: 2 "nodes" (torchrun --nnodes 2) of 2 ranks each, so the weights are sharded within a
    node and replicated across nodes (mesh 2 x 2), batch 1 per rank, against one process with batch 4 (SGD: a
    gradient averaged over the wrong group is off by 2x). The checkpoint it saves resumes in one process."""
    from ot_dist.checkpoint.layout import checkpoints_dir, latest_checkpoint
    from ot_dist.checkpoint.training_state import read_trainer_state

    family, model = "sd1", family_models["sd1"]
    reference_raw = base_config(model, shapes_data, tmp_path / "ref", family=family, method="full", batch_size=4,
                                **settings(family, "full"))
    Trainer(validate(reference_raw), log=lambda *_: None).train()
    reference = exported(tmp_path / "ref", family, "full")
    hybrid = base_config(model, shapes_data, tmp_path / "hybrid", family=family, method="full", batch_size=1,
                         strategy="fsdp", **{**settings(family, "full"), "fsdp.sharding": "hybrid_shard",
                                             "checkpoint.every_n_steps": STEPS})
    (tmp_path / "cases.json").write_text(json.dumps({"hybrid": hybrid}))
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
         "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(REPO / "tests" / "helpers" / "family_cases.py"), str(tmp_path / "cases.json")],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    got = exported(tmp_path / "hybrid", family, "full")
    diff = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert diff <= TOLERANCE, f"hybrid 2x2: max abs diff {diff:.3g}"
    folder = latest_checkpoint(checkpoints_dir(tmp_path / "hybrid"))
    state = read_trainer_state(folder)
    sizes = [f.stat().st_size for f in sorted(folder.glob("rank-*.safetensors"))]
    # the first replica group (ranks 0, 1) saves the sharded weights; the other only its random state
    assert state["world_size"] == 4 and len(sizes) == 4 and max(sizes[2:]) < 0.01 * min(sizes[:2])
    resumed_raw = {**hybrid, "strategy": "single", "batch_size": 4, "max_steps": STEPS + 1}
    resumed_raw["fsdp"] = {}
    result = Trainer(validate(resumed_raw), log=lambda *_: None, resume="auto").train()
    assert result.first_step == STEPS and result.steps == STEPS + 1
