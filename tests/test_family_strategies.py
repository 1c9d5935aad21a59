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
FAMILIES = ["sd1"]
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
