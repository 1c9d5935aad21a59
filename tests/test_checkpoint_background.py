"""Checkpoints written in the background (checkpoint.write_in_background; ot_dist/checkpoint/writer.py, staging.py).

The files are those a blocking write gives, byte for byte, although training changes the weights, the moments and
the EMA while they are written; a failed write is raised on every rank at the same point, commits nothing and
keeps the previous checkpoint; the commit protocol's collectives run beside training's without mixing with them."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks

from ot_dist.checkpoint import layout, writer
from ot_dist.checkpoint.staging import HostCopies
from ot_dist.config.load import validate
from ot_dist.errors import InputFileError
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
# What differs between two runs by design: where they write and when, their run ids.
PER_RUN = {"run_id", "saved_at", "run_started_at", "tracking_outbox", "config"}
WRITE_RANK_STATE = writer.write_rank_state


def quiet(*_args, **_kwargs):
    pass


def config(tiny_models, shapes_data, out: Path, background: bool, steps: int = STEPS) -> dict:
    return validate(base_config(tiny_models["sd1"], shapes_data, out, batch_size=2, max_steps=steps, **{
        "optimizer.name": "ADAMW", "ema.enabled": True, "ema.decay": 0.9, "ema.update_step_interval": 1,
        "checkpoint.every_n_steps": 1, "checkpoint.keep_last": None, "checkpoint.write_in_background": background}))


def train_recording(cfg, monkeypatch, hold_writes: bool) -> list[tuple[str, int]]:
    """Train; the events in order: ("stepped", n) after optimizer step n, ("writing" / "written", n) around the
    files of the checkpoint of step n. `hold_writes`: the files of step n wait until step n + 1 is done (they can
    only if training goes on while they are written)."""
    trainer = Trainer(cfg, log=quiet)
    events, stepped = [], threading.Condition()
    original_step = trainer.optimizer_step

    def optimizer_step(step):
        result = original_step(step)
        with stepped:
            events.append(("stepped", step + 1))
            stepped.notify_all()
        return result

    def write_rank_state(folder, rank, tensors, meta):
        step = sum(kind == "writing" for kind, _ in events) + 1  # one write at a time, every step saved
        events.append(("writing", step))
        if hold_writes and step < STEPS:
            with stepped:
                assert stepped.wait_for(lambda: ("stepped", step + 1) in events, timeout=60), \
                    f"step {step + 1} never ran while the checkpoint of step {step} was being written"
        WRITE_RANK_STATE(folder, rank, tensors, meta)
        events.append(("written", step))

    trainer.optimizer_step = optimizer_step
    monkeypatch.setattr(writer, "write_rank_state", write_rank_state)
    trainer.train()
    trainer.close()
    return events


def comparable_files(folder: Path) -> dict[str, object]:
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name == layout.TRAINER_FILE:
            files[path.name] = {k: v for k, v in json.loads(path.read_text()).items() if k not in PER_RUN}
        elif path.name == layout.MARKER:
            sizes = json.loads(path.read_text())["files"]
            files[path.name] = {name: size for name, size in sizes.items() if name != layout.TRAINER_FILE}
        else:
            files[path.name] = path.read_bytes()
    return files


def test_background_checkpoints_equal_blocking_ones_while_training_goes_on(tiny_models, shapes_data, tmp_path,
                                                                            monkeypatch):
    """Every step saved: the checkpoint of step n is written while step n + 1 changes the weights, moments and EMA,
    and holds step n's state, byte for byte what the blocking write holds."""
    events = {}
    for background in (False, True):
        cfg = config(tiny_models, shapes_data, tmp_path / str(background), background)
        events[background] = train_recording(cfg, monkeypatch, hold_writes=background)
    assert events[False] == [e for n in range(1, STEPS + 1) for e in (("stepped", n), ("writing", n), ("written", n))]
    for n in range(1, STEPS):  # in the background, step n + 1 ran before the files of step n were written
        order = events[True]
        assert order.index(("stepped", n + 1)) < order.index(("written", n)), order
    roots = [layout.checkpoints_dir(tmp_path / str(background)) for background in (False, True)]
    committed = [[p.name for p in layout.committed_checkpoints(root)] for root in roots]
    assert committed[0] == committed[1] == [layout.final_name(n) for n in range(1, STEPS + 1)]
    for name in committed[0]:
        blocking, background = (comparable_files(root / name) for root in roots)
        assert background.keys() == blocking.keys()
        for file in blocking:
            assert background[file] == blocking[file], f"{name}/{file} differs"


