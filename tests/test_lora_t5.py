"""T5-XXL text-encoder LoRAs of Flux, SD3, Chroma and PixArt are written under the names ComfyUI's loader maps for
T5-XXL, at the trained strength, beside the transformer's and CLIPs' modules (issue 24); diffusers' `load_lora_weights`
of the same file still gives the in-memory model's outputs where diffusers loads the component, and
`load_peft_lora` / `ot-dist lora merge` apply the T5 part diffusers skips.

ComfyUI's rules, as an oracle below. Read from github.com/Comfy-Org/ComfyUI:
  comfy/lora.py @ 17358c8f73b581a0d22facc3c385822f09b8bfb1, `model_lora_keys_clip`: for every weight
    `t5xxl.transformer.<k>.weight` of the loaded text-encoder model the name `lora_te{N}_<k with "_" for ".">` maps
    to it, with N = 1, +1 when clip_g is loaded, +1 when clip_l is loaded; when clip_l is loaded and N is then 2 (no
    clip_g: Flux), both lora_te2_ ("OneTrainer Flux") and lora_te3_ map. CLIP-L / CLIP-G LoRA modules in the
    diffusers layout: `text_encoder.text_model.encoder.layers.<b>.<c>` (clip_l), `text_encoder_2.text_model.…`
    (clip_g beside clip_l), c in LORA_CLIP_MAP (mlp.fc1, mlp.fc2, self_attn.q_proj / k_proj / v_proj / out_proj).
  `model_lora_keys_unet`: Flux (and Chroma, whose model class subclasses Flux), SD3 and PixArt map
    `transformer.<diffusers weight name without .weight>`.
  comfy/weight_adapter/lora.py @ 6f98b150e065f1ffc788558574a887835068bd40, LoRAAdapter.load / calculate_weight: per
    mapped name x it reads `x.lora_up.weight` + `x.lora_down.weight` or (diffusers2) `x.lora_B.weight` +
    `x.lora_A.weight`, and `x.alpha` when present; W += (alpha / rank, 1.0 without an alpha tensor) * up @ down.
  Text-encoder models (comfy/text_encoders/flux.py FluxClipModel: clip_l + t5xxl; sd3_clip.py SD3ClipModel: clip_l,
    clip_g, t5xxl; chroma.py ChromaT5XXL and pixart_t5.py PixArtT5XXL: t5xxl alone). Their T5 (comfy/text_encoders/
    t5.py) has transformers' module paths: encoder.block.<i>.layer.0.SelfAttention.{q,k,v,o},
    encoder.block.<i>.layer.1.DenseReluDense.{wi_0,wi_1,wo}.
kohya's sd-scripts name the T5 of Flux and SD3 lora_te3 too (networks/lora_flux.py, lora_sd3.py:
LORA_PREFIX_TEXT_ENCODER_T5 = "lora_te3", "make ComfyUI compatible").

diffusers 0.42 loads no T5 LoRA: FluxLoraLoaderMixin (Flux, Chroma) loads transformer + text_encoder (CLIP-L),
SD3LoraLoaderMixin transformer + text_encoder + text_encoder_2, PixArt's pipelines have no loader at all. The T5 part
is left alone by them (checked below) and loads with `ot_dist.lora_tools.peft_load.load_peft_lora`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.methods.lora import ADAPTER
from ot_dist.train.trainer import Trainer

RANK, ALPHA = 4, 2.0  # alpha != rank: a loader that ignores the alpha tensor applies twice the trained change

# family -> (the T5 component, the trained text encoders, ComfyUI's text-encoder models for the family)
FAMILIES = {
    "flux": ("text_encoder_2", ("text_encoder", "text_encoder_2"), ("clip_l", "t5xxl")),
    "sd3": ("text_encoder_3", ("text_encoder", "text_encoder_2", "text_encoder_3"), ("clip_l", "clip_g", "t5xxl")),
    "chroma": ("text_encoder", ("text_encoder",), ("t5xxl",)),
    "pixart_sigma": ("text_encoder", ("text_encoder",), ("t5xxl",)),
}
# diffusers component -> ComfyUI CLIP model, for the CLIP encoders (diffusers-layout names)
COMFY_CLIPS = {"flux": {"text_encoder": "clip_l"}, "sd3": {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}}
LORA_CLIP_MAP = ("mlp.fc1", "mlp.fc2", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj",
                 "self_attn.out_proj")


def comfy_t5_prefixes(clip_models: tuple[str, ...]) -> list[str]:
    """model_lora_keys_clip's lora_te{N} prefixes for t5xxl weights, from the CLIP models ComfyUI has loaded."""
    index, prefixes = 1, []
    if "clip_g" in clip_models:
        index += 1
    if "clip_l" in clip_models:
        index += 1
        if index == 2:  # "OneTrainer Flux"
            prefixes.append(f"lora_te{index}")
            index += 1
    return prefixes + [f"lora_te{index}"]


