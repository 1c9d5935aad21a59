"""LoRA variants (`lora.variant: dora | loha | lokr`, issues 17 and 24): trained through peft, written in the layout
ComfyUI reads for each variant, and applied by `ot-dist lora merge` as training changed the model.

ComfyUI's rules for the variants are written down below (with the commits read) as an oracle, next to the key
names of tests/test_lora_layouts.py. Every test runs at rank 4, alpha 2: a reader that ignores alpha applies twice
the trained change.
"""

from __future__ import annotations

import copy

import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config
from safetensors import safe_open
from safetensors.torch import load_file
from test_lora_layouts import check_diffusers_load, comfy_key_map, in_memory_module

from ot_dist.config.load import validate
from ot_dist.errors import InputFileError
from ot_dist.lora_tools.merge import merge_into
from ot_dist.methods.lora import ADAPTER, LoraMethod
from ot_dist.models.loading import load_model
from ot_dist.train.trainer import Trainer

RANK, ALPHA = 4, 2.0
VARIANTS = ("dora", "loha", "lokr")

# ---- ComfyUI's rules for the variants ---------------------------------------------------------------------------
# Read from github.com/comfyanonymous/ComfyUI:
#   comfy/lora.py load_lora: per mapped module name x, `x.alpha` (.item()) and `x.dora_scale` are read, then each
#     adapter's `load` takes its tensors; every key no adapter took is a "lora key not loaded" warning.
#   comfy/weight_adapter/lora.py @ 0323d8746da9beb8f3face4b77305af8d58319d6: x.lora_up.weight / x.lora_down.weight
#     (+ x.lora_mid.weight), or ("diffusers2") x.lora_B.weight / x.lora_A.weight; change = alpha / rank
#     (rank = down.shape[0]; 1.0 without alpha) x up @ down.
#   comfy/weight_adapter/loha.py @ 17adbb5cacc2d08310dad408e043a5d18e3ec013: x.hada_w1_a, x.hada_w1_b, x.hada_w2_a,
#     x.hada_w2_b (+ hada_t1 / hada_t2); change = alpha / w1_b.shape[0] x (w1_a @ w1_b) * (w2_a @ w2_b).
#   comfy/weight_adapter/lokr.py @ 179c2d35c84beb3d9761fcd146ffcba77273413e: x.lokr_w1 or x.lokr_w1_a / _b,
#     x.lokr_w2 or x.lokr_w2_a / _b (+ lokr_t2); dim = w1_b.shape[0] if w1 is decomposed, then w2_b.shape[0] if w2
#     is; change = (alpha / dim, 1.0 when no factor is decomposed or no alpha) x kron(w1, w2).
#   comfy/weight_adapter/base.py @ 9c0cf36cd7964978850fd40f8cf76ac2cf9f9e15 weight_decompose (DoRA, every adapter
#     with a dora_scale): W' = dora_scale x (W + change) / norm, at strength 1. Output axis when
#     dora_scale.shape[0] == W.shape[0]: norm = ||W|| per output row (of the base weight W: an open pull request,
#     Comfy-Org/ComfyUI#15458, makes it ||W + change|| as DoRA defines it); else input axis: norm = ||W + change||
#     per input column. norm + finfo(W.dtype).eps.
HADA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")


def comfy_load(tensors: dict[str, torch.Tensor], key_map: dict) -> tuple[dict, set[str]]:
    """(target -> (adapter, its tensors by suffix, alpha, dora_scale), the keys left over)."""
    patches, loaded = {}, set()
    for name, target in key_map.items():
        alpha = tensors[f"{name}.alpha"].item() if f"{name}.alpha" in tensors else None
        dora = tensors.get(f"{name}.dora_scale")
        found = None
        for up, down in (("lora_up.weight", "lora_down.weight"), ("lora_B.weight", "lora_A.weight")):
            if f"{name}.{up}" in tensors and found is None:
                found = ("lora", {"lora_up.weight": up, "lora_down.weight": down})
        if found is None and f"{name}.hada_w1_a" in tensors:
            found = ("loha", {s: s for s in HADA})
        elif found is None and any(f"{name}.{s}" in tensors for s in LOKR):
            found = ("lokr", {s: s for s in LOKR if f"{name}.{s}" in tensors})
        if found is None:
            continue
        kind, names = found
        patches[target] = (kind, {s: tensors[f"{name}.{f}"] for s, f in names.items()}, alpha, dora)
        loaded |= {f"{name}.{f}" for f in names.values()} | {f"{name}.{s}" for s in ("alpha", "dora_scale")
                                                               if f"{name}.{s}" in tensors}
    return patches, set(tensors) - loaded


