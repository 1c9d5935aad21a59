"""OFT (`lora.variant: oft`, OneTrainer's OFT_2 in the layout ComfyUI reads): the file's blocks, applied by
ComfyUI's rule (written down below as an oracle), give the weights training used; the layers start as the identity;
training lowers the loss; `ot-dist lora merge` applies it; OneTrainer's peft_type OFT_2 imports as it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import base_config
from safetensors import safe_open
from safetensors.torch import load_file
from test_lora_layouts import comfy_key_map, in_memory_module

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.errors import InputFileError
from ot_dist.lora_tools.files import read_lora_file
from ot_dist.lora_tools.merge import merge_into
from ot_dist.methods.lora import LoraMethod
from ot_dist.methods.oft import OrthogonalConv2d, OrthogonalLinear
from ot_dist.models.loading import load_model
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

BLOCK = 4  # the tiny models' layers are 32 - 64 wide: several blocks each


# ---- ComfyUI's rule ------------------------------------------------------------------------------------------------
# Read from github.com/Comfy-Org/ComfyUI comfy/weight_adapter/oft.py @ a125cd84 (OFTAdapter.load / calculate_weight):
#   x.oft_blocks (3-d: [block_num, block_size, block_size]; any other shape is not OFT) and x.rescale (optional);
#   alpha = x.alpha (.item(); 0 when absent). q = blocks - blocksᵀ; when alpha > 0 and ||q|| + 1e-8 > alpha
#   (Frobenius norm over all blocks): q = q * alpha / (||q|| + 1e-8). r = (I + q) @ inverse(I - q);
#   diff = einsum("k n m, k n ... -> k m ...", strength * r - strength * I, W.view(block_num, block_size, ...));
#   W += strength * diff.
def comfy_oft_weight(tensors: dict[str, torch.Tensor], name: str, weight: torch.Tensor) -> torch.Tensor:
    return weight.float() + comfy_oft_diff(tensors, name, weight)


def comfy_oft_diff(tensors: dict[str, torch.Tensor], name: str, weight: torch.Tensor) -> torch.Tensor:
    blocks = tensors[f"{name}.oft_blocks"].float()
    assert blocks.dim() == 3, name
    alpha = tensors[f"{name}.alpha"].item() if f"{name}.alpha" in tensors else 0
    block_num, block_size, _ = blocks.shape
    eye = torch.eye(block_size)
    q = blocks - blocks.transpose(1, 2)
    if alpha > 0:
        norm = torch.norm(q) + 1e-8
        if norm > alpha:
            q = q * alpha / norm
    r = (eye + q) @ (eye - q).inverse()
    w = weight.float()
    diff = torch.einsum("knm,kn...->km...", r - eye, w.view(block_num, block_size, *w.shape[1:]))
    return diff.reshape(w.shape)


def oft_config(tiny_models, shapes_data, out, **extra):
    settings = {"lora.variant": "oft", "lora.oft_block_size": BLOCK, "text_encoder.train": True, "max_steps": 2,
                "learning_rate": 1e-2, **extra}
    return validate(base_config(tiny_models["sd1"], shapes_data, out, family="sd1", method="lora", **settings))


def oft_layers(model) -> dict[tuple[str, str], torch.nn.Module]:
    return {(name, path): sub for name, part in model.parts().items() for path, sub in part.named_modules()
            if isinstance(sub, (OrthogonalLinear, OrthogonalConv2d))}


def moved(model, scale: float) -> None:
    """Seeded noise on the blocks: a stand-in for training, far enough to rotate."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in oft_layers(model).values():
            layer.oft_blocks.add_(torch.randn(layer.oft_blocks.shape, generator=generator) * scale)


def probe_input(layer: torch.nn.Module) -> torch.Tensor:
    if isinstance(layer, torch.nn.Linear):
        return torch.randn(2, layer.in_features)
    return torch.randn(1, layer.in_channels, 8, 8)


# ---- tests ---------------------------------------------------------------------------------------------------------
def test_oft_starts_as_the_identity(tiny_models, shapes_data, tmp_path):
    """At step 0 every adapted layer computes what the base layer did (zero blocks: R = I), UNet and text encoder."""
    config = oft_config(tiny_models, shapes_data, tmp_path / "out")
    base, model = load_model(config.model), load_model(config.model)
    LoraMethod(config).prepare(model)
    layers = oft_layers(model)
    assert {name for name, _ in layers} == {"unet", "text_encoder"}
    assert any(isinstance(layer, OrthogonalConv2d) for layer in layers.values())
    with torch.no_grad():
        for (name, path), layer in layers.items():
            x = probe_input(layer)
            torch.testing.assert_close(layer(x), base.parts()[name].get_submodule(path)(x), rtol=0, atol=1e-6,
                                       msg=f"{name}.{path}")