def weight_names(module: torch.nn.Module) -> list[str]:
    """The module's weight names as the model without its peft wrappers has them (what ComfyUI loads)."""
    return [k.replace(".base_layer.", ".") for k in module.state_dict() if k.endswith(".weight") and ".lora_" not in k]


def comfy_key_map(family: str, model) -> dict[str, tuple[str, str]]:
    """ComfyUI's LoRA name -> (diffusers component, module path) for the family's transformer and text encoders."""
    t5, _, clip_models = FAMILIES[family]
    names = {f"transformer.{k[:-len('.weight')]}": ("transformer", k[:-len(".weight")])
             for k in weight_names(model.denoiser)}
    names.update(clip_text_names(family, clip_models))
    for key in weight_names(model.text_encoders[t5]):  # T5EncoderModel's names = ComfyUI's t5xxl.transformer.<k>
        path = key[: -len(".weight")]
        for prefix in comfy_t5_prefixes(clip_models):
            names[f"{prefix}_{path.replace('.', '_')}"] = (t5, path)
    return names


def comfy_load(tensors: dict[str, torch.Tensor], key_map: dict) -> tuple[dict, set[str]]:
    """LoRAAdapter.load over the key map: (component, path) -> (up, down, alpha or None); the keys left unloaded."""
    patches, loaded = {}, set()
    for name, target in key_map.items():
        for up, down in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            if name + up in tensors:
                alpha = tensors.get(name + ".alpha")
                patches[target] = (tensors[name + up], tensors[name + down], None if alpha is None else alpha.item())
                loaded |= {name + up, name + down} | ({name + ".alpha"} if alpha is not None else set())
                break
    return patches, set(tensors) - loaded


def comfy_weight_change(patch) -> torch.Tensor:
    up, down, alpha = patch
    return (alpha / down.shape[0] if alpha is not None else 1.0) * (up.float() @ down.float())


def peft_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {path: sub for path, sub in module.named_modules() if isinstance(sub, LoraLayer)}


def layer_at(component: torch.nn.Module, path: str) -> torch.nn.Module:
    """A module by the path a file names; transformers 5's CLIPTextModel has no `text_model.` level."""
    modules = dict(component.named_modules())
    return modules[path] if path in modules else modules[path.removeprefix("text_model.")]


_RUNS = {}


