"""LoRA layers of a block that take the same input (q / k / v) share one down projection (ot_dist/methods/
shared_inputs.py): the groups are learned from a forward, the step computes what the per-layer projections compute
(to bf16 rounding) with fewer matmuls, and a recomputation in backward always replays its forward's layout."""

from __future__ import annotations


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ot_dist.methods.block_casts import casts_of
from ot_dist.methods.lora_block_casts import cast_adapters_per_block, share_down_projections
from ot_dist.methods.lora_forward import fuse_up_projections
from ot_dist.train.fast_path import checkpoint_forward

WIDTH = 32


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


class Attention(torch.nn.Module):
    """q / k / v of the hidden states, k / v of a context (cross-attention), an output layer called twice."""

    def __init__(self):
        super().__init__()
        for name in ("to_q", "to_k", "to_v", "ctx_k", "ctx_v", "to_out"):
            setattr(self, name, torch.nn.Linear(WIDTH, WIDTH))
        self.k_input = None  # set: to_k reads this tensor instead of the hidden states (another code path)

    def forward(self, x, context):
        q, k, v = self.to_q(x), self.to_k(x if self.k_input is None else self.k_input), self.to_v(x)
        ck, cv = self.ctx_k(context), self.ctx_v(context)
        mixed = (q * k).softmax(-1) * v + ck.mean(1, keepdim=True) * cv.mean(1, keepdim=True)
        return self.to_out(self.to_out(mixed))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()

    def forward(self, x, context):
        return x + self.attn(self.norm(x), context)


class CheckpointedCall(torch.nn.Module):
    """Calls its block inside a checkpoint, hooks included, as diffusers' gradient checkpointing calls its blocks."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def adapted(share: bool = True) -> tuple[torch.nn.Module, Block]:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    root = torch.nn.Sequential(Block())
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "ctx_k", "ctx_v",
                                                                          "to_out"], init_lora_weights=False),
                            root, adapter_name="default")
    for name, p in root.named_parameters():
        p.requires_grad_("lora_" in name)  # a LoRA's base is frozen
    assert cast_adapters_per_block(root, [root[0]], fuse_up_projections(root, "default"), "default") == 1
    if share:
        assert share_down_projections(root) == 1
    return root, root[0]


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, WIDTH, generator=generator).requires_grad_()
    return x, torch.randn(2, 5, WIDTH, generator=generator)  # the context needs no gradient (a frozen encoder's)


def step(root, x, context, forwards: int = 1):
    """Forward(s) under bf16 autocast, one backward; the output and every gradient (the input's included)."""
    for p in root.parameters():
        p.grad = None
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = [root[0](x, context) for _ in range(forwards)]
    sum(o.float().square().mean() for o in outputs).backward()
    grads = {n.replace(".block.", "."): p.grad.clone() for n, p in root.named_parameters() if p.grad is not None}
    return outputs[0].detach(), {**grads, "input": x.grad.clone()}


def group_names(root, block) -> set[tuple[str, ...]]:
    casts = casts_of(block)
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in root.named_modules()}
    return {tuple(names[id(casts.layers[i])] for i in members) for members in casts.sharing.groups}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_layers_taking_the_same_input_share_one_down_projection():
    shared, block = adapted()
    plain, _ = adapted(share=False)
    x, context = inputs()
    step(shared, x, context)  # the first forward records who reads what
    step(plain, x, context)
    # q / k / v read the normed hidden states, the context's k / v the context; to_out reads two tensors: alone
    assert group_names(shared, block) == {("to_q", "to_k", "to_v"), ("ctx_k", "ctx_v")}
    counts = {}
    for name, root in (("shared", shared), ("plain", plain)):
        with CountMatmuls() as counted:
            counts[name] = (step(root, x, context), counted.matmuls)
    (out, grads), (plain_out, plain_grads) = counts["shared"][0], counts["plain"][0]
    # per group of n: n - 1 fewer down projections, weight gradients and (where the input needs one) input gradients
    assert counts["plain"][1] - counts["shared"][1] == 2 * 3 + 1 * 2
    assert grads.keys() == plain_grads.keys() and len(grads) == 13  # 6 layers' A and B, and the input
    # the same sums in another order (the input's gradient: one matmul over 3 ranks instead of three added): a bf16
    # rounding apart; a part given to the wrong layer or a lost gradient is 100 % off
    assert relative(out, plain_out) < 1e-2
    for name in grads:
        assert relative(grads[name], plain_grads[name]) < 2e-2, name


