"""Streamed blocks whose weights train (memory/trained_streaming.py; `<denoiser>.offload_fraction` in a full finetune,
OneTrainer's layer offloading of a trained part): the same weights after the same steps as without streaming, the
weights and their updates at home in CPU memory between forwards, no more blocks' copies alive at a time than a
LoRA's frozen streaming keeps (the first forward's copies are not held until backward), and the config's rules. On
the CPU the "device" is the CPU: the copies are real copies all the same (`copy=True`)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from conftest import base_config
from PIL import Image
from test_block_streaming import SAMPLE, blocks_of, count_live_copies, flux_call, flux_transformer, quiet

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory import block_streaming
from ot_dist.memory.block_streaming import connect_trained_streaming, kept_home, stream_blocks, streamed_blocks
from ot_dist.memory.table import STREAMED_IN_FLIGHT
from ot_dist.optim.fused_backward import install_fused_back_pass
from ot_dist.train.trainer import Trainer


def trained_flux() -> torch.nn.Module:
    return flux_transformer(checkpointing=True).requires_grad_(True)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    install_fused_back_pass(optimizer)
    return optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        flux_call(model).square().mean().backward()
        optimizer.step()


def test_streamed_trained_blocks_step_as_without_streaming_and_hold_three_blocks_at_most(monkeypatch):
    """Two AdamW steps with the fused back pass: every weight equal to the run without streaming (bit for bit: the
    same ops on the same values), each streamed weight stepped on its copy once per step and back home in CPU memory
    as the same parameter object, its optimizer state made. Every copy is counted while alive: at most three blocks'
    at any block's start, none after the step (a leaf copy would keep every block's first-forward copy until
    backward)."""
    reference = trained_flux()
    train(reference, adamw(reference), 2)

    model = trained_flux()
    streamed = streamed_blocks(blocks_of(model), 0.8, trained=True)
    assert len(streamed) >= 4
    homes = [p for b in streamed for p in b.parameters()]
    with kept_home(streamed, trained=True):
        assert [p for b in streamed for p in b.parameters()] == []  # all of them out while the rest moves
    copies, alive_at_arrival = count_live_copies(monkeypatch, streamed)
    prefetcher = stream_blocks(model, streamed, torch.device("cpu"), trained=True)
    optimizer = adamw(model)
    assert connect_trained_streaming(model, optimizer)
    before = [p.detach().clone() for p in homes]
    for step in range(2):
        train(model, optimizer, 1)
        gc.collect()
        assert copies and all(ref() is None for _, ref in copies)
        assert max(alive_at_arrival) <= STREAMED_IN_FLIGHT, alive_at_arrival
        assert [p for b in streamed for p in b.parameters()] == homes  # the same objects, home again
        assert prefetcher.trained.updates == (step + 1) * len(homes)
    assert len(alive_at_arrival) == 2 * 2 * len(streamed)  # each block and step: its forward and recomputation
    assert all(optimizer.state[p]["exp_avg"].shape == p.shape for p in homes)
    assert not any(torch.equal(p, b) for p, b in zip(homes, before))  # the updates reached home
    for (name, value), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
        assert value.grad is None, name  # the fused back pass freed every gradient


def test_a_trained_streamed_weight_without_the_optimizer_fails_loudly():
    model = trained_flux()
    stream_blocks(model, streamed_blocks(blocks_of(model), 0.5, trained=True), torch.device("cpu"), trained=True)
    with pytest.raises(RuntimeError, match="before TrainedStreaming.connect"):
        flux_call(model).square().mean().backward()
    with pytest.raises(ValueError, match="optimizer.fused_back_pass: true"):
        connect_trained_streaming(model, torch.optim.SGD(model.parameters(), lr=0.1))


def full_config(tiny_models, shapes_data, out, fraction, **overrides):
    return validate(base_config(tiny_models["sdxl"], shapes_data, out, family="sdxl", method="full", max_steps=3,
                                batch_size=2, gradient_checkpointing=True, clip_grad_norm=None,
                                **{"optimizer.name": "ADAFACTOR", "optimizer.fused_back_pass": True,
                                   "unet.offload_fraction": fraction, **overrides}))


@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_a_full_finetune_with_streamed_blocks_trains_as_without(stochastic_rounding, tiny_models, shapes_data,
                                                                 tmp_path):
    """SDXL full finetune as OneTrainer's FINE_TUNE presets run it (bfloat16 weights, Adafactor with the fused back
    pass), an EMA in CPU memory, a sample at the end: the same losses, sample and saved UNet and EMA as without
    streaming, bit for bit, with stochastic rounding too (its noise is keyed by step and weight, so the other order
    autograd steps streamed weights in changes nothing; drawn from one sequence, the losses were 1.2e-3 apart)."""
    from safetensors.torch import load_file

    def run(fraction):
        out = tmp_path / f"run{fraction}"
        trainer = Trainer(full_config(tiny_models, shapes_data, out, fraction, train_dtype="bfloat16",
                                      trained_weight_dtype="bfloat16",
                                      **{"optimizer.stochastic_rounding": stochastic_rounding, "ema.enabled": True,
                                         "ema.device": "cpu", "sampling.prompts": [SAMPLE],
                                         "sampling.every_n_steps": 3}), log=quiet)
        return trainer, trainer.train().losses, out

    _, plain, plain_out = run(0.0)
    trainer, streamed, out = run(0.6)
    assert len(getattr(trainer.model.denoiser, block_streaming.STREAMED_ATTR)) >= 5
    assert getattr(trainer.model.denoiser, block_streaming.PREFETCHER_ATTR).trained.updates > 0
    assert streamed == plain
    # the sample's copy of the UNet streams the same blocks (with no optimizer: it never trains)
    images = [np.asarray(Image.open(next((o / "samples" / "step-3").glob("*.png")))) for o in (plain_out, out)]
    assert np.array_equal(*images)
    saved = sorted(p.relative_to(plain_out) for p in plain_out.rglob("*.safetensors"))
    assert saved
    for name in saved:
        expected, got = load_file(plain_out / name), load_file(out / name)
        assert expected.keys() == got.keys(), name
        for key, value in expected.items():
            assert torch.equal(got[key], value), (name, key)


def test_streaming_a_trained_denoiser_needs_the_fused_back_pass(tiny_models, shapes_data, tmp_path):
    with pytest.raises(ConfigError, match="unet.offload_fraction: the unet trains.*optimizer.fused_back_pass: true"):
        full_config(tiny_models, shapes_data, tmp_path, 0.5, **{"optimizer.fused_back_pass": False})
    with pytest.raises(ConfigError, match="strategies single and ddp stream blocks; zero2"):  # ddp: 2 ranks in test_family_strategies.py
        full_config(tiny_models, shapes_data, tmp_path, 0.5, strategy="zero2")
    with pytest.raises(ConfigError, match="unet.offload_fraction: .*gradient_accumulation_steps must be 1"):
        full_config(tiny_models, shapes_data, tmp_path, 0.5, gradient_accumulation_steps=2)
    assert full_config(tiny_models, shapes_data, tmp_path, 0.5).streams_trained_weights()
    assert not full_config(tiny_models, shapes_data, tmp_path, 0.0).streams_trained_weights()


def test_a_full_finetune_with_streamed_blocks_resumes_exactly(tiny_models, shapes_data, tmp_path):
    """Stopped by SIGTERM after step 2 and resumed: the uninterrupted run's losses and saved UNet, bit for bit (the
    optimizer state of the streamed weights goes through the checkpoint and back beside them), bfloat16 weights
    rounded stochastically (the rounding noise of step 3 is step 3's in the resumed run too)."""
    import os
    import signal

    from safetensors.torch import load_file

    def train_until(out, stop_after=None, resume=None):
        raw = base_config(tiny_models["sdxl"], shapes_data, out, family="sdxl", method="full", max_steps=4,
                          batch_size=2, gradient_checkpointing=True, clip_grad_norm=None,
                          train_dtype="bfloat16", trained_weight_dtype="bfloat16",
                          **{"optimizer.name": "ADAFACTOR", "optimizer.fused_back_pass": True,
                             "optimizer.stochastic_rounding": True, "unet.offload_fraction": 0.6,
                             "checkpoint.every_n_steps": 2})
        trainer = Trainer(validate(raw), log=quiet, resume=resume)
        if stop_after is not None:  # counted per optimizer step (the optimizer's own hooks run once per weight)
            optimizer_step, done = trainer.optimizer_step, [0]

            def counted(*args, **kwargs):
                result = optimizer_step(*args, **kwargs)
                done[0] += 1
                if done[0] == stop_after:
                    os.kill(os.getpid(), signal.SIGTERM)
                return result

            trainer.optimizer_step = counted
        return trainer.train()

    straight = train_until(tmp_path / "straight")
    stopped = train_until(tmp_path / "stopped", stop_after=2)
    assert stopped.stopped_by == "SIGTERM"
    resumed = train_until(tmp_path / "stopped", resume="auto")
    assert resumed.first_step == stopped.steps and resumed.losses == straight.losses[stopped.steps:]
    saved = sorted(p.relative_to(tmp_path / "straight") for p in (tmp_path / "straight").glob("*.safetensors"))
    assert saved
    for name in saved:
        want, got = load_file(tmp_path / "straight" / name), load_file(tmp_path / "stopped" / name)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name


def test_compiled_streamed_trained_blocks_step_as_eager_and_never_recompile():
    """performance.compile beside trained streaming (a streamed block compiles its forward; the weights it reads are
    StreamIn's device copies, new every call): two AdamW steps with the fused back pass give the eager streamed run's
    weights within float tolerance (aot_eager; each tensor within 0.1 % of its norm), and no frame compiles after the first
    step."""
    import contextlib
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from ot_dist.config.performance import PerformanceConfig
    from ot_dist.models.families.registry import get_family
    from ot_dist.train.fast_path import apply_performance

    def run(compiled: bool) -> torch.nn.Module:
        torch._dynamo.reset()
        counters.clear()
        model = trained_flux()
        stream_blocks(model, streamed_blocks(blocks_of(model), 0.5, trained=True), torch.device("cpu"), trained=True)
        apply_performance(SimpleNamespace(family=get_family("flux"), denoiser=model),
                          PerformanceConfig(compile=compiled, compile_backend="aot_eager"), torch.device("cpu"),
                          "single", log=quiet)
        optimizer = adamw(model)
        connect_trained_streaming(model, optimizer)
        for step in range(3):
            with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
                train(model, optimizer, 1)
        assert (counters["frames"]["total"] > 0) == compiled
        return model

    eager, compiled = run(False), run(True)
    # Per tensor, not per element: Adam turns a last-bit difference in a near-zero gradient into a step of its own
    # size on that element (5e-5 on one of 8192 weights on an AVX2 CPU), while stale or missing weight copies would
    # move whole tensors by the learning rate (1e-2 a step, ~10 % of these weights).
    for (name, value), expected in zip(compiled.named_parameters(), eager.parameters()):
        distance = ((value - expected).norm() / expected.norm()).item()
        assert distance < 1e-3, f"{name}: {distance:.3g} from the eager run"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_trained_blocks_on_cuda_step_as_resident_ones_and_hold_less():
    """On a GPU (pinned homes, the prefetcher's side stream, copies home queued on the compute stream): three AdamW
    steps with the fused back pass under bf16 autocast, 75 % of the blocks' weights streamed, give the resident run's
    weights (within float tolerance: the same kernels), the streamed weights stay pinned CPU parameters, the optimizer
    state of every weight is on the GPU, and the device holds less than with every block resident."""
    device = torch.device("cuda")

    def build(fraction):
        model = trained_flux()
        streamed = streamed_blocks(blocks_of(model), fraction, trained=True)
        with kept_home(streamed, trained=True):
            model.to(device)
        stream_blocks(model, streamed, device, trained=True)
        optimizer = adamw(model)
        connect_trained_streaming(model, optimizer)
        return model, optimizer, streamed

    def steps(model, optimizer):
        g = torch.Generator(device).manual_seed(1)
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(hidden_states=torch.randn(2, 16, 16, generator=g, device=device),
                            encoder_hidden_states=torch.randn(2, 8, 32, generator=g, device=device),
                            pooled_projections=torch.randn(2, 32, generator=g, device=device),
                            timestep=torch.tensor([0.3, 0.7], device=device), img_ids=torch.zeros(16, 3, device=device),
                            txt_ids=torch.zeros(8, 3, device=device), return_dict=False)[0]
            out.float().square().mean().backward()
            optimizer.step()  # settles: waits for the copies home
        torch.cuda.synchronize()

    resident, resident_optimizer, _ = build(0.0)
    steps(resident, resident_optimizer)
    resident_bytes = torch.cuda.memory_allocated()
    expected = {n: p.detach().cpu() for n, p in resident.named_parameters()}
    del resident, resident_optimizer
    model, optimizer, streamed = build(0.75)
    steps(model, optimizer)
    homes = [p for b in streamed for p in b.parameters()]
    assert homes and all(p.device.type == "cpu" and p.is_pinned() for p in homes)
    assert all(optimizer.state[p]["exp_avg"].device.type == "cuda" for p in homes)
    assert torch.cuda.memory_allocated() < resident_bytes
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach().cpu(), expected[name], rtol=1e-3, atol=1e-4, msg=name)