def comfy_weight(patch, weight: torch.Tensor, dora_norm_of_adapted: bool = False) -> torch.Tensor:
    """calculate_weight at strength 1 (float32). dora_norm_of_adapted: the output-axis norm as #15458 fixes it."""
    kind, t, alpha, dora = patch
    weight = weight.float()
    if kind == "lora":
        scale = alpha / t["lora_down.weight"].shape[0] if alpha is not None else 1.0
        diff = t["lora_up.weight"].flatten(1).float() @ t["lora_down.weight"].flatten(1).float()
    elif kind == "loha":
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        diff = (t["hada_w1_a"].float() @ t["hada_w1_b"].float()) * (t["hada_w2_a"].float() @ t["hada_w2_b"].float())
    else:
        dim = None
        w1 = t.get("lokr_w1")
        if w1 is None:
            dim, w1 = t["lokr_w1_b"].shape[0], t["lokr_w1_a"].float() @ t["lokr_w1_b"].float()
        w2 = t.get("lokr_w2")
        if w2 is None:
            dim, w2 = t["lokr_w2_b"].shape[0], t["lokr_w2_a"].float() @ t["lokr_w2_b"].float()
        w1, w2 = w1.float(), w2.float()
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        diff = torch.kron(w1, w2)
    diff = diff.reshape(weight.shape) * scale
    if dora is None:
        return weight + diff
    adapted = weight + diff
    eps = torch.finfo(weight.dtype).eps
    if dora.shape[0] == weight.shape[0]:
        source = adapted if dora_norm_of_adapted else weight
        norm = source.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True).reshape(weight.shape[0],
                                                                                   *[1] * (weight.dim() - 1))
    else:
        norm = (adapted.transpose(0, 1).reshape(adapted.shape[1], -1).norm(dim=1, keepdim=True)
                .reshape(adapted.shape[1], *[1] * (adapted.dim() - 1)).transpose(0, 1))
    return adapted * (dora.float() / (norm + eps))


# ---- runs ---------------------------------------------------------------------------------------------------------
def variant_config(tiny_models, shapes_data, out, variant, family="sd1", **extra):
    settings = {"lora.rank": RANK, "lora.alpha": ALPHA, "lora.variant": variant, "text_encoder.train": True, **extra}
    return validate(base_config(tiny_models[family], shapes_data, out, family=family, method="lora", max_steps=2,
                                learning_rate=1e-2, **settings))


_RUNS = {}


@pytest.fixture
def trained(tiny_models, shapes_data, tmp_path_factory):
    """variant -> (trainer, output dir) of a 2-step sd1 run on the UNet and the text encoder, made once."""

    def run(variant):
        if variant not in _RUNS:
            out = tmp_path_factory.mktemp(f"variant-{variant}") / "out"
            trainer = Trainer(variant_config(tiny_models, shapes_data, out, variant), log=lambda *_: None)
            trainer.train()
            _RUNS[variant] = trainer, out
        return _RUNS[variant]

    return run


def adapted_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {path: sub for path, sub in module.named_modules() if isinstance(sub, BaseTunerLayer)}


def trained_weights(model) -> dict[tuple[str, str], torch.Tensor]:
    """(part, module path) -> the weight peft's own merge makes of each adapted module (a copy: the model stays)."""
    out = {}
    for name, part in model.parts().items():
        for path, layer in adapted_layers(part).items():
            layer = copy.deepcopy(layer)
            layer.merge(adapter_names=[ADAPTER])
            out[(name, path)] = layer.get_base_layer().weight.detach().float()
    return out


def original(name: str, part: torch.nn.Module, path: str) -> str:
    if name.startswith("text_encoder") and "text_model" not in dict(part.named_children()):
        return "text_model." + path
    return path


# ---- tests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_comfyui_loads_every_tensor_and_applies_the_trained_change(trained, variant):
    trainer, out = trained(variant)
    model = trainer.model
    tensors = load_file(out / "lora.safetensors")
    patches, left_over = comfy_load(tensors, comfy_key_map("sd1", model.denoiser))
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    kinds = {"dora": "lora", "loha": "loha", "lokr": "lokr"}
    assert {p[0] for p in patches.values()} == {kinds[variant]}
    assert {p[2] for p in patches.values()} == {ALPHA}
    expected = trained_weights(model)
    assert set(patches) == {(name, original(name, model.parts()[name], path)) for name, path in expected}
    moved, deviation = set(), 0.0
    for (name, path), patch in patches.items():
        layer = in_memory_module(model.parts()[name], path)
        base = layer.get_base_layer().weight.detach()
        trained_weight = expected[(name, path.removeprefix("text_model.") if (name, path) not in expected else path)]
        if variant == "dora":
            assert patch[3].shape[0] == base.shape[0] and patch[3].numel() == base.shape[0]  # output axis
            torch.testing.assert_close(comfy_weight(patch, base, dora_norm_of_adapted=True), trained_weight,
                                       rtol=1e-5, atol=1e-6)
            # ComfyUI today normalises by ||W||: off by ||W + change|| / ||W|| per output row, nothing else
            adapted = comfy_weight((*patch[:3], None), base)
            factor = adapted.flatten(1).norm(dim=1) / base.float().flatten(1).norm(dim=1)
            current = comfy_weight(patch, base)
            torch.testing.assert_close(current, trained_weight * factor.reshape(-1, *[1] * (base.dim() - 1)),
                                       rtol=1e-5, atol=1e-6)
            deviation = max(deviation, float((factor - 1).abs().max()))
        else:
            torch.testing.assert_close(comfy_weight(patch, base), trained_weight, rtol=1e-5, atol=1e-6)
        if not torch.equal(trained_weight, base.float()):
            moved.add(name)
    assert moved == {"unet", "text_encoder"}, f"parts whose adapter did not train: {moved}"
    if variant == "dora":
        assert deviation > 1e-4  # (2 steps at lr 1e-2 moved rows' norms by up to ~1 %: docs/lora.md)
    with safe_open(out / "lora.safetensors", "pt") as f:
        metadata = f.metadata()
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"]) == (str(RANK), str(ALPHA))
    assert f'"variant": "{variant}"' in metadata["ot_dist_lora"]
    assert metadata["ss_network_module"] == "lycoris.kohya"


