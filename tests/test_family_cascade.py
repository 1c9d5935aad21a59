"""Stable Cascade's stage C prior on the family contract: the EfficientNetV2-S encoder in the official layout, the
objective against OneTrainer's formulas, text encoding against the prior pipeline's, training (full, LoRA through
peft's injection), the full export loading as a user loads the prior, the LoRA file in ComfyUI's stage C key layout,
and cached EfficientNet latents training as encoding each step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

FAMILY = "stable_cascade"


def quiet(*_):
    pass


def trainer_for(model, data, out, method="full", family=FAMILY, **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, "resolution": 128, **overrides}
    return Trainer(validate(base_config(model, data, out, family=family, method=method, **settings)), log=quiet)


def first_batch(trainer):
    return trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))


def test_effnet_has_torchvisions_efficientnet_v2_s_layout_and_size():
    """The official effnet_encoder.safetensors is torchvision's efficientnet_v2_s().features under `backbone.` and a
    1x1 conv + affine-free BatchNorm `mapper`. torchvision documents efficientnet_v2_s at 21,458,488 parameters,
    of which the classifier (Linear 1280 -> 1000) has 1,281,000: the features hold the rest."""
    from ot_dist.models.efficientnet import EfficientNetEncoder

    encoder = EfficientNetEncoder()
    state = encoder.state_dict()
    assert sum(p.numel() for n, p in encoder.named_parameters() if n.startswith("backbone.")) == 21_458_488 - 1_281_000
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["backbone.0.0.weight"] == (24, 3, 3, 3)  # stem
    assert shapes["backbone.1.1.block.0.0.weight"] == (24, 24, 3, 3)  # FusedMBConv, expand 1
    assert shapes["backbone.2.0.block.1.0.weight"] == (48, 96, 1, 1)  # FusedMBConv, expand 4: project
    assert shapes["backbone.4.0.block.2.fc1.weight"] == (16, 256, 1, 1)  # MBConv squeeze-excitation
    assert shapes["backbone.6.14.block.3.1.running_var"] == (256,)  # the 15th block of the last stage
    assert shapes["backbone.7.0.weight"] == (1280, 256, 1, 1)
    assert shapes["mapper.0.weight"] == (16, 1280, 1, 1) and "mapper.1.running_mean" in state
    assert "mapper.1.weight" not in state  # Stable Cascade's mapper norm is not affine
    with torch.no_grad():  # a 1024 px side: 3/4 then /32 = 24 latents (resolution_multiple 42.67)
        assert encoder.encode(torch.zeros(1, 3, 128, 256)).latent_dist.mean.shape == (1, 16, 3, 6)
    assert EfficientNetEncoder.latent_size(1024) == 24


def test_effnet_file_of_another_layout_is_refused_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    from ot_dist.errors import InputFileError
    from ot_dist.models.efficientnet import load_effnet

    save_file({"features.0.0.weight": torch.zeros(24, 3, 3, 3)}, str(tmp_path / "effnet_encoder.safetensors"))
    with pytest.raises(InputFileError, match="effnet_encoder.safetensors.*unexpected"):
        load_effnet(tmp_path / "effnet_encoder.safetensors")


def onetrainer_alpha_cumprod(timesteps):
    """OneTrainer modules/modelSetup/BaseWuerstchenSetup.py `__alpha_cumprod` (after dome272/wuerstchen)."""
    s = torch.tensor([0.008], dtype=torch.float32)
    init_alpha_cumprod = torch.cos(s / (1 + s) * torch.pi * 0.5) ** 2
    alpha_cumprod = torch.cos((timesteps + s) / (1 + s) * torch.pi * 0.5) ** 2 / init_alpha_cumprod
    return alpha_cumprod.clamp(0.0001, 0.9999)


def test_objective_equals_onetrainers_formulas(family_models, shapes_data, tmp_path):
    """OneTrainer (BaseWuerstchenSetup.predict, ModelSetupNoiseMixin._get_timestep_continuous,
    ModelSetupDiffusionMixin._add_noise_continuous, ModelSetupDiffusionLossMixin.__p2_loss_weight):
    t = (i + 1) / 10000 with i uniform in 0..9999, Stable Cascade: t + 0.001 clamped to [0.001, 1];
    noisy = sqrt(a(t)) x + sqrt(1 - a(t)) noise; the prior predicts the noise from (noisy, t, clip_text,
    clip_text_pooled, clip_img = zeros); P2 weight (1 + snr)^-gamma with snr = a / (1 - a). The latents are the
    EfficientNet's output as it is."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o",
                          **{"loss.weight_fn": "P2", "loss.weight_strength": 1.0})
    model = trainer.model
    batch = first_batch(trainer)
    seed, epoch = 1, 0
    shape = (16, 3, 3)  # 128 px -> 96 -> 3
    noise, t = [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        torch.randn(shape, generator=g)  # the posterior draw (unused: the encoder is deterministic)
        noise.append(torch.randn(shape, generator=g))
        t.append(torch.randint(0, 10000, (1,), generator=g))
    noise = torch.stack(noise)
    t = ((torch.cat(t).float() + 1) / 10000 + 0.001).clamp(0.001, 1.0)
    with torch.no_grad():
        x = model.vae(model.vae.preprocess(batch["pixels"]))
        a = onetrainer_alpha_cumprod(t).view(-1, 1, 1, 1)
        noisy = a.sqrt() * x + (1 - a).sqrt() * noise
        out = model.text_encoders["text_encoder"](batch["token_ids"]["text_encoder"],
                                                  attention_mask=batch["token_ids"]["text_encoder_mask"],
                                                  output_hidden_states=True)
        predicted = model.denoiser(noisy, timestep_ratio=t, clip_text_pooled=out.text_embeds.unsqueeze(1),
                                   clip_text=out.hidden_states[-1], clip_img=torch.zeros(2, 1, 16)).sample
        snr = a.flatten() / (1 - a.flatten())
        expected = (((predicted - noise) ** 2).mean(dim=(1, 2, 3)) * (1 + snr) ** -1.0).mean()
        ours = diffusion_loss(model, batch, seed, epoch, trainer.config.loss)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # the schedule DDPMWuerstchenScheduler samples with is the same alpha-bar
    from diffusers import DDPMWuerstchenScheduler

    torch.testing.assert_close(DDPMWuerstchenScheduler()._alpha_cumprod(t, "cpu"), onetrainer_alpha_cumprod(t))


def test_text_conditioning_equals_the_prior_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, captions = trainer.model, ["a red circle on a blue background", "a big green square"]
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        hidden, pooled, _, _ = model.pipeline.encode_prompt("cpu", 2, 1, False, prompt=captions)
    torch.testing.assert_close(ours["hidden"], hidden)
    torch.testing.assert_close(ours["pooled"], pooled)


def predictions(family, prior, text_encoder, tokenizer):
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 3, 4), torch.tensor([0.5])
    conditioning = family.encode_text({"text_encoder": text_encoder},
                                      family.tokenize({"tokenizer": tokenizer}, ["a dot"]))
    with torch.no_grad():
        return family.predict(prior, noisy, t, conditioning, {})


