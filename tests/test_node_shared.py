"""`share_frozen_cpu_weights` (ot_dist/memory/node_shared.py): the frozen weights that stay in CPU memory are held once
per node, not once per rank, and nothing a run computes changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks

from ot_dist.memory import node_shared
from ot_dist.memory.block_streaming import stream_blocks
from ot_dist.memory.offload import offload_to_cpu

REPO = Path(__file__).resolve().parents[1]


class Wrapped(torch.nn.Parameter):
    """A parameter subclass, as bitsandbytes' Params4bit is: state beside its bytes, so it is not shared."""


def test_the_visitors_frozen_cpu_tensors_are_found_once_and_trained_ones_never():
    torch.manual_seed(0)
    shared_layer = torch.nn.Linear(16, 16).requires_grad_(False)
    blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 16), shared_layer) for _ in range(2)])
    blocks[0][0].requires_grad_(False)
    blocks[1][0].weight.requires_grad_(False)  # its bias trains
    stream_blocks(blocks, list(blocks), torch.device("cpu"), trained=True)
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).requires_grad_(False)
    encoder[1].weight = Wrapped(encoder[1].weight.detach(), requires_grad=False)
    offload_to_cpu(encoder, torch.device("cpu"))
    resident = torch.nn.Linear(4, 4).requires_grad_(False)  # no visitor carries it: it is not a home

    entries, skipped = node_shared.frozen_cpu_entries([blocks, encoder, resident])
    found = [table[name] for table, name in entries]
    expected = [blocks[0][0].weight, blocks[0][0].bias, shared_layer.weight, shared_layer.bias, blocks[1][0].weight,
                encoder[0].weight, encoder[0].bias, encoder[1].bias]
    assert [id(t) for t in found] == [id(t) for t in expected]
    assert skipped == 1  # the subclass

    offsets, size = node_shared.layout(found)
    assert all(offset % node_shared.ALIGNMENT == 0 for offset in offsets)
    ends = [offset + t.numel() * t.element_size() for offset, t in zip(offsets, found)]
    assert all(end <= start for end, start in zip(ends, offsets[1:])) and size == ends[-1]


def test_a_channels_last_weight_keeps_its_strides_in_the_shared_view(tmp_path):
    weight = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    assert node_shared.dense(weight) and not node_shared.dense(torch.randn(8, 8)[:, ::2])
    storage = torch.UntypedStorage(weight.numel() * weight.element_size() + 64)
    view = node_shared.view_in(storage, 64, weight)
    view.copy_(weight)
    assert view.stride() == weight.stride() and torch.equal(view, weight)