@pytest.fixture
def trained(family_models, shapes_data, tmp_path_factory):
    """family -> (trainer, lora file) of a 2-step LoRA run on the transformer and the text encoders, made once."""

    def run(family):
        if family not in _RUNS:
            out = tmp_path_factory.mktemp(f"lora-t5-{family}") / "out"
            parts = {f"{name}.train": True for name in FAMILIES[family][1]}
            config = validate(base_config(family_models[family], shapes_data, out, family=family, method="lora",
                                          max_steps=2, learning_rate=1e-2, output_dtype="float32",
                                          **{"lora.rank": RANK, "lora.alpha": ALPHA}, **parts))
            trainer = Trainer(config, log=lambda *_: None)
            trainer.train()
            for encoder in trainer.model.text_encoders.values():
                encoder.eval()  # a trained encoder is left in train mode: no dropout in the comparisons
            _RUNS[family] = trainer, out / "lora.safetensors"
        return _RUNS[family]

    return run


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_module_is_named_as_comfyui_reads_it_at_the_trained_strength(trained, family):
    trainer, path = trained(family)
    model = trainer.model
    t5 = FAMILIES[family][0]
    tensors = load_file(path)
    patches, left_over = comfy_load(tensors, comfy_key_map(family, model))
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    parts = model.parts()
    expected = {(name, path) for name, part in parts.items() for path in peft_layers(part)}
    assert {(name, layer_path(parts[name], p)) for name, p in patches} == expected
    t5_names = {k.rsplit(".lora_", 1)[0] for k in tensors if k.startswith("lora_te")}
    assert t5_names and all(n.startswith(comfy_t5_prefixes(FAMILIES[family][2])[-1] + "_encoder_block_")
                            for n in t5_names)
    moved = set()
    for (component, module_path), patch in patches.items():
        layer = layer_at(parts[component], module_path)
        trained_change = layer.get_delta_weight(ADAPTER)
        torch.testing.assert_close(comfy_weight_change(patch), trained_change, rtol=1e-5, atol=1e-7)
        if component == t5:
            assert patch[2] == ALPHA  # the .alpha tensor is there, and it is the trained alpha
        if trained_change.abs().max() > 0:
            moved.add(component)
    assert t5 in moved, "the T5 LoRA did not train: the comparison would be 0 == 0"


def layer_path(component: torch.nn.Module, path: str) -> str:
    return path if path in dict(component.named_modules()) else path.removeprefix("text_model.")