def comfyui_stage_c_module(diffusers_key: str) -> str:
    """A diffusers StableCascadeUNet weight key -> the module name under which ComfyUI's StableCascade_C holds it:
    the original stage C names (diffusers' convert_stable_cascade_unet_single_file_to_diffusers, reversed), with
    ComfyUI's Attention2D splitting nn.MultiheadAttention into attn.to_q / to_k / to_v and keeping attn.out_proj."""
    module = diffusers_key[: -len(".weight")]
    for name in ("to_q", "to_k", "to_v"):
        if module.endswith(f".attention.{name}"):
            return module[: -len(name)] + f"attn.{name}"
    if module.endswith(".attention.to_out.0"):
        return module[: -len("to_out.0")] + "attn.out_proj"
    return module


def comfyui_lora_names(prior_dir) -> dict[str, str]:
    """ComfyUI comfy/lora.py model_lora_keys_unet: for every `diffusion_model.<k>.weight` of the model,
    key_map["lora_prior_unet_" + k with "." -> "_"] (the Stable Cascade prefix); here mapped to the diffusers key."""
    state = load_file(prior_dir / "prior" / "diffusion_pytorch_model.safetensors")
    return {"lora_prior_unet_" + comfyui_stage_c_module(k).replace(".", "_"): k for k in state if k.endswith(".weight")}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_training_lowers_the_loss_and_the_export_gives_the_trained_outputs(method, family_models, shapes_data,
                                                                           tmp_path):
    """full: the exported folder's prior loads with StableCascadeUNet.from_pretrained (what a user of the prior
    does; diffusers' saved prior pipeline folders reload too) and the single file with from_single_file, and both
    predict as the trained one. LoRA: every module
    of the file is a name ComfyUI maps onto stage C; applied to the base prior by that mapping at strength 1
    (up @ down x alpha / rank, ComfyUI's rule), it predicts as the trained prior."""
    from diffusers import StableCascadePriorPipeline, StableCascadeUNet

    model_dir = family_models[FAMILY]
    lr = 2e-3 if method == "full" else 2e-2
    extra = {"output_dtype": "float32", "lora.rank": 4, "lora.alpha": 2,
             "lora.preset": "attention_mlp"} if method == "lora" else {"output_dtype": "float32"}
    trainer = trainer_for(model_dir, shapes_data, tmp_path / "o", method=method, epochs=3, batch_size=4,
                          learning_rate=lr, **{"data.cache_latents": True, "data.cache_text": True}, **extra)
    result = trainer.train()
    per_epoch = np.array(result.losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"

    model = trainer.model
    trained = predictions(model.family, model.denoiser, model.text_encoders["text_encoder"],
                          model.tokenizers["tokenizer"])
    base = StableCascadePriorPipeline.from_pretrained(model_dir, local_files_only=True)
    if method == "full":
        prior = StableCascadeUNet.from_pretrained(tmp_path / "o" / "model" / "prior")
        again = StableCascadePriorPipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True).prior
        torch.testing.assert_close(predictions(model.family, again, base.text_encoder, base.tokenizer), trained)
        # Stability's stage_c.safetensors layout (ComfyUI's UNET loader, StableSwarm): read by diffusers'
        # from_single_file (its converter splits attn.in_proj_weight) and by ot_dist as model.path.
        from ot_dist.config.schema import ModelConfig
        from ot_dist.models.loading import load_model

        single = tmp_path / "o" / "model.safetensors"
        assert "down_blocks.0.2.attention.attn.in_proj_weight" in load_file(single)
        for loaded in (StableCascadeUNet.from_single_file(str(single), config=str(model_dir), subfolder="prior",
                                                          local_files_only=True),
                       load_model(ModelConfig(family=FAMILY, path=str(single), config=str(model_dir))).denoiser):
            torch.testing.assert_close(predictions(model.family, loaded, base.text_encoder, base.tokenizer), trained,
                                       rtol=1e-4, atol=1e-5)
    else:
        saved = load_file(tmp_path / "o" / "lora.safetensors")
        names = comfyui_lora_names(model_dir)
        modules = {k.split(".")[0] for k in saved}
        assert modules and modules <= set(names), modules - set(names)
        assert any(m.endswith("_attention_attn_out_proj") for m in modules)
        assert any(m.endswith("_kv_mapper_1") for m in modules)
        prior = base.prior
        state = prior.state_dict()
        for module in modules:
            down, up = saved[f"{module}.lora_down.weight"].float(), saved[f"{module}.lora_up.weight"].float()
            scale = saved[f"{module}.alpha"].item() / down.shape[0]
            state[names[module]] = state[names[module]] + (up @ down) * scale
        before = predictions(model.family, base.prior, base.text_encoder, base.tokenizer)
        assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison means something
        prior.load_state_dict(state)
    again = predictions(model.family, prior, base.text_encoder, base.tokenizer)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)


