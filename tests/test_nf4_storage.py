"""`weight_dtype: nf4` (memory/nf4.py): frozen Linear weights in bitsandbytes NF4 with OneTrainer's NFLOAT_4 settings.
The stored weight against OneTrainer's LinearNf4 (bitsandbytes directly), its bytes against the memory table, forward
and input gradient against linear with the dequantized weight (nothing weight-sized kept for backward), state dicts,
the non-Linear parameters in the compute dtype, OFT layers, a tiny LoRA run against the bfloat16 one, 2 ddp ranks
against one process, and the refusals. The full exports are tests/test_frozen_export.py's (nf4 case)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from conftest import base_config
from forked_ranks import run_ranks
from test_low_memory import component_calls
from safetensors.torch import load_file

from ot_dist.checkpoint.frozen_source import held_as_loaded
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory.nf4 import STATISTICS, store_frozen_in_nf4
from ot_dist.memory.placement import quantize_frozen
from ot_dist.memory.table import NF4_BYTES, frozen_bytes, linear_weight_count
from ot_dist.models.tiny import build_tiny_pipeline
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]

# The nf4 forward of the tiny SD components against the bfloat16 one, relative L2 error of the output: measured UNet
# 0.039, text encoder 0.21, VAE encoder 0.013 (its convolutions stay bfloat16). NF4 rounds a normal weight by 9% (L2),
# float8 by 2.6%: 3.5 times float8's figures (0.07, 0.06, 0.10 with the VAE's convolutions in float8 too).
# docs/low-memory.md "nf4 accuracy".
NF4_FORWARD_TOLERANCE = 0.3
# A 3-step LoRA run's losses against the bfloat16-stored run's: measured 0.2%, 0.2%, 0.6% apart (docs/low-memory.md).
NF4_LOSS_RTOL = 0.02
# 2 ddp ranks (batch 2 each) against one process, the exported LoRA after 3 steps: of batch 2 with 2 micro batches
# per step, the same bits (measured 0: gloo sums the 2 halves as accumulation does); of batch 4, GEMMs of another shape
# round differently and Adam's first steps magnify it (measured 1.0e-6; float32 storage: 4.9e-7).
DDP_TOLERANCE = 1e-6
BATCH_TOLERANCE = 1e-5


def linear_nf4_reference(weight: torch.Tensor, compute_dtype: torch.dtype, flat: bool = False):
    """(packed weight, dequantized weight) as OneTrainer's LinearNf4.quantize / unquantized_weight compute them;
    `flat`: dequantized as one row of weight.numel() (bitsandbytes' CPU kernel for narrow rows is wrong)."""
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4",
                                                 quant_storage=torch.uint8)
    nested = bnb.functional.QuantState(absmax=state.state2.absmax, shape=None, code=state.state2.code, blocksize=256,
                                       quant_type="nf4", dtype=torch.float32, offset=None, state2=None)
    shape = torch.Size([weight.numel()]) if flat else weight.shape
    quant_state = bnb.functional.QuantState(absmax=state.absmax, shape=shape, code=state.code, blocksize=64,
                                            quant_type="nf4", dtype=compute_dtype, offset=state.offset, state2=nested)
    return packed, bnb.functional.dequantize_4bit(A=packed, quant_state=quant_state,
                                                  quant_type="nf4").detach().to(compute_dtype).reshape(weight.shape)