def test_prior_model_leaves_the_rotation_out(tiny_models, shapes_data, tmp_path):
    """OneTrainer's prior model (prior preservation, concept prior targets: train/loss.py `adapters_disabled`)
    computes with the base weights; after it the layers rotate again."""
    from ot_dist.train.loss import adapters_disabled

    config = oft_config(tiny_models, shapes_data, tmp_path / "out")
    base, model = load_model(config.model), load_model(config.model)
    LoraMethod(config).prepare(model)
    moved(model, 0.2)
    with torch.no_grad():
        for (name, path), layer in oft_layers(model).items():
            x = probe_input(layer)
            plain = base.parts()[name].get_submodule(path)(x)
            with adapters_disabled(model):
                torch.testing.assert_close(layer(x), plain, rtol=0, atol=0, msg=f"{name}.{path}")
            assert not torch.allclose(layer(x), plain, atol=1e-4), f"{name}.{path}"


@pytest.mark.parametrize("constraint", [0.0, 0.05])
def test_comfyui_applies_the_blocks_as_trained(tiny_models, shapes_data, tmp_path, constraint):
    """The file's every tensor is read by ComfyUI's OFT rule, and the weight that rule makes of each module is the
    one the adapted layer computed with (its output = the base layer's with that weight). With a constraint
    (written as .alpha) small enough to bind, the rule's scaling is the one trained."""
    config = oft_config(tiny_models, shapes_data, tmp_path / "out", **{"lora.oft_constraint": constraint})
    model = load_model(config.model)
    method = LoraMethod(config)
    method.prepare(model)
    moved(model, 0.2)
    [path] = method.export(model, tmp_path / "out")
    tensors = load_file(path)
    with safe_open(str(path), framework="pt") as f:
        assert '"diag-oft"' in f.metadata()["ss_network_args"]
    key_map = comfy_key_map("sd1", model.denoiser)
    layers = oft_layers(model)
    read = set()
    bound = False
    for name, (part, module_path) in key_map.items():
        if f"{name}.oft_blocks" not in tensors:
            continue
        read |= {f"{name}.oft_blocks", f"{name}.alpha"}
        layer = in_memory_module(model.parts()[part], module_path)
        assert tensors[f"{name}.alpha"].item() == layer.oft_constraint == pytest.approx(constraint)
        q = layer.oft_blocks.detach() - layer.oft_blocks.detach().transpose(1, 2)
        bound |= constraint > 0 and torch.norm(q).item() > constraint
        expected = comfy_oft_weight(tensors, name, layer.weight.detach())
        x = probe_input(layer)
        with torch.no_grad():  # the layer's output is the base computation with the rule's weight
            if isinstance(layer, torch.nn.Linear):
                want = torch.nn.functional.linear(x, expected, layer.bias)
            else:
                want = layer._conv_forward(x, expected, layer.bias)
            torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5, msg=name)
    assert read == set(tensors), f"ComfyUI would not load {sorted(set(tensors) - read)[:5]}"
    assert len(read) == 2 * len(layers)
    assert bound == (constraint > 0)


def test_training_lowers_the_loss_and_merge_applies_it(tiny_models, shapes_data, tmp_path):
    """A short OFT run lowers a fixed batch's loss (same draws), and `ot-dist lora merge` of its file into a fresh
    base gives the weights the trained layers compute with; the tools that take plain LoRA refuse the file."""
    config = oft_config(tiny_models, shapes_data, tmp_path / "out", max_steps=8, learning_rate=3e-2,
                        **{"text_encoder.train": False})
    trainer = Trainer(config, log=lambda *_: None)
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    with torch.no_grad():
        before = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss).item()
    trainer.train()
    with torch.no_grad():
        after = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss).item()
    assert after < before * 0.98, (before, after)

    path = tmp_path / "out" / "lora.safetensors"
    with pytest.raises(InputFileError, match="oft file"):  # the tools for plain LoRA refuse it by name
        read_lora_file(path)
    base = load_model(config.model)
    merged, missing = merge_into(base, read_lora_file(path, ("oft",)), 1.0, str(path))
    layers = oft_layers(trainer.model)
    assert not missing and merged == len(layers)
    for (name, module_path), layer in layers.items():
        got = base.parts()[name].get_submodule(module_path).weight.float()
        with torch.no_grad():
            torch.testing.assert_close(got, layer.adapted_weight().float(), rtol=1e-5, atol=1e-6, msg=module_path)


