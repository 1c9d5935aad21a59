"""The LoRA file is read the same way by ComfyUI, A1111 / Forge, kohya and diffusers (issue 24, SD 1.x / 2.x / SDXL).

ComfyUI's rules are written down below as a small oracle (which names it maps to which module, which tensors it
reads per module, and the weight change it applies), and checked against the exported files: every module is
recognised, no tensor is left over, and the change ComfyUI applies equals the change the trained peft model makes.
diffusers' `load_lora_weights` of the same file reproduces the in-memory model's UNet and text-encoder outputs.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import base_config
from diffusers import DiffusionPipeline
from safetensors import safe_open
from safetensors.torch import load_file
from test_methods import text_output, unet_inputs, unet_output

from ot_dist.config.load import validate
from ot_dist.methods.lora import ADAPTER, LoraMethod
from ot_dist.train.trainer import Trainer

RANK, ALPHA = 4, 2.0  # alpha != rank: a loader that ignores alpha applies 2x the trained change

# ---- ComfyUI's key rules ------------------------------------------------------------------------------------
# Read from github.com/comfyanonymous/ComfyUI:
#   comfy/lora.py @ 41444b5236c613ee5ff7d09aa620f94b702f30eb: model_lora_keys_unet, model_lora_keys_clip, load_lora
#   comfy/utils.py @ 2ba5cc8b867bc1aabe59fdaf0a8489e65012d603: unet_to_diffusers (which diffusers UNet names exist)
#   comfy/weight_adapter/lora.py @ 6fd406fb14ca663225b88c6f75d7a7f2b997e5a0: LoRAAdapter.load / calculate_weight
# UNet (SD 1.x / 2.x / SDXL): "lora_unet_" + <diffusers weight name without ".weight", "." -> "_"> for every name
# unet_to_diffusers produces: resnets (conv1, conv2, time_emb_proj, conv_shortcut, norm1, norm2), attentions
# (proj_in, proj_out, norm), their transformer_blocks (norm1-3, attn1/attn2 to_q/to_k/to_v/to_out.0,
# ff.net.0.proj, ff.net.2), down/upsampler convs, and conv_in, conv_out, conv_norm_out, time_embedding.linear_1/2,
# add_embedding.linear_1/2, class_embedding.linear_1/2. It also takes "lora_unet_" + every original (ldm / sgm)
# weight name of its model, i.e. the weight's key in the original single file (`original_unet_paths`).
# ("unet.<name>" with ".processor.to_*" for attention is a third form; ot_dist does not write it.)
_BLOCK = r"(down_blocks\.\d+|up_blocks\.\d+|mid_block)"
COMFY_UNET_NAMES = re.compile(
    rf"{_BLOCK}\.resnets\.\d+\.(conv1|conv2|time_emb_proj|conv_shortcut|norm1|norm2)"
    rf"|{_BLOCK}\.attentions\.\d+\.(proj_in|proj_out|norm)"
    rf"|{_BLOCK}\.attentions\.\d+\.transformer_blocks\.\d+\."
    r"(norm[123]|attn[12]\.to_(q|k|v|out\.0)|ff\.net\.0\.proj|ff\.net\.2)"
    r"|down_blocks\.\d+\.downsamplers\.0\.conv|up_blocks\.\d+\.upsamplers\.0\.conv"
    r"|conv_in|conv_out|conv_norm_out|(time_embedding|add_embedding|class_embedding)\.linear_[12]"
)
# CLIP: LORA_CLIP_MAP's six modules of encoder layers 0-31, named "<prefix>_text_model_encoder_layers_<i>_<m>"
# with m in mlp_fc1, mlp_fc2, self_attn_q_proj / k_proj / v_proj / out_proj. Prefixes: SD 1.x (clip_l) and
# SD 2.x (clip_h): lora_te and lora_te1; SDXL: clip_l lora_te / lora_te1, clip_g (with clip_l present) lora_te2,
# plus lora_te2_text_projection for clip_g's projection.
CLIP_MODULES = {"mlp_fc1": "mlp.fc1", "mlp_fc2": "mlp.fc2", "self_attn_q_proj": "self_attn.q_proj",
                "self_attn_k_proj": "self_attn.k_proj", "self_attn_v_proj": "self_attn.v_proj",
                "self_attn_out_proj": "self_attn.out_proj"}
COMFY_CLIP_PREFIXES = {"sd1": {"lora_te": "text_encoder", "lora_te1": "text_encoder"},
                       "sd2": {"lora_te": "text_encoder", "lora_te1": "text_encoder"},
                       "sdxl": {"lora_te": "text_encoder", "lora_te1": "text_encoder", "lora_te2": "text_encoder_2"}}


_ORIGINAL_PATHS = {}


def original_unet_paths(model_path, family: str) -> dict[str, str]:
    """diffusers UNet module path -> its path in the original (ldm / sgm) UNet: the key of its weight in the
    original single file (what ComfyUI's model and kohya's SDXL UNet hold), less `model.diffusion_model.` and
    `.weight`; matched by value (random weights, each unique)."""
    if family not in _ORIGINAL_PATHS:
        import tempfile
        from pathlib import Path

        from ot_dist.models.families.registry import get_family

        pipe = DiffusionPipeline.from_pretrained(model_path)
        components = {n: pipe.components[n] for n in ("unet", "vae", *TEXT_PARTS[family])}
        with tempfile.TemporaryDirectory() as folder:
            single = Path(folder) / "model.safetensors"
            get_family(family).export_single_file(components, {n: m.state_dict() for n, m in components.items()},
                                                  single, torch.float32)
            prefix = "model.diffusion_model."
            original_of = {value.numpy().tobytes(): key[len(prefix):-len(".weight")]
                           for key, value in load_file(single).items()
                           if key.startswith(prefix) and key.endswith(".weight")}
        _ORIGINAL_PATHS[family] = {path: original_of[m.weight.detach().numpy().tobytes()]
                                   for path, m in pipe.unet.named_modules()
                                   if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    return _ORIGINAL_PATHS[family]


def comfy_key_map(family: str, unet: torch.nn.Module,
                  originals: dict[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """ComfyUI's name -> (diffusers component, module path in the original transformers-4 / diffusers naming).
    `originals`: the UNet's original module paths (`original_unet_paths`), for files that use them."""
    names = {}
    for path, module in unet.named_modules():
        if COMFY_UNET_NAMES.fullmatch(path) and getattr(module, "weight", None) is not None:
            names["lora_unet_" + path.replace(".", "_")] = ("unet", path)
    for path, original in (originals or {}).items():
        names["lora_unet_" + original.replace(".", "_")] = ("unet", path)
    for prefix, component in COMFY_CLIP_PREFIXES[family].items():
        for layer in range(32):
            for short, path in CLIP_MODULES.items():
                names[f"{prefix}_text_model_encoder_layers_{layer}_{short}"] = (
                    component, f"text_model.encoder.layers.{layer}.{path}")
    if family == "sdxl":
        names["lora_te2_text_projection"] = ("text_encoder_2", "text_projection")
    return names