@pytest.mark.parametrize("where", ["block_forward", "block_call", "inner_module"])
def test_a_recomputation_replays_its_forwards_layout(where):
    """Checkpointing the block's forward (performance.checkpoint_every_n_blocks), its whole call with hooks (diffusers'
    checkpointing) or a module inside it (checkpoint_only_attention): while the groups are learned, two forwards
    await one backward, then the step shares; each recomputation saves what its forward saved (torch checks) and
    gives the very gradients of the run without checkpointing."""
    runs = {}
    for checkpointed in (True, False):
        root, block = adapted()
        if checkpointed and where == "block_forward":
            checkpoint_forward(block)
        elif checkpointed and where == "inner_module":
            checkpoint_forward(block.attn)
        elif checkpointed:
            root[0] = CheckpointedCall(block)
        x, context = inputs()
        results = [step(root, x, context, forwards=2), step(root, x, context), step(root, x, context)]
        assert group_names(root, block) == {("to_q", "to_k", "to_v"), ("ctx_k", "ctx_v")}
        runs[checkpointed] = results
    for (out, grads), (plain_out, plain_grads) in zip(runs[True], runs[False]):
        assert torch.equal(out, plain_out)
        assert grads.keys() == plain_grads.keys()
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_a_forward_without_gradients_learns_at_once():
    root, block = adapted()
    x, context = inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x, context)
    assert group_names(root, block) == {("to_q", "to_k", "to_v"), ("ctx_k", "ctx_v")}


def test_layers_that_no_longer_share_their_input_compute_their_own():
    shared, block = adapted()
    plain, plain_block = adapted(share=False)
    x, context = inputs()
    step(shared, x, context)
    assert ("to_q", "to_k", "to_v") in group_names(shared, block)
    other = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(7))
    block.attn.k_input = plain_block.attn.k_input = other  # to_k reads another tensor from now on
    out, grads = step(shared, x, context)
    plain_out, plain_grads = step(plain, x, context)
    assert relative(out, plain_out) < 1e-2
    for name in grads:
        assert relative(grads[name], plain_grads[name]) < 2e-2, name


def test_sdxl_lora_trains_as_with_per_layer_projections(tmp_path):
    """The tiny SDXL's transformer blocks: attn1's q / k / v and attn2's k / v (the text's) share; the gradients after
    the shared step are as far from the per-layer ones as bf16 rounding puts them: within twice the per-layer ones'
    distance from float32 (on an AVX2 CPU the two are about as far apart as each is from float32: 2.8 % and 2.8 %)."""
    from ot_dist.bench.architectures import BENCH_MODELS
    from ot_dist.bench.setup import BenchOptions, prepare, train_config
    from test_block_casts import block_casts

    def tiny_sdxl(folder, dtype: str):
        options = BenchOptions(model="tiny-sdxl", lora_rank=4, resolution=64, batch_size=2, dtype=dtype, device="cpu",
                               count_flops=False)
        bench = BENCH_MODELS[options.model]
        return prepare(bench, options, train_config(bench, options, str(folder)), torch.device("cpu"))

    def gradients(run):
        generator = torch.Generator().manual_seed(0)
        for name, p in run.model.denoiser.named_parameters():
            if "lora_B" in name:  # non-zero, so the down projections get gradients
                p.data = torch.randn(p.shape, generator=generator) * 0.1
        for _ in range(2):  # the first forward records who reads what
            for p in run.params:
                p.grad = None
            run.backward(run.loss())
        return {n: p.grad.clone() for n, p in run.model.denoiser.named_parameters() if p.grad is not None}

    runs = {}
    for label, dtype in (("shared", "bf16"), ("plain", "bf16"), ("float32", "fp32")):
        run = tiny_sdxl(tmp_path / label, dtype)
        if label == "plain":
            for casts in block_casts(run.model.denoiser):
                casts.sharing = None
        runs[label] = gradients(run)
        if label == "shared":
            names = {id(m): n for n, m in run.model.denoiser.named_modules()}
            grouped = {tuple(names[id(c.layers[i])].rsplit(".", 2)[-2] + "." + names[id(c.layers[i])].rsplit(".", 1)[-1]
                             for i in members) for c in block_casts(run.model.denoiser) for members in c.sharing.groups}
            assert grouped == {("attn1.to_q", "attn1.to_k", "attn1.to_v"), ("attn2.to_k", "attn2.to_v")}
    shared, plain, exact = runs["shared"], runs["plain"], runs["float32"]
    assert shared.keys() == plain.keys() == exact.keys()
    downs = [n for n in shared if "lora_A" in n and ("attn1.to_" in n or "attn2.to_k" in n or "attn2.to_v" in n)]
    assert downs
    for name in downs:  # a wrong slice of the shared projection would be ~100 % off
        assert relative(shared[name], plain[name]) < 2 * max(relative(plain[name], exact[name]), 1e-3), name