def test_a_failed_background_write_stops_training_at_the_next_save(tiny_models, shapes_data, tmp_path, monkeypatch):
    def full_disk(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_rank_state", full_disk)
    trainer = Trainer(config(tiny_models, shapes_data, tmp_path / "out", background=True, steps=2), log=quiet)
    with pytest.raises(InputFileError, match="checkpoint of step 1 could not be written on rank 0 .*No space left on "
                                             "device; nothing was committed"):
        trainer.train()
    assert layout.committed_checkpoints(layout.checkpoints_dir(tmp_path / "out")) == []
    trainer.close()


def test_a_real_write_error_of_safetensors_is_the_disk_s_exit_3(tmp_path):
    """safetensors reports a failed write (disk full, quota, file size limit) as a SafetensorError, which the commit
    protocol took for a defect: a traceback and exit 1 instead of exit 3 naming the disk's error. A real write
    failure: a file size limit below the rank file (SIGXFSZ ignored, so the write fails with EFBIG, as it fails
    with ENOSPC on a full disk)."""
    import resource
    import signal

    from ot_dist.checkpoint.staging import CopiesDone

    files = writer.RankFiles(1, 0, {"w": torch.zeros(256 * 1024)}, {"rng": {}}, "{}", CopiesDone(None))
    root = tmp_path / "checkpoints"
    root.mkdir()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    try:
        with pytest.raises(InputFileError, match=r"checkpoint of step 1 could not be written on rank 0 .*File too "
                                                 r"large: .*rank-00000.safetensors'; nothing was committed"):
            writer.write_and_commit(files, root, None, None, writer.Ranks(False, 1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert layout.committed_checkpoints(root) == []


def test_the_writer_thread_works_on_its_ranks_gpu(monkeypatch):
    """A new thread's current CUDA device is GPU 0 whatever its process uses: the writer, which waits on the copies'
    event and frees pinned memory, first makes its rank's GPU current (else every rank of a node would make a CUDA
    context on GPU 0). A CPU stands in: set_device is recorded, not made."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device,
                                                                               threading.current_thread().name)))
    runtime = SimpleNamespace(distributed=False, world_size=1, device=torch.device("cuda", 3))
    background = writer.BackgroundWriter(runtime, timeout_minutes=1)
    background.start(lambda ranks: calls.append(("work", threading.current_thread().name)))
    background.wait()
    assert calls == [("set_device", torch.device("cuda", 3), "ot_dist-checkpoint-writer"),
                     ("work", "ot_dist-checkpoint-writer")]


def test_the_commit_protocol_on_two_ranks(tmp_path):
    """Real gloo ranks, no model (tests/helpers/commit_ranks.py)."""
    done = run_ranks(REPO / "tests" / "helpers" / "commit_ranks.py", str(tmp_path), str(tmp_path / "result"),
                     nproc=2, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    for out in results:
        ok = out["background_ok"]
        assert ok["error"] is None and ok["latest"] == layout.final_name(1) == ok["committed"][0]
        assert ok["collectives_while_writing"] == 20  # training's all-reduces went on, with right sums
        for case in ("rank1_fails", "rank1_fails_background"):
            failed = out[case]
            assert failed["error"].startswith("InputFileError: checkpoint of step 2 could not be written on rank 1 ")
            assert failed["latest"] == layout.final_name(1) and failed["committed"] == [layout.final_name(1)]
        assert out["rank0_cannot_mkdir"]["error"].startswith(
            "InputFileError: checkpoint of step 1 could not be written on rank 0 ")
    assert "No space left on device" in results[1]["rank1_fails"]["error"]  # the failing rank says why
    assert "that rank's log says why" in results[0]["rank1_fails"]["error"]
    # output_dir not shared between the nodes: refused on every rank, nothing committed on node 0 (its step 1 stays)
    for out in results:
        assert out["not_shared"]["error"].startswith("InputFileError: checkpoint of step 2 could not be committed")
    assert "files of rank(s) 1" in results[0]["not_shared"]["error"] and "shared filesystem" in results[0][
        "not_shared"]["error"]
    assert results[0]["not_shared"]["committed"] == [layout.final_name(1)] == [results[0]["not_shared"]["latest"]]


@pytest.mark.parametrize("public, private, called", [
    (True, True, "public"), (False, True, "private"), (False, False, None)])
def test_pinned_copies_are_released_with_the_torch_at_hand(monkeypatch, public, private, called):
    """torch 2.13 releases cached pinned memory through torch.accelerator.empty_host_cache; older releases (2.11 on
    the lent GPU machines) have only torch._C._host_emptyCache, and a background checkpoint must not fail there."""
    from ot_dist.checkpoint import staging

    calls = []
    accelerator, c = SimpleNamespace(), SimpleNamespace()
    if public:
        accelerator.empty_host_cache = lambda: calls.append("public")
    if private:
        c._host_emptyCache = lambda: calls.append("private")
    monkeypatch.setattr(staging, "torch", SimpleNamespace(accelerator=accelerator, _C=c))
    staging.CopiesDone(event=object()).release()
    assert calls == ([called] if called else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_state_is_copied_without_the_host_waiting_and_holds_its_step(tmp_path):
    weights = torch.randn(16 * 2**20, device="cuda")  # 64 MiB
    expected = weights.cpu()
    torch.cuda._sleep(2_000_000_000)  # the stream is busy (an optimizer step, say) for a second or so
    copies = HostCopies(independent=True)
    files = writer.RankFiles(1, 0, {"w/0": copies(weights)}, {"owned": []}, "{}", copies.ready())
    assert not files.copies_done.event.query(), "the host waited for the device-to-host copy"
    assert files.tensors["w/0"].is_pinned()
    weights.add_(1.0)  # the next optimizer step, queued after the copy on the same stream
    files.copies_done.wait()
    assert torch.equal(files.tensors["w/0"], expected)
    pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    assert pinned >= weights.nbytes
    writer.write_and_commit(files, tmp_path / "checkpoints", 1, None, writer.Ranks(False, 1))
    # the pinned copy went back to the system once written (not kept by torch's caching host allocator)
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] <= pinned - weights.nbytes