# ComfyUI's names for Stable Cascade's CLIP-G LoRA modules. Read from github.com/Comfy-Org/ComfyUI:
#   comfy/lora.py @ 17358c8f73b581a0d22facc3c385822f09b8bfb1, model_lora_keys_clip: for b in range(32) and each
#     LORA_CLIP_MAP module c (mlp.fc1, mlp.fc2, self_attn.q_proj / k_proj / v_proj / out_proj) whose weight
#     `clip_g.transformer.text_model.encoder.layers.<b>.<c>.weight` the text-encoder model has, with no clip_l loaded:
#     `lora_te_text_model_encoder_layers_<b>_<c with _>`, `text_encoder.text_model.encoder.layers.<b>.<c>` and
#     (the cascade line) `lora_prior_te_text_model_encoder_layers_<b>_<c with _>`; `clip_g.transformer.
#     text_projection.weight` -> `lora_prior_te_text_projection` only. comfy/sdxl_clip.py StableCascadeClipModel is
#     an SD1ClipModel with clip_name "g" (its weights under `clip_g.transformer.`), the CLIP of comfy/clip_model.py
#     (`text_model.…` and a top-level `text_projection` Linear, transformers' CLIPTextModelWithProjection names).
#   comfy/weight_adapter/lora.py @ 6f98b150e065f1ffc788558574a887835068bd40, LoRAAdapter.load / calculate_weight:
#     `x.lora_up.weight`, `x.lora_down.weight`, `x.alpha` when present; W += (alpha / rank, 1.0 without alpha) up @ down.
COMFY_CLIP_MODULES = ("mlp.fc1", "mlp.fc2", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj",
                      "self_attn.out_proj")


def comfyui_clip_g_names(text_encoder) -> dict[str, str]:
    """ComfyUI's LoRA module name -> the CLIP-G module path (transformers' names) for Stable Cascade's text encoder."""
    weights = {k[: -len(".weight")] for k in text_encoder.state_dict() if k.endswith(".weight")}
    weights = {k.replace(".base_layer", "") for k in weights if ".lora_" not in k}
    names = {}
    for block in range(32):
        for module in COMFY_CLIP_MODULES:
            path = f"text_model.encoder.layers.{block}.{module}"
            if path in weights:
                flat = path.replace(".", "_")
                names |= {f"lora_te_{flat}": path, f"text_encoder.{path}": path, f"lora_prior_te_{flat}": path}
    if "text_projection" in weights:
        names["lora_prior_te_text_projection"] = "text_projection"
    return names