# LyCORIS's LoKr rule (lycoris/modules/lokr.py, the reference LoKr; OneTrainer's LoKrModule sets alpha to the rank
# when both factors are full, modules/module/LoRAModule.py; ComfyUI's lokr.py above; diffusers' _bake_lokr_alpha_):
# delta W = kron(w1, w2) when both factors are full matrices (no rank in them), alpha / rank x kron(w1, w2) when one is
# split into _a @ _b (rank: that split's inner size).
def lycoris_delta(layer) -> torch.Tensor:
    """The change LyCORIS's rule makes of a peft LoKr layer's factors (adapter ADAPTER), shaped as its weight."""
    def factor(name):
        if ADAPTER in getattr(layer, f"lokr_{name}"):
            return getattr(layer, f"lokr_{name}")[ADAPTER].float(), None
        a, b = getattr(layer, f"lokr_{name}_a")[ADAPTER].float(), getattr(layer, f"lokr_{name}_b")[ADAPTER].float()
        return a @ b.flatten(1), b.shape[0]

    (w1, rank1), (w2, rank2) = factor("w1"), factor("w2")
    rank = rank2 or rank1
    scale = 1.0 if rank is None else layer.alpha[ADAPTER] / rank
    weight = layer.get_base_layer().weight
    return (torch.kron(w1, w2.flatten(1)) * scale).reshape(weight.shape)


