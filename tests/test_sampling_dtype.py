"""What a sample point holds: the gathered copies of the weights autocast computes in 16 bits (Linear and Conv layers,
a LoRA's base layers) are cast to that dtype as they arrive (ot_dist/train/sampling.py `low_precision_keys`,
`arrival_cast`), about half the float32 copy's bytes, and the samples are the same bit for bit: autocast computes
those layers from 16-bit casts of their weights anyway, and the inference copy reports the `.dtype` it did, so the
pipelines make their latents and embeddings as before. A single process's copy without the EMA is the training
weights themselves and stays so; with train_dtype float32 nothing is cast."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks

from ot_dist.config.load import validate
from ot_dist.train import sampling
from ot_dist.train.sampling import AUTOCAST_LAYERS, arrival_cast, low_precision_keys, meta_structure
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RED = {"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}
BLUE = {"prompt": "a blue square on a green background", "seed": 7, "steps": 2, "width": 64, "height": 48}
HALF = 0.55  # of the float32 bytes, at most, for a cast copy: a few tensors (norms, the first parameter) stay float32


def quiet(*_):
    pass


def layer_and_input(cls: type) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if cls is torch.nn.Linear:
        return cls(24, 40), torch.randn(6, 24)
    dims = int(cls.__name__[-2])  # Conv1d ... ConvTranspose3d
    return cls(8, 12, 3, padding=1), torch.randn(2, 8, *[7] * dims)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", AUTOCAST_LAYERS, ids=lambda cls: cls.__name__)
def test_autocast_computes_a_16_bit_weight_as_the_float32_weight_it_casts(cls, dtype):
    """What the cast rests on: under CPU autocast each layer whose weight sampling casts (AUTOCAST_LAYERS) computes in
    the autocast dtype from a cast of its weight, so a weight held in that dtype gives the same bits (the bias stays
    float32 in both). A layer added to the list whose op autocast does not cast (or casts otherwise) fails here."""
    layer, x = layer_and_input(cls)
    cast = meta_structure(layer)
    cast.load_state_dict({"weight": layer.weight.to(dtype), "bias": layer.bias}, assign=True)
    assert cast.weight.dtype == dtype
    with torch.autocast("cpu", dtype=dtype):
        expected, got = layer(x), cast(x)
    assert expected.dtype == got.dtype == dtype
    assert torch.equal(got, expected)


def test_under_zero3s_linear_the_bias_must_stay_float32(monkeypatch):
    """DeepSpeed ZeRO-3 replaces torch.nn.functional.linear while its engine lives (samples run with it): its product
    is an autocast op, but it adds the bias after, outside autocast, in float32 when the bias is float32. So sampling
    casts weights only: a cast weight gives the same bits there too, a cast bias does not (the test that fails when
    biases are cast: flux under zero3 in test_two_ranks_sample_the_same_pngs_from_half_the_bytes)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    layer = torch.nn.Linear(64, 64)
    x = torch.randn(2, 5, 64)  # 3-D: the matmul and the separate bias add, not addmm
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
        weight_cast = torch.nn.functional.linear(x, layer.weight.to(torch.bfloat16), layer.bias)
        both_cast = torch.nn.functional.linear(x, layer.weight.to(torch.bfloat16), layer.bias.to(torch.bfloat16))
    assert torch.equal(weight_cast, expected)
    assert not torch.equal(both_cast, expected)


def test_the_cast_entries_are_weights_autocast_computes_in_16_bits():
    """An SD 1.x UNet: every Linear / Conv weight but the first parameter (`.dtype` reads it), no norm, and a bias
    only where the layer's block casts its weights together (a full finetune's, methods/weight_block_casts.py: the
    block casts biases too); a LoRA's base layers but not its adapters, nothing inside a DoRA layer; nothing without
    a 16-bit autocast."""
    from peft import LoraConfig, inject_adapter_in_model

    from ot_dist.methods.weight_block_casts import cast_weights_per_block
    from ot_dist.models.families.registry import get_family
    from ot_dist.models.tiny import build_tiny_pipeline
    from ot_dist.parallel.fsdp import family_units

    unet = build_tiny_pipeline("sd1").unet
    template = meta_structure(unet)
    keys = low_precision_keys(template)
    layers = {name: m for name, m in template.named_modules() if type(m) in AUTOCAST_LAYERS}
    assert keys == {f"{name}.weight" for name in layers} - {"conv_in.weight"}
    assert next(iter(template.state_dict())) == "conv_in.weight"
    assert not any("norm" in key for key in keys)

    assert cast_weights_per_block(unet, family_units(get_family("sd1"), "unet", unet))
    blocks = meta_structure(unet)
    in_blocks = {name for name, m in blocks.named_modules() if "_block_casts" in vars(m)}
    assert in_blocks and in_blocks < set(layers)
    assert low_precision_keys(blocks) == keys | {f"{name}.bias" for name in in_blocks if layers[name].bias is not None}

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.norm = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    plain, dora = Two(), Two()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["a", "b"]), plain)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["b"], use_dora=True), dora)
    assert low_precision_keys(meta_structure(plain)) == {"a.base_layer.weight", "b.base_layer.weight"}
    assert low_precision_keys(meta_structure(dora)) == {"a.weight"}

    assert arrival_cast(keys, None) is None and arrival_cast(keys, torch.float32) is None
    convert = arrival_cast(keys, torch.bfloat16)
    weight = torch.ones(2)
    assert convert("conv_out.weight", weight).dtype == torch.bfloat16
    assert convert("conv_in.weight", weight) is weight and convert("conv_norm_out.weight", weight) is weight