def encode(model, tokenizer_name: str, encoder, prompt="a red circle"):
    tokenizer = model.tokenizers[tokenizer_name]
    ids = tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    with torch.no_grad():
        return encoder(ids)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_diffusers_and_load_peft_lora_give_the_in_memory_outputs(trained, family_models, family):
    """diffusers' load_lora_weights: the transformer and CLIP encoders as trained, the T5 untouched (it loads no
    T5 LoRA); load_peft_lora(components=[T5]) then adds the T5 part. PixArt: load_peft_lora loads everything."""
    import diffusers

    from ot_dist.lora_tools.peft_load import load_peft_lora

    trainer, path = trained(family)
    model = trainer.model
    t5, encoders, _ = FAMILIES[family]
    pipeline_cls = getattr(diffusers, model.family.pipeline_class)
    base = pipeline_cls.from_pretrained(family_models[family], local_files_only=True)
    loaded = pipeline_cls.from_pretrained(family_models[family], local_files_only=True)
    tokenizer_of = dict(zip(model.family.text_encoders, model.family.tokenizers))
    if hasattr(loaded, "load_lora_weights"):
        loaded.load_lora_weights(path.parent, weight_name=path.name)
        torch.testing.assert_close(encode(model, tokenizer_of[t5], getattr(loaded, t5)),
                                   encode(model, tokenizer_of[t5], getattr(base, t5)), rtol=0, atol=0)
        assert load_peft_lora(loaded, path, components=[t5]) == [t5]
    else:
        assert load_peft_lora(loaded, path) == sorted({"transformer", *encoders})
    for name in encoders:
        ours = encode(model, tokenizer_of[name], model.text_encoders[name])
        assert not torch.allclose(ours, encode(model, tokenizer_of[name], getattr(base, name)), atol=1e-5), name
        torch.testing.assert_close(encode(model, tokenizer_of[name], getattr(loaded, name)), ours, rtol=1e-5,
                                   atol=1e-6, msg=name)
    # the transformer, on the in-memory model's conditioning
    torch.manual_seed(0)
    channels = model.denoiser.config.in_channels
    noisy = torch.randn(1, channels if family != "flux" and family != "chroma" else channels // 4, 8, 8)
    t = torch.tensor([500.0])
    with torch.no_grad():
        conditioning = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, ["a dot"]))
        ours = model.family.predict(model.denoiser, noisy, t, conditioning, {})
        theirs = model.family.predict(loaded.transformer, noisy, t, conditioning, {})
        before = model.family.predict(base.transformer, noisy, t, conditioning, {})
    assert (ours - before).abs().max() > 1e-5
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merge_applies_the_t5_part_as_trained(trained, family_models, family):
    """ot-dist lora merge's reading of the file: every T5 weight becomes base + the trained change (diffusers'
    fuse_lora has no T5 to compare with; tests/test_lora_tools.py compares the rest with it)."""
    from ot_dist.config.schema import ModelConfig
    from ot_dist.lora_tools.files import read_lora_file
    from ot_dist.lora_tools.merge import merge_into
    from ot_dist.models.loading import load_model

    trainer, path = trained(family)
    t5 = FAMILIES[family][0]
    base = load_model(ModelConfig(family=family, path=str(family_models[family])))
    merged, missing = merge_into(base, read_lora_file(path), 1.0, str(path))
    assert not missing
    trained_t5 = trainer.model.text_encoders[t5]
    layers = peft_layers(trained_t5)
    assert layers and merged == sum(len(peft_layers(p)) for p in trainer.model.parts().values())
    merged_t5 = dict(base.text_encoders[t5].named_modules())
    for module_path, layer in layers.items():
        expected = layer.base_layer.weight.float() + layer.get_delta_weight(ADAPTER)
        torch.testing.assert_close(merged_t5[module_path].weight.float(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["flux", "chroma"])
def test_init_from_the_file_starts_every_adapter_at_the_trained_change(trained, family_models, shapes_data, tmp_path,
                                                                        family):
    """lora.init_from reads the T5 names too: a new run from the file starts where training ended, at another alpha."""
    from ot_dist.methods.lora import LoraMethod
    from ot_dist.models.loading import load_model

    trainer, path = trained(family)
    parts = {f"{name}.train": True for name in FAMILIES[family][1]}
    config = validate(base_config(family_models[family], shapes_data, tmp_path / "o", family=family, method="lora",
                                  **{"lora.rank": RANK, "lora.alpha": 1.0, "lora.init_from": str(path)}, **parts))
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    checked = 0
    for name, part in trainer.model.parts().items():
        started = peft_layers(model.part(name))
        for module_path, layer in peft_layers(part).items():
            torch.testing.assert_close(started[module_path].get_delta_weight(ADAPTER), layer.get_delta_weight(ADAPTER),
                                       rtol=1e-5, atol=1e-7)
            checked += 1
    assert checked and FAMILIES[family][0] in trainer.model.parts()


# A1111 / Forge. Read from github.com/lllyasviel/stable-diffusion-webui-forge:
#   backend/patcher/lora.py @ cea9f37fa5fd5b4c372b95bd46635f4241f60d26, `model_lora_keys_clip`: first the
#     ComfyUI-derived map below, then for every weight `t5xxl.transformer.<k>.weight` of the text-encoder model the
#     names lora_te1_<k>, lora_te2_<k> and lora_te3_<k> ("." as "_"), whatever CLIP models are loaded.
#   packages_3rdparty/comfyui_lora_collection/lora.py @ 5e1dcd35a8535564884a4116f6bbb37dbb8dfc46: t5xxl weights from
#     lora_te3_<k> and lora_te2_<k>; clip_l's layers from `text_encoder.text_model.encoder.layers.<b>.<c>` (and
#     lora_te1_ / lora_te_ kohya names), clip_g's beside clip_l from `text_encoder_2.text_model.encoder.layers.<b>.<c>`,
#     c in LORA_CLIP_MAP; `load_lora` reads `x.lora_up.weight` + `x.lora_down.weight` or `x.lora_B.weight` +
#     `x.lora_A.weight` and `x.alpha`; backend/patcher/lora.py `merge_lora_to_weight` applies W += alpha / rank
#     (rank = the down matrix's first dimension; 1.0 without an alpha tensor) * up @ down, ComfyUI's rule.
#   The text-encoder models (backend/diffusion_engine/flux.py: clip_l + t5xxl, sd35.py: clip_l + clip_g + t5xxl,
#     chroma.py: t5xxl alone) hold T5 as backend/nn/t5.py IntegratedT5, `transformer` = T5 with transformers' module
#     paths (encoder.block.<i>.layer.0.SelfAttention.q, ...).
FORGE_T5_PREFIXES = ("lora_te1", "lora_te2", "lora_te3")


def clip_text_names(family: str, clip_models) -> dict[str, tuple[str, str]]:
    """The CLIP text encoders' layer names both loaders take (`<component>.text_model.encoder.layers.N.<module>`)."""
    names = {}
    for component, clip in COMFY_CLIPS.get(family, {}).items():
        if clip == "clip_g" and "clip_l" not in clip_models:
            continue
        for block in range(32):
            for module in LORA_CLIP_MAP:
                names[f"{component}.text_model.encoder.layers.{block}.{module}"] = (
                    component, f"text_model.encoder.layers.{block}.{module}")
    return names


def forge_text_key_map(family: str, model) -> dict[str, tuple[str, str]]:
    """Forge's LoRA name -> (diffusers component, module path) for the family's text encoders."""
    t5, _, clip_models = FAMILIES[family]
    names = {}
    names.update(clip_text_names(family, clip_models))
    for key in weight_names(model.text_encoders[t5]):
        path = key[: -len(".weight")]
        for prefix in FORGE_T5_PREFIXES:
            names[f"{prefix}_{path.replace('.', '_')}"] = (t5, path)
    return names


@pytest.mark.parametrize("family", ["flux", "sd3", "chroma"])
def test_text_encoder_modules_are_named_as_forge_reads_them_at_the_trained_strength(trained, family):
    """Every text-encoder module of the file (T5's lora_te3_ for Flux / SD3, lora_te1_ for Chroma; CLIP-L / CLIP-G
    in the diffusers layout) is one Forge's key map loads, and its change is the trained one."""
    trainer, path = trained(family)
    model = trainer.model
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith("transformer.")}
    patches, left_over = comfy_load(tensors, forge_text_key_map(family, model))
    assert not left_over, f"Forge would not load {sorted(left_over)[:5]}"
    parts = model.parts()
    expected = {(name, p) for name in FAMILIES[family][1] for p in peft_layers(parts[name])}
    assert {(name, layer_path(parts[name], p)) for name, p in patches} == expected
    t5 = FAMILIES[family][0]
    assert any(component == t5 for component, _ in patches)
    for (component, module_path), patch in patches.items():
        layer = layer_at(parts[component], module_path)
        torch.testing.assert_close(comfy_weight_change(patch), layer.get_delta_weight(ADAPTER), rtol=1e-5, atol=1e-7)
        if component == t5:
            assert patch[2] == ALPHA