def test_lokr_trains_at_lycoris_scale_and_files_keep_it(tiny_models, shapes_data, tmp_path):
    """LoKr modules whose factors are both full matrices train at 1.0 whatever alpha (LyCORIS's and OneTrainer's
    scale; peft's own layer applies alpha / rank, here 1/2), the others at alpha / rank: the adapted layer's output
    is the base layer's plus the rule's change. The kohya file holds the factors as trained, and ComfyUI's rule
    applies them at the trained change. Random factors stand in for training."""
    config = variant_config(tiny_models, shapes_data, tmp_path / "out", "lokr")
    model = load_model(config.model)
    method = LoraMethod(config)
    method.prepare(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for part in model.parts().values():
            for name, p in part.named_parameters():
                if "lokr_" in name:
                    p.normal_(0, 0.3)
    kinds = set()
    with torch.no_grad():
        for name, part in model.parts().items():
            for path, layer in adapted_layers(part).items():
                base = layer.get_base_layer()
                probe = copy.deepcopy(base)  # the base layer computing with the rule's change as its weight, no bias
                probe.weight.data, probe.bias = lycoris_delta(layer), None
                x = torch.randn(2, base.in_features) if isinstance(base, torch.nn.Linear) else \
                    torch.randn(1, base.in_channels, 8, 8)
                torch.testing.assert_close(layer(x), base(x) + probe(x), rtol=1e-5, atol=1e-5,
                                           msg=f"{name}.{path}")
                kinds.add(ADAPTER in layer.lokr_w1 and ADAPTER in layer.lokr_w2)
    assert kinds == {True, False}  # rank 4 on these sizes: peft makes full and split factors
    [path] = method.export(model, tmp_path / "out")
    tensors = load_file(path)
    patches, left_over = comfy_load(tensors, comfy_key_map("sd1", model.denoiser))
    assert not left_over
    full = [p for p in patches.values() if "lokr_w1" in p[1] and "lokr_w2" in p[1]]
    decomposed = [p for p in patches.values() if "lokr_w2_a" in p[1]]
    assert full and decomposed
    expected = trained_weights(model)
    for (name, module_path), patch in patches.items():
        layer = in_memory_module(model.parts()[name], module_path)
        key = (name, module_path.removeprefix("text_model.") if (name, module_path) not in expected else module_path)
        torch.testing.assert_close(comfy_weight(patch, layer.get_base_layer().weight), expected[key],
                                   rtol=1e-5, atol=1e-6)
        if "lokr_w1" in patch[1]:  # written as trained: no scale moved into it
            torch.testing.assert_close(patch[1]["lokr_w1"], layer.lokr_w1[ADAPTER].detach())


def prepared_factors(tiny_models, shapes_data, out, variant) -> dict[str, list[torch.Tensor]]:
    """factor name (hada_w1_a, lokr_w2, ...) -> that factor of every adapted module, as prepare leaves them."""
    config = variant_config(tiny_models, shapes_data, out, variant)
    model = load_model(config.model)
    torch.manual_seed(0)
    LoraMethod(config).prepare(model)
    factors = {}
    for part in model.parts().values():
        for name, p in part.named_parameters():
            if f".{ADAPTER}" in name and ("hada_" in name or "lokr_" in name):
                factors.setdefault(name.split(".")[-2], []).append(p.detach())
    return factors


def test_loha_starts_from_lycoris_and_onetrainers_factors(tiny_models, shapes_data, tmp_path):
    """LyCORIS's LoHa init, which OneTrainer's LoHaModule copies: hada_w1_a ~ N(0, 0.1), hada_w1_b and hada_w2_b
    ~ N(0, 1), hada_w2_a zero. peft's own (Kaiming-uniform factors, hada_w2_b zero) started products ~100x smaller,
    so at OneTrainer's learning rate the change grew 130 - 270x slower in the first steps."""
    factors = prepared_factors(tiny_models, shapes_data, tmp_path / "out", "loha")
    assert all(bool((t == 0).all()) for t in factors["hada_w2_a"])
    for name, std in (("hada_w1_a", 0.1), ("hada_w1_b", 1.0), ("hada_w2_b", 1.0)):
        values = torch.cat([t.flatten() for t in factors[name]])
        assert values.numel() > 1000 and abs(values.std().item() - std) < 0.05 * std, name
        assert abs(values.mean().item()) < 0.1 * std, name


def test_lokr_starts_from_lycoris_and_onetrainers_factors(tiny_models, shapes_data, tmp_path):
    """LyCORIS's (and OneTrainer's LoKrModule's) LoKr init: the second Kronecker factor (lokr_w2, or lokr_w2_b of a
    split one) zero, the first and lokr_w2_a Kaiming-uniform (peft's default zeroes lokr_w1 instead)."""
    factors = prepared_factors(tiny_models, shapes_data, tmp_path / "out", "lokr")
    assert factors.get("lokr_w2") and factors.get("lokr_w2_b")  # rank 4 on these sizes: full and split factors
    for name in ("lokr_w2", "lokr_w2_b"):
        assert all(bool((t == 0).all()) for t in factors[name]), name
    for name in ("lokr_w1", "lokr_w2_a"):
        for t in factors[name]:  # Kaiming-uniform (a = sqrt(5)): U(-1 / sqrt(fan_in), 1 / sqrt(fan_in))
            bound = 1 / t.flatten(1).shape[1] ** 0.5
            assert t.abs().max() <= bound and t.abs().max() > bound / 2, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_applies_the_trained_change(trained, variant):
    """`ot-dist lora merge` of the exported file into a fresh base equals peft's own merge of the trained model,
    for every adapted weight (the other weights untouched)."""
    from ot_dist.lora_tools.files import read_lora_file

    trainer, out = trained(variant)
    base = load_model(trainer.config.model)
    path = out / "lora.safetensors"
    merged, missing = merge_into(base, read_lora_file(path, ("lora", "dora", "loha", "lokr")), 1.0, str(path))
    expected = trained_weights(trainer.model)
    assert not missing and merged == len(expected)
    for (name, module_path), weight in expected.items():
        got = base.parts()[name].get_submodule(module_path).weight.float()
        torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-6, msg=f"{name}.{module_path}")


def test_dora_in_the_diffusers_layout_loads_in_diffusers_and_merges(trained, tiny_models, tmp_path):
    """diffusers reads peft's DoRA keys (lora_magnitude_vector) and applies them as trained. (It drops the
    dora_scale of a kohya-layout file with a warning: loaders.lora_pipeline.lora_state_dict.)"""
    from ot_dist.lora_tools.files import read_lora_file

    trainer, _ = trained("dora")
    config = trainer.config
    config = config.model_copy(update={"lora": config.lora.model_copy(update={"file_layout": "diffusers"})})
    [path] = LoraMethod(config).export(trainer.model, tmp_path)
    assert any(k.endswith(".lora_magnitude_vector.weight") for k in load_file(path))
    check_diffusers_load(trainer, tiny_models["sd1"], path, "sd1")
    base = load_model(config.model)
    merge_into(base, read_lora_file(path, ("dora",)), 1.0, str(path))
    for (name, module_path), weight in trained_weights(trainer.model).items():
        torch.testing.assert_close(base.parts()[name].get_submodule(module_path).weight.float(), weight,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["loha", "lokr"])