def test_config_errors_name_the_field(tiny_models, shapes_data, tmp_path):
    with pytest.raises(Exception, match="lora.dropout"):
        oft_config(tiny_models, shapes_data, tmp_path, **{"lora.dropout": 0.1})
    with pytest.raises(Exception, match="lora.file_layout"):
        oft_config(tiny_models, shapes_data, tmp_path, **{"lora.file_layout": "diffusers"})
    with pytest.raises(Exception, match="oft_block_size"):
        oft_config(tiny_models, shapes_data, tmp_path, **{"lora.oft_block_size": 0})
    with pytest.raises(Exception, match="oft_constraint"):
        oft_config(tiny_models, shapes_data, tmp_path, **{"lora.oft_constraint": -1})


def test_block_size_is_the_nearest_divisor_of_the_output_size():
    """OneTrainer's adjustment (LoRAModule.py OFTModule.adjust_oft_parameters), on the rotated dimension."""
    from ot_dist.methods.oft import block_size_for

    assert [block_size_for(320, b) for b in (32, 30, 33, 7, 500)] == [32, 32, 32, 8, 320]
    assert block_size_for(12, 5) == 4  # 4 and 6 are as near: the lower


@pytest.mark.parametrize("settings, expected, skipped", [
    ({"peft_type": "OFT_2"}, {"variant": "oft", "oft_block_size": 32}, None),
    ({"peft_type": "OFT_2", "oft_block_size": 16}, {"variant": "oft", "oft_block_size": 16}, None),
    ({"peft_type": "OFT_2", "oft_block_share": True}, {"variant": "oft"}, "oft_block_share"),
    ({"peft_type": "OFT_2", "oft_scaled": True}, {"variant": "oft"}, "oft_scaled"),
    ({"peft_type": "OFT_2", "dropout_probability": 0.1}, {"variant": "oft", "dropout": 0.0}, "dropout_probability"),
])
def test_onetrainer_oft_2_becomes_oft(settings, expected, skipped):
    """OneTrainer's TrainConfig peft_type OFT_2 with oft_block_size / oft_block_share / oft_scaled (its defaults 32,
    false, false: modules/util/config/TrainConfig.py)."""
    from ot_dist.migrate.onetrainer import _lora_variant

    lora, notes = {"rank": 4, "alpha": 1.0, "dropout": settings.get("dropout_probability", 0.0)}, []
    _lora_variant(settings, lora, notes.append)
    assert {k: lora[k] for k in expected} == expected
    assert (skipped is None) == (not notes) and all(skipped in n for n in notes)


def test_onetrainer_oft_2_of_a_family_without_oft_files_is_plain_lora(tmp_path):
    """An OFT_2 config of a family ot_dist writes no oft file for imports as plain LoRA, listed, instead of a config
    that is refused."""
    from ot_dist.migrate.onetrainer import _lora_variant

    lora, notes = {"rank": 4, "alpha": 1.0, "dropout": 0.0}, []
    _lora_variant({"peft_type": "OFT_2", "oft_block_size": 16}, lora, notes.append, oft_written=False)
    assert "variant" not in lora and "oft_block_size" not in lora
    assert len(notes) == 1 and "OFT_2" in notes[0] and "not written" in notes[0]


def test_stop_and_resume_continues_exactly(tiny_models, shapes_data, tmp_path):
    """The blocks (and their optimizer state) go through a checkpoint: stopped after step 3 and resumed, the run's
    losses are the uninterrupted run's, bit for bit."""
    from test_checkpoint import train_in_process

    def raw(out):
        return base_config(tiny_models["sd1"], shapes_data, out, method="lora", batch_size=2, max_steps=6,
                           learning_rate=1e-2, **{"lora.variant": "oft", "lora.oft_block_size": BLOCK})

    straight = train_in_process(raw(tmp_path / "straight"))
    stopped = train_in_process(raw(tmp_path / "stopped"), stop_after=3)
    assert stopped.stopped_by == "SIGTERM" and stopped.steps == 4
    resumed = train_in_process(raw(tmp_path / "stopped"), resume="auto")
    assert resumed.first_step == 4 and resumed.losses == straight.losses[4:]