def test_bitsandbytes_cpu_dequantization_of_narrow_rows_is_what_nf4_avoids():
    """Why memory/nf4.py dequantizes flat: bitsandbytes 0.50.2's 2-D CPU kernel put half of a (16, 48) weight's
    values in the wrong blocks on the CPUs of earlier sessions (its AVX2 path, on an AMD EPYC, gets them right); the
    flat one is NF4 (each weight the nearest of the 16 levels x its block's absmax) on both."""
    torch.manual_seed(0)
    weight = torch.randn(16, 48)
    _, shaped = linear_nf4_reference(weight, torch.float32)
    _, flat = linear_nf4_reference(weight, torch.float32, flat=True)
    code, blocks = bnb.functional.get_4bit_type("nf4", device="cpu"), weight.reshape(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    nearest = (code[((blocks / absmax).unsqueeze(-1) - code).abs().argmin(-1)] * absmax).reshape(weight.shape)
    torch.testing.assert_close(flat, nearest, rtol=1e-2, atol=0)  # absmax itself is stored in 8 bits
    assert relative_error(flat, weight) < 0.1
    # the 2-D kernel is NF4 too, or it is the misplacement the flat path avoids
    shaped_is_nf4 = torch.allclose(shaped, nearest, rtol=1e-2, atol=0)
    assert shaped_is_nf4 or relative_error(shaped, weight) > 0.1


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def frozen_linear(i: int, o: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(i, o).requires_grad_(False)


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("features", [(130, 96), (32, 48)])
def test_the_stored_weight_is_onetrainers_linear_nf4(compute_dtype, features):
    """(130, 96): 12480 weights, the last block of 64 partial. (32, 48): rows shorter than a block, which bitsandbytes'
    2-D CPU dequantization gets wrong (on CUDA it is the flat one): the reference is dequantized flat there."""
    layer = frozen_linear(*features)
    weight = layer.weight.detach().clone()
    assert store_frozen_in_nf4(layer, compute_dtype) == weight.numel()
    packed, expected = linear_nf4_reference(weight, compute_dtype, flat=features[0] < 64)
    assert isinstance(layer, torch.nn.Linear) and type(layer).__name__ == "Nf4Linear"
    assert torch.equal(layer._parameters["weight"], packed) and packed.dtype == torch.uint8
    got = layer.weight  # what peft's LoRA wrapper reads as base_layer.weight
    assert got.shape == weight.shape and got.dtype == compute_dtype
    assert torch.equal(got, expected)
    assert 0.05 < relative_error(got, weight) < 0.15  # NF4 did round (16 levels per block of 64)
    assert layer.bias.dtype == compute_dtype  # not quantized: OneTrainer loads it in the train dtype


def test_bytes_per_weight_are_the_memory_tables():
    layer = frozen_linear(256, 64)  # 16384 weights: 256 blocks, one block of absmaxes
    store_frozen_in_nf4(layer, torch.bfloat16)
    weight_bytes = layer._parameters["weight"].nbytes + layer.nf4_absmax.nbytes + layer.nf4_nested_absmax.nbytes
    assert weight_bytes == 16384 * NF4_BYTES == 8452  # 0.5 + 1/64 + 1/4096 bytes per weight
    # The tiny SD UNet stored as placement stores it: every byte it holds (parameters and the nf4 statistics, the
    # per-layer code tables aside) is the table's figure for it.
    unet = build_tiny_pipeline("sd1").unet.requires_grad_(False)
    count, linear = sum(p.numel() for p in unet.parameters()), linear_weight_count(unet)
    store_frozen_in_nf4(unet, torch.bfloat16)
    tables = sum(m.nf4_code.nbytes + m.nf4_nested_code.nbytes + m.nf4_offset.nbytes
                 for m in unet.modules() if hasattr(m, "nf4_shape"))
    held = sum(p.nbytes for p in unet.parameters()) + sum(b.nbytes for n, b in unet.named_buffers() if "nf4_" in n)
    assert held - tables == pytest.approx(frozen_bytes("nf4", count, linear), rel=2e-3)  # the partial blocks' rounding
    assert 0 < linear < count  # both kinds: Linear weights and the convolutions, norms, biases


@pytest.mark.parametrize("autocast", [False, True])
def test_forward_and_input_gradient_are_linear_with_the_dequantized_weight(autocast):
    layer = frozen_linear(130, 96)
    store_frozen_in_nf4(layer, torch.bfloat16)
    x = torch.randn(5, 7, 130, requires_grad=True)
    saved = []
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    # backward keeps the packed weight and its statistics, nothing else: nothing of the weight's shape, 0.6 bytes per
    # weight with this small layer's code tables (1.1 KB)
    stored = [layer._parameters["weight"], *(getattr(layer, f"nf4_{s}") for s in STATISTICS)]
    assert {id(t) for t in saved} == {id(t) for t in stored}
    assert sum(t.nbytes for t in saved) < 130 * 96 * 0.61
    out.float().square().sum().backward()

    dtype = torch.bfloat16 if autocast else torch.float32
    weight = layer.state_dict()["weight"].to(dtype)  # the dequantized weight (float32 dequantization, cast)
    x_ref = x.detach().clone().requires_grad_(True)
    expected = torch.nn.functional.linear(x_ref.to(dtype), weight, layer.bias.to(dtype))
    expected.float().square().sum().backward()
    assert out.dtype == dtype and x.grad.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-2 if autocast else 1e-6, atol=1e-6)


@pytest.mark.parametrize("storage", ["float8", "nf4", "int8"])
def test_stored_layers_backpropagate_under_gradient_checkpointing(storage):
    """Non-reentrant checkpointing lets backward read a saved tensor once (the op of memory/stored.py, float8's too;
    int8's own op: 24 rows take its int8 products)."""
    from torch.utils.checkpoint import checkpoint

    layer = frozen_linear(64, 32)
    quantize_frozen(layer, storage, torch.float32)
    x = torch.randn(24, 64, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    layer(x_ref).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_the_state_dict_is_a_normal_one_and_loading_quantizes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 32),
                                torch.nn.Embedding(10, 32)).requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    store_frozen_in_nf4(model, torch.bfloat16)
    # every other frozen parameter in the compute dtype, as OneTrainer loads a quantized part's other tensors
    assert model[1].weight.dtype == model[3].weight.dtype == model[0].bias.dtype == torch.bfloat16
    state = model.state_dict()
    assert state.keys() == before.keys()  # the statistics are not state
    for key in ("0.weight", "2.weight"):
        assert state[key].dtype == torch.float32 and state[key].shape == before[key].shape
        assert torch.equal(state[key], linear_nf4_reference(before[key], torch.float32)[1])
    # loading quantizes the incoming float32 weights again: a fresh original gives the same packed weights and
    # statistics as storing it did; a state dict of dequantized weights keeps the codes, its statistics move a
    # little (the absmaxes are quantized again around their new mean): measured 3.7e-5, the weights up to 0.125.
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(before)
    for a, b in zip(fresh.modules(), model.modules()):
        for name in ("weight", *(f"nf4_{s}" for s in STATISTICS)):
            if hasattr(a, "nf4_shape"):
                assert torch.equal(getattr(a, "_parameters")["weight"] if name == "weight" else getattr(a, name),
                                   b._parameters["weight"] if name == "weight" else getattr(b, name)), name
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert torch.equal(fresh[0]._parameters["weight"], model[0]._parameters["weight"])
    assert (again["0.weight"] - state["0.weight"]).abs().max() < 1e-4