def test_variants_in_the_diffusers_layout_merge(trained, tmp_path, variant):
    """The diffusers layout (peft's key names, the scale inside the factors, no alpha) reads back at the trained
    change: a loader applying 1.0 (ComfyUI without an alpha tensor) is right too."""
    from ot_dist.lora_tools.files import read_lora_file

    trainer, _ = trained(variant)
    config = trainer.config
    config = config.model_copy(update={"lora": config.lora.model_copy(update={"file_layout": "diffusers"})})
    [path] = LoraMethod(config).export(trainer.model, tmp_path)
    assert not any(k.endswith(".alpha") for k in load_file(path))
    base = load_model(config.model)
    merge_into(base, read_lora_file(path, (variant,)), 1.0, str(path))
    expected = trained_weights(trainer.model)
    for (name, module_path), weight in expected.items():
        torch.testing.assert_close(base.parts()[name].get_submodule(module_path).weight.float(), weight,
                                   rtol=1e-5, atol=1e-6)
    if variant == "lokr":  # read back by peft: diffusers' load_lora_adapter makes a LoKrConfig of the file's metadata
        import json

        from diffusers import UNet2DConditionModel

        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            metadata = json.loads(f.metadata()["lora_adapter_metadata"])
        unet = UNet2DConditionModel.from_pretrained(config.model.path, subfolder="unet")
        unet.load_lora_adapter({k.removeprefix("unet."): v for k, v in tensors.items() if k.startswith("unet.")},
                               metadata={k.removeprefix("unet."): v for k, v in metadata.items()
                                         if k.startswith("unet.")}, prefix=None)
        unet.fuse_lora()
        for (name, module_path), weight in expected.items():
            if name == "unet":
                torch.testing.assert_close(unet.get_submodule(module_path).get_base_layer().weight.float(), weight,
                                           rtol=1e-5, atol=1e-6)


def test_tools_other_than_merge_refuse_variants(trained, tmp_path):
    from ot_dist.lora_tools.resize import resize_command

    _, out = trained("loha")
    with pytest.raises(InputFileError, match="loha file.*ot-dist lora resize.*ot-dist lora merge applies"):
        resize_command(str(out / "lora.safetensors"), 2, str(tmp_path / "r.safetensors"), log=lambda *_: None)


def test_config_refusals(tiny_models, shapes_data, tmp_path):
    with pytest.raises(Exception, match="lora.dropout"):
        variant_config(tiny_models, shapes_data, tmp_path, "loha", **{"lora.dropout": 0.1})
    with pytest.raises(Exception, match="lora.init_from"):
        variant_config(tiny_models, shapes_data, tmp_path, "dora", **{"lora.init_from": str(tmp_path / "x")})
    for variant in ("lora", *VARIANTS):  # ZeRO-3 gathers what the variant layers read (tested on 2 ranks below)
        assert variant_config(tiny_models, shapes_data, tmp_path, variant, strategy="zero3").strategy == "zero3"
    assert variant_config(tiny_models, shapes_data, tmp_path, "dora", **{"lora.dropout": 0.1}).lora.variant == "dora"


