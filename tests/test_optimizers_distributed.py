"""Every optimizer of the stack under fsdp and ZeRO-1/2/3 with 2 gloo ranks (one launch for all): it
trains (finite loss, the weights move), or the config refuses the combination with a reason. Nothing
crashes mid-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from forked_ranks import run_ranks

from ot_dist.optim.registry import SPECS

REPO = Path(__file__).resolve().parents[1]


STRATEGIES = ("fsdp", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def results_by_strategy(tiny_models, shapes_data, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("optimizers_distributed")
    result = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_ranks(str(REPO / "tests" / "helpers" / "optimizers_under_strategy.py"), str(tiny_models["sd1"]), str(shapes_data),
         str(tmp_path / "out"), ",".join(STRATEGIES), str(result),
        env=env, timeout=1500,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(result.read_text())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_optimizer_trains_or_is_refused_under(strategy, results_by_strategy):
    results = results_by_strategy[strategy]
    assert set(results) == set(SPECS)
    crashed = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not crashed, f"crashed instead of being refused by the config: {crashed}"
    refused = {name for name, r in results.items() if "refused" in r}
    for name in refused:
        assert f"strategy: {strategy}" in results[name]["refused"]
    trained = set(SPECS) - refused
    assert {"ADAMW", "ADAM", "SGD"} <= trained
    for name in trained:
        r = results[name]
        assert r["finite"], name
        assert r["changed"] >= r["tensors"] // 2, f"{name}: {r['changed']} of {r['tensors']} tensors moved"
    # D-Adaptation estimates per shard; PRODIGY is ot_dist's sharding-aware implementation and trains
    expected_refused = {n for n, s in SPECS.items() if (s.adaptive and n != "PRODIGY") or s.trust_ratio or n == "ADAFACTOR"
                        or s.whole_tensor or (s.schedule_free and strategy.startswith("zero"))}
    if strategy == "fsdp":
        expected_refused |= {n for n, s in SPECS.items() if s.target.startswith("bitsandbytes")}
    assert refused == expected_refused