def test_targets_match_paths_and_suffixes_but_the_excluded():
    """peft's rule (a target is a path or a path's dotted suffix), and lora.layer_filter's exact paths: the suffix
    matches it would add are excluded (methods/lora.py passes them)."""
    from ot_dist.methods.oft import add_oft

    def toy():
        block = torch.nn.Module()
        block.proj = torch.nn.Linear(8, 8)
        root = torch.nn.Module()
        root.proj, root.block, root.norm = torch.nn.Linear(8, 8), block, torch.nn.LayerNorm(8)
        return root

    assert add_oft(toy(), ["proj", "norm"], 4, 0.0) == {"proj": 4, "block.proj": 4}  # LayerNorm: not a layer OFT takes
    assert add_oft(toy(), ["proj"], 4, 0.0, exclude=["block.proj"]) == {"proj": 4}


@pytest.mark.parametrize("model_type, variant", [("STABLE_DIFFUSION_15", "oft"), ("FLUX_DEV_1", "oft"),
                                                 ("SANA", "lora")])
def test_onetrainer_config_with_oft_2_imports_and_validates(tmp_path, model_type, variant):
    """`ot-dist import onetrainer` end to end: OFT_2 with its block size on SD 1.5 (kohya names) and Flux (the
    diffusers layout ComfyUI applies as trained); on Sana (no oft file is written) a valid plain-LoRA config, OFT_2
    listed."""
    from test_import_onetrainer import import_only

    config, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "LORA",
                                             "peft_type": "OFT_2", "oft_block_size": 16})
    assert config.lora.variant == variant
    assert (config.lora.oft_block_size == 16) == (variant == "oft")
    assert any("OFT_2" in line for line in skipped) == (variant == "lora")


