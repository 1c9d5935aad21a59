"""The GPU fast path, checked on CPU by proxies that fail when it is lost (issue 21)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from forked_ranks import run_ranks
from conftest import base_config

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def two_ranks(tiny_models, shapes_data, tmp_path_factory):
    """One 2-rank gloo launch; what its ranks observed (tests/helpers/fastpath_ranks.py)."""
    root = tmp_path_factory.mktemp("fastpath")
    ddp = base_config(tiny_models["sd1"], shapes_data, root / "ddp", method="full", strategy="ddp", batch_size=1,
                      gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-5, **{"text_encoder.train": True})
    case = {"ddp_config": ddp, "result": str(root / "result.json")}
    (root / "case.json").write_text(json.dumps(case))
    done = run_ranks(str(REPO / "tests" / "helpers" / "fastpath_ranks.py"),
                           str(root / "case.json"), env=ENV, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads((root / "result.json").read_text())


def test_ddp_all_reduce_overlaps_backward(two_ranks):
    """Under ddp the first gradient all-reduce is issued while backward is still computing gradients, and
    micro steps inside an accumulation issue none."""
    micro_steps = two_ranks["ddp_events"]
    assert len(micro_steps) == 4  # 2 optimizer steps x accumulation 2
    for i, events in enumerate(micro_steps):
        last_grad = len(events) - 1 - events[::-1].index("grad")
        if i % 2 == 0:
            assert "allreduce" not in events, f"micro step {i} (not the last of its accumulation) reduced gradients"
            continue
        assert events.count("allreduce") >= 2, events
        first_reduce = events.index("allreduce")
        assert first_reduce < last_grad, (
            f"micro step {i}: the first all-reduce came after the last gradient (no overlap with backward): "
            f"{events.count('grad')} gradients, then {events.count('allreduce')} all-reduces")


def test_zero2_config_overlaps_communication_on_gpu_in_explicit_buckets(family_models, shapes_data, tmp_path):
    from ot_dist.config.load import validate
    from ot_dist.parallel.deepspeed import deepspeed_config

    def zero(stage: int, device: str, **overrides) -> dict:
        raw = base_config(family_models["sd1"], shapes_data, tmp_path, strategy=f"zero{stage}", **overrides)
        return deepspeed_config(validate(raw), stage, 2, device)["zero_optimization"]

    for stage in (1, 2):
        gpu = zero(stage, "cuda")
        assert gpu["overlap_comm"] is True, gpu
        assert gpu["reduce_bucket_size"] == gpu["allgather_bucket_size"] == 200_000_000
        assert gpu["contiguous_gradients"] and gpu["reduce_scatter"]
        assert zero(stage, "cpu")["overlap_comm"] is False  # no side stream on the CPU accelerator
    chosen = zero(2, "cpu", **{"deepspeed.overlap_comm": True, "deepspeed.reduce_bucket_size": 50_000_000})
    assert chosen["overlap_comm"] is True and chosen["reduce_bucket_size"] == 50_000_000
    # ZeRO-3 overlaps by default and its own bucket choices stay; a parameter is released when its module is done
    assert zero(3, "cuda") == {"stage": 3, "stage3_max_reuse_distance": 0}
    # the engine is called at every micro step, where DeepSpeed's throughput timer would synchronize the device
    raw = base_config(family_models["sd1"], shapes_data, tmp_path, strategy="zero3")
    assert deepspeed_config(validate(raw), 3, 2, "cuda")["timers"] == {"throughput": {"enabled": False}}


def test_zero3_engine_build_formats_no_parameter_values(monkeypatch):
    """ZeRO-3's optimizer formats its constructor's locals() into a debug line it discards, the {parameter: name} map
    among them: on a GPU every parameter's values would be read to the host to be formatted. While the engine is
    built a parameter prints as its shape and dtype; afterwards torch's own repr is back."""
    import torch._tensor_str

    from ot_dist.parallel.deepspeed import parameters_shown_by_shape

    formatted = []
    original_str = torch._tensor_str._str
    monkeypatch.setattr(torch._tensor_str, "_str", lambda *a, **k: formatted.append(1) or original_str(*a, **k))
    names = {torch.nn.Parameter(torch.ones(3, 2)): "w", torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)): "b"}
    with parameters_shown_by_shape():
        line = f"stage3 locals: {locals()}"
    assert formatted == [], "a parameter's values were formatted"
    assert "Parameter(shape=(3, 2), dtype=torch.float32)" in line and "dtype=torch.bfloat16" in line
    assert "1., 1." in repr(next(iter(names)))  # torch's repr is restored
    assert formatted