def test_fsdp_converts_only_tensors_gathered_into_storage_of_their_own(one_rank_group, monkeypatch):
    """FSDPStrategy.state_dict_of's `convert` is for copies: over a shard group of one rank a full tensor is the local
    shard, the parameter itself, and stays so (a converted copy would add memory beside it); a full tensor gathered
    into storage of its own (every rank of a larger group) is converted as it arrives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ot_dist.parallel.fsdp import FSDPStrategy

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    converted = []

    def convert(key, tensor):
        converted.append(key)
        return tensor.to(torch.bfloat16)

    state = FSDPStrategy.state_dict_of(None, module, host=False, convert=convert)
    assert converted == [] and all(v.dtype == torch.float32 for v in state.values())
    assert [v.data_ptr() for v in state.values()] == [p.to_local().data_ptr() for p in module.parameters()]

    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self: full_tensor(self).clone())  # as a gather of 2+ ranks
    state = FSDPStrategy.state_dict_of(None, module, host=False, convert=convert)
    assert converted == list(state) and all(v.dtype == torch.bfloat16 for v in state.values())


def measured_copies(monkeypatch) -> list[dict]:
    """The inference copies `Sampler.sample` builds from now on: their parameters' bytes, what those would be in
    float32, whether they are the training weights' own storage, their `.dtype`."""
    copies = []
    original = sampling.inference_copy

    def measured(template, state, device, *stored_from):
        module = original(template, state, device, *stored_from)
        params = list(module.parameters())
        copies.append({"bytes": sum(p.numel() * p.element_size() for p in params),
                       "float32_bytes": sum(p.numel() * 4 for p in params if p.is_floating_point()),
                       "storage": [p.data_ptr() for p in params], "dtype": module.dtype})
        return module

    monkeypatch.setattr(sampling, "inference_copy", measured)
    return copies


@pytest.mark.parametrize("family", ["sd1", "flux"])
def test_one_process_casts_the_ema_copy_and_keeps_the_trained_weights_shared(family, family_models, shapes_data,
                                                                             tmp_path, monkeypatch):
    """bfloat16, one process, EMA and non-EMA samples: the EMA's copy is gathered (a fresh tensor each) and cast, at
    most HALF of its float32 bytes; the trained weights' copy is the denoiser's own parameters, not a copy (casting
    them would add memory). The images are those of the same weights kept as gathered, byte for byte."""
    raw = base_config(family_models[family], shapes_data, tmp_path / "run", family=family, batch_size=2,
                      max_steps=1, train_dtype="bfloat16", **{
                          "ema.enabled": True, "ema.update_step_interval": 1, "sampling.prompts": [RED, BLUE],
                          "sampling.non_ema_samples": True})
    copies = measured_copies(monkeypatch)
    trainer = Trainer(validate(raw), log=quiet)
    trainer.train()
    ema, trained = copies
    assert ema["bytes"] <= HALF * ema["float32_bytes"]
    denoiser = trainer.model.denoiser
    assert trained["storage"] == [p.data_ptr() for p in denoiser.parameters()]
    assert trained["bytes"] == sum(p.numel() * p.element_size() for p in denoiser.parameters())
    assert ema["dtype"] == trained["dtype"] == torch.float32

    cast = sorted((tmp_path / "run" / "samples" / "step-1").iterdir())
    monkeypatch.setattr(trainer.sampler, "output_dir", tmp_path / "plain")
    monkeypatch.setattr(sampling, "arrival_cast", lambda keys, dtype: None)
    plain = sorted(trainer.sampler.sample(trainer, 1))
    assert copies[2]["bytes"] == copies[2]["float32_bytes"]  # the same EMA, as gathered
    assert [p.name for p in plain] == [p.name for p in cast] and len(plain) == 4
    assert [p.read_bytes() for p in plain] == [p.read_bytes() for p in cast]


