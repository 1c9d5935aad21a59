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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_on_a_gpu_steps_as_one_process(tmp_path):
    """NCCL beside gloo, as a CUDA run's group: the reduces, the zeros of the unreached experts and the flags copied
    from pinned memory on the device; the weights of one process (only rank 0's batch)."""
    done = run_ranks(REPO / "tests" / "helpers" / "fused_reduce_ranks.py", tmp_path, "cuda", nproc=1, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    for optimizer, run in result.items():
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