def test_cuda_runs_initialise_nccl_and_gloo(monkeypatch):
    """On CUDA the process group carries both backends: CPU tensors (a CPU EMA, offloaded shards) go over gloo."""
    import torch
    import torch.distributed as dist

    from ot_dist.parallel import runtime

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    started = runtime.start_runtime(1)
    assert started.device == torch.device("cuda", 1)
    assert calls[0]["backend"] == "cpu:gloo,cuda:nccl" and calls[0]["device_id"] == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runtime.start_runtime(1)
    assert calls[1]["backend"] == "gloo"


def test_cpu_tensor_collectives_over_the_cpu_backend_of_a_cuda_group(two_ranks):
    """The sharded EMA's gather of CPU tensors, over a group made with the CPU backend a CUDA run names."""
    got = two_ranks["cpu_collectives"]
    assert "error" not in got, got["error"] if "error" in got else ""
    assert got["backend"] == "cpu:gloo"
    assert got["gathered"] == got["expected"]


def test_fused_adamw_on_cuda_foreach_elsewhere():
    """torch's fused kernel when every parameter is a floating CUDA tensor (fake CUDA tensors here: the choice and
    the optimizer's construction run without a GPU), foreach otherwise or when asked with fused: false."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ot_dist.config.load import validate
    from ot_dist.methods.base import ParamGroup
    from ot_dist.optim.factory import build_optimizer

    def kernel(name: str, params, **options) -> tuple:
        config = validate({"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o", "data": {"path": "d"},
                           "optimizer": {"name": name, **options}}).optimizer
        group = build_optimizer(config, [ParamGroup("unet", params, 1e-4)]).param_groups[0]
        return group["fused"], group["foreach"]

    with FakeTensorMode():
        cuda32 = torch.nn.Parameter(torch.zeros(4, 4, device="cuda"))
        cuda16 = torch.nn.Parameter(torch.zeros(4, device="cuda", dtype=torch.bfloat16))
        cpu = torch.nn.Parameter(torch.zeros(4))
        assert kernel("ADAMW", [cuda32, cuda16]) == (True, False)
        assert kernel("ADAM", [cuda32]) == (True, False)
        assert kernel("SGD", [cuda32]) == (True, False)
        assert kernel("ADAMW", [cuda32, cpu]) == (None, True)  # one CPU tensor: no fused launch for all
        assert kernel("ADAMW", [cpu]) == (None, True)
        assert kernel("ADAMW", [cuda32], fused=False) == (False, True)
        assert kernel("ADAGRAD", [cuda32]) == (None, True)  # torch's fused Adagrad is CPU only


def test_fused_kernel_on_sharded_parameters_only_where_dtensor_has_its_rule(one_rank_group):
    """FSDP2's sharded parameters (DTensors, here in a 1-rank gloo group): AdamW / Adam take the fused kernel on any
    device (a foreach op over DTensors costs seconds of sharding propagation at the first step), SGD keeps foreach
    (DTensor has no rule for fused SGD: its first step would raise). Each optimizer takes a real step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ot_dist.config.load import validate
    from ot_dist.methods.base import ParamGroup
    from ot_dist.optim.factory import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    chosen = {}
    for name in ("ADAMW", "ADAM", "SGD"):
        config = validate({"model": {"family": "sd1", "path": "m"}, "method": "full", "output_dir": "o",
                           "data": {"path": "d"}, "optimizer": {"name": name}}).optimizer
        optimizer = build_optimizer(config, [ParamGroup("unet", list(model.parameters()), 1e-2)])
        before = [p.full_tensor().clone() for p in model.parameters()]
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
        group = optimizer.param_groups[0]
        chosen[name] = group["fused"], group["foreach"]
    assert chosen == {"ADAMW": (True, False), "ADAM": (True, False), "SGD": (None, True)}


