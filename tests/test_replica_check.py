"""The fingerprint that compares the ranks' replicas (ot_dist/parallel/replica_check.py): equal tensors give equal
fingerprints, whatever their storage; any changed element, or two swapped ones, changes it; it is exact for tensors
longer than one chunk. The comparison across 2 ranks and the trainer's warning: tests/test_fused_reduce.py."""

from __future__ import annotations

import pytest
import torch

from ot_dist.parallel import replica_check
from ot_dist.parallel.replica_check import fingerprint


def test_the_fingerprint_sees_every_element_and_its_place(monkeypatch):
    monkeypatch.setattr(replica_check, "CHUNK", 7)  # several chunks, the last one part full
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        weights = torch.randn(5, 9, generator=torch.Generator().manual_seed(0)).to(dtype)
        same = fingerprint(weights.clone())
        assert fingerprint(weights) == same and fingerprint(weights.t().contiguous().t()) == same
        for index in (0, 17, 44):
            changed = weights.clone()
            changed.view(-1)[index] = torch.nextafter(changed.view(-1)[index].float(),
                                                      torch.tensor(float("inf"))).to(dtype)
            if torch.equal(changed, weights):  # one float32 step below the narrower dtype's resolution
                changed.view(-1)[index] += changed.view(-1)[index].abs() * 0.01 + 1e-3
            assert fingerprint(changed) != same, (dtype, index)
        swapped = weights.clone()
        swapped.view(-1)[[3, 30]] = weights.view(-1)[[30, 3]]
        assert fingerprint(swapped) != same, dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cpu_weight_fingerprinted_on_the_gpu_is_the_cpu_fingerprint(monkeypatch):
    """A streamed weight lives in CPU memory and is fingerprinted on the GPU, chunk by chunk; a resident one on the
    GPU: integer arithmetic, so the same values whatever the device."""
    monkeypatch.setattr(replica_check, "CHUNK", 1000)
    weights = torch.randn(3001, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    on_cpu = fingerprint(weights)
    assert fingerprint(weights, torch.device("cuda")).item() == on_cpu.item()
    assert fingerprint(weights.cuda()).item() == on_cpu.item()