def comfy_load(tensors: dict[str, torch.Tensor], key_map: dict) -> tuple[dict, set[str]]:
    """ComfyUI's load_lora for plain LoRAs: per mapped name x it takes x.lora_up.weight + x.lora_down.weight
    (+ x.alpha, x.lora_mid.weight, x.dora_scale when present); returns the patches and the keys it did not load
    (each one a "lora key not loaded" warning)."""
    patches, loaded = {}, set()
    for name, target in key_map.items():
        up, down, alpha = f"{name}.lora_up.weight", f"{name}.lora_down.weight", f"{name}.alpha"
        if up in tensors:
            patches[target] = (tensors[up], tensors[down], tensors[alpha].item() if alpha in tensors else None)
            loaded |= {up, down} | ({alpha} if alpha in tensors else set())
    return patches, set(tensors) - loaded


def comfy_weight_change(patch, weight: torch.Tensor) -> torch.Tensor:
    """calculate_weight at strength 1: (alpha / rank, 1.0 without an alpha tensor) x up @ down."""
    up, down, alpha = patch
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    return scale * (up.flatten(1).float() @ down.flatten(1).float()).reshape(weight.shape)


def in_memory_module(component: torch.nn.Module, path: str) -> torch.nn.Module:
    """A module by its original path; transformers 5's CLIPTextModel has no `text_model.` level."""
    modules = dict(component.named_modules())
    if path not in modules and path.startswith("text_model."):
        path = path[len("text_model."):]
    return modules[path]


