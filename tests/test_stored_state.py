"""A LoRA on a quantized base (`weight_dtype: float8 / nf4 / int8`, memory/stored.py) never has its base dequantized for
an export or a sample point. A LoRA export picks the adapters from the denoiser's state dict: the stored layers' state
hooks (which give their weight dequantized to float32 in CPU memory) leave the entries the export's key filter drops
as stored (stored.kept_entries), the same file bit for bit. A sample point's copy of the trained module holds the
training module's stored tensors themselves (stored.share_stored) instead of a float32 state dict moved to the device
and quantized again: the same PNG bytes where the old path's quantization gave the stored weights back (float8), and
for nf4 (whose statistics move when a dequantized weight is quantized again) and int8 (whose old path failed: the
copy's meta weight read through the dequantizing property) the PNG the training module's own layers give. Flux.1 dev:
48 GB of float32 at each LoRA export (host) and sample point (host, then device) before, none now."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.memory import float8, int8, nf4
from ot_dist.memory.stored import share_stored, stored_layers, stored_state_keys
from ot_dist.train import sampling
from ot_dist.train.sampling import inference_copy, meta_structure
from ot_dist.train.trainer import Trainer

RED = {"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}
PNG = "0-a-red-circle.png"
STORES = {"float8": float8.store_frozen_in_float8, "nf4": nf4.store_frozen_in_nf4, "int8": int8.store_frozen_in_int8}


class Dequantizations:
    """Counts the stored entries the stored layers' state-dict hooks give dequantized, and their bytes. Installed
    before the layers are stored: each registers the hook it is given then."""

    def __init__(self, monkeypatch):
        self.entries = self.bytes = 0
        monkeypatch.setattr(float8, "_upcast_state", self.counting(float8._upcast_state, lambda m: m._float8_scales))
        for module, name in ((nf4, "NF4"), (int8, "INT8")):
            storage = getattr(module, name)
            monkeypatch.setattr(module, name, dataclasses.replace(
                storage, state_hook=self.counting(storage.state_hook, lambda m: ("weight",))))

    def counting(self, hook, names_of):
        def counted(module, state_dict, prefix, local_metadata):
            before = {name: state_dict.get(prefix + name) for name in names_of(module)}
            hook(module, state_dict, prefix, local_metadata)
            for name, tensor in before.items():
                if state_dict.get(prefix + name) is not tensor:
                    self.entries += 1
                    self.bytes += state_dict[prefix + name].nbytes

        return counted

    def take(self) -> tuple[int, int]:
        counted, self.entries, self.bytes = (self.entries, self.bytes), 0, 0
        return counted


def old_exports(monkeypatch) -> None:
    """The path before: a stored layer's state hook dequantizes every entry, kept or not."""
    for module in (float8, nf4, int8):
        monkeypatch.setattr(module, "dequantizes", lambda key: True)


def old_samples(monkeypatch, sampler) -> None:
    """The path before: the copy gets the whole state dict, stored weights dequantized, and loading quantizes them."""
    old_exports(monkeypatch)
    monkeypatch.setattr(sampling, "share_stored", lambda copy, source: frozenset())
    monkeypatch.setattr(sampler, "stored", {name: frozenset() for name in sampler.stored})


def trainer_of(tiny_models, shapes_data, out, weight_dtype, **options) -> Trainer:
    raw = base_config(tiny_models["sd1"], shapes_data, out, method="lora", batch_size=2, max_steps=1,
                      weight_dtype=weight_dtype, **options)
    return Trainer(validate(raw), log=lambda *_: None)


@pytest.mark.parametrize("weight_dtype", ["float8", "nf4", "int8"])
def test_a_lora_export_dequantizes_no_stored_weight_and_writes_the_same_file(weight_dtype, tiny_models, shapes_data,
                                                                             tmp_path, monkeypatch):
    dequantized = Dequantizations(monkeypatch)
    trainer = trainer_of(tiny_models, shapes_data, tmp_path / "o", weight_dtype)
    trainer.train()  # exports at the end
    assert dequantized.take() == (0, 0)
    (tmp_path / "o" / "lora.safetensors").rename(tmp_path / "new.safetensors")
    stored = stored_state_keys(trainer.model.denoiser)
    assert stored  # the LoRA's base is stored
    old_exports(monkeypatch)
    trainer.export(tmp_path / "old")
    entries, size = dequantized.take()
    print(f"{weight_dtype} LoRA export: {entries} stored entries dequantized ({size} bytes) before, none now")
    assert entries >= len(stored)  # the old path did dequantize the base
    assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "old" / "lora.safetensors").read_bytes()