@pytest.mark.parametrize("name,family,part", [("SDXL", "sdxl", "unet"),
                                              ("Flux.1 dev", "flux", "transformer")])
def test_every_sharding_unit_of_the_real_denoisers_is_a_few_percent(name, family, part):
    """The published SDXL / SD 1.5 UNet and Flux-dev transformer on the meta device, wrapped with the family's
    shard_units as the fsdp strategy does: no all-gather (unit, or the root's remainder) is over 5 % of the model.
    (Whole down_blocks / up_blocks made SDXL's up_blocks[0] 47 % of the UNet in one gather.)"""
    from ot_dist.memory.sharding import sharding
    from ot_dist.memory.table import build_components
    from ot_dist.models.families.registry import get_family

    denoiser = build_components(name)[part]
    units = sharding(denoiser, get_family(family).shard_units[part])  # raises if units overlap
    assert units.parameters == sum(units.unit_parameters) + units.root_parameters
    assert units.largest_fraction <= 0.05, (
        f"{name}: largest unit {units.largest_fraction:.1%} of {units.parameters / 1e9:.2f} B parameters")


def test_fsdp_prefetches_the_next_unit_in_execution_order(family_models, one_rank_group):
    """Each FSDP unit of the tiny SD UNet prefetches the unit that runs after it (recorded on the first forward:
    a UNet registers attentions before the resnets they follow), in a 1-rank gloo group."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ot_dist.models.families.registry import get_family
    from ot_dist.parallel.fsdp import prefetch_in_execution_order, wrap_units

    unet = UNet2DConditionModel.from_pretrained(family_models["sd1"] / "unet")
    units = wrap_units(unet, get_family("sd1").shard_units["unet"])
    mesh = init_device_mesh("cpu", (1,))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(unet, mesh=mesh)
    prefetch_in_execution_order(unet, units)
    ran = []
    for u in units:
        u.register_forward_pre_hook(lambda m, *_: ran.append(m))
    config = unet.config
    sample = torch.randn(1, config.in_channels, 8, 8)
    text = torch.randn(1, 4, config.cross_attention_dim)
    unet(sample, 10, text).sample.sum().backward()
    assert [id(m) for m in ran] != [id(m) for m in units], "the tiny UNet must run units out of registration order"
    for unit, following in zip(ran, ran[1:]):
        assert [s._modules for s in unit._get_fsdp_state()._states_to_forward_prefetch] == [(following,)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device")])])
def test_the_weights_kept_for_zeros_engine_masters_are_in_cpu_memory(device):
    """DeepSpeed's bf16 / fp16 engine casts the weights; the float32 ones as loaded are kept for its masters
    (masters_from_loaded_weights) in CPU memory, not beside the cast copies on the GPU; CPU weights are not copied."""
    import torch

    from ot_dist.parallel.deepspeed import loaded_for_masters

    weights = {"unet.w": torch.nn.Parameter(torch.randn(4, 4, device=device))}
    kept = loaded_for_masters(weights)
    assert kept["unet.w"].device.type == "cpu" and torch.equal(kept["unet.w"], weights["unet.w"].detach().cpu())
    assert (kept["unet.w"].data_ptr() == weights["unet.w"].data_ptr()) == (device == "cpu")