# ---- the diffusers-layout families ---------------------------------------------------------------------------------
# ComfyUI's names for them, read from github.com/Comfy-Org/ComfyUI @ a125cd84: comfy/lora.py model_lora_keys_unet maps
# "transformer.{k}" (k a diffusers weight name without .weight) to utils.flux_to_diffusers(...)[k] for Flux (and
# Chroma, whose model subclasses Flux), to utils.mmdit_to_diffusers(...)[k] for SD3: a ComfyUI weight, a tuple
# (weight, (dim, offset, size)) for a block of a fused weight's rows, or (weight, None, swap_scale_shift).
# comfy/lora.py calculate_weight narrows the weight to (dim, offset, size) and hands the adapter the narrowed view and
# the function; oft.py computes its change on that (ComfyUI-ordered) view and adds function(change) in place.
# swap_scale_shift(w) = cat(second half, first half). The text encoders' names: tests/test_lora_t5.py.
def comfy_transformer_map(family: str, transformer) -> dict[str, tuple[str, tuple | None, bool]]:
    """diffusers module path -> (ComfyUI weight, (dim, offset, size) or None, swap_scale_shift?), for the Linear
    layers of the two maps. Offsets: flux_to_diffusers' hidden_size; mmdit_to_diffusers' depth x 64, which is the
    hidden size of every SD3 / 3.5 model (ComfyUI reads depth as the hidden size / 64; the tiny model's 32 is not a
    multiple of 64, so its width is used, and its block count for the last block's swapped modulation)."""
    h = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    qkv, rows = ("to_q", "to_k", "to_v"), lambda j, size=h: (0, j * h, size)
    found = {}
    if family == "flux":
        for i in range(len(transformer.transformer_blocks)):
            d, c = f"transformer_blocks.{i}.", f"double_blocks.{i}."
            for j, (x, y) in enumerate(zip(qkv, ("add_q_proj", "add_k_proj", "add_v_proj"))):
                found[d + "attn." + x] = (c + "img_attn.qkv", rows(j), False)
                found[d + "attn." + y] = (c + "txt_attn.qkv", rows(j), False)
            for x, y in {"attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin",
                         "norm1_context.linear": "txt_mod.lin", "attn.to_add_out": "txt_attn.proj",
                         "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
                         "ff_context.net.2": "txt_mlp.2"}.items():
                found[d + x] = (c + y, None, False)
        for i in range(len(transformer.single_transformer_blocks)):
            d, c = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
            for j, x in enumerate(qkv):
                found[d + "attn." + x] = (c + "linear1", rows(j), False)
            found[d + "proj_mlp"] = (c + "linear1", rows(3, 4 * h), False)
            found[d + "norm.linear"] = (c + "modulation.lin", None, False)
            found[d + "proj_out"] = (c + "linear2", None, False)
        basic = {"proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
                 "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
                 "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
                 "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
                 "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
                 "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
                 "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer"}
        swapped = {"norm_out.linear": "final_layer.adaLN_modulation.1"}
    elif family == "pixart_sigma":  # utils.pixart_to_diffusers: offsets of its hidden_size
        for i in range(len(transformer.transformer_blocks)):
            d, c = f"transformer_blocks.{i}.", f"blocks.{i}."
            for j, x in enumerate(qkv):
                found[d + "attn1." + x] = (c + "attn.qkv", rows(j), False)
            found[d + "attn2.to_k"] = (c + "cross_attn.kv_linear", rows(0), False)
            found[d + "attn2.to_v"] = (c + "cross_attn.kv_linear", rows(1), False)
            for x, y in {"attn2.to_q": "cross_attn.q_linear", "attn1.to_out.0": "attn.proj",
                         "attn2.to_out.0": "cross_attn.proj", "ff.net.0.proj": "mlp.fc1",
                         "ff.net.2": "mlp.fc2"}.items():
                found[d + x] = (c + y, None, False)
        emb = "adaln_single.emb."
        basic = {emb + "resolution_embedder.linear_1": "csize_embedder.mlp.0",
                 emb + "resolution_embedder.linear_2": "csize_embedder.mlp.2",
                 emb + "aspect_ratio_embedder.linear_1": "ar_embedder.mlp.0",
                 emb + "aspect_ratio_embedder.linear_2": "ar_embedder.mlp.2",
                 emb + "timestep_embedder.linear_1": "t_embedder.mlp.0",
                 emb + "timestep_embedder.linear_2": "t_embedder.mlp.2",
                 "caption_projection.linear_1": "y_embedder.y_proj.fc1",
                 "caption_projection.linear_2": "y_embedder.y_proj.fc2", "adaln_single.linear": "t_block.1",
                 "proj_out": "final_layer.linear"}
        swapped = {}
    else:  # sd3
        depth = len(transformer.transformer_blocks)
        for i in range(depth):
            d, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
            for j, (x, y) in enumerate(zip(qkv, ("add_q_proj", "add_k_proj", "add_v_proj"))):
                found[d + "attn." + x] = (c + "x_block.attn.qkv", rows(j), False)
                found[d + "attn." + y] = (c + "context_block.attn.qkv", rows(j), False)
                found[d + "attn2." + x] = (c + "x_block.attn2.qkv", rows(j), False)
            for x, y in {"norm1_context.linear": "context_block.adaLN_modulation.1",
                         "attn.to_add_out": "context_block.attn.proj", "ff_context.net.0.proj": "context_block.mlp.fc1",
                         "ff_context.net.2": "context_block.mlp.fc2", "norm1.linear": "x_block.adaLN_modulation.1",
                         "attn.to_out.0": "x_block.attn.proj", "attn2.to_out.0": "x_block.attn2.proj",
                         "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2"}.items():
                found[d + x] = (c + y, None, False)
        basic = {"context_embedder": "context_embedder", "proj_out": "final_layer.linear",
                 "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
                 "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
                 "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
                 "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2"}
        swapped = {"norm_out.linear": "final_layer.adaLN_modulation.1",
                   f"transformer_blocks.{depth - 1}.norm1_context.linear":
                       f"joint_blocks.{depth - 1}.context_block.adaLN_modulation.1"}
    found.update({x: (y, None, False) for x, y in basic.items()})
    found.update({x: (y, None, True) for x, y in swapped.items()})
    layers = {path for path, sub in transformer.named_modules() if isinstance(sub, torch.nn.Linear)}
    return {path: target for path, target in found.items() if path in layers}


def swap_scale_shift(weight: torch.Tensor) -> torch.Tensor:
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def comfy_weights(transformer, mapping) -> dict[str, torch.Tensor]:
    """ComfyUI's weights (float32) made of the diffusers layers: fused row blocks concatenated, swapped ones swapped."""
    pieces: dict[str, list] = {}
    for path, (key, offset, swapped) in mapping.items():
        weight = transformer.get_submodule(path).weight.detach().float()
        pieces.setdefault(key, []).append((offset[1] if offset else 0, swap_scale_shift(weight) if swapped else weight))
    return {key: torch.cat([w for _, w in sorted(parts, key=lambda p: p[0])]) for key, parts in pieces.items()}


