"""`activation_offloading` (train/activation_offload.py, OneTrainer's activation offloading): with gradient
checkpointing the checkpointed blocks' inputs wait in CPU memory between forward and backward. On the CPU the "device"
is the CPU: the host copies are real copies all the same, so which tensors are copied, and that autograd no longer
holds the originals, is what a GPU run does. The size threshold is lowered to the tiny models' scale."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import base_config
from test_block_streaming import blocks_of, flux_call, flux_transformer, quiet

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory.heap import freeze_long_lived_objects
from ot_dist.train import activation_offload
from ot_dist.train.checkpointing import enable_gradient_checkpointing
from ot_dist.train.trainer import Trainer

# The tiny Flux's hidden states (2 x 16 tokens x 32 float32: 4 KiB) and text states (2 KiB) are offloaded, its timestep
# embedding (256 B, also read by the output norm outside the blocks) is not.
TINY_THRESHOLD = 1024


def traced_offloads(monkeypatch) -> list[tuple[tuple[int, ...], weakref.ref]]:
    """Every offloaded tensor (shape, a weak reference to the original), as activation_offload.offload sees it."""
    offloaded = []
    offload = activation_offload.offload

    def traced(tensor):
        packed = offload(tensor)
        if packed is not tensor:
            offloaded.append((tuple(tensor.shape), weakref.ref(tensor)))
        return packed

    monkeypatch.setattr(activation_offload, "offload", traced)
    monkeypatch.setattr(activation_offload, "MIN_OFFLOADED_BYTES", TINY_THRESHOLD)
    return offloaded


def test_checkpointed_blocks_keep_their_inputs_in_cpu_memory_and_compute_the_same(monkeypatch):
    """A Flux transformer checkpointed by diffusers: with offloading, each block's image and text states (diffusers
    0.42 hands the single blocks both, as the double ones) are copied out in forward, and after the forward autograd holds none of the originals (the
    device memory a GPU frees); backward gives the same gradients, bit for bit, as without."""
    def gradients(model):
        flux_call(model).square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain = flux_transformer(checkpointing=True).requires_grad_(True)
    expected = gradients(plain)
    offloaded = traced_offloads(monkeypatch)
    model = flux_transformer(checkpointing=False).requires_grad_(True)
    enable_gradient_checkpointing(model, offload_activations=True)
    freeze_long_lived_objects()  # each collection below scans only what the step made
    loss = flux_call(model).square().mean()
    gc.collect()
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    hidden, text = (2, 16, 32), (2, 8, 32)
    assert sorted(shape for shape, _ in offloaded) == sorted([hidden, text] * (double + single))
    assert all(ref() is None for _, ref in offloaded)  # the originals are gone until backward restores copies
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    assert len(blocks_of(model)) == double + single


def test_nothing_is_offloaded_without_gradients_or_below_the_threshold(monkeypatch):
    offloaded = traced_offloads(monkeypatch)
    model = flux_transformer(checkpointing=False).requires_grad_(True)
    enable_gradient_checkpointing(model, offload_activations=True)
    with torch.no_grad():
        flux_call(model)
    assert offloaded == []
    monkeypatch.setattr(activation_offload, "MIN_OFFLOADED_BYTES", 1 << 20)
    flux_call(model).square().mean().backward()
    assert offloaded == []


@pytest.mark.parametrize("selective", [False, True])
def test_a_lora_run_with_offloaded_activations_trains_as_without(selective, tiny_models, shapes_data, tmp_path,
                                                                  monkeypatch):
    """SDXL LoRA with gradient checkpointing (diffusers' every block, or ot_dist's every second block): the same
    losses and LoRA file with activation_offloading as without, and inputs were offloaded."""
    from safetensors.torch import load_file

    offloaded = traced_offloads(monkeypatch)

    def run(offload):
        out = tmp_path / f"run{offload}"
        raw = base_config(tiny_models["sdxl"], shapes_data, out, family="sdxl", method="lora", max_steps=2,
                          batch_size=2, gradient_checkpointing=True, activation_offloading=offload,
                          **({"performance.checkpoint_every_n_blocks": 2} if selective else {}))
        return Trainer(validate(raw), log=quiet).train().losses, load_file(out / "lora.safetensors")

    plain, plain_lora = run(False)
    assert offloaded == []
    losses, lora = run(True)
    assert len(offloaded) >= 2 * 5  # two steps, several blocks each
    assert losses == plain
    for key, value in plain_lora.items():
        assert torch.equal(lora[key], value), key


def test_activation_offloading_needs_gradient_checkpointing(tiny_models, shapes_data, tmp_path):
    with pytest.raises(ConfigError, match="activation_offloading: offloads what gradient checkpointing keeps"):
        validate(base_config(tiny_models["sd1"], shapes_data, tmp_path, activation_offloading=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_activations_lower_the_peak_on_cuda_and_compute_the_same():
    """On a GPU: a checkpointed transformer at a long sequence holds less at its peak with its blocks' inputs in pinned
    CPU memory, and its gradients are the same. Run in the attention kernels the trainer allows Flux: without that the
    recomputed attention's cuDNN backward ended this test with a failed cuBLAS call on an H100 (2026-11-28)."""
    from diffusers import FluxTransformer2DModel
    from ot_dist.config.schema import PerformanceConfig
    from ot_dist.models.families.flux import FlowTransformerFamily
    from ot_dist.train.fast_path import attention_kernel

    device = torch.device("cuda")

    def step(offload):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=8,
                                       attention_head_dim=64, num_attention_heads=8, joint_attention_dim=64,
                                       pooled_projection_dim=64, axes_dims_rope=(16, 24, 24)).to(device).train()
        enable_gradient_checkpointing(model, offload_activations=offload)
        g = torch.Generator(device).manual_seed(1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        def kernels():  # a new context each time: torch's sdpa_kernel is a generator context, entered once only
            return attention_kernel(PerformanceConfig(), device, FlowTransformerFamily.attention_kernels_avoided)

        with kernels(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(hidden_states=torch.randn(4, 4096, 16, generator=g, device=device),
                        encoder_hidden_states=torch.randn(4, 64, 64, generator=g, device=device),
                        pooled_projections=torch.randn(4, 64, generator=g, device=device),
                        timestep=torch.tensor([0.5] * 4, device=device), img_ids=torch.zeros(4096, 3, device=device),
                        txt_ids=torch.zeros(64, 3, device=device), return_dict=False)[0]
        with kernels():  # backward recomputes the checkpointed blocks' attention
            out.float().square().mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, model.proj_out.weight.grad.clone()

    plain_peak, plain_grad = step(False)
    peak, grad = step(True)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-3, atol=1e-5)
    assert peak < plain_peak
