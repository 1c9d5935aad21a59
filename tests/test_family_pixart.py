"""PixArt-α / Σ on the family contract: the objective (epsilon MSE on the first half of the output, the VB term on
the learned variance, α-1024's micro-conditioning) against hand computations, text encoding against the
pipelines' own, training (full, LoRA through peft's injection), exports that the pipelines load and that equal the
trained modules, the LoRA file in ComfyUI's PixArt key layout, and sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.models.learned_variance import VarianceSchedule, vb_loss
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


def trainer_for(model, data, out, family="pixart_alpha", method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family=family, method=method, **settings)), log=quiet)


def first_batch(trainer):
    return trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))


def test_vb_loss_is_zero_for_the_true_posterior_and_the_gaussian_kl_otherwise():
    """eps = the true noise gives the true posterior mean; variance value -1 the posterior variance: KL 0. Value +1
    (variance beta_t) gives the KL of two Gaussians with one mean: (log b - log s + s / b - 1) / (2 ln 2)."""
    betas = torch.linspace(1e-4, 0.02, 1000)
    schedule = VarianceSchedule(betas)
    alphas_cumprod = torch.cumprod(1 - betas.double(), 0)
    x0, noise = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    t = torch.tensor([10, 500, 999])
    a = alphas_cumprod[t].float().view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    low = vb_loss(schedule, x0, xt, t, noise, -torch.ones_like(x0))
    torch.testing.assert_close(low, torch.zeros_like(low), atol=2e-3, rtol=0)
    high = vb_loss(schedule, x0, xt, t, noise, torch.ones_like(x0))
    previous = alphas_cumprod[t - 1]
    posterior = betas.double()[t] * (1 - previous) / (1 - alphas_cumprod[t])
    beta = betas.double()[t]
    expected = (torch.log(beta) - torch.log(posterior) + posterior / beta - 1) / (2 * math.log(2))
    torch.testing.assert_close(high.mean(dim=(1, 2, 3)).double(), expected, rtol=2e-3, atol=2e-4)
    assert (expected > 0).all()


def transformer_call(model, batch, seed, epoch):
    """The noisy latents, noise, clean latents, timesteps and the transformer's 8-channel output, computed as
    PixArtAlphaPipeline calls the transformer (micro-conditioning from the pixel size for α-1024)."""
    vae, transformer = model.vae, model.denoiser
    shape = (4, batch["pixels"].shape[-2] // 8, batch["pixels"].shape[-1] // 8)
    eps, noise, steps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(seed, epoch, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        steps.append(torch.randint(0, 1000, (1,), generator=g))
    eps, noise, t = torch.stack(eps), torch.stack(noise), torch.cat(steps)
    with torch.no_grad():
        posterior = vae.encode(batch["pixels"]).latent_dist
        x = (posterior.mean + posterior.std * eps) * 0.18215
        betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float32)
        a = torch.cumprod(1 - betas, 0)[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * x + (1 - a).sqrt() * noise
        mask = batch["token_ids"]["text_encoder_mask"]
        hidden = model.text_encoders["text_encoder"](batch["token_ids"]["text_encoder"], attention_mask=mask)[0]
        height, width = batch["pixels"].shape[-2:]
        added = {"resolution": torch.tensor([[height, width]] * 2, dtype=torch.float32),
                 "aspect_ratio": torch.tensor([[height / width]] * 2)}
        out = transformer(noisy, encoder_hidden_states=hidden, encoder_attention_mask=mask, timestep=t,
                          added_cond_kwargs=added, return_dict=False)[0]
    return noisy, noise, x, t, out


def test_alpha_objective_equals_a_hand_computation(family_models, shapes_data, tmp_path):
    """With the VB term off: MSE of the first 4 output channels against the noise, the transformer called with the
    mask and α-1024's resolution / aspect micro-conditioning; with it on (default 1.0, OneTrainer's): plus the VB
    term of the other 4 channels."""
    trainer = trainer_for(family_models["pixart_alpha"], shapes_data, tmp_path / "o", **{"loss.vb_loss_strength": 0})
    model = trainer.model
    assert model.denoiser.use_additional_conditions  # the tiny α is α-1024's layout
    batch = first_batch(trainer)
    noisy, noise, x, t, out = transformer_call(model, batch, 1, 0)
    eps_only = diffusion_loss(model, batch, 1, 0, trainer.config.loss)
    expected = torch.nn.functional.mse_loss(out[:, :4], noise)
    torch.testing.assert_close(eps_only.detach(), expected, rtol=1e-5, atol=1e-6)

    with_vb = diffusion_loss(model, batch, 1, 0, None)  # the default strength
    vb = vb_loss(VarianceSchedule(torch.linspace(1e-4, 0.02, 1000)), x, noisy, t, out[:, :4], out[:, 4:]).mean()
    assert vb > 0
    torch.testing.assert_close(with_vb.detach(), expected + vb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,max_length", [("pixart_alpha", 120), ("pixart_sigma", 300)])
def test_text_conditioning_equals_the_pipelines_encode_prompt(family, max_length, family_models, shapes_data,
                                                              tmp_path):
    trainer = trainer_for(family_models[family], shapes_data, tmp_path / "o", family=family)
    model, captions = trainer.model, ["a red circle on a blue background", "a big green square"]
    assert model.family.max_sequence_length == max_length
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32  # bounded by the tiny tokenizer's model_max_length
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, model.family.tokenize(model.tokenizers, captions))
        hidden, mask, _, _ = model.pipeline.encode_prompt(captions, do_classifier_free_guidance=False,
                                                          max_sequence_length=options["max_sequence_length"])
    assert torch.equal(ours["mask"], mask.long()) and 0 < mask.sum() < mask.numel()  # padding is masked
    torch.testing.assert_close(ours["hidden"], hidden)


def predictions(family, model, transformer, text_encoders, tokenizers):
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 4, 8, 8), torch.tensor([500])
    spec = model.family
    conditioning = spec.encode_text(text_encoders, spec.tokenize(tokenizers, ["a dot"]))
    with torch.no_grad():
        return spec.transformer_output(transformer, noisy, t, conditioning)


@pytest.mark.parametrize("family,method", [("pixart_alpha", "full"), ("pixart_sigma", "lora")])
def test_training_lowers_the_loss_and_the_exports_load_in_the_pipeline(family, method, family_models, shapes_data,
                                                                       tmp_path):
    import diffusers

    from ot_dist.lora_tools.peft_load import load_peft_lora

    lr = 1e-3 if method == "full" else 1e-2
    extra = {"text_encoder.train": True, "output_dtype": "float32"} if method == "lora" else {}
    trainer = trainer_for(family_models[family], shapes_data, tmp_path / "o", family=family, method=method,
                          epochs=3, batch_size=4, learning_rate=lr, **{"loss.vb_loss_strength": 0}, **extra)
    result = trainer.train()
    per_epoch = np.array(result.losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.02, f"loss did not fall: {per_epoch}"

    model = trainer.model
    model.text_encoders["text_encoder"].eval()  # a trained T5 is left in train mode: no dropout in the comparison
    pipeline_cls = getattr(diffusers, model.family.pipeline_class)
    trained = predictions(family, model, model.denoiser, model.text_encoders, model.tokenizers)
    if method == "full":
        assert not (tmp_path / "o" / "model.safetensors").exists()  # no single-file layout: the folder only
        loaded = pipeline_cls.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    else:
        loaded = pipeline_cls.from_pretrained(family_models[family], local_files_only=True)
        base = predictions(family, model, loaded.transformer, {"text_encoder": loaded.text_encoder},
                           {"tokenizer": loaded.tokenizer})
        assert (base - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
        assert load_peft_lora(loaded, tmp_path / "o" / "lora.safetensors") == ["text_encoder", "transformer"]
    again = predictions(family, model, loaded.transformer, {"text_encoder": loaded.text_encoder},
                        {"tokenizer": loaded.tokenizer})
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)
    if method == "lora":  # ot-dist lora merge reads the file too (T5 and transformer modules)
        from ot_dist.lora_tools.merge import merge_command

        merged_dir = merge_command(str(family_models[family]), family, [str(tmp_path / "o" / "lora.safetensors")],
                                   [1.0], str(tmp_path / "merged"), "diffusers", None, "float32", log=quiet)
        merged = pipeline_cls.from_pretrained(merged_dir, local_files_only=True)
        again = predictions(family, model, merged.transformer, {"text_encoder": merged.text_encoder},
                            {"tokenizer": merged.tokenizer})
        torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)


def test_vb_term_trains_the_variance_channels_only_when_on(family_models, shapes_data, tmp_path):
    """The variance half of proj_out gets a gradient from the VB term only; the epsilon MSE leaves it alone."""
    grads = {}
    for strength in (0, 1.0):
        trainer = trainer_for(family_models["pixart_alpha"], shapes_data, tmp_path / f"o{strength}",
                              **{"loss.vb_loss_strength": strength})
        model = trainer.model
        loss = diffusion_loss(model, first_batch(trainer), 1, 0, trainer.config.loss)
        loss.backward()
        weight_grad = model.denoiser.proj_out.weight.grad.view(2, 2, 8, -1)  # (patch row, patch col, channel, in)
        grads[strength] = weight_grad[:, :, 4:].abs().max().item()
    assert grads[0] == 0 and grads[1.0] > 0


def comfyui_pixart_keys(model_dir) -> set[str]:
    """The module names ComfyUI's PixArt branch of model_lora_keys_unet maps: transformer.<k> for every diffusers
    weight key k of the transformer."""
    state = load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    return {f"transformer.{k[:-len('.weight')]}" for k in state if k.endswith(".weight")}


def test_lora_file_is_read_by_comfyui_rules_at_the_trained_strength(family_models, shapes_data, tmp_path):
    trainer = trainer_for(family_models["pixart_alpha"], shapes_data, tmp_path / "o", method="lora", max_steps=3,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp"})
    trainer.train()
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    comfy_keys = comfyui_pixart_keys(family_models["pixart_alpha"])
    assert modules and modules <= comfy_keys, modules - comfy_keys
    assert any(".attn2." in m for m in modules) and any(".ff." in m for m in modules)
    assert not any(k.endswith(".alpha") for k in saved)  # ComfyUI then applies strength 1.0: the scale is inside
    layers = dict(trainer.model.denoiser.named_modules())
    for module in modules:
        layer = layers[module[len("transformer."):]]
        trained = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        comfy = saved[f"{module}.lora_B.weight"].float() @ saved[f"{module}.lora_A.weight"].float()
        torch.testing.assert_close(comfy, trained.detach(), rtol=1e-5, atol=1e-7)
    assert any(layer.lora_B["default"].weight.abs().max() > 0 for layer in layers.values() if hasattr(layer, "lora_B"))


def test_samples_equal_the_pipeline_on_the_export(family_models, shapes_data, tmp_path):
    from diffusers import PixArtAlphaPipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.5, "width": 64, "height": 48}
    trainer = trainer_for(family_models["pixart_alpha"], shapes_data, tmp_path / "o", max_steps=2,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = PixArtAlphaPipeline.from_pretrained(tmp_path / "o" / "model", local_files_only=True)
    image = pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3, guidance_scale=4.5,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, use_resolution_binning=False,
                 clean_caption=False, output_type="pil").images[0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1


def test_alpha_1024_micro_conditioning_is_the_pipelines_for_a_non_square_image(family_models):
    """(height, width) in pixels and height / width, as PixArtAlphaPipeline passes them; the transformer's output
    depends on them (swapped sides give another output)."""
    from diffusers import PixArtTransformer2DModel

    from ot_dist.models.families.registry import get_family

    transformer = PixArtTransformer2DModel.from_pretrained(family_models["pixart_alpha"] / "transformer")
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 4, 6, 8), torch.tensor([300, 700])  # 48 x 64 pixels
    conditioning = {"hidden": torch.randn(2, 5, 32), "mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}

    def call(height, width):
        added = {"resolution": torch.tensor([[height, width]] * 2, dtype=torch.float32),
                 "aspect_ratio": torch.tensor([[height / width]] * 2)}
        return transformer(noisy, encoder_hidden_states=conditioning["hidden"],
                           encoder_attention_mask=conditioning["mask"], timestep=t, added_cond_kwargs=added,
                           return_dict=False)[0]

    with torch.no_grad():
        ours = get_family("pixart_alpha").transformer_output(transformer, noisy, t, conditioning)
        torch.testing.assert_close(ours, call(48, 64))
        assert (ours - call(64, 48)).abs().max() > 1e-4


def test_load_peft_lora_names_the_file_and_key_it_cannot_read(tmp_path):
    from safetensors.torch import save_file

    from ot_dist.errors import InputFileError
    from ot_dist.lora_tools.peft_load import load_peft_lora

    path = tmp_path / "kohya.safetensors"
    save_file({"lora_unet_blocks_0.lora_down.weight": torch.zeros(2, 4)}, str(path))
    with pytest.raises(InputFileError, match="kohya.safetensors.*lora_unet_blocks_0"):
        load_peft_lora(object(), path)


def test_cached_text_trains_like_encoding_each_step(family_models, shapes_data, tmp_path):
    """The conditioning carries T5's attention mask (an integer tensor the cache keeps as it is)."""
    losses = []
    for cached in (False, True):
        trainer = trainer_for(family_models["pixart_sigma"], shapes_data, tmp_path / str(cached), family="pixart_sigma",
                              method="lora", max_steps=3, **{"data.cache_text": cached})
        losses.append(trainer.train().losses)
    assert losses[0] == losses[1]