def test_clip_g_lora_has_comfyuis_stable_cascade_names_at_the_trained_strength(family_models, shapes_data, tmp_path):
    """A LoRA on the prior and CLIP-G (its projection too): every module of the file is a name ComfyUI maps for
    Stable Cascade (prior: lora_prior_unet_; CLIP-G: lora_prior_te_, the only prefix it gives text_projection), each
    with its .alpha tensor, none left over, and W + alpha / rank x up @ down is the trained weight."""
    from peft.tuners.lora import LoraLayer

    from ot_dist.methods.lora import ADAPTER

    rank, alpha = 4, 2.0  # alpha != rank: a loader ignoring .alpha applies twice the trained change
    targets = [*COMFY_CLIP_MODULES, "text_projection"]
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=2e-2, output_dtype="float32", **{"text_encoder.train": True,
                          "lora.rank": rank, "lora.alpha": alpha, "lora.text_encoder_targets": targets})
    trainer.train()
    tensors = load_file(tmp_path / "o" / "lora.safetensors")
    model = trainer.model
    encoder = model.text_encoders["text_encoder"]
    prior_names = comfyui_lora_names(family_models[FAMILY])
    clip_names = comfyui_clip_g_names(encoder)
    parts = {"prior": model.denoiser, "text_encoder": encoder}
    layers = {(part, path): m for part, module in parts.items() for path, m in module.named_modules()
              if isinstance(m, LoraLayer)}
    key_map = {**{n: ("prior", k[: -len(".weight")]) for n, k in prior_names.items()},
               **{n: ("text_encoder", p) for n, p in clip_names.items()}}
    loaded, applied = set(), {}
    for name, target in key_map.items():  # ComfyUI's load_lora over its key map
        if name + ".lora_up.weight" in tensors:
            assert name + ".alpha" in tensors, f"{name}: no .alpha tensor"
            applied[target] = (tensors[name + ".lora_up.weight"], tensors[name + ".lora_down.weight"],
                               tensors[name + ".alpha"].item())
            loaded |= {name + ".lora_up.weight", name + ".lora_down.weight", name + ".alpha"}
    assert not set(tensors) - loaded, f"ComfyUI would not load {sorted(set(tensors) - loaded)[:5]}"
    clip_modules = {k.rsplit(".", 2)[0] for k in tensors if not k.startswith("lora_prior_unet_")}
    assert clip_modules and all(m.startswith("lora_prior_te_") for m in clip_modules)
    assert "lora_prior_te_text_projection" in clip_modules
    assert set(applied) == set(layers), set(layers) ^ set(applied)  # every trained module, once
    moved = set()
    for (part, path), (up, down, file_alpha) in applied.items():
        layer = layers[part, path]
        assert file_alpha == alpha
        change = file_alpha / down.shape[0] * (up.float() @ down.float())
        torch.testing.assert_close(layer.base_layer.weight.float() + change,
                                   layer.base_layer.weight.float() + layer.get_delta_weight(ADAPTER),
                                   rtol=1e-5, atol=1e-7)
        if layer.get_delta_weight(ADAPTER).abs().max() > 1e-6:
            moved.add(part)
    assert moved == {"prior", "text_encoder"}, f"only {moved} trained: the comparison would be 0 == 0"


# ComfyUI's reading of an embedding file for Stable Cascade. Read from github.com/Comfy-Org/ComfyUI:
#   comfy/sdxl_clip.py StableCascadeClipGTokenizer: SDTokenizer with embedding_size 1280, embedding_key "clip_g";
#   comfy/sd1_clip.py load_embed: a safetensors file's dict; no "string_to_param" and not a list -> embed[embedding_key]
#     when the key is there (else bundle_emb.* / the first tensor); the [n, size] vectors stand in the prompt for the
#     `embedding:<file name>` word, one position per vector.
# OneTrainer (modules/modelSaver/wuerstchen/WuerstchenEmbeddingSaver, both Würstchen v2 and Stable Cascade) writes the
# prior text encoder's vectors under "clip_g" too.
def comfyui_load_embed(path, embedding_key: str = "clip_g"):
    embed = load_file(path)
    assert "string_to_param" not in embed
    return embed[embedding_key] if embedding_key in embed else next(iter(embed.values()))


# Minimal relative drop of the fixed-noise loss (deterministic: float32 rounding moves it by ~1e-7). Würstchen v2's
# tiny prior starts with its output conv x 0.01 (build_tiny), so the frozen prior's prediction depends little on the
# text: the embedding moves its loss by ~1e-4 (measured 1.1e-4; Stable Cascade 1.7e-2).
EMBEDDING_DROP = {"stable_cascade": 0.005, "wuerstchen_v2": 5e-5}