# ---- runs -----------------------------------------------------------------------------------------------------
TEXT_PARTS = {"sd1": ("text_encoder",), "sd2": ("text_encoder",), "sdxl": ("text_encoder", "text_encoder_2")}


def lora_config(tiny_models, shapes_data, out, family, **extra):
    parts = {f"{p}.train": True for p in TEXT_PARTS[family]}
    return validate(base_config(tiny_models[family], shapes_data, out, family=family, method="lora", max_steps=2,
                                learning_rate=1e-2, **{"lora.rank": RANK, "lora.alpha": ALPHA}, **parts, **extra))


_RUNS = {}


@pytest.fixture
def trained(tiny_models, shapes_data, tmp_path_factory):
    """family -> (trainer, output dir) of a 2-step LoRA run on the UNet and every text encoder, made once."""

    def run(family):
        if family not in _RUNS:
            out = tmp_path_factory.mktemp(f"lora-{family}") / "out"
            trainer = Trainer(lora_config(tiny_models, shapes_data, out, family), log=lambda *_: None)
            trainer.train()
            _RUNS[family] = trainer, out
        return _RUNS[family]

    return run


def peft_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {path: sub for path, sub in module.named_modules() if isinstance(sub, LoraLayer)}


def original_path(component_name: str, component: torch.nn.Module, path: str) -> str:
    if component_name.startswith("text_encoder") and "text_model" not in dict(component.named_children()):
        return "text_model." + path
    return path


# ---- tests ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_comfyui_recognises_every_module_and_leaves_nothing(trained, tiny_models, family):
    trainer, out = trained(family)
    tensors = load_file(out / "lora.safetensors")
    key_map = comfy_key_map(family, trainer.model.denoiser, original_unet_paths(tiny_models[family], family))
    patches, left_over = comfy_load(tensors, key_map)
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    # Every adapted module of every trained part is in the file, with its alpha.
    expected = {(name, original_path(name, part, path))
                for name, part in trainer.model.parts().items() for path in peft_layers(part)}
    assert set(patches) == expected
    assert {p[2] for p in patches.values()} == {ALPHA}
    assert {name for name, _ in expected} == {"unet", *TEXT_PARTS[family]}
    with safe_open(out / "lora.safetensors", "pt") as f:
        metadata = f.metadata()
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"]) == (str(RANK), str(ALPHA))
    assert "lora_adapter_metadata" not in metadata  # diffusers would read the kohya keys as peft ones


# kohya's model version keys (sd-scripts: model_util.get_model_version_str_for_sd1_sd2, sdxl_model_util
# MODEL_VERSION_SDXL_BASE_V1_0, `ss_v2` = its --v2 flag)
KOHYA_VERSIONS = {"sd1": ("sd_v1", "False"), "sd2": ("sd_v2", "True"), "sdxl": ("sdxl_base_v1-0", "False")}


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_metadata_names_the_base_model_version_as_kohya_writes_it(trained, family):
    """A1111 knows a LoRA's model version from `ss_base_model_version` ("sdxl_..." -> SDXL) and `ss_v2` ("True" ->
    SD 2.x) only; any other file with metadata counts as SD 1.x (extensions-builtin/Lora/network.py
    detect_version), and its Lora page hides LoRAs of another version than the loaded checkpoint's (`lora_show_all`
    is off by default): without these keys an SDXL or SD 2.x LoRA was missing from the page of its own model."""
    _, out = trained(family)
    with safe_open(out / "lora.safetensors", "pt") as f:
        metadata = f.metadata()
    assert (metadata.get("ss_base_model_version"), metadata.get("ss_v2")) == KOHYA_VERSIONS[family]


