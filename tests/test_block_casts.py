"""One cast per block for the trained float32 weights under autocast (ot_dist/methods/block_casts.py: LoRA adapters,
a full finetune's Linear and Conv2d layers): training computes the same bits as the per-layer casts, a cast per
weight each way becomes one per block, and the per-layer casts stay where grouping would be wrong."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ot_dist.methods.block_casts import BlockCasts, block_casts_in
from ot_dist.methods.lora_block_casts import cast_adapters_per_block
from ot_dist.methods.lora_forward import fuse_up_projections


class CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten._foreach_copy_):  # one, or a list at once
            self.casts += 1
        return func(*args, **(kwargs or {}))


def tiny_sdxl(tmp_path, method: str = "lora", checkpointing: bool = False, device: str = "cpu", **performance):
    from ot_dist.bench.architectures import BENCH_MODELS
    from ot_dist.bench.setup import BenchOptions, prepare, train_config

    options = BenchOptions(model="tiny-sdxl", method=method, lora_rank=4, resolution=64, batch_size=2, device=device,
                           gradient_checkpointing=checkpointing or bool(performance), count_flops=False,
                           performance=tuple((k, str(v)) for k, v in performance.items()))
    bench = BENCH_MODELS[options.model]
    return prepare(bench, options, train_config(bench, options, str(tmp_path)), torch.device(device))


def block_casts(module: torch.nn.Module) -> list[BlockCasts]:
    return block_casts_in(module)


def per_layer_casts(module: torch.nn.Module) -> None:
    """Undo the grouping: every layer casts its own weights again."""
    for casts in block_casts(module):
        casts.remove()


def trained_weights(run) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in run.model.denoiser.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("performance", [
    {}, {"checkpointing": True}, {"checkpoint_every_n_blocks": 2},
    pytest.param({"device": "cuda"}, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),  # torch._foreach_copy_'s CUDA kernel
], ids=["plain", "diffusers_checkpointing", "checkpoint_every_2nd_block", "cuda"])
def test_training_with_block_casts_equals_per_layer_casts(tmp_path, performance, method):
    """diffusers' checkpointing recomputes a block's whole call (its hooks too); ot_dist's selective checkpointing
    its forward, which casts again itself. The shared down projections (tests/test_shared_inputs.py) sum in another
    order: left out here, where the same bits are asserted."""
    runs = {}
    for grouped in (True, False):
        run = tiny_sdxl(tmp_path / str(grouped), method, **performance)
        for casts in block_casts(run.model.denoiser):
            casts.sharing = None
        if not grouped:
            per_layer_casts(run.model.denoiser)
        assert bool(block_casts(run.model.denoiser)) == grouped
        # Three steps: lora_B starts at zero, so the down projections' gradients count from the second step on, and
        # a copy outliving an optimizer step would show in the third.
        losses = [run.step() for _ in range(3)]
        runs[grouped] = (losses, trained_weights(run))
    (losses, weights), (plain_losses, plain_weights) = runs[True], runs[False]
    start = trained_weights(tiny_sdxl(tmp_path / "start", method, **performance))
    assert weights.keys() == plain_weights.keys() == start.keys()
    # the test trained (with LoRA, the down projections too: their gradients count from the second step on)
    assert any(not torch.equal(weights[n], start[n]) for n in weights if "lora_A" in n or method == "full")
    if performance.get("device") == "cuda":
        # CUDA's backward kernels may sum in another order from run to run: the updates agree to bfloat16 rounding;
        # a stale copy (B still zero in the forward) would leave the downs' updates 100 % off
        for name in weights:
            update, plain_update = weights[name] - start[name], plain_weights[name] - start[name]
            if plain_update.norm() > 0:
                assert float((update - plain_update).norm() / plain_update.norm()) < 2e-2, name
        return
    assert torch.equal(torch.stack(losses), torch.stack(plain_losses))
    assert all(torch.equal(weights[n], plain_weights[n]) for n in weights)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_block_casts_replace_two_casts_per_weight_with_two_per_block(tmp_path, method):
    counts = {}
    for grouped in (True, False):
        run = tiny_sdxl(tmp_path / str(grouped), method)
        groups = block_casts(run.model.denoiser)
        grouped_weights = sum(len(ws) for g in groups for ws in g.weights())
        if not grouped:
            per_layer_casts(run.model.denoiser)
        run.step()
        with CountCasts() as counted:
            run.step()
        counts[grouped] = counted.casts
    assert len(groups) >= 4 and grouped_weights >= 8 * len(groups)
    # per weight: cast down in forward and its gradient cast back; per block: one list each way
    assert counts[False] - counts[True] == 2 * grouped_weights - 2 * len(groups)


def adapted_block(layers: int = 3) -> tuple[torch.nn.Module, BlockCasts]:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    block = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
    inject_adapter_in_model(LoraConfig(r=4, target_modules=[str(i) for i in range(layers)], init_lora_weights=False),
                            block, adapter_name="default")
    root = torch.nn.Sequential(block)
    assert cast_adapters_per_block(root, [block], fuse_up_projections(root, "default"), "default") == 1
    return root, block[0]._block_casts


def copies_seen(root: torch.nn.Module, casts: BlockCasts, autocast: bool = True) -> list:
    seen = []
    layer = casts.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(casts.copies_of(module)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        root(torch.randn(2, 16))
    handle.remove()
    return seen


def test_copies_exist_only_while_their_block_runs():
    root, casts = adapted_block()
    (seen,) = copies_seen(root, casts)
    assert seen is not None and seen[0].dtype == torch.bfloat16
    assert torch.equal(seen[0], casts.layers[0].lora_A["default"].weight.to(torch.bfloat16))
    assert casts.copies is None  # after the forward

    def fail(module, args):
        raise RuntimeError("inside the block")

    handle = casts.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=torch.bfloat16):
        root(torch.randn(2, 16))
    handle.remove()
    assert casts.copies is None  # cleared even when the forward raised


def test_per_layer_casts_where_grouping_would_be_wrong():
    root, casts = adapted_block()
    assert copies_seen(root, casts, autocast=False) == [None]  # no autocast: nothing is cast
    handle = casts.layers[2].lora_A["default"].register_forward_pre_hook(lambda *args: None)
    assert copies_seen(root, casts) == [None]  # a hook on an adapter (ZeRO-3 gathers partitioned weights in one)
    handle.remove()
    assert copies_seen(root, casts)[0] is not None


@pytest.mark.parametrize("method", ["lora", "full"])
def test_fsdp2_keeps_per_layer_casts_and_its_gradients(tmp_path, one_rank_group, method):
    """FSDP2 reduce-scatters a unit's gradients when backward leaves the unit: the per-layer casts stay, and the
    sharded LoRA's gradients equal the unsharded one's (a 1-rank gloo group in this process)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    run = tiny_sdxl(tmp_path, method)
    plain = run.model.denoiser
    with torch.no_grad():  # lora_B starts at zero: the down projections would get no gradient
        for name, param in plain.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    sharded = copy.deepcopy(plain)
    groups = block_casts(sharded)
    mesh = init_device_mesh("cpu", (1,))
    from ot_dist.parallel.fsdp import wrap_units

    for unit in wrap_units(sharded, run.model.family.shard_units["unet"]):
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    grads = []
    for denoiser in (plain, sharded):
        run.model.pipeline.unet = denoiser
        with CountCasts() as counted:
            run.backward(run.loss())
        named = {n: p.grad for n, p in denoiser.named_parameters() if p.grad is not None}
        grads.append(({n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in named.items()},
                      counted.casts))
    (plain_grads, plain_casts), (sharded_grads, sharded_casts) = grads
    grouped_weights = sum(len(ws) for g in groups for ws in g.weights())
    assert sharded_casts - plain_casts == 2 * grouped_weights - 2 * len(groups)
    assert plain_grads.keys() == sharded_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        # bfloat16 compute: FSDP2 sums the same terms in another order; a lost gradient would be off by 100 %
        if grad.norm() > 0:  # (a full finetune's unused parameters: SDXL's unused embeddings get none)
            assert float((sharded_grads[name] - grad).norm() / grad.norm()) < 2e-2, name


