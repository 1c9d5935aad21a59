"""Flux.1 (dev, schnell) and Chroma on the family contract: the objective against a hand computation, text
encoding against the pipelines' own, training (full, LoRA), exports that diffusers loads and that equal the
trained modules, single files, cached text and sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.models.families.flux import pack, unpack
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


def trainer_for(model, data, out, family="flux", method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family=family, method=method, **settings)), log=quiet)


def test_pack_and_unpack_are_inverse_and_match_the_pipeline():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 8, 6)
    packed = pack(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 6))
    assert torch.equal(unpack(packed, 8, 6), latents)


def test_flux_objective_equals_a_hand_computation(family_models, shapes_data, tmp_path):
    """sigma from the sample's own draw (logit-normal u, Flux's shift for this resolution's token count),
    x_t = (1 - sigma) x + sigma n, target n - x, and the transformer called as FluxPipeline calls it."""
    trainer = trainer_for(family_models["flux"], shapes_data, tmp_path / "o")
    model = trainer.model
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    seed, epoch = 1, 0
    loss = diffusion_loss(model, batch, seed, epoch)

    vae, transformer = model.vae, model.denoiser
    shape = (16, batch["pixels"].shape[-2] // 8, batch["pixels"].shape[-1] // 8)
    tokens = (shape[1] // 2) * (shape[2] // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)  # the scheduler config's base / max shift
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    eps, noise = torch.stack(eps), torch.stack(noise)
    with torch.no_grad():
        posterior = vae.encode(batch["pixels"]).latent_dist
        x = ((posterior.mean + posterior.std * eps) - vae.config.shift_factor) * vae.config.scaling_factor
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        noisy = (1 - sigma) * x + sigma * noise
        text = model.family.encode_text(model.text_encoders, batch["token_ids"])
        h, w = shape[1:]
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        out = transformer(hidden_states=pack(noisy), timestep=sigma.flatten(), guidance=torch.ones(2),
                          pooled_projections=text["pooled"], encoder_hidden_states=text["hidden"],
                          txt_ids=torch.zeros(text["hidden"].shape[1], 3), img_ids=ids.reshape(-1, 3),
                          return_dict=False)[0]
        expected = torch.nn.functional.mse_loss(unpack(out, h, w), noise - x)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["flux", "chroma"])
def test_text_conditioning_equals_the_pipelines_encode_prompt(family, family_models, shapes_data, tmp_path):
    trainer = trainer_for(family_models[family], shapes_data, tmp_path / "o", family=family)
    model, captions = trainer.model, ["a red circle on a blue background", "a big green square"]
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        max_length = model.family.pipeline_call_options(model.pipeline)["max_sequence_length"]
        if family == "flux":
            hidden, pooled, _ = model.pipeline.encode_prompt(captions, captions, max_sequence_length=max_length)
            torch.testing.assert_close(ours["pooled"], pooled)
        else:
            hidden, mask = model.pipeline._get_t5_prompt_embeds(captions, max_sequence_length=max_length)
            assert torch.equal(ours["mask"].float(), mask.float())
    torch.testing.assert_close(ours["hidden"], hidden)


@pytest.mark.parametrize("family,method", [("flux", "full"), ("flux", "lora"), ("chroma", "full"), ("chroma", "lora")])
def test_training_lowers_the_loss_and_the_exports_load_in_diffusers(family, method, family_models, shapes_data,
                                                                  tmp_path):
    import diffusers

    lr = 3e-4 if method == "full" else 3e-3
    extra = {"text_encoder.train": True} if family == "flux" and method == "lora" else {}
    trainer = trainer_for(family_models[family], shapes_data, tmp_path / "o", family=family, method=method,
                          epochs=4, learning_rate=lr, **extra)
    result = trainer.train()
    per_epoch = np.array(result.losses).reshape(4, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"

    model = trainer.model
    pipeline_cls = getattr(diffusers, model.family.pipeline_class)
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 8, 8), torch.tensor([500.0])
    conditioning = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, ["a dot"]))
    with torch.no_grad():
        trained = model.family.predict(model.denoiser, noisy, t, conditioning, {})
    if method == "full":
        loaded = pipeline_cls.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    else:
        loaded = pipeline_cls.from_pretrained(family_models[family], local_files_only=True)
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    with torch.no_grad():
        loaded_conditioning = model.family.encode_text(
            {n: getattr(loaded, n) for n in model.family.text_encoders},
            model.family.tokenize({n: getattr(loaded, n) for n in model.family.tokenizers}, ["a dot"]))
        again = model.family.predict(loaded.transformer, noisy, t, loaded_conditioning, {})
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)


def test_single_file_and_folder_train_to_identical_weights(family_models, shapes_data, tmp_path):
    """The transformer as Black Forest Labs ship it (one file, their key layout) with the other components from a
    diffusers folder trains exactly like the folder; the export's single file is that layout again."""
    from ot_dist.models.families.flux_single_file import FLUX
    from safetensors.torch import save_file

    folder = family_models["flux"]
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    import json
    config = json.loads((folder / "transformer" / "config.json").read_text())
    original = FLUX.to_original(state, config)
    single = tmp_path / "flux1-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in original.items()}, single)
    weights = []
    for name, path, extra in (("folder", folder, {}), ("single", single, {"model.config": str(folder)})):
        trainer = trainer_for(path, shapes_data, tmp_path / name, max_steps=2, **extra)
        trainer.train()
        weights.append(load_file(tmp_path / name / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    exported = load_file(tmp_path / "folder" / "model.safetensors")
    assert "double_blocks.0.img_attn.qkv.weight" in exported and "final_layer.adaLN_modulation.1.weight" in exported


def test_a_single_file_without_its_config_folder_is_named(family_models, shapes_data, tmp_path):
    from ot_dist.errors import InputFileError

    single = tmp_path / "flux.safetensors"
    from safetensors.torch import save_file
    save_file({"img_in.weight": torch.zeros(2, 2)}, single)
    with pytest.raises(InputFileError, match="model.config"):
        trainer_for(single, shapes_data, tmp_path / "o", max_steps=1)
    with pytest.raises(InputFileError, match="double_blocks"):
        trainer_for(single, shapes_data, tmp_path / "o2", max_steps=1, **{"model.config": str(family_models["flux"])})


def test_cached_text_trains_like_encoding_each_step(family_models, shapes_data, tmp_path):
    """Chroma's conditioning carries its attention mask; the cache must hand it back unchanged."""
    losses = []
    for cached in (False, True):
        trainer = trainer_for(family_models["chroma"], shapes_data, tmp_path / str(cached), family="chroma",
                              method="lora", max_steps=3, **{"data.cache_text": cached})
        losses.append(trainer.train().losses)
    assert losses[0] == losses[1]


def test_samples_equal_the_pipeline_on_the_export(family_models, shapes_data, tmp_path):
    from diffusers import FluxPipeline

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 3.5, "width": 64, "height": 64}
    trainer = trainer_for(family_models["flux"], shapes_data, tmp_path / "o", max_steps=2,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = FluxPipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    image = pipe(prompt="a red circle", width=64, height=64, num_inference_steps=3, guidance_scale=3.5,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, output_type="pil").images[0]
    from PIL import Image
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1


def test_every_feature_under_fsdp_equals_one_process(family_models, tmp_path):
    """Flux with the features at once: sharded Prodigy, sharded EMA, gradient checkpointing, cached latents and
    text, masked training, two resolutions on the family's grid; 2 fsdp ranks (batch 2 each) against one process
    (batch 4): the trained and the EMA weights agree."""
    import json
    import os
    from pathlib import Path

    from PIL import Image

    from ot_dist.demo import make_demo_dataset

    data = make_demo_dataset(tmp_path / "masked", count=8)
    for i in range(8):
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (0, 0, 32 + 2 * i, 64))
        mask.save(data / f"{i:04d}-masklabel.png")
    settings = {"max_steps": 4, "optimizer.name": "PRODIGY", "optimizer.d0": 1e-3, "learning_rate": 1.0,
                "ema.enabled": True, "ema.decay": 0.9, "ema.update_step_interval": 1, "gradient_checkpointing": True,
                "data.cache_latents": True, "data.cache_text": True, "masked_training.enabled": True,
                "masked_training.unmasked_weight": 0.1, "resolution": [48, 64], "data.bucket_step": 16}
    model = family_models["flux"]
    one = base_config(model, data, tmp_path / "one", family="flux", batch_size=4, **settings)
    Trainer(validate(one), log=quiet).train()
    two = base_config(model, data, tmp_path / "two", family="flux", batch_size=2, strategy="fsdp", **settings)
    two["data"]["shards"] = one["data"]["shards"]  # the same shard set (and caches) as the one-process run
    (tmp_path / "cases.json").write_text(json.dumps({"fsdp": two}))
    repo = Path(__file__).resolve().parents[1]
    done = run_ranks(str(repo / "tests" / "helpers" / "family_cases.py"),
                           str(tmp_path / "cases.json"), env={**os.environ, "OMP_NUM_THREADS": "1",
                                                               "PYTHONPATH": str(repo)}, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    base = load_file(model / "transformer" / "diffusion_pytorch_model.safetensors")
    for folder in ("model", "model_ema"):
        want = load_file(tmp_path / "one" / folder / "transformer" / "diffusion_pytorch_model.safetensors")
        got = load_file(tmp_path / "two" / folder / "transformer" / "diffusion_pytorch_model.safetensors")
        diff = max((want[k] - got[k]).abs().max().item() for k in want)
        moved = max((want[k] - base[k]).abs().max().item() for k in want)
        assert diff <= 1e-5 and moved > 1e-3, f"{folder}: diff {diff:.3g}, moved {moved:.3g}"


# ComfyUI's rule for diffusers-layout LoRAs of these families (comfy/lora.py, model_lora_keys_unet: the Flux /
# Chroma branch maps "transformer.{k}" for every diffusers key k of utils.flux_to_diffusers, the SD3 branch the
# same over utils.mmdit_to_diffusers; comfy/weight_adapter/lora.py reads "{x}.lora_A.weight" / "{x}.lora_B.weight"
# as the diffusers2 format and scales by "{x}.alpha" / rank, or by 1.0 when no alpha tensor exists).
def comfyui_transformer_keys(model_dir) -> set[str]:
    """The keys ComfyUI maps, from the diffusers names of the base model's transformer weights."""
    state = load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    return {f"transformer.{k[:-len('.weight')]}" for k in state if k.endswith(".weight")}


@pytest.mark.parametrize("family", ["flux", "chroma", "sd3"])
def test_lora_file_is_read_by_comfyui_rules_at_the_trained_strength(family, family_models, shapes_data, tmp_path):
    trainer = trainer_for(family_models[family], shapes_data, tmp_path / "o", family=family, method="lora",
                          max_steps=3, learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2})
    trainer.train()
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    transformer = trainer.model.denoiser
    comfy_keys = comfyui_transformer_keys(family_models[family])
    assert modules and modules <= comfy_keys, modules - comfy_keys
    assert not any(k.endswith(".alpha") for k in saved)  # ComfyUI then applies strength 1.0: the scale is inside
    layers = dict(transformer.named_modules())
    for module in modules:
        layer = layers[module[len("transformer."):]]
        trained = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        comfy = saved[f"{module}.lora_B.weight"].float() @ saved[f"{module}.lora_A.weight"].float()
        torch.testing.assert_close(comfy, trained.detach(), rtol=1e-5, atol=1e-7)
    assert any(layer.lora_B["default"].weight.abs().max() > 0 for name, layer in layers.items()
               if hasattr(layer, "lora_B"))  # trained: the comparison is not 0 == 0


def test_float8_frozen_transformer_and_t5_train_a_lora(family_models, shapes_data, tmp_path):
    """weight_dtype float8 stores the frozen transformer and the T5 in one byte a weight; the LoRA still trains
    close to the bfloat16-stored run."""
    losses = {}
    for dtype in ("bfloat16", "float8"):
        trainer = trainer_for(family_models["flux"], shapes_data, tmp_path / dtype, method="lora", max_steps=3,
                              train_dtype="bfloat16", weight_dtype=dtype)
        t5 = trainer.model.text_encoders["text_encoder_2"]
        stored = {p.dtype for p in t5.parameters()} | {b.dtype for b in t5.buffers()}
        if dtype == "float8":
            assert torch.float8_e4m3fn in stored, stored
        losses[dtype] = trainer.train().losses
    assert all(abs(a - b) / abs(a) < 0.05 for a, b in zip(losses["bfloat16"], losses["float8"]))


@pytest.mark.parametrize("name", ["flux", "chroma", "sd3"])
def test_t5_max_tokens_sets_the_caption_length_the_pipeline_is_called_with(name):
    """model.t5_max_tokens pads and truncates T5's tokens to its length (the peers' 77 / 256 / 512), in training and
    in the sampling pipeline's max_sequence_length; unset, the family's default stays."""
    from types import SimpleNamespace

    from ot_dist.models.families.registry import get_family
    from ot_dist.models.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

    family = get_family(name)
    t5_name = "tokenizer_3" if name == "sd3" else family.t5_tokenizer
    tokenizers = {n: tiny_t5_tokenizer() if n == t5_name else tiny_clip_tokenizer() for n in family.tokenizers}
    t5_encoder = family.text_encoders[family.tokenizers.index(t5_name)]
    pipeline = SimpleNamespace(**tokenizers)
    short = family.configure(SimpleNamespace(guidance_scale=None, t5_max_tokens=8))
    tokens = short.tokenize(tokenizers, ["a red circle on a blue background with a green square beside it"])
    assert tokens[t5_encoder].shape[-1] == 8 and short.pipeline_call_options(pipeline) == {"max_sequence_length": 8}
    default = family.configure(SimpleNamespace(guidance_scale=None, t5_max_tokens=None))
    assert default is family and default.tokenize(tokenizers, ["a dot"])[t5_encoder].shape[-1] == \
        min(tokenizers[t5_name].model_max_length, 256 if name == "sd3" else 512)


def test_another_t5_length_is_another_text_cache():
    """Cached T5 outputs of one caption length are not read back for another (data.cache_text)."""
    import copy
    from types import SimpleNamespace

    from ot_dist.data.caches import text_key
    from ot_dist.models.families.registry import get_family

    def key(tokens):
        family = copy.copy(get_family("flux").configure(SimpleNamespace(guidance_scale=None, t5_max_tokens=tokens)))
        family.text_encoders = family.tokenizers = ()  # the key's model part aside: only the settings differ
        return text_key(SimpleNamespace(family=family, text_encoders={}, tokenizers={}))

    assert key(None) == key(None) != key(77)
