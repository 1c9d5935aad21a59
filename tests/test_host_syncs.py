"""Blocking host syncs in the training step, counted on the CPU (issue 21; tests/helpers/host_syncs.py).

On a GPU each `.item()` / `.tolist()` / `bool(tensor)` ... of a device tensor stalls the host until the device
has caught up, so the next step's kernels are not queued in time. The step path keeps at most one: the blocking
step guard's combined flags (stop, save, non-finite loss: one all-reduce, one read; the lagged guard reads none,
tests/test_step_guard.py); losses and gradient norms are read once per log window."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import base_config

import ot_dist.models.families as families_package

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from host_syncs import count_trainer_syncs  # noqa: E402


def _counted(raw):
    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    from ot_dist.tracking.utilization import UtilizationMeter

    trainer = Trainer(validate(raw), log=lambda *_: None)
    # MFU counting on, as on a GPU with a known peak: its FLOP counting must add no sync either
    trainer.utilization = UtilizationMeter(trainer.device, "float32", False, peak=lambda device, dtype: 1e12)
    try:
        return count_trainer_syncs(trainer)
    finally:
        trainer.close()


def _listing(syncs) -> str:
    return "\n".join(f"{n} x {kind} at {where}" for (kind, where), n in Counter((s.kind, s.where) for s in syncs).items())


def test_at_most_one_host_sync_per_optimizer_step(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", batch_size=1, gradient_accumulation_steps=2,
                      max_steps=4, log_every_steps=2, clip_grad_norm=1.0, gradient_checkpointing=True,
                      **{"ema.enabled": True, "checkpoint.at_end": False,
                         # the performance options on the CPU add no sync either
                         "performance.checkpoint_every_n_blocks": 2, "performance.channels_last": "on",
                         "performance.attention_backend": "math"})
    counter, result = _counted(raw)
    assert result.steps == 4
    step_syncs, log_syncs = counter.in_phase("step"), counter.in_phase("log")
    assert len(step_syncs) <= result.steps, f"{len(step_syncs)} host syncs in {result.steps} steps:\n{_listing(step_syncs)}"
    windows = 2  # log_every_steps 2 of 4 steps
    assert len(log_syncs) <= windows, f"{len(log_syncs)} host syncs in {windows} log windows:\n{_listing(log_syncs)}"
    assert len(result.losses) == 4  # the window still delivers every step's loss


@pytest.mark.parametrize("family, cache_text", [("sd1", False), ("sdxl", False), ("qwen_image", False),
                                                ("qwen_image", True), ("z_image", False), ("z_image", True),
                                                ("ernie_image", False), ("ernie_image", True),
                                                ("ideogram4", False), ("ideogram4", True),
                                                ("krea2", False), ("krea2", True)])
def test_the_step_copies_host_tensors_to_the_device_without_blocking(tiny_models, family_models, shapes_data, tmp_path,
                                                                      family, cache_text):
    """Batches and the per-sample noise are made on the host; the loss moves them with `to_device` (pinned memory,
    non_blocking on CUDA), never with a plain `.to(device)`, whose copy from pageable memory waits for the stream.
    Without data.cache_text the families' `encode_text` move the token ids the same way, every micro step and text
    encoder (sdxl: two encoders), and SDXL its time ids. (Copies inside transformers / diffusers are theirs.)
    Nor does the family's code read the device back: Qwen-Image trims the text to the batch's longest caption with
    lengths counted from the batch's host mask (the tokens', or the text cache's), and Z-Image cuts each caption to its
    own length so; ERNIE-Image trims to the longest so, its caption lengths staying on the device; Ideogram 4 packs its
    sequence from those lengths and builds the layout on the host; Krea 2 trims its compacted text stream so."""
    model = (family_models if family in ("qwen_image", "z_image", "ernie_image", "ideogram4", "krea2")
             else tiny_models)[family]
    raw = base_config(model, shapes_data, tmp_path / "run", family=family, batch_size=2, max_steps=2,
                      **{"checkpoint.at_end": False, "data.cache_text": cache_text})
    counter, result = _counted(raw)
    assert result.steps == 2
    in_step = [c for c in counter.blocking_copies if c.phase == "step"]
    in_loss = [c for c in in_step if c.where.startswith("loss.py")]
    assert not in_loss, f"blocking host -> device copies in the loss:\n{_listing(in_loss)}"
    families = Path(next(iter(families_package.__path__))).resolve()
    in_families = [c for c in in_step if Path(c.origin).resolve().parent == families]
    assert not in_families, f"blocking host -> device copies in the family's text encoding:\n{_listing(in_families)}"
    reads = [s for s in counter.in_phase("step") if Path(s.origin).resolve().parent == families]
    assert not reads, f"host syncs in the family's code:\n{_listing(reads)}"


def test_to_device_pins_and_queues_host_to_cuda_copies(monkeypatch):
    """The CUDA path by construction (no GPU here): host tensors go through pinned memory with non_blocking;
    tensors already there are not copied; a device -> host copy stays blocking (its values are read next)."""
    import torch

    from ot_dist.train.transfer import to_device

    calls = []
    original_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)

    def to(self, *args, **kwargs):
        if "device" in kwargs:
            calls.append(("to", str(kwargs["device"]), kwargs.get("non_blocking", False)))
            return self
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    host = torch.ones(2)
    assert to_device(host, torch.device("cuda:0"), torch.float16).dtype == torch.float16
    assert calls == ["pin", ("to", "cuda:0", True)]
    calls.clear()
    assert to_device(host, torch.device("cpu")) is host and calls == []


def test_prodigy_adds_no_host_sync_to_the_step(tiny_models, shapes_data, tmp_path):
    """PRODIGY keeps its estimate d on the device (ot_dist/optim/prodigy.py): nothing of the optimizer step is
    read on the host; d x lr of every step and group is copied with the window's losses, in its one host copy.
    The text encoder trains too: two parameter groups."""
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", batch_size=1, max_steps=6, log_every_steps=3,
                      learning_rate=1.0, **{"optimizer.name": "PRODIGY", "text_encoder.train": True,
                                            "checkpoint.at_end": False})
    counter, result = _counted(raw)
    assert result.steps == 6
    from_prodigy = [s for s in counter.in_phase("step") if "prodigy.py" in s.where]
    assert not from_prodigy, f"host syncs in Prodigy's step:\n{_listing(from_prodigy)}"
    step_syncs = counter.in_phase("step")
    assert len(step_syncs) <= result.steps, f"{len(step_syncs)} host syncs in {result.steps} steps:\n{_listing(step_syncs)}"
    log_syncs = counter.in_phase("log")
    assert len(log_syncs) <= 2, f"{len(log_syncs)} host syncs in 2 log windows:\n{_listing(log_syncs)}"
    assert len(result.d_lr) == 6 and all(set(d) == {"unet", "text_encoder"} for d in result.d_lr)
    assert all(isinstance(v, float) for d in result.d_lr for v in d.values())
    assert result.d_lr[-1]["unet"] > 1.5 * result.d_lr[0]["unet"] == 1.5e-6  # d grew from d0 (lr 1)


def test_preserve_embedding_norm_adds_no_host_sync_to_the_step(one_level_sd1, shapes_data, tmp_path):
    """preserve_embedding_norm's rescale (ot_dist/train/embedding_norm.py) runs inside every optimizer step: its
    norms, standard deviations and factors stay on the device. Method embedding's input vectors and an additional
    output embedding's vectors: both rules."""
    raw = base_config(one_level_sd1, None, tmp_path / "run", method="embedding", batch_size=2, max_steps=3,
                      log_every_steps=3, preserve_embedding_norm=True,
                      **{"embedding.token": "<tok>", "checkpoint.at_end": False,
                         "additional_embeddings": [{"token": "<add>", "output_embedding": True}]})
    raw["data"] = {"concepts": [{"path": str(shapes_data), "caption_prefix": "<add>"}], "shards": f"{tmp_path}-shards"}
    counter, result = _counted(raw)
    assert result.steps == 3
    from_norms = [s for s in counter.in_phase("step") if "embedding_norm.py" in s.where]
    assert not from_norms, f"host syncs in the rescale:\n{_listing(from_norms)}"
    step_syncs = counter.in_phase("step")
    assert len(step_syncs) <= result.steps, f"{len(step_syncs)} host syncs in {result.steps} steps:\n{_listing(step_syncs)}"
