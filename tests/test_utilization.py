"""MFU per log window (issue 21): FLOPs counted on the first micro step of each batch shape, over the window's
seconds and the device's peak (ot_dist/tracking/utilization.py)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import base_config

from ot_dist.tracking.base import Tracker
from ot_dist.tracking.utilization import UtilizationMeter, batch_shape


class Recording(Tracker):
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step, wall_time=None):
        self.rows.append((step, dict(metrics)))


def test_unknown_device_logs_no_mfu_and_says_so_once():
    lines = []
    meter = UtilizationMeter(torch.device("cpu"), "bfloat16", False, lines.append)
    assert not meter.enabled and len(lines) == 1 and "no peak FLOP/s known" in lines[0] and "H100" in lines[0]
    assert meter.micro_step({"x": torch.zeros(1)}, lambda: torch.tensor(1.0)).item() == 1.0
    assert meter.take(1.0) == {}


def test_flops_are_counted_once_per_batch_shape_and_summed_per_window():
    meter = UtilizationMeter(torch.device("cpu"), "float32", False, peak=lambda device, dtype: 1e9)
    weight = torch.randn(8, 8, requires_grad=True)

    def step(rows):
        def run():
            loss = (torch.randn(rows, 8) @ weight).square().mean()
            loss.backward()
            return loss.detach()
        return run

    for rows in (4, 4, 16):
        meter.micro_step({"pixels": torch.zeros(rows, 8)}, step(rows))
    # forward 2*rows*8*8, backward of the weight only (the input needs no gradient) the same again
    assert meter.flops_of[batch_shape({"pixels": torch.zeros(4, 8)})] == 2 * (2 * 4 * 8 * 8)
    expected = 2 * (2 * 4 * 64) * 2 + 2 * (2 * 16 * 64)
    assert meter.take(2.0) == pytest.approx({"mfu": expected / 2.0 / 1e9, "tflops_per_s": expected / 2.0 / 1e12})
    assert meter.take(1.0) == {}  # the window starts afresh
    assert UtilizationMeter(torch.device("cpu"), "float32", True, peak=lambda d, t: 1e9).name == "hfu"


def test_trainer_logs_mfu_and_samples_per_s_per_window(tiny_models, shapes_data, tmp_path, monkeypatch):
    from ot_dist.config.load import validate
    from ot_dist.train import trainer as trainer_module

    recording = Recording()
    monkeypatch.setattr(trainer_module, "start_tracking", lambda *a, **k: recording)
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "run", method="lora", batch_size=2, max_steps=4,
                      log_every_steps=2, **{"checkpoint.at_end": False})
    trainer = trainer_module.Trainer(validate(raw), log=lambda *_: None)
    trainer.utilization = UtilizationMeter(trainer.device, "float32", False, peak=lambda device, dtype: 1e12)
    # samples (validation, checkpoints) taken after step 2 are no training: the second window's rate leaves them out
    after_step = trainer.sampler.after_step
    trainer.sampler.after_step = lambda t, step: (time.sleep(3.0) if step == 2 else None, after_step(t, step))
    trainer.train()
    trainer.close()
    windows = [(step, m) for step, m in recording.rows if "samples_per_s" in m]
    assert [step for step, _ in windows] == [2, 4]
    flops_per_micro_step = list(trainer.utilization.flops_of.values())
    assert len(flops_per_micro_step) == 1 and flops_per_micro_step[0] > 0  # one bucket shape
    for _, metrics in windows:
        seconds = 2 * 2 / metrics["samples_per_s"]  # 2 steps x global batch 2 per window
        assert seconds < 3.0  # two steps of a tiny LoRA, without the 3 s "samples"
        assert metrics["mfu"] == pytest.approx(2 * flops_per_micro_step[0] / seconds / 1e12, rel=1e-6)
        assert metrics["tflops_per_s"] == pytest.approx(metrics["mfu"], rel=1e-6)  # peak 1 TFLOP/s


@pytest.mark.parametrize("whole", [True, False])
def test_counting_a_compiled_model_leaves_it_compiled(whole):
    """Dynamo skips a compiled frame for good when it first meets it under the FLOP counter's dispatch mode; the
    meter runs the compiled blocks eagerly while it counts, so the next micro step compiles them. Blocks compiled
    whole (their call) or by their forward alone (a streamed block's: train/fast_path.py compile_forward)."""
    from torch._dynamo.utils import counters

    from ot_dist.train.fast_path import EAGER_FORWARD, compile_forward

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.linear(x))

    torch._dynamo.reset()
    counters.clear()
    root = torch.nn.Sequential(Block(), Block())
    for block in root:
        if whole:
            block.compile(backend="aot_eager")
        else:
            compile_forward(block, backend="aot_eager")
    compiled = [(b._compiled_call_impl, b.forward) for b in root]
    x = torch.randn(4, 8)

    def run():
        loss = root(x).square().mean()
        loss.backward()
        return loss.detach()

    meter = UtilizationMeter(torch.device("cpu"), "float32", False, peak=lambda d, t: 1e12, root=root)
    meter.micro_step({"x": x}, run)
    assert [(b._compiled_call_impl, b.forward) for b in root] == compiled  # put back after the count
    assert whole or all(EAGER_FORWARD in b.__dict__ for b in root)
    assert not counters["stats"]  # the counted step ran eagerly
    meter.micro_step({"x": x}, run)
    assert counters["stats"]["unique_graphs"] >= 1, "the blocks were never compiled after the counted step"
    assert list(meter.flops_of.values()) == [2 * 2 * (2 * 4 * 8 * 8) + 2 * 4 * 8 * 8]  # fwd + both grads, 2nd block's input grad