@pytest.mark.parametrize("family", ["stable_cascade", "wuerstchen_v2"])
def test_embedding_trains_and_loads_back_as_comfyui_reads_it(family, family_models, shapes_data, tmp_path):
    """Textual inversion on the prior's CLIP: the fixed-noise loss falls; the file is {"clip_g": [2, width]} (the
    key ComfyUI's Stable Cascade tokenizer and OneTrainer use); its vectors put in place of the token's words in the
    base text encoder (ComfyUI's substitution; in transformers: add_tokens, resize_token_embeddings, set the rows)
    give the trained encoder's conditioning."""
    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model
    from ot_dist.train.evaluate import fixed_noise_loss

    out = tmp_path / "o"
    sample = {"prompt": "a photo of <ot-embedding>", "steps": 2}  # sampling with the trained words works too
    trainer = Trainer(validate(base_config(family_models[family], shapes_data, out, family=family, method="embedding",
                                           epochs=3, batch_size=4, resolution=128, learning_rate=5e-2,
                                           output_dtype="float32", **{"embedding.vectors": 2, "sampling.prompts": [sample],
                                           "model.decoder": str(family_models[family] / "decoder_stages")})), log=quiet)
    before = fixed_noise_loss(trainer)
    result = trainer.train()
    after = fixed_noise_loss(trainer)
    assert after < before * (1 - EMBEDDING_DROP[family]), f"fixed-noise loss {before:.6f} -> {after:.6f}"
    assert [p.name for p in result.exported] == ["embedding.safetensors"]
    assert len(list((out / "samples").glob("step-*/*.png"))) == 1
    model = trainer.model
    width = model.text_encoders["text_encoder"].config.hidden_size
    assert set(load_file(out / "embedding.safetensors")) == {"clip_g"}
    vectors = comfyui_load_embed(out / "embedding.safetensors")
    assert vectors.shape == (2, width)

    base = load_model(ModelConfig(family=family, path=str(family_models[family])))
    tokenizer, encoder = base.tokenizers["tokenizer"], base.text_encoders["text_encoder"]
    init_row = encoder.get_input_embeddings().weight[tokenizer("*", add_special_tokens=False).input_ids[0]]
    assert not torch.allclose(vectors[0], init_row, atol=1e-3), "the embedding did not train"
    # docs/checkpoints.md's block for these families, exactly as documented
    from types import SimpleNamespace

    from test_early_checks import doc_blocks

    block = doc_blocks("checkpoints.md", "Loading an exported embedding")[2]
    token = trainer.config.embedding.token
    exec(block.replace("OUT/", f"{out}/").replace('"TOKEN"', repr(token)).replace("TOKEN_", f"{token}_"),
         {"pipe": SimpleNamespace(tokenizer=tokenizer, text_encoder=encoder)})
    words = trainer.method.token_strings()
    assert tokenizer.unk_token_id not in tokenizer.convert_tokens_to_ids(words)
    prompt = trainer.method.caption(f"a photo of {trainer.config.embedding.token} on a white background")
    family_of = model.family
    with torch.no_grad():
        mine_tokens = family_of.tokenize(model.tokenizers, [prompt])
        theirs_tokens = family_of.tokenize({"tokenizer": tokenizer}, [prompt])
        assert torch.equal(mine_tokens["text_encoder"], theirs_tokens["text_encoder"])
        mine = family_of.encode_text(model.text_encoders, mine_tokens)
        theirs = family_of.encode_text({"text_encoder": encoder}, theirs_tokens)
        untrained = family_of.encode_text(base.text_encoders, family_of.tokenize(base.tokenizers, ["a photo"]))
    assert mine.keys() == theirs.keys() and untrained
    for key in mine:
        torch.testing.assert_close(theirs[key], mine[key], rtol=1e-5, atol=1e-6, msg=key)


def test_cached_effnet_latents_train_like_encoding_each_step(family_models, shapes_data, tmp_path):
    """The cache encodes one image at a time, training a batch of 4: the EfficientNet's convolutions sum in another
    order, so the latents agree to float32 rounding (the losses to ~1e-7), not bit for bit. A cache of other latents
    (unnormalised, another scaling, another image) moves the loss by far more than the tolerance."""
    losses = []
    for cached in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / str(cached), method="lora", max_steps=3,
                              **{"data.cache_latents": cached, "data.cache_text": cached})
        losses.append(trainer.train().losses)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


@pytest.mark.parametrize(("family", "weight_dtype"), [("stable_cascade", "bfloat16"), ("wuerstchen_v2", "float8")])
def test_frozen_effnet_in_low_precision_storage_encodes_like_float32(family, weight_dtype, family_models, shapes_data,
                                                                   tmp_path):
    """weight_dtype bfloat16 / float8 store the EfficientNet encoder in low precision; its BatchNorm running
    statistics follow (a bfloat16 input meeting float32 statistics is an error on the CPU), so a LoRA step runs and
    the encoder's latents equal the float32 encoder's within the storage's rounding (measured: 1 % relative error
    for bfloat16, 8-9 % for float8)."""
    from ot_dist.memory.float8 import compute_dtype

    reference = trainer_for(family_models[family], shapes_data, tmp_path / "f32", method="lora", family=family)
    trainer = trainer_for(family_models[family], shapes_data, tmp_path / weight_dtype, method="lora", family=family,
                          max_steps=1, weight_dtype=weight_dtype, train_dtype="bfloat16")
    pixels = first_batch(trainer)["pixels"]

    def encoded(vae):
        with torch.no_grad():
            return vae.encode(pixels.to(compute_dtype(vae))).latent_dist.mean.float()

    expected, latents = encoded(reference.model.vae), encoded(trainer.model.vae)
    error = ((latents - expected).norm() / expected.norm()).item()
    assert error < (0.05 if weight_dtype == "bfloat16" else 0.15), error
    assert all(math.isfinite(loss) for loss in trainer.train().losses)