def test_a_cast_leaves_the_statistics_and_dtype_reports_the_compute_dtype():
    """The float32 statistics are held as int32 bits: `.to(bfloat16)` (which casts floating-point buffers) leaves the
    weight as stored, and a model of bias-free Linear layers, whose `.dtype` diffusers reads from the buffers when no
    parameter is floating, reports the compute dtype."""
    from diffusers import ModelMixin

    class BiasFree(ModelMixin):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False)

    torch.manual_seed(0)
    model = BiasFree().requires_grad_(False)
    store_frozen_in_nf4(model, torch.bfloat16)
    assert model.dtype == torch.bfloat16
    weight = model.a.weight.clone()
    model.to(torch.bfloat16)
    assert torch.equal(model.a.weight, weight)


def test_the_sampling_copy_computes_as_the_stored_module():
    """A copy of a module's weightless structure (train/sampling.py: meta parameters and nf4 statistics) assigned a
    whole state dict, without the module to share the stored tensors of (samples share them:
    tests/test_stored_state.py): loading quantizes the dequantized weights again, the statistics beside the packed
    weight (not on the meta device). Measured: outputs 1e-4 apart (the absmaxes quantized again)."""
    from ot_dist.train.sampling import inference_copy, meta_structure

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    model.requires_grad_(False)
    store_frozen_in_nf4(model, torch.float32)
    copy_ = inference_copy(meta_structure(model), model.state_dict(), torch.device("cpu"))
    assert all(b.device.type == "cpu" for b in copy_.buffers())
    assert torch.equal(copy_[0]._parameters["weight"], model[0]._parameters["weight"])
    x = torch.randn(4, 64)
    torch.testing.assert_close(copy_(x), model(x), rtol=0, atol=1e-3)