def comfy_patched(tensors, key_map, transformer_map, transformer):
    """ComfyUI's load_lora + calculate_weight at strength 1 over the file: (ComfyUI's transformer weights after the
    patches, the text encoders' patched weights by (component, path), the file's keys no name took)."""
    weights = comfy_weights(transformer, transformer_map)
    text, loaded = {}, set()
    for name, target in key_map.items():
        if f"{name}.oft_blocks" not in tensors:
            continue
        loaded |= {f"{name}.oft_blocks", f"{name}.alpha"} & set(tensors)
        if target[0] != "transformer":
            component, path = target
            from test_lora_t5 import layer_at

            text[target] = comfy_oft_weight(tensors, name, layer_at(text_layers[component], path).weight)
            continue
        key, offset, swapped = transformer_map[target[1]]
        view = weights[key] if offset is None else weights[key].narrow(*offset)
        diff = comfy_oft_diff(tensors, name, view)
        view += swap_scale_shift(diff) if swapped else diff
    return weights, text, set(tensors) - loaded


text_layers: dict = {}  # component -> module, for comfy_patched's text-encoder names


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart_sigma"])
def test_comfyui_applies_a_transformer_familys_file_as_trained(family_models, shapes_data, tmp_path, family):
    """Flux / SD3 / PixArt (all_linear, every text encoder): the file's every tensor is taken by a name ComfyUI maps,
    and ComfyUI's rule over its fused weights (q / k / v as row blocks of qkv) gives, for each adapted layer, the
    weight the layer computed with (its output = the base layer's with that weight); `ot-dist lora merge` too. The modules ComfyUI keeps in
    another row order (shift | scale; Flux, SD3) are left out by the preset: adapted, ComfyUI would apply another
    rotation (checked)."""
    from test_lora_t5 import FAMILIES
    from test_lora_t5 import comfy_key_map as transformer_family_key_map
    from test_lora_t5 import layer_at

    from ot_dist.methods.oft import add_oft

    parts = {f"{name}.train": True for name in FAMILIES[family][1]}
    config = validate(base_config(family_models[family], shapes_data, tmp_path / "out", family=family, method="lora",
                                  **{"lora.variant": "oft", "lora.oft_block_size": BLOCK, "lora.preset": "all_linear",
                                     "lora.oft_constraint": 0.5, **parts}))
    model = load_model(config.model)
    method = LoraMethod(config)
    method.prepare(model)
    reordered = model.family.lora_oft_reordered_modules(model.denoiser)
    assert bool(reordered) == (family != "pixart_sigma")
    assert not any(isinstance(model.denoiser.get_submodule(p), OrthogonalLinear) for p in reordered)
    moved(model, 0.2)
    [path] = method.export(model, tmp_path / "out")
    tensors = load_file(path)
    with safe_open(str(path), framework="pt") as f:
        assert '"diag-oft"' in f.metadata()["ss_network_args"]
    transformer_map = comfy_transformer_map(family, model.denoiser)
    key_map = {name: target for name, target in transformer_family_key_map(family, model).items()
               if target[0] != "transformer"}
    key_map.update({f"transformer.{p}": ("transformer", p) for p in transformer_map})
    text_layers.update({name: part for name, part in model.parts().items() if name != "transformer"})
    weights, text, left_over = comfy_patched(tensors, key_map, transformer_map, model.denoiser)
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    layers = oft_layers(model)
    assert {part for part, _ in layers} == {"transformer", *FAMILIES[family][1]}
    assert len(tensors) == 2 * len(layers)
    checked = 0
    for (part, module_path), layer in layers.items():
        if part == "transformer":
            key, offset, _ = transformer_map[module_path]
            comfy = weights[key] if offset is None else weights[key].narrow(*offset)
        else:
            comfy = next(w for (c, p), w in text.items() if c == part and layer_at(model.parts()[c], p) is layer)
        x = probe_input(layer)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, comfy, layer.bias), rtol=1e-4,
                                       atol=1e-5, msg=f"{part}.{module_path}")
        checked += 1
    assert checked == len(layers)
    # and `ot-dist lora merge` reads the same names (transformer.<path>, text_encoder.text_model.*, lora_te*_)
    base = load_model(config.model)
    assert merge_into(base, read_lora_file(path, ("oft",)), 1.0, str(path)) == (len(layers), [])
    for (part, module_path), layer in layers.items():
        torch.testing.assert_close(base.parts()[part].get_submodule(module_path).weight.float(),
                                   layer.adapted_weight().detach().float(), rtol=1e-5, atol=1e-6, msg=module_path)

    if not reordered:
        return
    # why those modules are left out: adapted, ComfyUI's swap of the change is not the trained rotation
    add_oft(model.denoiser, reordered, BLOCK, 0.0)
    layer = model.denoiser.get_submodule(reordered[0])
    with torch.no_grad():
        layer.oft_blocks.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    key, _, swapped = transformer_map[reordered[0]]
    assert swapped
    alone = {f"{reordered[0]}.oft_blocks": layer.oft_blocks.detach(), f"{reordered[0]}.alpha": torch.tensor(0.0)}
    comfy = weights[key] + swap_scale_shift(comfy_oft_diff(alone, reordered[0], weights[key]))
    assert not torch.allclose(swap_scale_shift(comfy), layer.adapted_weight().detach(), atol=1e-3)