def lora_b_inputs(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the layer's up matrix receives in its forward, the down matrix's output for the undropped x)."""
    seen = []
    handle = layer.lora_B[ADAPTER].register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    try:
        layer(x)
    finally:
        handle.remove()
    down = layer.lora_A[ADAPTER]
    undropped = down._conv_forward(x, down.weight, None) if isinstance(down, torch.nn.Conv2d) else \
        torch.nn.functional.linear(x, down.weight)
    return seen[0], undropped.detach()


def test_lora_dropout_drops_the_rank_features_as_onetrainer_and_kohya(tiny_models, shapes_data, tmp_path):
    """`lora.dropout` on plain LoRA drops the down projection's output in train mode (OneTrainer's LoRAModule:
    lora_up(dropout(lora_down(x))) with its dropout_probability; kohya's network_dropout), each rank feature zero
    or scaled by 1 / (1 - p), and nothing in eval mode; peft's lora_dropout dropped input features instead. DoRA
    keeps the input dropout (OneTrainer's DoRA drops the input too)."""
    p = 0.5
    config = variant_config(tiny_models, shapes_data, tmp_path / "out", "lora", **{"lora.dropout": p})
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    layers = [layer for layer in adapted_layers(model.denoiser).values()
              if isinstance(layer.get_base_layer(), torch.nn.Linear)]
    assert layers
    torch.manual_seed(0)
    dropped = total = 0
    for layer in layers:
        assert isinstance(layer.lora_dropout[ADAPTER], torch.nn.Identity)  # the input is not dropped
        x = torch.randn(8, layer.get_base_layer().in_features)
        layer.train()
        received, down = lora_b_inputs(layer, x)
        zero = received == 0
        torch.testing.assert_close(received[~zero], down[~zero] / (1 - p))
        dropped, total = dropped + int(zero.sum()), total + zero.numel()
        layer.eval()
        received, down = lora_b_inputs(layer, x)
        torch.testing.assert_close(received, down)
    assert total > 1000 and abs(dropped / total - p) < 0.05
    dora = variant_config(tiny_models, shapes_data, tmp_path / "dora", "dora", **{"lora.dropout": p})
    model = load_model(dora.model)
    LoraMethod(dora).prepare(model)
    assert all(layer.lora_dropout[ADAPTER].p == p for layer in adapted_layers(model.denoiser).values())


# ---- strategies ---------------------------------------------------------------------------------------------------
def test_variants_train_on_two_ranks_as_in_one_process(small_sd1, shapes_data, tmp_path):
    """fsdp and zero3 for every variant, and ddp / zero1 / zero2 for oft (ot_dist's own layer, not peft's), in one
    2-process gloo launch (batch 2 each), equal to one process with batch 4 on the exported file
    (tests/test_strategies.py's comparison). Under zero3 peft's variant layers read weights outside their owners'
    forward (DoRA the base weight's norm, LoHa / LoKr their ParameterDict factors), which ZeRO-3 gathers only because
    they are registered with the adapter layer (parallel/deepspeed.py). On the 2-level UNet (conftest.py small_sd1:
    every adapted layer kind, 40% of the modules ZeRO-3 hooks) and one shard set."""
    import json

    from test_strategies import ENV, REPO, assert_matches

    steps, lr = 3, 1e-5
    strategies = {**{variant: ("fsdp", "zero3") for variant in VARIANTS}, "oft": ("ddp", "zero1", "zero2")}

    def raw(out, variant, **extra):
        return base_config(small_sd1, shapes_data, out, method="lora", max_steps=steps, learning_rate=lr,
                           **{"lora.rank": RANK, "lora.alpha": ALPHA, "lora.variant": variant,
                              "data.shards": str(tmp_path / "shards")},
                           **({"lora.oft_block_size": 8} if variant == "oft" else {}), **extra)

    references, initial = {}, {}
    for variant in strategies:
        out = tmp_path / f"ref-{variant}"
        trainer = Trainer(validate(raw(out, variant, batch_size=4)), log=lambda *_: None)
        [path] = trainer.export(tmp_path / f"initial-{variant}")
        initial[variant] = load_file(path)
        trainer.train()
        references[variant] = load_file(out / "lora.safetensors")
    cases = {f"{s}-{v}": raw(tmp_path / f"{s}-{v}", v, batch_size=2, strategy=s) for v in strategies
             for s in strategies[v]}
    (tmp_path / "cases.json").write_text(json.dumps(cases, default=str))
    done = run_ranks(str(REPO / "tests" / "helpers" / "family_cases.py"),
                           str(tmp_path / "cases.json"), env=ENV, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for case in cases:
        variant = case.split("-")[1]
        got = load_file(tmp_path / case / "lora.safetensors")
        assert_matches(references[variant], got)
        # the comparison can fail: training moved the file by more than the tolerance
        moved = max((references[variant][k].float() - initial[variant][k].float()).abs().max().item() for k in got)
        assert moved > 2e-5, case


# ---- OneTrainer import --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, variant, skipped", [
    ({"peft_type": "LOHA"}, "loha", None),
    ({"peft_type": "LOKR", "dropout_probability": 0.1}, "lokr", "dropout_probability"),
    ({"peft_type": "LORA", "lora_decompose": True, "lora_decompose_output_axis": True}, "dora", None),
    ({"peft_type": "LORA", "lora_decompose": True, "lora_decompose_output_axis": False}, "lora", "input axis"),
    ({"peft_type": "OFT_2"}, "oft", None),
])
def test_onetrainer_peft_type_becomes_the_variant(settings, variant, skipped):
    """OneTrainer's TrainConfig peft_type (LORA, LOHA, OFT_2, LOKR) and lora_decompose / lora_decompose_output_axis
    (modules/util/config/TrainConfig.py)."""
    from ot_dist.migrate.onetrainer import _lora_variant

    lora, notes = {"rank": 4, "alpha": 1.0, "dropout": settings.get("dropout_probability", 0.0)}, []
    _lora_variant(settings, lora, notes.append)
    assert lora.get("variant", "lora") == variant
    assert (skipped is None) == (not notes) and all(skipped in n for n in notes)


# ---- transformer families -----------------------------------------------------------------------------------------
def moved_flux_lora(family_models, shapes_data, out, variant, scale, **parts):
    """A Flux model with `variant` adapters whose trainable tensors moved by seeded noise x `scale` (a stand-in for
    training), and the LoRA file exported from it: (model, file)."""
    config = validate(base_config(family_models["flux"], shapes_data, out, family="flux", method="lora",
                                  **{"lora.rank": RANK, "lora.alpha": ALPHA, "lora.variant": variant, **parts}))
    model = load_model(config.model)
    method = LoraMethod(config)
    method.prepare(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for part in model.parts().values():
            for p in part.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=generator) * scale)
    [lora] = method.export(model, out)
    return model, lora