def test_two_ranks_of_a_node_hold_one_copy_and_train_as_before(tiny_models, shapes_data, tmp_path):
    def config(name, share):
        return base_config(tiny_models["sdxl"], shapes_data, tmp_path / name, family="sdxl", method="lora",
                           strategy="ddp", max_steps=2, batch_size=2, gradient_checkpointing=True,
                           offload_frozen_components=True, share_frozen_cpu_weights=share,
                           **{"unet.offload_fraction": 0.6})

    cases = {"shared": config("shared", True), "per_rank": config("per_rank", False)}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "spare").mkdir()
    done = run_ranks(REPO / "tests" / "helpers" / "node_shared_ranks.py", tmp_path / "cases.json",
                     tmp_path / "result.json", tmp_path / "spare", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((tmp_path / "result.json").read_text())

    synthetic = results["synthetic"]
    weights = 4 * (3200 * 3200 + 3200) * 4
    assert [r["bytes"] for r in synthetic] == [weights] * 2  # each tensor's bytes a multiple of 64: no padding
    assert all(r["tensors"] == 8 and r["ranks_on_node"] == 2 for r in synthetic)
    names = [r["filenames"] for r in synthetic]
    assert names[0] == names[1] and len(names[0]) == 1 and names[0][0].startswith(
        f"{synthetic[0]['directory']}/{node_shared.FILE_PREFIX}"), names
    assert not any(r["file_left"] for r in synthetic)  # removed once mapped: a crash leaves nothing behind
    assert [r["seen_by_this_rank"] for r in synthetic] == [12345.0, 12345.0]  # one copy of the bytes
    assert all(r["same_output"] for r in synthetic)
    saved = sum(r["pss_before"] for r in synthetic) - sum(r["pss_after"] for r in synthetic)
    print(f"node memory: {saved / 2**20:.1f} MiB less for {weights / 2**20:.1f} MiB of frozen weights on 2 ranks")
    assert saved >= 0.8 * weights, saved  # one of the two copies is gone from the node

    errors = [r["error"] for r in results["differs"]]
    assert all(e and "rank 1's frozen weight '2.weight' differs" in e for e in errors), errors
    errors = [r["error"] for r in results["pin_fails"]]
    assert all(e and e.startswith("rank 1: share_frozen_cpu_weights: cudaHostRegister") for e in errors), errors

    for r in results["full"]:
        assert r["tensors"] == 0 and r["shared"] == [] and r["files_left"] == [], r
        assert "GiB free" in r["reason"], r["reason"]
    assert any("keeps its own copy" in line for line in results["full"][0]["logged"])

    shared, per_rank = results["shared"], results["per_rank"]
    print(f"the tiny SDXL LoRA run: {shared['tensors']} tensors, {shared['bytes'] / 2**20:.1f} MiB shared"
          f"{'; not shared: ' + shared['reason'] if shared['reason'] else ''}")
    # a container's /dev/shm is 64 MB unless set larger: then the run must say so and train as before
    assert (shared["tensors"] > 0 and shared["bytes"] > 0) or "GiB free" in shared["reason"], shared["reason"]
    assert per_rank["tensors"] == 0 and per_rank["reason"] is None
    assert shared["losses"] == per_rank["losses"]
    assert shared["lora"] == per_rank["lora"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_page_locked_mapping_is_copied_from_in_place(tmp_path):
    """On a GPU each rank page-locks its mapping of the node's file: torch must see the views as pinned, or the
    streaming copy (memory/offload.py device_copies) would pin a private copy of each, the per-rank memory this
    removes."""
    import os
    from pathlib import Path

    from ot_dist.memory.offload import device_copies

    weight = torch.randn(256, 256)
    # in the memory filesystem the node's file lives in, as share_frozen_cpu_weights makes it: Linux may refuse to
    # page-lock a writable mapping of a file on disk for long
    shm = Path(node_shared.SHARED_MEMORY_DIR)
    path = (shm if shm.is_dir() else tmp_path) / f"{node_shared.FILE_PREFIX}{os.getpid()}-pin-test"
    path.write_bytes(b"\0" * (weight.numel() * 4))
    try:
        storage = torch.UntypedStorage.from_file(str(path), True, weight.numel() * 4)
        view = node_shared.view_in(storage, 0, weight).copy_(weight)
        node_shared.pin_mapping(storage)
        try:
            assert view.is_pinned()
            address = view.data_ptr()
            (copy,) = device_copies([view], torch.device("cuda"), pin=True)
            torch.cuda.synchronize()
            assert view.data_ptr() == address and torch.equal(copy.cpu(), weight)
        finally:
            torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())
    finally:
        path.unlink()


def test_files_of_ranks_that_died_while_writing_them_are_removed(tmp_path):
    """A node's first rank killed between creating its file and removing it leaves the file, and its memory, in
    /dev/shm; the next run's first rank removes the files of processes that no longer exist, and no other."""
    import os
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(finished.stdout)
    stale = tmp_path / f"{node_shared.FILE_PREFIX}{dead}-0123abcd"
    live = tmp_path / f"{node_shared.FILE_PREFIX}{os.getpid()}-4567ef01"
    other = tmp_path / "another-programs-file"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    logged = []
    tensor = torch.arange(16, dtype=torch.float32)
    path, why = node_shared.write_node_file(str(tmp_path), [tensor], [0], 64, log=logged.append)
    assert why is None and not stale.exists() and live.exists() and other.exists()
    assert logged and stale.name in logged[0]
    node_shared.remove(path)