@pytest.mark.parametrize("weight_dtype,ema", [("float8", False), ("nf4", False), ("int8", False), ("float8", True)])
def test_a_sample_point_shares_the_stored_weights(weight_dtype, ema, tiny_models, shapes_data, tmp_path,
                                                   monkeypatch):
    dequantized = Dequantizations(monkeypatch)
    copies = []

    def kept_copy(*args, **kwargs):
        copies.append(inference_copy(*args, **kwargs))
        return copies[-1]

    monkeypatch.setattr(sampling, "inference_copy", kept_copy)
    trainer = trainer_of(tiny_models, shapes_data, tmp_path / "o", weight_dtype, **{
        "sampling.prompts": [RED], "sampling.every_n_steps": 1, "ema.enabled": ema})
    assert dequantized.take() == (0, 0)  # sampling's structure of the trained module: none either
    trainer.train()  # samples at step 1
    assert dequantized.take() == (0, 0)
    denoiser, (copy_,) = trainer.model.denoiser, copies
    layers = dict(denoiser.named_modules())
    shared = [(layer, layers[name], parts) for name, layer, parts in stored_layers(copy_)]
    assert shared and len(shared) == len(list(stored_layers(denoiser)))
    for layer, own, parts in shared:
        for name in parts.entries:
            assert layer._parameters[name].data_ptr() == own._parameters[name].data_ptr()
            assert layer._parameters[name] is not own._parameters[name]  # a `.to()` of the copy leaves training's
        for name in parts.buffers:
            assert layer._buffers[name].data_ptr() == own._buffers[name].data_ptr()
    new = (tmp_path / "o" / "samples" / "step-1" / PNG).read_bytes()

    if not ema:  # the training module's own layers (a deepcopy: the same stored bits) give the same PNG
        monkeypatch.setattr(sampling, "inference_copy", lambda template, state, device, stored_from: copy.deepcopy(
            stored_from).eval().requires_grad_(False))
        trainer.sampler.sample(trainer, 101)
        assert (tmp_path / "o" / "samples" / "step-101" / PNG).read_bytes() == new

    old_samples(monkeypatch, trainer.sampler)
    monkeypatch.setattr(sampling, "inference_copy", inference_copy)
    if weight_dtype == "int8":  # the old path failed: assigning the weight read the meta one through its property
        with pytest.raises(RuntimeError, match="not on the expected device meta"):
            trainer.sampler.sample(trainer, 102)
        return
    trainer.sampler.sample(trainer, 102)
    entries, size = dequantized.take()
    print(f"{weight_dtype} sample point (ema {ema}): {entries} stored entries dequantized ({size} bytes) before")
    assert entries >= len(shared)
    old = (tmp_path / "o" / "samples" / "step-102" / PNG).read_bytes()
    if weight_dtype == "float8":  # quantizing a dequantized float8 weight again gives it back
        assert old == new
    else:  # nf4's statistics move when quantized again: the old path sampled other weights
        assert old != new


@pytest.mark.parametrize("weight_dtype", ["float8", "nf4", "int8"])
def test_a_copy_computes_with_the_stored_tensors_of_its_source(weight_dtype):
    """share_stored on a small model of each storage: the copy's stored layers hold the source's tensors (no
    quantization again, nothing dequantized), compute the same, and the state loaded into the copy leaves them out."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 24),
                                torch.nn.LayerNorm(24)).requires_grad_(False)
    model[3].requires_grad_(True)  # trained: not stored by any kind
    STORES[weight_dtype](model, torch.float32)
    template = meta_structure(model)
    assert all(t.device.type == "meta" for _, layer, parts in stored_layers(template)
               for t in (*(layer._parameters[n] for n in parts.entries), *(layer._buffers[n] for n in parts.buffers)))
    stored = stored_state_keys(model)
    assert stored >= {"0.weight", "2.weight"}
    state = {k: v for k, v in model.state_dict().items() if k not in stored}
    copy_ = inference_copy(template, state, torch.device("cpu"), model)
    x = torch.randn(20, 32)  # more than 16 rows: int8 products
    assert torch.equal(copy_(x), model(x))
    probe = meta_structure(model)
    assert share_stored(probe, model) == stored
    with pytest.raises(RuntimeError, match=r"missing \['3.weight'\]"):  # what is not shared must be in the state
        inference_copy(template, {k: v for k, v in state.items() if k != "3.weight"}, torch.device("cpu"), model)


@pytest.mark.parametrize("weight_dtype", ["float8", "nf4", "int8"])
def test_a_cache_key_of_a_stored_encoder_dequantizes_one_layer_at_a_time(weight_dtype, monkeypatch):
    """The text / latent cache key hashes a frozen encoder's state dict (data/caches.py module_key). Of an encoder stored
    in float8 / nf4 / int8 that is every stored weight dequantized to float32 (a T5-XXL in float8: ~19 GB of RAM at
    once). The key is the same as the whole state dict's (existing caches keep theirs), made with at most one stored
    layer dequantized at any time."""
    import gc
    import hashlib
    import weakref

    from ot_dist.data.caches import module_key

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(12)), torch.nn.LayerNorm(32))
    model.register_buffer("scale", torch.ones(3))
    STORES[weight_dtype](model.requires_grad_(False), torch.float32)
    stored = stored_state_keys(model)
    assert len(stored) >= 12  # the 12 weights (float8 also stores the biases and the norm's)
    per_layer = max(len(parts.entries) for _, _, parts in stored_layers(model))
    whole = hashlib.sha256()  # the key as it was made: the whole state dict, sorted
    whole.update(b"{}")
    for name, tensor in sorted(model.state_dict().items()):
        whole.update(name.encode())
        whole.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    alive, most, calls = [], [0], [0]  # the float32 copies of stored weights alive, the most at once, all made
    storage = {"float8": float8, "nf4": nf4, "int8": int8}[weight_dtype]
    real = storage.dequantize

    def counted(*args, **kwargs):
        gc.collect()
        alive[:] = [ref for ref in alive if ref() is not None]
        out = real(*args, **kwargs)
        calls[0] += 1
        alive.append(weakref.ref(out))
        most[0] = max(most[0], len(alive))
        return out

    monkeypatch.setattr(storage, "dequantize", counted)
    digest = hashlib.sha256()
    module_key(digest, model)
    assert digest.hexdigest() == whole.hexdigest()
    assert calls[0] == len(stored) and most[0] == per_layer