def test_a_deep_copy_casts_its_own_weights(tmp_path):
    """The sampler deep-copies the trained modules: the copy's blocks hook their own layers' weights, and undoing
    the copy's grouping leaves the original's."""
    import copy

    root, casts = adapted_block()
    twin = copy.deepcopy(root)
    (twin_casts,) = block_casts(twin)
    assert twin_casts is not casts and twin_casts.layers[0] is twin[0][0]
    with torch.no_grad():
        twin[0][0].lora_A["default"].weight.add_(1.0)
    (seen,) = copies_seen(twin, twin_casts)
    assert torch.equal(seen[0], twin[0][0].lora_A["default"].weight.to(torch.bfloat16))
    twin_casts.remove()
    assert copies_seen(twin, twin_casts) == [None] and block_casts(twin) == []
    assert copies_seen(root, casts)[0] is not None


def test_a_layer_its_block_skips_keeps_no_gradient_under_ddp(one_rank_group):
    """Every grouped weight is in the graph once its block runs, also a layer the block did not call (an MoE expert no
    token chose). DDP's unused-parameter search then counts it as used; its reducer must still finish the step and
    leave it without a gradient, as the per-layer casts would (a 1-rank gloo group in this process)."""

    from ot_dist.methods.weight_block_casts import cast_weights_per_block
    from ot_dist.parallel.ddp import Replica

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            return self.experts[0](x) + self.experts[2](x)  # expert 1: not chosen

    torch.manual_seed(0)
    root = torch.nn.Sequential(Routed())
    assert cast_weights_per_block(root, [root[0]]) == 1
    Replica(root, None)
    for _ in range(3):  # a reduction left unfinished fails the next step's forward
        with CountCasts() as counted, torch.autocast("cpu", dtype=torch.bfloat16):
            out = root(torch.randn(4, 8))
        out.float().sum().backward()
        experts = root[0].experts
        # the block's one list cast, and autocast's casts of the float32 input for each expert called
        assert counted.casts == 1 + 2
        assert experts[0].weight.grad is not None and experts[2].weight.grad is not None
        assert experts[1].weight.grad is None and experts[1].bias.grad is None
        root.zero_grad(set_to_none=True)
