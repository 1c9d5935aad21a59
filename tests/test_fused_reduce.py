"""The fused back pass under ddp (ot_dist/parallel/fused_reduce.py): each gradient averaged over the ranks and its
parameter stepped inside backward. 2 gloo ranks on a small routed model (tests/helpers/fused_reduce_ranks.py) against
one process of the global batch; the trainer's own runs (SD 1.x with its text encoder, Flux with streamed trained
blocks) are in tests/test_family_strategies.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from forked_ranks import run_ranks
import torch

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BUFFER_BYTES, COALESCE_BYTES = 2048, 1024  # the helper's
MISSED_ON = {1: ("denoiser.experts.1.weight", "denoiser.experts.1.bias")}  # rank -> what its batch never reaches
NOBODYS = ("denoiser.experts.2.weight", "denoiser.experts.2.bias")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused-reduce")
    done = run_ranks(REPO / "tests" / "helpers" / "fused_reduce_ranks.py", out, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def steps_of(events: list) -> list[list]:
    steps = []
    for event in events:
        if event[0] == "step":
            steps.append([])
        else:
            steps[-1].append(event)
    return steps


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "sgd_alone"])
def test_two_ranks_step_as_one_process_of_the_global_batch(ranks, optimizer):
    """Plain SGD (a gradient summed instead of averaged moves twice as far) and AdamW with weight decay (a parameter no
    rank reached must get no step: the decay would move it), three steps, small gradients averaged in shared buckets
    (sgd_alone: each alone): the weights of one process, on both ranks, also the expert rank 1 never reaches (its
    average is rank 0's half) and the one nobody reaches (untouched)."""
    for rank, result in ranks.items():
        run = result[optimizer]
        reference, got = run["reference"], run["weights"]
        assert reference.keys() == got.keys()
        for name in reference:
            diff = (torch.tensor(reference[name]) - torch.tensor(got[name])).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} {optimizer} {name}: {diff:.3g}"
    start = ranks[0]["adamw"]
    for name in NOBODYS:  # the optimizer never saw it: no state, so no step
        assert name in start["untouched_state"]
    moved = torch.tensor(start["weights"][MISSED_ON[1][0]]) - torch.tensor(ranks[0]["sgd"]["reference"][MISSED_ON[1][0]])
    assert torch.equal(torch.tensor(ranks[1]["sgd"]["weights"][MISSED_ON[1][0]]),
                       torch.tensor(ranks[0]["sgd"]["weights"][MISSED_ON[1][0]]))
    assert moved.abs().max() > 0  # AdamW's and SGD's runs differ: the comparison above can fail


def test_gradients_are_averaged_during_backward_in_a_bounded_buffer(ranks):
    """Overlap: from the second step (the order learned), every step's first all-reduce is issued before its last
    gradient completes, and parameters are stepped before backward ends. Memory: no more gradient bytes are held
    than the buffer, the largest gradient and what this rank's batch missed (averaged as zeros, stepped once the
    ranks agree whether anyone reached it), where the whole model's gradients are more."""
    for rank, result in ranks.items():
        run = result["adamw"]
        sizes = run["sizes"]
        bound = (BUFFER_BYTES + max(sizes.values()) + COALESCE_BYTES
                 + sum(sizes[n] for n in MISSED_ON.get(rank, ())))
        assert bound < sum(sizes.values())
        for step, events in enumerate(steps_of(run["events"])[1:], start=1):
            kinds = [kind for kind, _ in events]
            last_complete = len(kinds) - 1 - kinds[::-1].index("complete")
            assert kinds.index("all_reduce") < last_complete, f"rank {rank} step {step}: no overlap"
            assert kinds.index("stepped") < last_complete, f"rank {rank} step {step}: steps wait for backward's end"
            assert run["peaks"][step] <= bound, f"rank {rank} step {step}: {run['peaks'][step]} bytes held > {bound}"