def test_float32_samples_hold_the_weights_as_gathered(tiny_models, shapes_data, tmp_path, monkeypatch):
    """train_dtype float32: no autocast, nothing cast: the EMA's copy holds its float32 bytes."""
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, batch_size=2, max_steps=1, **{
        "ema.enabled": True, "ema.update_step_interval": 1, "sampling.prompts": [RED]})
    copies = measured_copies(monkeypatch)
    Trainer(validate(raw), log=quiet).train()
    (ema,) = copies
    assert ema["bytes"] == ema["float32_bytes"]


@pytest.mark.parametrize("family,strategy", [("sd1", "fsdp"), ("sd1", "zero3"), ("flux", "fsdp"), ("flux", "zero3")])
def test_two_ranks_sample_the_same_pngs_from_half_the_bytes(family, strategy, small_sd1, family_models, shapes_data,
                                                            tmp_path):
    """bfloat16 under fsdp and zero3, 2 ranks, one prompt each: every gathered copy (the EMA's and the trained
    weights') holds at most HALF of its float32 bytes and reports the `.dtype` it did as gathered; the PNGs are
    byte for byte those of the same step sampled again with the weights kept as gathered (float32, all the bytes)."""
    model = small_sd1 if family == "sd1" else family_models[family]
    out = tmp_path / "out"
    raw = base_config(model, shapes_data, out, family=family, batch_size=2, max_steps=1, strategy=strategy,
                      train_dtype="bfloat16", **{
                          "ema.enabled": True, "ema.update_step_interval": 1, "sampling.non_ema_samples": True,
                          "sampling.prompts": [RED, BLUE]})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_ranks(str(REPO / "tests" / "helpers" / "sample_dtype_ranks.py"), str(tmp_path / "config.json"),
                     str(tmp_path), env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        copies = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        cast = [c for c in copies if c["phase"] == "cast"]
        plain = [c for c in copies if c["phase"] == "plain"]
        assert len(cast) == len(plain) == 2  # the EMA's and the trained weights' copy of the denoiser
        for c, p in zip(cast, plain):
            assert c["bytes"] <= HALF * c["float32_bytes"], c
            assert p["bytes"] == p["float32_bytes"], p
            assert (c["dtype"], c["first"]) == (p["dtype"], p["first"]) == ("torch.float32", "torch.float32")
    cast = sorted((out / "samples" / "step-1").iterdir())
    plain = sorted((tmp_path / "plain" / "samples" / "step-1").iterdir())
    assert [p.name for p in cast] == [p.name for p in plain] and len(cast) == 4
    for c, p in zip(cast, plain):
        assert c.read_bytes() == p.read_bytes(), c.name


@pytest.mark.parametrize("family", ["sd1", "sdxl", "flux", "sd3", "krea2", "wan", "stable_cascade"])
def test_a_cast_copy_reports_the_dtype_it_did(family):
    """Every component a family may train, its cast entries in bfloat16: each model in it (a module with a `.dtype`:
    diffusers', transformers') reports the `.dtype` and `next(parameters())` dtype it did in float32, Krea 2's
    `_keep_in_fp32_modules` and the sub-modules whose parameters' dtype the library reads (PARAMETER_DTYPE_READS:
    Wan's time embedder, Stable Cascade's pooled text mapper) included."""
    from ot_dist.memory.stored import parameter_dtype_reads
    from ot_dist.models.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline(family)
    components = {n: m for n, m in pipe.components.items()
                  if isinstance(m, torch.nn.Module) and any(True for _ in m.parameters())}
    for name, component in components.items():
        keys = low_precision_keys(meta_structure(component))
        cast = meta_structure(component)
        cast.load_state_dict({k: v.to(torch.bfloat16) if k in keys else v for k, v in component.state_dict().items()},
                             assign=True)
        assert keys or name == "vae", name
        for model, copied in zip(component.modules(), cast.modules()):
            if isinstance(getattr(type(model), "dtype", None), property):
                assert copied.dtype == model.dtype, name
                assert next(copied.parameters()).dtype == next(model.parameters()).dtype, name
        read = parameter_dtype_reads(component)
        for module, copied in zip(component.modules(), cast.modules()):
            if id(module) in read:
                assert all(p.dtype == torch.float32 for p in copied.parameters()), name