def test_model_folder_without_the_effnet_is_refused_naming_the_file(family_models, tmp_path):
    import shutil

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.loading import load_model

    folder = tmp_path / "prior"
    shutil.copytree(family_models[FAMILY], folder)
    (folder / "effnet_encoder.safetensors").unlink()
    with pytest.raises(InputFileError, match="effnet_encoder.safetensors"):
        load_model(ModelConfig(family=FAMILY, path=str(folder)))


def test_continuous_time_respects_the_timestep_range():
    """loss.min_timestep / max_timestep count OneTrainer's 10000 discrete steps: t stays in their share of (0, 1]."""
    from ot_dist.config.loss import LossConfig
    from ot_dist.models.objectives import ContinuousCosine

    objective, options = ContinuousCosine(), LossConfig(min_timestep=2000, max_timestep=2999)
    g = torch.Generator().manual_seed(0)
    t = torch.cat([objective.draw(g, options, torch.Size((16, 3, 3))) for _ in range(200)])
    assert t.min() >= 0.2011 - 1e-6 and t.max() <= 0.3011 + 1e-6
    assert math.isclose(objective.draw(torch.Generator().manual_seed(1), LossConfig(min_timestep=9999), None).item(),
                        1.0)  # (9999 + 1) / 10000 + 0.001, clamped to 1


@pytest.mark.parametrize("name,gigabytes", [("Stable Cascade C", 14.4), ("Stable Cascade C lite", 4.2)])
def test_memory_table_rows_are_the_published_sizes_sharded_by_block(name, gigabytes):
    """The seed's fp32 sizes of stage C (3.6 B) and the lite prior (1 B); the family's sharding units (every
    block of each level of down_blocks / up_blocks) are each a few % of the prior."""
    from ot_dist.memory.table import build_components, fsdp_rank_bytes, sharding_units
    from ot_dist.models.families.registry import get_family

    components = build_components(name)
    prior = components["prior"]
    total = sum(p.numel() for p in prior.parameters())
    assert abs(4 * total / 1e9 - gigabytes) / gigabytes < 0.02, total
    units = sharding_units(prior, get_family(FAMILY).shard_units["prior"])
    assert len(units) == sum(len(level) for level in (*prior.down_blocks, *prior.up_blocks))
    assert max(sum(p.numel() for p in u.parameters()) for u in units) / total < 0.05
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.05


# -- Würstchen v2 (the sibling family in the same module) ------------------------------------------------------------

def test_wuerstchen_v2_memory_row_is_warp_ais_prior_sharded_by_block():
    """The memory table's Würstchen v2 row (ot-dist init's reference for the family) is warp-ai/wuerstchen-prior as
    diffusers' convert_wuerstchen.py builds it: a 0.99 B WuerstchenPrior (the ~1 B stage C of the Würstchen paper),
    CLIP-bigG's text model without projection, the
    EfficientNet with the affine mapper norm; the family's sharding units (each block of `blocks`) are each a few
    % of the prior."""
    from ot_dist.memory.table import DENOISERS, build_components, fsdp_rank_bytes, sharding_units
    from ot_dist.models.families.registry import get_family

    family = get_family("wuerstchen_v2")
    name = family.memory_reference
    components = build_components(name)
    prior = components["prior"]
    assert type(prior).__name__ == "WuerstchenPrior" and type(components["text_encoder"]).__name__ == "CLIPTextModel"
    total = sum(p.numel() for p in prior.parameters())
    assert total == 993_636_896
    assert sum(p.numel() for p in components["text_encoder"].parameters()) == 693_021_440
    assert "mapper.1.weight" in components["effnet"].state_dict()  # Würstchen v2's affine mapper norm
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    units = sharding_units(prior, family.shard_units["prior"])
    assert len(units) == len(prior.blocks) == 3 * 32
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.05