def test_small_gradients_share_their_all_reduces(ranks):
    """Each gradient alone costs a collective per parameter (and one for the reached flags); in buckets the small ones
    share theirs, in the same number on both ranks."""
    for rank, result in ranks.items():
        alone, coalesced = ([sum(kind == "all_reduce" for kind, _ in events) for events in
                             steps_of(result[run]["events"])] for run in ("sgd_alone", "sgd"))
        sizes = result["sgd"]["sizes"].values()
        assert alone == [len(sizes) + 1] * 3
        # the large ones alone, the small ones in buckets of COALESCE_BYTES (and a last one part full), the flags
        small = [size for size in sizes if size < COALESCE_BYTES]
        bound = (len(sizes) - len(small)) + -(-sum(small) // COALESCE_BYTES) + 1 + 1
        assert all(c <= bound < a for c, a in zip(coalesced, alone)), (coalesced, bound, alone)
        assert coalesced == [sum(kind == "all_reduce" for kind, _ in events)
                             for events in steps_of(ranks[1 - rank]["sgd"]["events"])]


def test_stochastic_rounding_keeps_the_ranks_equal(ranks):
    """bfloat16 weights rounded stochastically, gradients averaged in float32 and rounded back to nearest or
    stochastically (ddp.reduce_rounding), by the fused reduce and by DDP's reducer: both ranks hold the same weights,
    bit for bit, after every run, although rank 1 steps the expert it missed last (noise drawn from one sequence in
    step order gives every weight stepped after it other noise there); the stochastic gradient rounding changes the
    weights (it is applied), and every run stays near one process of the global batch in float32."""
    names = ranks[0]["sgd"]["reference"].keys()
    for run, weights in ranks[0]["bfloat16"].items():
        other = ranks[1]["bfloat16"][run]
        for name in names:
            assert torch.equal(torch.tensor(weights[name]), torch.tensor(other[name])), f"{run} {name}: ranks differ"
            reference = torch.tensor(ranks[0]["sgd"]["reference"][name])
            diff = (torch.tensor(weights[name]) - reference).abs().max().item()
            assert diff <= 0.05 * reference.abs().max().item() + 2e-2, f"{run} {name}: {diff:.3g} from one process"
    for path in ("fused", "ddp"):
        nearest, stochastic = (ranks[0]["bfloat16"][f"{path}-{rounding}"] for rounding in ("nearest", "stochastic"))
        assert any(nearest[name] != stochastic[name] for name in names), path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_on_a_gpu_steps_as_one_process(tmp_path):
    """NCCL beside gloo, as a CUDA run's group: the reduces, the zeros of the unreached experts and the flags copied
    from pinned memory on the device; the weights of one process (only rank 0's batch). The device names its index:
    torch 2.11's init_process_group refuses a bare "cuda" device_id (it failed so on an H100, 2026-11-28)."""
    done = run_ranks(REPO / "tests" / "helpers" / "fused_reduce_ranks.py", tmp_path, "cuda:0", nproc=1, timeout=300,
                     fork=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    for optimizer, run in result.items():
        if optimizer == "bfloat16":  # rank consistency: nothing to show with one rank
            continue
        for name, reference in run["reference"].items():
            diff = (torch.tensor(reference) - torch.tensor(run["weights"][name])).abs().max().item()
            assert diff <= 1e-5, f"{optimizer} {name}: {diff:.3g}"
        assert set(NOBODYS) <= set(run["untouched_state"]) or optimizer == "sgd"


def test_the_config_takes_fused_back_pass_under_ddp_only(small_sd1, shapes_data, tmp_path):
    from conftest import base_config

    raw = base_config(small_sd1, shapes_data, tmp_path / "run", optimizer={"name": "ADAMW", "fused_back_pass": True},
                      clip_grad_norm=None, strategy="ddp")
    assert validate(raw).ddp.fused_reduce_buffer_mb == 100
    for strategy in ("fsdp", "zero2"):
        with pytest.raises(ConfigError, match="strategy: must be single or ddp"):
            validate({**raw, "strategy": strategy})


def test_bfloat16_weights_rounded_stochastically_stay_equal_on_every_rank(one_level_sd1, shapes_data, tmp_path):
    """A full finetune with trained_weight_dtype bfloat16 and stochastic rounding (OneTrainer's FINE_TUNE setup)
    under ddp, the averaged gradients rounded back stochastically too (ddp.reduce_rounding, OneTrainer's default
    FLOAT_32_STOCHASTIC): with DDP's reducer and with the fused back pass, both ranks end with the same weights, bit for
    bit, near one process of the global batch; rounding the averages to nearest instead changes the weights. The
    rounding once swapped each weight's `.data` to float32 and back, which replaced its gradient-accumulation node:
    DDP's reducer stopped averaging after the first step and the ranks drifted apart; the fused reduce failed outright. And a replica that drifts anyway (rank 1 moves one of its
    weights) is reported once, before the exports, naming the tensor and the rank (parallel/replica_check.py); ranks
    that start from different weights are refused, on every rank, before the first step."""
    from conftest import base_config

    from ot_dist.train.trainer import Trainer

    def config(out, **extra):
        return base_config(one_level_sd1, shapes_data, tmp_path / out, max_steps=3, learning_rate=0.05,
                           clip_grad_norm=None, train_dtype="bfloat16", trained_weight_dtype="bfloat16",
                           optimizer={"name": "SGD", "stochastic_rounding": True}, **extra)

    cases = {f"{name}-{rounding}": {"config": config(f"{name}-{rounding}", batch_size=2, strategy="ddp",
                                                     ddp={"reduce_rounding": rounding},
                                                     **{"optimizer.fused_back_pass": fused})}
             for name, fused in (("ddp", False), ("ddp+fused", True)) for rounding in ("nearest", "stochastic")}
    # a replica that drifts away (rank 1 moves a weight of its own after step 1): the trainer must say so
    cases["drifted"] = {"config": config("drifted", batch_size=2, strategy="ddp"), "perturb": "after_first_step"}
    # ranks that start from different weights (the fused reduce has no DDP to broadcast rank 0's): refused by all
    cases["different"] = {"config": config("different", batch_size=2, strategy="ddp",
                                           **{"optimizer.fused_back_pass": True}), "perturb": "before_training"}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = run_ranks(REPO / "tests" / "helpers" / "replica_ranks.py", tmp_path / "cases.json",
                     tmp_path / "result.json", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((tmp_path / "result.json").read_text())
    different = results.pop("different")["errors"]
    assert len(set(different)) == 1 and different[0].startswith("the ranks start from different trained weights"), \
        different
    drifted = results.pop("drifted")
    warned = [line for line in drifted["logged"] if "replicas diverged" in line]
    assert drifted["ranks_apart"] > 0 and len(warned) == 1, drifted["logged"]
    assert f"differ after step 3 ({drifted['first']} (rank 1))" in warned[0], warned[0]
    one = Trainer(validate(config("one")), log=lambda *_: None)
    start = {n: p.detach().float().flatten().clone() for n, p in one.strategy.trained_parameters().items()}
    one.train()
    reference = {n: p.detach().float().flatten() for n, p in one.strategy.trained_parameters().items()}
    moved = max((reference[n] - start[n]).abs().max().item() for n in start)
    for case, result in results.items():
        assert result["dtypes"] == ["torch.bfloat16"], case
        assert result["ranks_apart"] == 0, f"{case}: the ranks' weights differ by {result['ranks_apart']:.3g}"
        assert not any("replicas diverged" in line for line in result["logged"]), case
        diff = max((torch.tensor(result["weights"][n]) - reference[n]).abs().max().item() for n in reference)
        print(f"{case}: {diff:.3g} from one process, which moved the weights {moved:.3g}")
        assert diff <= 0.25 * moved, f"{case}: {diff:.3g} from one process (moved {moved:.3g})"
    for name in ("ddp", "ddp+fused"):  # the averages' rounding is applied on both paths
        nearest, stochastic = (results[f"{name}-{rounding}"]["weights"] for rounding in ("nearest", "stochastic"))
        assert nearest != stochastic, name