def test_nf4_storage_is_not_held_as_loaded():
    """A float32 compute dtype leaves every floating parameter float32: the packed uint8 weights alone tell that the
    module holds rounded copies (full exports read the frozen parts from model.path again)."""
    text_encoder = build_tiny_pipeline("sd1").text_encoder.requires_grad_(False)
    assert held_as_loaded(text_encoder)
    quantize_frozen(text_encoder, "nf4", torch.float32)
    assert all(p.dtype == torch.float32 for p in text_encoder.parameters() if p.is_floating_point())
    assert not held_as_loaded(text_encoder)
    assert text_encoder.dtype == torch.float32  # transformers' .dtype: the compute dtype, not the packed uint8


@pytest.mark.parametrize("name", ["unet", "text_encoder", "vae"])
def test_the_forward_stays_near_bfloat16(name):
    original = getattr(build_tiny_pipeline("sd1"), name).requires_grad_(False)
    bf16, nf4 = copy.deepcopy(original).to(torch.bfloat16), copy.deepcopy(original)
    store_frozen_in_nf4(nf4, torch.bfloat16)
    assert nf4.dtype == torch.bfloat16
    call = component_calls()[name]
    with torch.no_grad():
        reference, expected, got = call(original, torch.float32), call(bf16, torch.bfloat16), call(nf4, torch.bfloat16)
    error = relative_error(got, expected)
    print(f"nf4 {name} forward vs bfloat16: relative L2 {error:.4f}; bfloat16 vs float32 "
          f"{relative_error(expected, reference):.4f}")
    assert got.dtype == torch.bfloat16
    assert error <= NF4_FORWARD_TOLERANCE
    assert relative_error(got, reference) > relative_error(expected, reference)  # it did round to 4 bits