def test_flux_dora_file_loads_in_diffusers_as_ot_dist_merges_it(family_models, shapes_data, tmp_path):
    """Flux's file (peft layout: transformer + CLIP-L, magnitude and scale inside): diffusers' load_lora_weights +
    fuse_lora gives the weights `ot-dist lora merge` writes. (At strength 1: for DoRA diffusers' lora_scale scales
    the direction's change, merge's --weight blends the merged weight as ComfyUI does.)"""
    from diffusers import DiffusionPipeline
    from test_lora_tools import assert_same_weights, diffusers_fused, run_cli

    model, lora = moved_flux_lora(family_models, shapes_data, tmp_path / "o", "dora", 0.05,
                                  **{"text_encoder.train": True})
    base = family_models["flux"]
    done = run_cli("lora", "merge", base, lora, "--family", "flux", "--out", tmp_path / "merged", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout, done.stdout
    merged = DiffusionPipeline.from_pretrained(tmp_path / "merged")
    assert_same_weights(merged, diffusers_fused(base, lora, 1.0), DiffusionPipeline.from_pretrained(base))
    expected = trained_weights(model)
    for (name, module_path), weight in expected.items():
        torch.testing.assert_close(getattr(merged, name).get_submodule(module_path).weight.float(), weight,
                                   rtol=1e-5, atol=1e-6)


def test_flux_dora_file_gives_comfyui_its_magnitude(family_models, shapes_data, tmp_path):
    """ComfyUI (and Forge) read DoRA's magnitude only as `<module>.dora_scale` (load_lora above): the diffusers-layout
    file (Flux's here; SD3's, Chroma's and PixArt's are written alike) carries it beside peft's
    `lora_magnitude_vector.weight`, which diffusers reads, so ComfyUI applies DoRA on every module: the trained
    weight, with the output-axis norm of W + change (#15458; until then each row is off by ||W + change|| / ||W||).
    With the magnitude vector alone ComfyUI applied the plain LoRA part, without the magnitude or the norm."""
    from test_lora_t5 import comfy_key_map as flux_key_map
    from test_lora_t5 import layer_at

    model, lora = moved_flux_lora(family_models, shapes_data, tmp_path / "o", "dora", 0.05,
                                  **{"text_encoder.train": True, "text_encoder_2.train": True})
    tensors = load_file(lora)
    patches, left_over = comfy_load(tensors, flux_key_map("flux", model))
    # peft's name for the magnitude is left to diffusers (ComfyUI: "lora key not loaded")
    assert left_over == {k for k in tensors if k.endswith(".lora_magnitude_vector.weight")}
    expected = trained_weights(model)
    assert {part for part, _ in patches} == {"transformer", "text_encoder", "text_encoder_2"}
    assert len(patches) == len(expected)
    for (part, path), patch in patches.items():
        assert patch[3] is not None, f"{part}.{path}: no dora_scale"
        layer = layer_at(model.parts()[part], path)
        key = next(k for k in expected if k[0] == part and layer_at(model.parts()[part], k[1]) is layer)
        torch.testing.assert_close(comfy_weight(patch, layer.get_base_layer().weight, dora_norm_of_adapted=True),
                                   expected[key], rtol=1e-5, atol=1e-6, msg=f"{part}.{path}")


@pytest.mark.parametrize("variant", ["loha", "lokr"])
def test_flux_loha_lokr_load_in_comfyui_at_the_trained_change(family_models, shapes_data, tmp_path, variant):
    """Flux's file: transformer and CLIP-L under peft's names with the scale inside (ComfyUI: no alpha, 1.0), T5-XXL
    under ComfyUI's lora_te3_ names with .alpha tensors; ComfyUI's key names from tests/test_lora_t5.py."""
    from test_lora_t5 import comfy_key_map as flux_key_map
    from test_lora_t5 import layer_at

    model, lora = moved_flux_lora(family_models, shapes_data, tmp_path / "o", variant, 0.2,
                                  **{"text_encoder.train": True, "text_encoder_2.train": True})
    patches, left_over = comfy_load(load_file(lora), flux_key_map("flux", model))
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    expected = trained_weights(model)
    assert {part for part, _ in patches} == {"transformer", "text_encoder", "text_encoder_2"}
    assert len(patches) == len(expected)
    for (part, path), patch in patches.items():
        layer = layer_at(model.parts()[part], path)
        key = next(k for k in expected if k[0] == part and layer_at(model.parts()[part], k[1]) is layer)
        torch.testing.assert_close(comfy_weight(patch, layer.get_base_layer().weight), expected[key],
                                   rtol=1e-5, atol=1e-6)


def test_merge_applies_another_trainers_input_axis_dora(tiny_models, tmp_path):
    """OneTrainer's / LyCORIS's default DoRA (dora_scale [1, in]: the norm per input column) merges as ComfyUI's
    input-axis rule applies it, at a strength other than 1; Tucker factors are refused naming the key."""
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.lora_tools.files import read_lora_file

    base = load_model(ModelConfig(family="sd1", path=str(tiny_models["sd1"])))
    path = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    weight = base.denoiser.get_submodule(path).weight.detach().clone()
    generator = torch.Generator().manual_seed(1)
    name = "lora_unet_" + path.replace(".", "_")
    tensors = {f"{name}.lora_down.weight": torch.randn(2, weight.shape[1], generator=generator) * 0.3,
               f"{name}.lora_up.weight": torch.randn(weight.shape[0], 2, generator=generator) * 0.3,
               f"{name}.alpha": torch.tensor(1.0),
               f"{name}.dora_scale": weight.norm(dim=0, keepdim=True) * 1.5}
    save_file(tensors, str(tmp_path / "onetrainer_dora.safetensors"))
    merge_into(base, read_lora_file(tmp_path / "onetrainer_dora.safetensors", ("dora",)), 0.6, "file")
    patch = ("lora", {k.split(".", 1)[1]: v for k, v in tensors.items() if "lora_" in k}, 1.0,
             tensors[f"{name}.dora_scale"])
    assert patch[3].shape[0] != weight.shape[0]  # input axis
    expected = weight + 0.6 * (comfy_weight(patch, weight) - weight)  # ComfyUI's strength rule
    torch.testing.assert_close(base.denoiser.get_submodule(path).weight.float(), expected, rtol=1e-5, atol=1e-6)

    save_file({f"{name}.hada_w1_a": torch.zeros(4, 2), f"{name}.hada_w1_b": torch.zeros(2, 4),
               f"{name}.hada_w2_a": torch.zeros(4, 2), f"{name}.hada_w2_b": torch.zeros(2, 4),
               f"{name}.hada_t1": torch.zeros(2, 2, 3, 3)}, str(tmp_path / "tucker.safetensors"))
    with pytest.raises(InputFileError, match="hada_t1"):
        read_lora_file(tmp_path / "tucker.safetensors", VARIANTS)


# ---- A1111's built-in Lora extension and DoRA ---------------------------------------------------------------------
# Read from AUTOMATIC1111/stable-diffusion-webui extensions-builtin/Lora/network.py (DoRA since PR #15160, alpha / rank
# applied before the decomposition since PR #16151, in 1.10): NetworkModule.finalize_updown multiplies the module's
# change (network_lora.py: up @ down, reshaped to the weight) by calc_scale (alpha / rank), then, when the module has a
# dora_scale, apply_weight_decompose: merged = W + change; norm = ||merged|| per INPUT column (transpose(0, 1),
# reshape(in, -1), norm(dim=1), back to [1, in, 1, ...]); change = merged x (dora_scale / norm) - W; finally x the
# multiplier (the prompt's strength). dora_scale's shape is not checked: an output-axis [out, 1] broadcasts against
# the [1, in] norm without an error.
def a1111_weight(patch, weight: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
    kind, t, alpha, dora = patch
    assert kind == "lora"
    weight = weight.float()
    rank = t["lora_down.weight"].shape[0]
    change = (t["lora_up.weight"].flatten(1).float() @ t["lora_down.weight"].flatten(1).float()).reshape(weight.shape)
    change = change * (alpha / rank if alpha is not None else 1.0)
    merged = weight + change
    norm = (merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1, keepdim=True)
            .reshape(merged.shape[1], *[1] * (merged.dim() - 1)).transpose(0, 1))
    return weight + strength * (merged * (dora.float() / norm) - weight)


def test_a1111_applies_our_dora_file_scaled_by_row_over_column_norms(trained):
    """A1111 (and Forge before its wd_on_output support) normalises DoRA per input column. Our file's magnitude is per
    output row (peft's DoRA), which A1111 applies without an error as W_a[o, j] = trained[o, j] x r_o / c_j, with r_o /
    c_j the norms of row o / column j of W + change: not the trained model (docs/lora.md). The same rule applies an
    input-axis file (OneTrainer's / LyCORIS's default) as ComfyUI does, which is what `ot-dist lora merge` does."""
    trainer, out = trained("dora")
    model = trainer.model
    tensors = load_file(out / "lora.safetensors")
    patches, _ = comfy_load(tensors, comfy_key_map("sd1", model.denoiser))
    expected = trained_weights(model)
    worst = 0.0
    for (name, path), patch in patches.items():
        base = in_memory_module(model.parts()[name], path).get_base_layer().weight.detach().float()
        trained_weight = expected[(name, path.removeprefix("text_model.") if (name, path) not in expected else path)]
        merged = comfy_weight((*patch[:3], None), base)  # W + alpha / rank x up @ down
        rows = merged.flatten(1).norm(dim=1).reshape(-1, *[1] * (base.dim() - 1))
        columns = merged.transpose(0, 1).flatten(1).norm(dim=1).reshape(1, -1, *[1] * (base.dim() - 2))
        applied = a1111_weight(patch, base)
        torch.testing.assert_close(applied, trained_weight * rows / columns, rtol=1e-5, atol=1e-6)
        worst = max(worst, float((applied - trained_weight).abs().max() / trained_weight.abs().max()))
        # an input-axis magnitude (what A1111 means): A1111's rule is ComfyUI's input-axis rule
        as_input = (*patch[:3], columns.reshape(1, -1, *[1] * (base.dim() - 2)) * 1.1)
        torch.testing.assert_close(a1111_weight(as_input, base), comfy_weight(as_input, base), rtol=1e-5, atol=1e-6)
    assert worst > 0.5, worst  # far from the trained weights (measured 1.66 x the largest trained entry)
