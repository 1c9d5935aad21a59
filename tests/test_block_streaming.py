"""`<denoiser>.offload_fraction` (memory/block_streaming.py, OneTrainer's layer offloading): which blocks stream,
that a streamed block's frozen weights are device copies only during its forward and its recomputation in backward
(and at most two blocks' copies exist at a time with gradient checkpointing), that a LoRA run and its samples are the
same as without, that compiled streamed blocks (their forward only) train as eager without recompiling, and the
refusals. On the CPU the "device" is the CPU: the copies are real copies all the same (`copy=True`), so their number
and lifetime are what a GPU run holds."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import base_config
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory import offload
from ot_dist.memory.block_streaming import (STREAMED_ATTR, StreamedBlock, kept_home, stream_blocks, streamed_blocks,
                                            streamed_bytes_of, streamed_in)
from ot_dist.memory.table import STREAMED_IN_FLIGHT
from ot_dist.train.trainer import Trainer

SAMPLE = {"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}


def quiet(*_):
    pass


def flux_transformer(checkpointing: bool) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=3, num_single_layers=3,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).requires_grad_(False)
    model.proj_out.requires_grad_(True)  # something trains, after the blocks: backward runs through all of them
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def flux_call(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    tokens, text = 16, 8
    return model(hidden_states=torch.randn(2, tokens, 16, generator=g).requires_grad_(True),
                 encoder_hidden_states=torch.randn(2, text, 32, generator=g),
                 pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.3, 0.7]),
                 img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3), return_dict=False)[0]


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def prefetcher_of(block: torch.nn.Module):
    """The Prefetcher of a streamed block (its visitor's hook)."""
    return next(hook.__self__.prefetcher for hook in block._forward_pre_hooks.values()
                if isinstance(getattr(hook, "__self__", None), StreamedBlock))


def test_the_last_blocks_stream_by_frozen_bytes():
    model = flux_transformer(checkpointing=False)
    blocks = blocks_of(model)
    sizes = [streamed_bytes_of(b) for b in blocks]
    assert streamed_blocks(blocks, 0.0) == [] and streamed_blocks(blocks, 1.0) == blocks
    for fraction in (0.1, 0.5, 0.9):
        streamed = streamed_blocks(blocks, fraction)
        resident = sizes[:len(blocks) - len(streamed)]
        assert blocks[len(resident):] == streamed
        # the resident ones fit in (1 - fraction) of the bytes, one more would not
        assert sum(resident) <= (1 - fraction) * sum(sizes) < sum(sizes[:len(resident) + 1])


def count_live_copies(monkeypatch, streamed: list[torch.nn.Module]) -> tuple[list, list[int]]:
    """Every device copy made for a streamed block (on arrival or prefetched) and what took a home's place in the
    module (a parameter or StreamIn's view wrapping the copy), weakly referenced: (the references as (block index,
    reference), the number of blocks with a live one at each block's arrival, after a collection). Patches
    before the hooks are attached (they bind `arrive`), and checks at each arrival that no home is in the module."""
    from ot_dist.memory import block_streaming

    block_of_home = {id(p): i for i, b in enumerate(streamed) for p in b.parameters()}
    copies: list[tuple[int, weakref.ref]] = []
    alive_at_arrival: list[int] = []
    made, arrive = block_streaming.device_copies, offload.Visitor.arrive

    def counted_copies(homes_, device, pin):
        out = made(homes_, device, pin)
        copies.extend((block_of_home[id(h)], weakref.ref(c)) for h, c in zip(homes_, out))
        return out

    def counting_arrive(self, module, args, kwargs):
        out = arrive(self, module, args, kwargs)
        copies.extend((block_of_home[id(h)], weakref.ref(table[name])) for (table, name), h in zip(self.entries,
                                                                                                  self.homes))
        gc.collect()
        alive_at_arrival.append(len({b for b, ref in copies if ref() is not None}))
        assert not any(id(table[name]) in block_of_home for table, name in self.entries)
        return out

    monkeypatch.setattr(block_streaming, "device_copies", counted_copies)
    monkeypatch.setattr(offload.Visitor, "arrive", counting_arrive)
    # Each count collects: what exists now (libraries, models, earlier tests' objects) is collected once and frozen,
    # so those collections scan only what the steps make (the trainer freezes the same way; it is never undone).
    gc.collect()
    gc.freeze()
    return copies, alive_at_arrival


@pytest.mark.parametrize("checkpointing", [True, False])
def test_copies_exist_only_while_their_block_computes(checkpointing, monkeypatch):
    """Every streamed block's frozen parameters are device copies inside its forward and CPU homes outside it. Every
    device copy made (on arrival or prefetched) is counted while alive: with checkpointing no more than three blocks'
    copies exist at any block's start (its own, the next one's prefetched, in backward the previous recomputation's
    until its backward is done), and none after the step; without, every earlier block's are kept for backward, which
    is why the option needs checkpointing. From the second step on, every block but the first to run in forward and
    in backward takes copies prefetched while the block before it computed. Gradients equal the run without
    streaming, both steps."""
    reference = flux_transformer(checkpointing)
    for _ in range(2):
        flux_call(reference).square().mean().backward()
    model = flux_transformer(checkpointing)
    blocks = blocks_of(model)
    streamed = streamed_blocks(blocks, 0.8)
    assert len(streamed) >= 4
    homes = {id(p) for b in streamed for p in b.parameters()}
    with kept_home(streamed):
        assert [p for b in streamed for p in b.parameters()] == []  # out of the modules while they move
    copies, alive_at_arrival = count_live_copies(monkeypatch, streamed)
    prefetcher = stream_blocks(model, streamed, torch.device("cpu"))
    assert all(id(p) in homes for b in streamed for p in b.parameters())  # between forwards: the homes
    for step in range(2):
        prefetcher.taken = prefetcher.made = 0
        flux_call(model).square().mean().backward()
        gc.collect()
        assert copies and all(ref() is None for _, ref in copies)  # nothing left on the device
        assert all(id(p) in homes for b in streamed for p in b.parameters())
    if checkpointing:
        assert len(alive_at_arrival) == 2 * 2 * len(streamed)  # each block and step: its forward and recomputation
        assert max(alive_at_arrival) <= STREAMED_IN_FLIGHT, alive_at_arrival  # what the memory table counts
        assert (prefetcher.made, prefetcher.taken) == (2, 2 * len(streamed) - 2)  # the second step
    else:
        assert max(alive_at_arrival) >= len(streamed) - 1  # every earlier block's copies kept for backward
    torch.testing.assert_close(model.proj_out.weight.grad, reference.proj_out.weight.grad, rtol=0, atol=0)


def sdxl_lora_run(models, data, out, fraction: float, family: str = "sdxl", **overrides):
    """Two steps of SDXL LoRA (or `family`'s, `models` holding its folder) with gradient checkpointing and a sample
    at step 2: the trainer, its losses, its LoRA file's tensors and its sample (an array)."""
    from safetensors.torch import load_file

    from ot_dist.models.families.registry import get_family

    denoiser = get_family(family).denoiser
    raw = base_config(models[family], data, out, family=family, method="lora", max_steps=2, batch_size=2,
                      gradient_checkpointing=True, **{f"{denoiser}.offload_fraction": fraction,
                                                      "sampling.prompts": [SAMPLE], "sampling.every_n_steps": 2,
                                                      **overrides})
    trainer = Trainer(validate(raw), log=quiet)
    losses = trainer.train().losses
    image = np.asarray(Image.open(next((out / "samples" / "step-2").glob("*.png"))))
    return trainer, losses, load_file(out / "lora.safetensors"), image


@pytest.mark.parametrize("weight_dtype", ["float32", "nf4"])
def test_a_lora_run_and_its_samples_are_the_same_with_streamed_blocks(tiny_models, shapes_data, tmp_path, weight_dtype):
    """SDXL LoRA with gradient checkpointing: the same losses, LoRA file and sample as without (the sample's copy of
    the UNet streams the same blocks, their weights left in CPU memory). nf4: the packed weights stream, their
    statistics (buffers) stay on the device."""
    _, plain, plain_lora, plain_image = sdxl_lora_run(tiny_models, shapes_data, tmp_path / "plain", 0.0,
                                                      weight_dtype=weight_dtype)
    trainer, streamed, lora, image = sdxl_lora_run(tiny_models, shapes_data, tmp_path / "streamed", 0.6,
                                                   weight_dtype=weight_dtype)
    names = getattr(trainer.model.denoiser, STREAMED_ATTR)
    assert len(names) >= 5 and all(name.startswith(("down_blocks", "mid_block", "up_blocks")) for name in names)
    assert streamed == plain
    for key, value in plain_lora.items():
        assert torch.equal(lora[key], value), key
    assert np.array_equal(image, plain_image)


def test_compiled_streamed_blocks_train_and_sample_as_compiled_resident_ones_under_autocast(family_models, shapes_data,
                                                                                            tmp_path):
    """performance.compile with streamed blocks (train/fast_path.py compile_forward), Flux LoRA in bfloat16 autocast
    (dynamo's graphs run eagerly; two block kinds, so few compiles): with 60 % of the blocks streamed the same losses,
    LoRA file and sample as compiled with none streamed, to the bit.
    The streamed blocks compile their forward only and their hooks copy the weights in eagerly (each step each
    streamed block's forward takes or makes copies); the other blocks compile their whole call. A streamed block
    drops the hook that casts its adapters together (methods/block_casts.py) and casts them per layer inside the
    graph, as a block compiled whole does; with that hook left on, the casts made outside the graph and the
    recomputation disagree (torch.utils.checkpoint's metadata check fails). The sampler copied the UNet before it
    was compiled: its copy runs the plain blocks. That compiled == eager beside streaming, and that no step
    recompiles: test_compiled_streamed_blocks_train_as_eager_and_never_recompile."""
    from ot_dist.methods.block_casts import casts_of
    from ot_dist.train.fast_path import EAGER_FORWARD, denoiser_blocks

    compiled = {"train_dtype": "bfloat16", "performance.compile": True, "performance.compile_backend": "eager"}
    torch._dynamo.reset()
    _, resident_losses, resident_lora, resident_image = sdxl_lora_run(family_models, shapes_data,
                                                                      tmp_path / "resident", 0.0, "flux", **compiled)
    torch._dynamo.reset()
    trainer, losses, lora, image = sdxl_lora_run(family_models, shapes_data, tmp_path / "streamed", 0.6, "flux",
                                                 **compiled)
    streamed = streamed_in(trainer.model.denoiser)
    resident = [b for b in denoiser_blocks(trainer.model) if not any(b is s for s in streamed)]
    assert len(streamed) >= 2 and resident
    assert all(EAGER_FORWARD in b.__dict__ and b._compiled_call_impl is None and casts_of(b) is None for b in streamed)
    assert all(b._compiled_call_impl is not None and EAGER_FORWARD not in b.__dict__ for b in resident)
    prefetcher = prefetcher_of(streamed[0])
    assert prefetcher.taken + prefetcher.made >= 2 * len(streamed)  # each step, each streamed block's forward
    template = trainer.sampler.templates["transformer"]
    assert not any(EAGER_FORWARD in m.__dict__ or m._compiled_call_impl is not None for m in template.modules())
    assert losses == resident_losses
    for key, value in resident_lora.items():
        assert torch.equal(lora[key], value), key
    assert np.array_equal(image, resident_image)


def test_compiled_streamed_blocks_train_as_eager_and_never_recompile():
    """Flux with half its blocks streamed and compiled (apply_performance): four SGD steps of the blocks' biases give
    the eager run's losses and weights; the frozen weights are the CPU homes between steps, each streamed block took
    or made copies for its forward and its recomputation each step; and the new device copies of every forward do
    not make dynamo compile again: every frame is compiled in the first step (dynamo's fail_on_recompile stance
    raises on any compile after it). A deep copy of the compiled model (sampling's, were it made after compiling)
    computes with its own blocks, not the originals'."""
    from torch._dynamo.utils import counters

    from ot_dist.config.performance import PerformanceConfig
    from ot_dist.models.families.registry import get_family
    from ot_dist.train.fast_path import EAGER_FORWARD, apply_performance

    def train(compiled: bool):
        torch._dynamo.reset()
        counters.clear()
        model = flux_transformer(checkpointing=True)
        for name, param in model.named_parameters():
            param.requires_grad_(name.endswith(".bias") or name.startswith("proj_out."))
        streamed = streamed_blocks(blocks_of(model), 0.5)
        prefetcher = stream_blocks(model, streamed, torch.device("cpu"))
        homes = [p for b in streamed for p in b.parameters() if not p.requires_grad]
        apply_performance(SimpleNamespace(family=get_family("flux"), denoiser=model),
                          PerformanceConfig(compile=compiled, compile_backend="aot_eager"), torch.device("cpu"),
                          "single", log=quiet)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        losses, frames, graphs = [], [], []
        for step in range(4):
            prefetcher.taken = prefetcher.made = 0
            with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
                loss = flux_call(model).square().mean()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            frames.append(counters["frames"]["total"])
            graphs.append(counters["stats"]["unique_graphs"])
            assert prefetcher.taken + prefetcher.made == 2 * len(streamed)
            assert [p for b in streamed for p in b.parameters() if not p.requires_grad] == homes
        return model, streamed, torch.stack(losses), frames, graphs

    eager, _, eager_losses, eager_frames, _ = train(compiled=False)
    model, streamed, losses, frames, graphs = train(compiled=True)
    assert eager_frames == [0] * 4
    assert all(EAGER_FORWARD in b.__dict__ and b._compiled_call_impl is None for b in streamed)
    assert 0 < len(streamed) < len(blocks_of(model))
    assert frames[0] > 0 and frames == frames[:1] * 4 and graphs == graphs[:1] * 4, (frames, graphs)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    assert not torch.equal(losses[0], losses[-1])  # it trained
    for (name, param), reference in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(param, reference, rtol=1e-4, atol=1e-5, msg=name)
    twin, eager_twin = copy.deepcopy(model), copy.deepcopy(eager)
    with torch.no_grad():
        for m in (twin, eager_twin):
            streamed_in(m)[-1].proj_out.weight.mul_(2)  # the copies' own weights, not the originals'
        torch.testing.assert_close(flux_call(twin), flux_call(eager_twin), rtol=1e-5, atol=1e-6)


def test_offload_fraction_is_refused_where_it_cannot_work(tiny_models, shapes_data, tmp_path):
    def check(message, method="lora", **overrides):
        with pytest.raises(ConfigError, match=message):
            validate(base_config(tiny_models["sdxl"], shapes_data, tmp_path, family="sdxl", method=method,
                                 **{"unet.offload_fraction": 0.5, "gradient_checkpointing": True, **overrides}))

    check("unet.offload_fraction: needs gradient_checkpointing: true", gradient_checkpointing=False)
    check("unet.offload_fraction: strategies single and ddp stream blocks; fsdp", strategy="fsdp")
    check("unet.offload_fraction: the unet trains, so its streamed weights are updated inside backward", method="full",
          clip_grad_norm=None)
    check("unet.offload_fraction: not with performance.float8_matmuls", **{"performance.float8_matmuls": True})
    check(r"unet.offload_fraction: not with performance.compile_mode: reduce-overhead \(CUDA graphs",
          **{"performance.compile": True, "performance.compile_mode": "reduce-overhead"})
    check("unet.offload_fraction: not with performance.compile_mode: max-autotune ",
          **{"performance.compile": True, "performance.compile_mode": "max-autotune"})
    check("text_encoder.offload_fraction: only the denoiser", **{"text_encoder.offload_fraction": 0.5})
    check("unet.offload_fraction: not with performance.checkpoint_every_n_blocks",
          **{"performance.checkpoint_every_n_blocks": 2})
    for mode in ("default", "max-autotune-no-cudagraphs"):  # compiled without CUDA graphs: streamed blocks' forward
        config = validate(base_config(tiny_models["sdxl"], shapes_data, tmp_path, family="sdxl", method="lora",
                                      **{"unet.offload_fraction": 0.5, "gradient_checkpointing": True,
                                         "performance.compile": True, "performance.compile_mode": mode}))
        assert config.performance.compile and config.unet.offload_fraction == 0.5


def test_the_sampling_copy_leaves_streamed_weights_in_cpu_memory():
    """inference_copy (train/sampling.py) moves the state to the device but the streamed blocks' weights: the meta
    device stands in for the accelerator, so where each tensor ends up is visible."""
    from ot_dist.train.sampling import inference_copy, meta_structure

    model = flux_transformer(checkpointing=True)
    streamed = streamed_blocks(blocks_of(model), 0.5)
    stream_blocks(model, streamed, torch.device("cpu"))
    copy = inference_copy(meta_structure(model), model.state_dict(), torch.device("meta"))
    names = getattr(model, STREAMED_ATTR)
    devices = {name: p.device.type for name, p in copy.named_parameters()}
    assert {d for n, d in devices.items() if n.startswith(tuple(f"{b}." for b in names))} == {"cpu"}
    assert {d for n, d in devices.items() if not n.startswith(tuple(f"{b}." for b in names))} == {"meta"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_blocks_lower_the_peak_on_cuda_and_compute_the_same():
    """On a GPU: a forward and backward with 75 % of the blocks streaming peaks lower than with every block on the
    device, by most of the streamed bytes, and gives the same gradient (bf16 autocast, pinned copies)."""
    from diffusers import FluxTransformer2DModel

    device = torch.device("cuda")

    def build(fraction):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=6,
                                       attention_head_dim=64, num_attention_heads=8, joint_attention_dim=64,
                                       pooled_projection_dim=64, axes_dims_rope=(16, 24, 24)).requires_grad_(False)
        model.proj_out.requires_grad_(True)
        model.enable_gradient_checkpointing()
        streamed = streamed_blocks(blocks_of(model), fraction)
        with kept_home(streamed):
            model.to(device)
        stream_blocks(model, streamed, device)
        return model.train(), sum(streamed_bytes_of(b) for b in streamed)

    def step(model):
        g = torch.Generator(device).manual_seed(1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(hidden_states=torch.randn(1, 256, 16, generator=g, device=device).requires_grad_(True),
                        encoder_hidden_states=torch.randn(1, 16, 64, generator=g, device=device),
                        pooled_projections=torch.randn(1, 64, generator=g, device=device),
                        timestep=torch.tensor([0.5], device=device), img_ids=torch.zeros(256, 3, device=device),
                        txt_ids=torch.zeros(16, 3, device=device), return_dict=False)[0]
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, model.proj_out.weight.grad.clone()

    plain, _ = build(0.0)
    plain_peak, plain_grad = step(plain)
    plain_resident = torch.cuda.memory_allocated()
    del plain
    streamed, streamed_bytes = build(0.75)
    assert streamed_bytes > 0
    saved_resident = plain_resident - torch.cuda.memory_allocated()
    peak, grad = step(streamed)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=0)
    assert saved_resident >= 0.9 * streamed_bytes  # the streamed weights never sit on the device between steps
    assert peak <= plain_peak + 3 * max(streamed_bytes_of(b) for b in blocks_of(streamed))  # current, next, previous


def test_a_copy_of_a_streaming_module_prefetches_on_its_own():
    """Sampling deep-copies the trained denoiser: the copy's blocks share one fresh Prefetcher (no copies, streams or
    events copied, its order recorded again) and compute as the original."""
    model = flux_transformer(checkpointing=True)
    streamed = streamed_blocks(blocks_of(model), 0.8)
    prefetcher = stream_blocks(model, streamed, torch.device("cpu"))
    with torch.no_grad():
        for _ in range(2):
            expected = flux_call(model)
    assert prefetcher.complete and prefetcher.taken  # the second forward took prefetched copies
    twin = copy.deepcopy(model)
    twin_prefetchers = {id(h.__self__.prefetcher) for b in blocks_of(twin)[-len(streamed):]
                        for h in b._forward_pre_hooks.values()}
    assert len(twin_prefetchers) == 1 and id(prefetcher) not in twin_prefetchers
    twin_prefetcher = blocks_of(twin)[-1]._forward_pre_hooks[next(iter(blocks_of(twin)[-1]._forward_pre_hooks))]
    assert twin_prefetcher.__self__.prefetcher.order == [] and not twin_prefetcher.__self__.prefetcher.ready
    with torch.no_grad():
        assert torch.equal(flux_call(twin), expected)