@pytest.mark.parametrize("family, preset", [("sd1", "all_linear"), ("sdxl", "all_linear"), ("sd1", "all_layers"),
                                            ("sdxl", "all_layers")])
def test_all_linear_modules_load_in_comfyui_and_diffusers(tiny_models, shapes_data, tmp_path, family, preset):
    """Every nn.Linear of the UNet (time / added-condition embeddings, resnet projections too) has a name ComfyUI
    maps and diffusers reads back; with all_layers (OneTrainer's "full" layer filter) every nn.Conv2d too (conv_in /
    conv_out, the resnets' 3x3 and shortcut, the samplers, SD 1.x's 1x1 proj_in / proj_out). Untrained: random up
    matrices stand in for training."""
    from ot_dist.models.loading import load_model

    config = lora_config(tiny_models, shapes_data, tmp_path / "out", family, **{"lora.preset": preset})
    model = load_model(config.model)
    method = LoraMethod(config)
    method.prepare(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for part in model.parts().values():
            for name, p in part.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    [path] = method.export(model, tmp_path / "out")
    originals = original_unet_paths(tiny_models[family], family)
    patches, left_over = comfy_load(load_file(path), comfy_key_map(family, model.denoiser, originals))
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    kinds = (torch.nn.Linear, torch.nn.Conv2d) if preset == "all_layers" else torch.nn.Linear
    layers = {p.removesuffix(".base_layer") for p, m in model.denoiser.named_modules()
              if isinstance(m, kinds) and "lora_" not in p}
    assert {path for part, path in patches if part == "unet"} == layers
    for (part, module_path), patch in patches.items():
        layer = in_memory_module(model.parts()[part], module_path)
        torch.testing.assert_close(comfy_weight_change(patch, layer.base_layer.weight),
                                   layer.get_delta_weight(ADAPTER), rtol=1e-5, atol=1e-7)
    trainer = type("Run", (), {"model": model})
    check_diffusers_load(trainer, tiny_models[family], path, family)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_comfyui_applies_the_trained_change(trained, tiny_models, family):
    """W + alpha / rank x up @ down (ComfyUI; 1.0 without an alpha tensor) equals peft's change, every weight."""
    trainer, out = trained(family)
    key_map = comfy_key_map(family, trainer.model.denoiser, original_unet_paths(tiny_models[family], family))
    patches, _ = comfy_load(load_file(out / "lora.safetensors"), key_map)
    parts = trainer.model.parts()
    checked, moved = 0, set()
    for (part, path), patch in patches.items():
        layer = in_memory_module(parts[part], path)
        trained_change = layer.get_delta_weight(ADAPTER)
        torch.testing.assert_close(comfy_weight_change(patch, layer.base_layer.weight), trained_change,
                                   rtol=1e-5, atol=1e-7)
        checked += 1
        if trained_change.abs().max() > 0:
            moved.add(part)
    assert checked == sum(len(peft_layers(m)) for m in parts.values())
    # (SDXL's first encoder feeds its penultimate layer: its last layer's LoRA gets no gradient.)
    assert moved == set(parts), f"parts whose LoRA did not train: {set(parts) - moved}"


# ---- kohya sd-scripts' names -----------------------------------------------------------------------------------
# kohya's SDXL UNet is the original SGM implementation (library/sdxl_original_unet.py, which loads the original
# checkpoint's keys as they are), and networks/lora.py names a LoRA module "lora_unet_" + its path in that UNet with
# "." -> "_". Its SD 1.x / 2.x UNet (library/original_unet.py) is diffusers-derived: there the path is diffusers'.
# Its scripts load a LoRA by these names only (`--network_weights`: load_state_dict(strict=False); sdxl_merge_lora.py
# skips a name it has no module for), so a UNet module named otherwise silently does nothing there.
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_unet_modules_are_named_as_kohya_sd_scripts_names_them(trained, tiny_models, family):
    trainer, out = trained(family)
    originals = original_unet_paths(tiny_models[family], family) if family == "sdxl" else {}
    expected = {"lora_unet_" + originals.get(path, path).replace(".", "_")
                for path in peft_layers(trainer.model.denoiser)}
    names = {key.split(".")[0] for key in load_file(out / "lora.safetensors") if key.startswith("lora_unet_")}
    assert names == expected


# stabilityai/stable-diffusion-xl-base-1.0's unet/config.json (what differs from diffusers' defaults)
SDXL_UNET = {"addition_embed_type": "text_time", "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256,
             "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
             "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
             "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True}
# Module names in kohya's SDXL UNet (sgm: input_blocks 0 = conv_in, then per level 2 x (resnet .0, attention .1) and
# a downsampler `.0.op`; middle_block resnet / attention / resnet; output_blocks per level 3 x (resnet, attention)
# with the upsampler after the third; resnets' in_layers.2 / out_layers.3 / emb_layers.1 / skip_connection).
KOHYA_SDXL_NAMES = {
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": "input_blocks_4_1_transformer_blocks_0_attn1_to_q",
    "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2": "input_blocks_8_1_transformer_blocks_9_ff_net_2",
    "mid_block.attentions.0.proj_in": "middle_block_1_proj_in",
    "up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_k": "output_blocks_2_1_transformer_blocks_0_attn2_to_k",
    "up_blocks.1.attentions.2.proj_out": "output_blocks_5_1_proj_out",
    "up_blocks.0.upsamplers.0.conv": "output_blocks_2_2_conv",
    "up_blocks.1.upsamplers.0.conv": "output_blocks_5_2_conv",
    "down_blocks.0.downsamplers.0.conv": "input_blocks_3_0_op",
    "down_blocks.0.resnets.0.conv1": "input_blocks_1_0_in_layers_2",
    "up_blocks.2.resnets.0.conv_shortcut": "output_blocks_6_0_skip_connection",
    "mid_block.resnets.1.time_emb_proj": "middle_block_2_emb_layers_1",
    "up_blocks.2.resnets.2.conv2": "output_blocks_8_0_out_layers_3",
    "conv_in": "input_blocks_0_0", "time_embedding.linear_2": "time_embed_2", "add_embedding.linear_1": "label_emb_0_0",
    "conv_out": "out_2"}


def test_the_real_sdxl_unet_gets_kohya_sd_scripts_names():
    """On the real SDXL UNet (meta device): kohya's names for its modules, one name per module, and as many default
    targets as kohya's SDXL network adapts (its log: "create LoRA for U-Net: 722 modules")."""
    from diffusers import UNet2DConditionModel

    from ot_dist.lora_tools.matching import adaptable_modules
    from ot_dist.methods.lora_layouts import kohya_names
    from ot_dist.models.families.registry import get_family
    from ot_dist.models.families.sd import UNET_LORA_TARGETS

    family = get_family("sdxl")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**SDXL_UNET)
    names = kohya_names(family.lora_file_prefixes, family.lora_file_roots, {"unet": unet},
                        {"unet": family.lora_file_module_renames("unet", unet)})["unet"]
    paths = adaptable_modules(unet)
    named = {path: names.module_name(path) for path in paths}
    assert {named[path] for path in KOHYA_SDXL_NAMES} == {"lora_unet_" + n for n in KOHYA_SDXL_NAMES.values()}
    assert len(set(named.values())) == len(paths)
    blocks = re.compile(r"lora_unet_(input_blocks|middle_block|output_blocks|time_embed|label_emb|out)_\d.*")
    assert all(blocks.fullmatch(name) for name in named.values())
    assert sum(path.endswith(tuple("." + t for t in UNET_LORA_TARGETS)) for path in paths) == 722


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_diffusers_loads_the_kohya_file(trained, tiny_models, family):
    """diffusers converts kohya names (SD 2.x's text encoder is a CLIPTextModel too) and applies alpha / rank."""
    trainer, out = trained(family)
    assert next(iter(load_file(out / "lora.safetensors"))).startswith("lora_")
    check_diffusers_load(trainer, tiny_models[family], out / "lora.safetensors", family)


def test_diffusers_layout_option_loads(trained, tiny_models, tmp_path):
    trainer, _ = trained("sdxl")
    config = trainer.config
    config = config.model_copy(update={"lora": config.lora.model_copy(update={"file_layout": "diffusers"})})
    [path] = LoraMethod(config).export(trainer.model, tmp_path)
    keys = load_file(path)
    assert all(k.startswith(("unet.", "text_encoder.", "text_encoder_2.")) and ".lora_" in k for k in keys)
    check_diffusers_load(trainer, tiny_models["sdxl"], path, "sdxl")


def check_diffusers_load(trainer, model_path, lora_file, family):
    model = trainer.model
    base, untouched = DiffusionPipeline.from_pretrained(model_path), DiffusionPipeline.from_pretrained(model_path)
    base.load_lora_weights(lora_file.parent, weight_name=lora_file.name)
    inputs = unet_inputs(model.pipeline, family)
    mine = unet_output(model.denoiser, inputs)
    assert not torch.allclose(unet_output(untouched.unet, inputs), mine, atol=1e-4)
    torch.testing.assert_close(unet_output(base.unet, inputs), mine, rtol=1e-5, atol=1e-6)
    for name in TEXT_PARTS[family]:
        tokenizer = base.components[name.replace("text_encoder", "tokenizer")]
        _, ours = text_output(tokenizer, model.text_encoders[name], "a red circle")
        _, before = text_output(tokenizer, untouched.components[name], "a red circle")
        _, theirs = text_output(tokenizer, base.components[name], "a red circle")
        assert not torch.allclose(before, ours, atol=1e-5), f"{name} did not train"
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_kohya_layout_is_refused_where_the_family_has_no_kohya_names(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, family="flux", method="lora",
                      **{"lora.file_layout": "kohya"})
    with pytest.raises(Exception, match="lora.file_layout"):
        validate(raw)
    raw["lora"]["file_layout"] = "auto"
    assert validate(raw).lora_file_layout() == "diffusers"
    assert lora_config(tiny_models, shapes_data, tmp_path, "sd1").lora_file_layout() == "kohya"


def test_renamed_plain_lora_bakes_the_scale_and_refuses_what_a_plain_file_cannot_hold():
    """The companion files of several families (Wan, Krea 2, Anima) rename a plain LoRA: the scale alpha / rank goes
    into the up matrix (the file has no alpha tensors, readers apply strength 1); a DoRA, LoHa or LoKr adapter, or a
    module with no name in that layout, gives no file (None) rather than a file that changes the model otherwise."""
    from ot_dist.methods.lora_layouts import renamed_plain_lora

    down, up = torch.randn(4, 8), torch.randn(16, 4)
    state = {"blocks.0.to_q.lora_A.weight": down, "blocks.0.to_q.lora_B.weight": up}
    config = {"r": 4, "lora_alpha": 2.0}
    renamed = renamed_plain_lora(state, config, lambda path: "model." + path.replace("to_q", "q"))
    assert set(renamed) == {"model.blocks.0.q.lora_A.weight", "model.blocks.0.q.lora_B.weight"}
    change = renamed["model.blocks.0.q.lora_B.weight"] @ renamed["model.blocks.0.q.lora_A.weight"]
    torch.testing.assert_close(change, 0.5 * up @ down)  # what the trained layer adds, at strength 1
    assert renamed_plain_lora(state, {**config, "use_dora": True}, lambda path: path) is None
    assert renamed_plain_lora(state, config, lambda path: None) is None
    loha = {"blocks.0.to_q.hada_w1_a": torch.randn(16, 4), "blocks.0.to_q.hada_w1_b": torch.randn(4, 8),
            "blocks.0.to_q.hada_w2_a": torch.randn(16, 4), "blocks.0.to_q.hada_w2_b": torch.randn(4, 8)}
    assert renamed_plain_lora(loha, {"r": 4, "alpha": 4}, lambda path: path) is None
