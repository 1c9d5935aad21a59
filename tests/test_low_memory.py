"""Low-memory options: float8 storage of frozen weights (bytes, forward accuracy against bfloat16,
the 1-byte weights being all that backward keeps, state dicts, a training run), CPU offload of the
frozen text encoders and VAE (placement per forward on a stand-in device, same losses as without) and
the counting of the memory table in docs/low-memory.md (optimizer state and LoRA shapes against the real implementations)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.memory.float8 import FLOAT8, store_frozen_in_float8
from ot_dist.memory.offload import movement_units, offload_to_cpu
from ot_dist.memory.table import lora_shapes, optimizer_state_bytes
from ot_dist.models.families.sd import UNET_LORA_TARGETS as UNET_ATTENTION_TARGETS
from ot_dist.models.tiny import build_tiny_pipeline
from ot_dist.train.trainer import Trainer

# The float8 forward may differ from the bfloat16 one by this relative L2 error of the output
# (measured on the tiny models: UNet 0.07, text encoder 0.06, VAE encoder 0.10; e4m3 keeps 3 mantissa
# bits, so every weight is rounded by up to 1/16 of its value). docs/low-memory.md: "float8 accuracy".
FLOAT8_TOLERANCE = 0.15


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def stored_bytes(module: torch.nn.Module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


@pytest.fixture(scope="module")
def sd1():
    pipe = build_tiny_pipeline("sd1")
    for name in ("unet", "text_encoder", "vae"):
        getattr(pipe, name).requires_grad_(False)
    return pipe


def component_calls():
    g = torch.Generator().manual_seed(0)
    latents, hidden = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 32, generator=g)
    ids, pixels = torch.randint(0, 300, (2, 77), generator=g), torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    return {
        "unet": lambda m, dt: m(latents.to(dt), torch.tensor([10, 600]), encoder_hidden_states=hidden.to(dt)).sample,
        "text_encoder": lambda m, dt: m(ids)[0],
        "vae": lambda m, dt: m.encode(pixels.to(dt)).latent_dist.mean,
    }


@pytest.mark.parametrize("name", ["unet", "text_encoder", "vae"])
def test_float8_weights_take_one_byte_each_and_the_forward_matches_bfloat16(sd1, name):
    original = getattr(sd1, name)
    bf16 = copy.deepcopy(original).to(torch.bfloat16)
    f8 = copy.deepcopy(original)
    count = sum(p.numel() for p in original.parameters())
    assert store_frozen_in_float8(f8, torch.bfloat16) == count
    assert stored_bytes(f8) == count == stored_bytes(original) // 4  # one byte per parameter, all of them
    assert all(p.dtype == FLOAT8 for p in f8.parameters())

    call = component_calls()[name]
    with torch.no_grad():
        reference, expected, got = call(original, torch.float32), call(bf16, torch.bfloat16), call(f8, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, expected) <= FLOAT8_TOLERANCE
    assert relative_error(got, reference) > relative_error(expected, reference)  # it did round to float8

    # The state dict is a normal one: the same keys, float32 values within float8's rounding (1/16 + subnormals).
    state, before = f8.state_dict(), original.state_dict()
    assert state.keys() == before.keys()
    for key, value in before.items():
        if value.is_floating_point():
            assert state[key].dtype == torch.float32
            assert ((state[key] - value).abs() <= value.abs() / 16 + value.abs().max() / 448 * 2 ** -9 + 1e-12).all(), key
    # Loading a state dict quantizes it again: the round trip is exact.
    f8.load_state_dict(state)
    again = f8.state_dict()
    assert all(torch.equal(again[k], v) for k, v in state.items())


@pytest.mark.parametrize("autocast", [False, True])
def test_float8_layers_backpropagate_to_their_input_through_the_upcast_weight(autocast):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 24), torch.nn.Conv2d(8, 12, 3, padding=1, stride=2, groups=2)]
    inputs = [torch.randn(5, 16, requires_grad=True), torch.randn(2, 8, 9, 9, requires_grad=True)]
    for layer, x in zip(layers, inputs):
        layer.requires_grad_(False)
        store_frozen_in_float8(layer, torch.bfloat16)
        assert layer._parameters["weight"].dtype == FLOAT8
        weight, bias = layer.state_dict()["weight"], layer.state_dict()["bias"]  # the upcast values, float32
        saved = []
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = layer(x)
        # backward keeps the 1-byte weight, not an upcast copy of it
        assert [t.dtype for t in saved if t.shape == weight.shape] == [FLOAT8]
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
        out.float().square().sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        if isinstance(layer, torch.nn.Linear):
            expected = torch.nn.functional.linear(x_ref, weight, bias)
        else:
            expected = torch.nn.functional.conv2d(x_ref, weight, bias, stride=2, padding=1, groups=2)
        expected.square().sum().backward()
        tolerance = 3e-2 if autocast else 1e-5  # bfloat16 compute under autocast
        assert relative_error(out, expected) < tolerance
        assert relative_error(x.grad, x_ref.grad) < tolerance
        assert x.grad.dtype == torch.float32


def test_a_lora_run_with_float8_base_weights_trains_close_to_the_float32_one(tiny_models, shapes_data, tmp_path):
    results = {}
    for weight_dtype in ("float32", "float8"):
        raw = base_config(tiny_models["sd1"], shapes_data, tmp_path / weight_dtype, method="lora", max_steps=2,
                          weight_dtype=weight_dtype)
        trainer = Trainer(validate(raw), log=print)
        frozen = [p for m in (trainer.model.denoiser, trainer.model.vae, *trainer.model.text_encoders.values())
                  for p in m.parameters() if not p.requires_grad]
        if weight_dtype == "float8":
            assert stored_bytes(trainer.model.vae) == sum(p.numel() for p in trainer.model.vae.parameters())
            assert all(p.dtype == FLOAT8 for p in frozen)
            assert all(p.dtype == torch.float32 for p in trainer.params)  # the LoRA weights train in float32
        results[weight_dtype] = trainer.train().losses
        assert (tmp_path / weight_dtype / "lora.safetensors").is_file()
    assert results["float8"] != results["float32"]
    torch.testing.assert_close(torch.tensor(results["float8"]), torch.tensor(results["float32"]), rtol=0.05, atol=0)


def test_float8_needs_strategy_single_or_ddp(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, method="lora", weight_dtype="float8", strategy="fsdp")
    with pytest.raises(ConfigError, match="weight_dtype: float8 storage is supported with strategy single or ddp"):
        validate(raw)


def test_offloaded_components_visit_the_device_only_for_each_childs_forward(sd1):
    """The meta device stands in for the accelerator: a forward there computes shapes only. Every unit of
    movement is watched: during its own forward all its weights are on the device, right after it they are
    home on the CPU, and a unit whose forward never runs (the VAE decoder in training) never moves."""
    text_encoder, vae = copy.deepcopy(sd1.text_encoder), copy.deepcopy(sd1.vae)
    homes = {id(p): (p.data_ptr(), p.detach().clone()) for m in (text_encoder, vae) for p in m.parameters()}
    meta = torch.device("meta")
    offload_to_cpu(text_encoder, meta)
    offload_to_cpu(vae, meta)
    during, after = {}, {}
    units = {f"{component}:{index}": unit for component, module in (("text", text_encoder), ("vae", vae))
             for index, unit in enumerate(movement_units(module)) if any(True for _ in unit.parameters())}
    for name, unit in units.items():
        # hooks registered after offloading run after the offload's own: they see where forward reads, and
        # where the weights are once the unit has finished
        unit.register_forward_pre_hook(
            lambda m, a, name=name: during.setdefault(name, {p.device.type for p in m.parameters()}) and None)
        unit.register_forward_hook(
            lambda m, a, out, name=name: after.setdefault(name, {p.device.type for p in m.parameters()}) and None)

    hidden = text_encoder(torch.randint(0, 300, (2, 77)))[0]  # inputs on the CPU are moved along
    latents = vae.encode(torch.rand(1, 3, 64, 64)).latent_dist.mean
    assert hidden.device == meta and hidden.shape == (2, 77, 32) and latents.device == meta
    decoder = {id(m) for m in vae.decoder.modules()} | {id(vae.post_quant_conv)}
    expected_to_run = {name for name, unit in units.items() if id(unit) not in decoder}
    assert set(during) == expected_to_run and len(expected_to_run) > 10
    assert all(devices == {"meta"} for devices in during.values()), during
    assert all(devices == {"cpu"} for devices in after.values()) and set(after) == set(during), after
    # Blocks move one at a time: no unit is a whole encoder stack.
    assert text_encoder.encoder not in movement_units(text_encoder) and vae.encoder not in movement_units(vae)
    assert text_encoder.encoder.layers[0] in movement_units(text_encoder)
    for module in (text_encoder, vae):  # between calls everything is home again, the same storage and values
        for p in module.parameters():
            pointer, value = homes[id(p)]
            assert p.device.type == "cpu" and p.data_ptr() == pointer and torch.equal(p, value)


def test_training_with_offload_gives_the_same_losses(tiny_models, shapes_data, tmp_path):
    losses = []
    for offload in (False, True):
        raw = base_config(tiny_models["sdxl"], shapes_data, tmp_path / str(offload), family="sdxl", method="lora",
                          max_steps=2, offload_frozen_components=offload)
        trainer = Trainer(validate(raw), log=print)
        frozen = [trainer.model.vae, *trainer.model.text_encoders.values()]
        hooked = [all(bool(c._forward_pre_hooks) for c in movement_units(m)) for m in frozen]
        assert hooked == [offload] * 3
        assert not any(m._forward_pre_hooks for m in trainer.model.denoiser.children())  # the UNet always stays
        losses.append(trainer.train().losses)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("optimizer", ["ADAMW", "ADAMW_8BIT", "ADAFACTOR"])
def test_the_memory_tables_optimizer_state_is_what_the_optimizers_allocate(optimizer):
    import bitsandbytes
    import transformers

    shapes = [(64, 128), (10,), (12, 8, 3, 3), (4099,), (16, 320, 1, 1)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    cls = {"ADAMW": lambda p: torch.optim.AdamW(p, lr=1e-3),
           "ADAMW_8BIT": lambda p: bitsandbytes.optim.AdamW8bit(p, lr=1e-3),
           "ADAFACTOR": lambda p: transformers.optimization.Adafactor(p, lr=None)}[optimizer]
    opt = cls(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    storages = {}
    for p in params:
        for value in opt.state[p].values():
            if torch.is_tensor(value) and value.numel() > 1:  # step counters and scalars aside
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    shared_quantization_maps = 2 * 256 * 4 if optimizer == "ADAMW_8BIT" else 0  # one pair per optimizer
    assert sum(storages.values()) == optimizer_state_bytes(shapes, optimizer) + shared_quantization_maps


def test_the_memory_tables_lora_shapes_are_what_peft_adds():
    from peft import LoraConfig

    unet = build_tiny_pipeline("sd1").unet
    expected = sum(math.prod(s) for s in lora_shapes(unet, rank=4))
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=1, target_modules=list(UNET_ATTENTION_TARGETS)))
    assert sum(p.numel() for p in unet.parameters() if p.requires_grad) == expected > 0