def test_oft_layers_rotate_the_dequantized_weight():
    """As under float8: an OFT layer's frozen base weight is stored, its forward (the rotation) reads it dequantized."""
    from ot_dist.methods.oft import add_oft

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32)).requires_grad_(False)
    add_oft(model, ["0"], 8, 0.0)
    layer = model[0]
    with torch.no_grad():
        layer.oft_blocks.normal_(std=0.1)
    store_frozen_in_nf4(model, torch.float32)
    assert layer._parameters["weight"].dtype == torch.uint8 and layer.oft_blocks.requires_grad
    x = torch.randn(3, 16)
    want = torch.nn.functional.linear(x, layer.adapted_weight(), layer.bias)
    out = layer(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert layer.oft_blocks.grad is not None and layer.oft_blocks.grad.abs().sum() > 0


def lora_run(tiny_models, shapes_data, out, weight_dtype, **overrides):
    raw = base_config(tiny_models["sd1"], shapes_data, out, method="lora", max_steps=3, weight_dtype=weight_dtype,
                      **overrides)
    return Trainer(validate(raw), log=lambda *_: None)


def test_a_lora_run_on_nf4_base_weights_trains_close_to_the_bfloat16_one(tiny_models, shapes_data, tmp_path):
    losses = {}
    for weight_dtype in ("bfloat16", "nf4"):
        trainer = lora_run(tiny_models, shapes_data, tmp_path / weight_dtype, weight_dtype)
        if weight_dtype == "nf4":
            linears = [m for c in (trainer.model.denoiser, trainer.model.vae, *trainer.model.text_encoders.values())
                       for m in c.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
            assert linears and all(m._parameters["weight"].dtype == torch.uint8 for m in linears)
            assert all(p.dtype == torch.float32 for p in trainer.params)  # the LoRA weights train in float32
        losses[weight_dtype] = trainer.train().losses
        assert (tmp_path / weight_dtype / "lora.safetensors").is_file()
    print(f"losses bfloat16 {losses['bfloat16']}, nf4 {losses['nf4']}")
    assert losses["nf4"] != losses["bfloat16"]
    torch.testing.assert_close(torch.tensor(losses["nf4"]), torch.tensor(losses["bfloat16"]), rtol=NF4_LOSS_RTOL,
                               atol=0)
    exported = load_file(tmp_path / "nf4" / "lora.safetensors")
    assert exported and all(v.is_floating_point() for v in exported.values())


def test_two_ddp_ranks_equal_one_process(tiny_models, shapes_data, tmp_path):
    """2 ranks of batch 2 against one process of batch 4, and of batch 2 with 2 micro batches per step: the same 4
    samples per step. The packed weights and statistics DDP broadcasts from rank 0 (uint8 parameters, non-persistent
    buffers) are what each rank stored."""
    ones = {}
    for name, batches in (("one", dict(batch_size=4)),
                          ("accumulated", dict(batch_size=2, gradient_accumulation_steps=2))):
        lora_run(tiny_models, shapes_data, tmp_path / name, "nf4", **batches).train()
        ones[name] = load_file(tmp_path / name / "lora.safetensors")
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / "ddp", method="lora", max_steps=3, batch_size=2,
                      weight_dtype="nf4", strategy="ddp")
    (tmp_path / "cases.json").write_text(json.dumps({"ddp": raw}))
    done = run_ranks(REPO / "tests" / "helpers" / "family_cases.py", tmp_path / "cases.json", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = load_file(tmp_path / "ddp" / "lora.safetensors")
    for name, tolerance in (("accumulated", DDP_TOLERANCE), ("one", BATCH_TOLERANCE)):
        assert got.keys() == ones[name].keys()
        diff = max(float((got[k] - v).abs().max()) for k, v in ones[name].items())
        print(f"ddp 2 ranks vs one process ({name}): LoRA max abs diff {diff:.3g}")
        assert diff <= tolerance, name


@pytest.mark.parametrize("strategy,field", [("fsdp", "weight_dtype"), ("zero2", "weight_dtype"),
                                            ("fsdp", "text_encoder.weight_dtype")])
def test_nf4_needs_strategy_single_or_ddp(tiny_models, shapes_data, tmp_path, strategy, field):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, method="lora", strategy=strategy, **{field: "nf4"})
    with pytest.raises(ConfigError, match=f"{field}: nf4 storage is supported with strategy single or ddp"):
        validate(raw)


def test_one_component_in_nf4(tiny_models, shapes_data, tmp_path):
    """`<part>.weight_dtype: nf4` (OneTrainer's per-part NFLOAT_4): that component's Linear weights are packed, the
    others keep weight_dtype."""
    trainer = lora_run(tiny_models, shapes_data, tmp_path, "bfloat16", **{"text_encoder.weight_dtype": "nf4"})
    encoder, unet = trainer.model.text_encoders["text_encoder"], trainer.model.denoiser
    assert all(hasattr(m, "nf4_shape") for m in encoder.modules() if isinstance(m, torch.nn.Linear))
    assert not any(hasattr(m, "nf4_shape") for m in unet.modules())
    assert {p.dtype for p in unet.parameters() if not p.requires_grad} == {torch.bfloat16}


@pytest.mark.parametrize("family,method", [("sd1", "lora"), ("flux", "lora")])
def test_nf4_stored_weights_sample(family, method, family_models, shapes_data, tmp_path):
    """Sampling copies the trained modules into a weightless structure (train/sampling.py): a LoRA's nf4 base is the
    training module's packed weights and statistics (tests/test_stored_state.py); the frozen text encoders and VAE
    sample as stored. The pipelines take their latents' dtype from `.dtype`, the compute dtype (not the packed uint8).
    SD 1.x and Flux (CLIP + T5, its transformer all Linear layers)."""
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}

    def run(output_dir, **sampled):
        raw = base_config(family_models[family], shapes_data, output_dir, family=family, method=method, batch_size=2,
                          max_steps=2, weight_dtype="nf4", **sampled)
        return Trainer(validate(raw), log=lambda *_: None)

    plain = run(tmp_path / "plain").train()
    trainer = run(tmp_path / "o", **{"sampling.prompts": [prompt], "sampling.every_n_steps": 1})
    assert trainer.train().losses == plain.losses  # the step after a sample trains as without one
    for step in (1, 2):
        image = Image.open(tmp_path / "o" / "samples" / f"step-{step}" / "0-a-red-circle.png")
        assert image.size == (64, 64)
    assert any(hasattr(m, "nf4_shape") for m in trainer.model.denoiser.modules())  # the LoRA's base
    assert all(hasattr(m, "nf4_shape") for encoder in trainer.model.text_encoders.values() for m in encoder.modules()
               if isinstance(m, torch.nn.Linear))