def test_a_merged_single_file_carries_the_merged_text_encoder(trained, family_models, tmp_path):
    """`ot-dist lora merge --format single-file` of a LoRA with T5 modules: the file is Chroma's full checkpoint (as a
    full finetune that trained the T5 writes, docs/checkpoints.md), and its T5 is the merged one when read back with the
    base folder as model.config."""
    from ot_dist.config.schema import ModelConfig
    from ot_dist.lora_tools.merge import merge_command
    from ot_dist.models.loading import load_model

    trainer, path = trained("chroma")
    out = merge_command(str(family_models["chroma"]), "chroma", [str(path)], [1.0], str(tmp_path / "m.safetensors"),
                        "single-file", None, "float32", log=lambda *_: None)
    assert any(k.startswith("cond_stage_model.t5xxl.transformer.") for k in load_file(out))
    merged = load_model(ModelConfig(family="chroma", path=str(out), config=str(family_models["chroma"])))
    t5 = dict(merged.text_encoders["text_encoder"].named_modules())
    for module_path, layer in peft_layers(trainer.model.text_encoders["text_encoder"]).items():
        expected = layer.base_layer.weight.float() + layer.get_delta_weight(ADAPTER)
        torch.testing.assert_close(t5[module_path].weight.float(), expected, rtol=1e-5, atol=1e-6)