def test_wuerstchen_v2_objective_equals_onetrainers_formulas(family_models, shapes_data, tmp_path):
    """OneTrainer BaseWuerstchenSetup.predict for Würstchen v2: latents (x + 1) / 42, t = ((i + 1) / 10000) x 1.08
    + 0.001 clamped to [0.001, 1], the prior called as prior(noisy, t, c = CLIP's last hidden states)."""
    trainer = Trainer(validate(base_config(family_models["wuerstchen_v2"], shapes_data, tmp_path / "o",
                                           family="wuerstchen_v2", batch_size=2, resolution=128)), log=quiet)
    model = trainer.model
    batch = first_batch(trainer)
    noise, t = [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        torch.randn((16, 3, 3), generator=g)
        noise.append(torch.randn((16, 3, 3), generator=g))
        t.append(torch.randint(0, 10000, (1,), generator=g))
    noise = torch.stack(noise)
    # (in float64, then float32: OneTrainer's float32 arithmetic rounds t differently by ~1e-7, which the tiny
    # random prior's (x - a) / |1 - b| output amplifies past the tolerance)
    t = ((torch.cat(t).double() + 1) / 10000 * 1.08 + 0.001).clamp(0.001, 1.0).float()
    with torch.no_grad():
        x = (model.vae(model.vae.preprocess(batch["pixels"])) + 1.0) / 42.0
        a = onetrainer_alpha_cumprod(t).view(-1, 1, 1, 1)
        noisy = a.sqrt() * x + (1 - a).sqrt() * noise
        hidden = model.text_encoders["text_encoder"](batch["token_ids"]["text_encoder"],
                                                     attention_mask=batch["token_ids"]["text_encoder_mask"])[0]
        expected = ((model.denoiser(noisy, t, hidden) - noise) ** 2).mean()
        ours = diffusion_loss(model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert model.vae.config.affine  # Würstchen v2's mapper norm has weight and bias


def test_wuerstchen_v2_trains_and_the_prior_export_loads_as_users_load_it(family_models, shapes_data, tmp_path):
    """The saved WuerstchenPriorPipeline folder does not reload through diffusers (WuerstchenPrior is not exported);
    users load the prior with WuerstchenPrior.from_pretrained, and ot_dist loads such folders component by
    component (model.path = the export works)."""
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior

    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model

    trainer = Trainer(validate(base_config(family_models["wuerstchen_v2"], shapes_data, tmp_path / "o",
                                           family="wuerstchen_v2", resolution=128, epochs=3, batch_size=4,
                                           learning_rate=2e-3, output_dtype="float32",
                                           **{"data.cache_latents": True, "data.cache_text": True})), log=quiet)
    per_epoch = np.array(trainer.train().losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"
    model = trainer.model
    prior = WuerstchenPrior.from_pretrained(tmp_path / "o" / "model" / "prior")
    torch.manual_seed(0)
    noisy, t, c = torch.randn(1, 16, 3, 4), torch.tensor([0.5]), torch.randn(1, 77, 32)
    with torch.no_grad():
        torch.testing.assert_close(prior(noisy, t, c), model.denoiser(noisy, t, c), rtol=1e-4, atol=1e-5)
    # The export holds the EfficientNet (and the tiny one's effnet_encoder.json) itself: nothing to copy in.
    again = load_model(ModelConfig(family="wuerstchen_v2", path=str(tmp_path / "o" / "model")))
    with torch.no_grad():
        torch.testing.assert_close(again.denoiser(noisy, t, c), model.denoiser(noisy, t, c), rtol=1e-4, atol=1e-5)


def test_wuerstchen_v2_lora_trains_and_loads_back_through_peft(family_models, shapes_data, tmp_path):
    """LoRA on Würstchen v2's prior: the loss falls, and the diffusers-layout file (no UI reads kohya names for this
    family; diffusers gives WuerstchenPrior no LoRA loader) loads with load_peft_lora into the pipeline a user
    builds from the base folder's components, giving the trained prior's outputs."""
    from diffusers import DDPMWuerstchenScheduler, WuerstchenPriorPipeline
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior
    from transformers import CLIPTextModel, CLIPTokenizer

    from ot_dist.lora_tools.peft_load import load_peft_lora

    model_dir = family_models["wuerstchen_v2"]
    trainer = Trainer(validate(base_config(model_dir, shapes_data, tmp_path / "o", family="wuerstchen_v2", method="lora",
                                           resolution=128, epochs=3, batch_size=4, learning_rate=2e-2,
                                           output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 2,
                                           "data.cache_latents": True, "data.cache_text": True})), log=quiet)
    per_epoch = np.array(trainer.train().losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"
    pipe = WuerstchenPriorPipeline(
        prior=WuerstchenPrior.from_pretrained(model_dir / "prior"), text_encoder=CLIPTextModel.from_pretrained(
            model_dir / "text_encoder"), tokenizer=CLIPTokenizer.from_pretrained(model_dir / "tokenizer"),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(model_dir / "scheduler"))
    torch.manual_seed(0)
    noisy, t, c = torch.randn(1, 16, 3, 4), torch.tensor([0.5]), torch.randn(1, 77, 32)
    with torch.no_grad():
        before = pipe.prior(noisy, t, c)
        assert load_peft_lora(pipe, tmp_path / "o" / "lora.safetensors") == ["prior"]
        trained = trainer.model.denoiser(noisy, t, c)
        assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison means something
        torch.testing.assert_close(pipe.prior(noisy, t, c), trained, rtol=1e-4, atol=1e-5)


def chained_pipelines(family: str, export, decoder_dir, prompt: dict):
    """What a user of the exported prior gets from diffusers: the prior pipeline built from the export's components
    (its prior loaded on its own: these folders do not reload as pipelines), the decoder pipeline built from the
    decoder folder's components, the prior's image embeddings handed to the decoder, one generator for both.
    Stable Cascade's decoder decodes from the prompt with its own CLIP-G (the same weights as the prior's)."""
    import diffusers
    from diffusers import DDPMWuerstchenScheduler, StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    cascade = family == "stable_cascade"
    encoder_cls = CLIPTextModelWithProjection if cascade else CLIPTextModel
    prior_cls = StableCascadeUNet if cascade else WuerstchenPrior
    prior = getattr(diffusers, "StableCascadePriorPipeline" if cascade else "WuerstchenPriorPipeline")(
        prior=prior_cls.from_pretrained(export / "prior"), text_encoder=encoder_cls.from_pretrained(export / "text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(export / "tokenizer"),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(export / "scheduler"))
    decoder_cls = StableCascadeUNet if cascade else WuerstchenDiffNeXt
    decoder = getattr(diffusers, "StableCascadeDecoderPipeline" if cascade else "WuerstchenDecoderPipeline")(
        decoder=decoder_cls.from_pretrained(decoder_dir / "decoder"), vqgan=PaellaVQModel.from_pretrained(decoder_dir / "vqgan"),
        text_encoder=encoder_cls.from_pretrained(decoder_dir / "text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(decoder_dir / "tokenizer"),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(decoder_dir / "scheduler"))
    generator = torch.Generator().manual_seed(prompt["seed"])
    embeddings = prior(prompt=prompt["prompt"], height=128, width=128, num_inference_steps=prompt["steps"],
                       guidance_scale=prompt["guidance_scale"], generator=generator, output_type="pt")[0]
    steps = 10 if cascade else 12  # the decoder steps ot_dist samples with (Stability's model card; diffusers' default)
    image = decoder(image_embeddings=embeddings, prompt=prompt["prompt"], num_inference_steps=steps,
                    guidance_scale=0.0, generator=generator, output_type="pil").images[0]
    return np.asarray(image).astype(int)


@pytest.mark.parametrize("family", ["stable_cascade", "wuerstchen_v2"])
def test_samples_during_training_equal_the_prior_and_decoder_pipelines(family, family_models, shapes_data, tmp_path):
    """A short full finetune with a sample prompt: the sample (prior from the trained weights, then the frozen
    decoder stages of model.decoder) is the image diffusers' prior + decoder pipelines make from the exported prior
    and the decoder folder's components, same prompt and seed; it differs from the base prior's image."""
    from PIL import Image

    model_dir = family_models[family]
    decoder_dir = model_dir / "decoder_stages"
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0}
    Trainer(validate(base_config(model_dir, shapes_data, tmp_path / "o", family=family, resolution=128, max_steps=2,
                                 learning_rate=1e-1, output_dtype="float32", **{"model.decoder": str(decoder_dir),
                                 "sampling.prompts": [prompt]})), log=quiet).train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (128, 128, 3)  # 128 px -> 3 embeddings -> 32 stage A latents (x 10.67) -> 128 px
    expected = chained_pipelines(family, tmp_path / "o" / "model", decoder_dir, prompt)
    assert np.abs(ours - expected).max() <= 1
    base = chained_pipelines(family, model_dir, decoder_dir, prompt)
    assert np.abs(base - expected).max() > 4  # the trained prior drew it (well past the rounding tolerance)


def test_decoder_setting_errors_name_the_key(family_models, shapes_data, tmp_path):
    """Sample prompts without model.decoder, model.decoder for a family without decoder stages, and a folder that
    is not a decoder pipeline are refused naming model.decoder."""
    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import ConfigError, InputFileError
    from ot_dist.models.loading import load_model

    raw = base_config(family_models[FAMILY], shapes_data, tmp_path / "o", family=FAMILY, resolution=128,
                      **{"sampling.prompts": [{"prompt": "a red circle"}]})
    with pytest.raises((ConfigError, ValueError), match="model.decoder: sampling stable_cascade needs"):
        validate(raw)
    with pytest.raises((ConfigError, ValueError), match="model.decoder: sd1 has no separate decoder"):
        validate(base_config(family_models[FAMILY], shapes_data, tmp_path / "o", **{"model.decoder": "x"}))
    for folder, message in ((family_models[FAMILY], "holds a StableCascadePriorPipeline"),
                            (tmp_path / "missing", "is not a folder")):
        with pytest.raises(InputFileError, match=f"model.decoder: .*{message}"):
            load_model(ModelConfig(family=FAMILY, path=str(family_models[FAMILY]), decoder=str(folder)))