def test_transformer_family_refusals(family_models, shapes_data, tmp_path):
    """Targets that name a module ComfyUI reorders are refused naming it; a family whose ComfyUI file is not
    checked for OFT (Lumina 2: ComfyUI reads its fused q | k | v file) is refused naming lora.variant."""
    from ot_dist.errors import ConfigError

    config = validate(base_config(family_models["flux"], shapes_data, tmp_path / "out", family="flux", method="lora",
                                  **{"lora.variant": "oft", "lora.transformer_targets": ["to_q", "norm_out.linear"]}))
    with pytest.raises(ConfigError, match="lora.transformer_targets: selects norm_out.linear"):
        LoraMethod(config).prepare(load_model(config.model))
    # OneTrainer's substrings (lora.layer_filter) are a broad selection, as the presets: the module is left out
    config = validate(base_config(family_models["flux"], shapes_data, tmp_path / "out", family="flux", method="lora",
                                  **{"lora.variant": "oft", "lora.layer_filter": ["attn.to_q", "norm_out"]}))
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    assert {path for (_, path) in oft_layers(model)} == {f"{blocks}.{i}.attn.to_q" for i in range(2)
                                                          for blocks in ("transformer_blocks",
                                                                         "single_transformer_blocks")}
    with pytest.raises(Exception, match="lora.variant: oft is not written for lumina2"):
        validate(base_config(family_models["flux"], shapes_data, tmp_path / "l", family="lumina2", method="lora",
                             **{"lora.variant": "oft"}))


def test_float8_storage_keeps_the_rotated_base_weights_in_one_byte(tiny_models, shapes_data, tmp_path):
    """weight_dtype float8: the OFT layers' base weights are stored in float8 too (memory/float8.py leaves other
    modules with a trainable parameter of their own alone), each layer still computes with its rotation of the
    upcast weight, and a short run trains close to the float32-stored one."""
    from ot_dist.memory.float8 import FLOAT8

    losses = {}
    for weight_dtype in ("float32", "float8"):
        config = oft_config(tiny_models, shapes_data, tmp_path / weight_dtype, weight_dtype=weight_dtype,
                            **{"text_encoder.train": False})
        trainer = Trainer(config, log=lambda *_: None)
        layers = oft_layers(trainer.model)
        if weight_dtype == "float8":
            assert all(layer._parameters["weight"].dtype == FLOAT8 for layer in layers.values())
            assert all(layer.oft_blocks.dtype == torch.float32 and layer.oft_blocks.requires_grad
                       for layer in layers.values())
        losses[weight_dtype] = trainer.train().losses
    moved(trainer.model, 0.2)
    with torch.no_grad():
        for (name, path), layer in layers.items():
            x = probe_input(layer)
            weight = layer.adapted_weight()
            want = (torch.nn.functional.linear(x, weight, layer.bias) if isinstance(layer, torch.nn.Linear)
                    else layer._conv_forward(x, weight, layer.bias))
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6, msg=path)
            assert not torch.allclose(weight, layer.weight, atol=1e-3), path  # the rotation is not the identity
    torch.testing.assert_close(torch.tensor(losses["float8"]), torch.tensor(losses["float32"]), rtol=0.05, atol=0)
