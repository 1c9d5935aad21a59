"""diffusers' attention processor without its division by a rescale factor of 1 (ot_dist/train/lean_attention.py):
the same bits forward and backward, two ops fewer per attention call, diffusers' own processor for anything else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ot_dist.train.lean_attention import LeanAttnProcessor, use_lean_attention

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))
from fast_path_levers import undone  # noqa: E402


class CountDivisions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.divisions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.div:
            self.divisions += 1
        return func(*args, **(kwargs or {}))


def tiny_sdxl(folder, method: str):
    from ot_dist.bench.architectures import BENCH_MODELS
    from ot_dist.bench.setup import BenchOptions, prepare, train_config

    options = BenchOptions(model="tiny-sdxl", method=method, lora_rank=4, resolution=64, batch_size=2, device="cpu",
                           count_flops=False, gradient_checkpointing=method == "full")
    bench = BENCH_MODELS[options.model]
    return prepare(bench, options, train_config(bench, options, str(folder)), torch.device("cpu"))


@pytest.mark.parametrize("method", ["lora", "full"])
def test_training_computes_the_same_bits_with_two_ops_fewer_per_attention_call(tmp_path, method):
    from diffusers.models.attention_processor import Attention

    runs = {}
    for lean in (True, False):
        with undone(None if lean else "lean_attention"):
            run = tiny_sdxl(tmp_path / str(lean), method)
        attentions = [m for m in run.model.denoiser.modules() if isinstance(m, Attention)]
        assert attentions and all(isinstance(m.processor, LeanAttnProcessor) == lean for m in attentions)
        calls = []
        for m in attentions:
            m.register_forward_pre_hook(lambda *_: calls.append(1))
        losses = [run.step() for _ in range(2)]
        with CountDivisions() as counted:
            losses.append(run.step())
        weights = {n: p.detach().clone() for n, p in run.model.denoiser.named_parameters() if p.requires_grad}
        runs[lean] = (losses, weights, counted.divisions, len(calls) // 3)
    (losses, weights, divisions, calls), (plain_losses, plain_weights, plain_divisions, _) = runs[True], runs[False]
    assert torch.equal(torch.stack(losses), torch.stack(plain_losses))
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[n], plain_weights[n]) for n in weights)
    # a division forward and one backward per call (a recomputation's forward calls again: counted in `calls`)
    assert plain_divisions - divisions == 2 * calls - (calls // 2 if method == "full" else 0) > 0


def attention_pair(**options):
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=24, heads=2, dim_head=16, **options)
    return attn, [torch.randn(2, 5, 32), torch.randn(2, 7, 24)]


def test_modules_using_an_option_it_leaves_out_keep_diffusers_processor():
    from diffusers.models.attention_processor import AttnProcessor2_0

    for options in ({"rescale_output_factor": 2.0}, {"residual_connection": True}):
        attn, _ = attention_pair(**options)
        assert use_lean_attention(attn) == 0 and type(attn.processor) is AttnProcessor2_0
    attn, (x, context) = attention_pair()
    assert use_lean_attention(attn) == 1
    # a call with a mask goes to diffusers' processor, as does one with 4-D hidden states
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[:, -2:] = False
    reference, _ = attention_pair()
    assert torch.equal(attn(x, context, attention_mask=mask), reference(x, context, attention_mask=mask))
    assert torch.equal(attn(x, context), reference(x, context))
    attn.rescale_output_factor = 3.0  # changed after the swap: diffusers' processor divides
    reference.rescale_output_factor = 3.0
    assert torch.equal(attn(x, context), reference(x, context))


def test_self_attention_gives_diffusers_output_and_gradients():
    from diffusers.models.attention_processor import Attention

    results = []
    for lean in (True, False):
        torch.manual_seed(0)
        attn = Attention(query_dim=32, heads=2, dim_head=16)
        if lean:
            assert use_lean_attention(attn) == 1
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = attn(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, [p.grad for p in attn.parameters()]))
    (out, grad, grads), (reference, reference_grad, reference_grads) = results
    assert torch.equal(out, reference) and torch.equal(grad, reference_grad)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads))
