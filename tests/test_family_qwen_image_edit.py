"""Qwen-Image-Edit (Qwen-Image with a reference image) on the family contract: the conditioning against
QwenImageEditPipeline.encode_prompt with the reference (edit template, the processor's vision tokens, 64 dropped),
the objective against the pipeline's denoiser call written out for one training batch (reference latents appended,
both grids in img_shapes, the prediction sliced), samples against the pipeline with the same reference and seed, the
LoRA file in load_lora_weights and by ComfyUI's Qwen-Image rule, and the refused text cache."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import base_config, small_edit_reference_areas
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError
from ot_dist.models.families.qwen_image_edit import EDIT_PROMPT_TEMPLATE, EDIT_TEMPLATE_TOKENS_DROPPED
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

FAMILY = "qwen_image_edit"
# Qwen-Image-Edit-2509 / 2511 through QwenImageEditPlusPipeline, one reference per sample: the conditioning,
# objective and samples tests run on both
BOTH = ("qwen_image_edit", "qwen_image_edit_plus")


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def edit_pairs(shapes_data, tmp_path_factory):
    """The shapes demo as edited images, each with a reference image of its own (another drawing, same size)."""
    from ot_dist.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("qwen_edit_pairs")
    images = shutil.copytree(shapes_data, root / "images")
    references = make_demo_dataset(root / "references", count=len(list(images.glob("*.png"))), seed=7)
    for caption in references.glob("*.txt"):
        caption.unlink()
    return images, references


def edit_config(model, pairs, out, method="full", family=FAMILY, **overrides):
    images, references = pairs
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    raw = base_config(model, images, out, family=family, method=method, **settings)
    raw["data"].pop("path")
    raw["data"]["concepts"] = [{"path": str(images), "reference_path": str(references)}]
    return raw


def trainer_for(model, pairs, out, method="full", family=FAMILY, **overrides):
    return Trainer(validate(edit_config(model, pairs, out, method, family, **overrides)), log=quiet)


def first_batch(trainer):
    return trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))


def load_pipeline(folder, family=FAMILY):
    """The pipeline's from_pretrained with the processor the family reads (its video part needs torchvision)."""
    from ot_dist.models.families.registry import get_family

    return get_family(family).pipeline_cls().from_pretrained(folder, local_files_only=True,
                                                             **get_family(family).folder_components(folder))


def pipeline_embeds(pipe, captions, images):
    """encode_prompt with each caption's reference, one call a sample (QwenImageEditPlusPipeline gives every prompt of
    a call every image), re-stacked as the pipeline stacks a batch: zeros after each row's tokens, and its mask."""
    rows = []
    for caption, image in zip(captions, images):
        hidden, _ = pipe.encode_prompt([caption], image=image if type(pipe).__name__ == "QwenImageEditPipeline"
                                       else [condition_image(pipe, image)], device="cpu")
        rows.append(hidden[0])
    longest = max(r.shape[0] for r in rows)
    hidden = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.stack([torch.arange(longest) < r.shape[0] for r in rows]).long()
    return hidden, mask


def condition_image(pipe, image):
    """QwenImageEditPlusPipeline's copy of a reference for the vision tower: scaled to 384^2 pixels."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
    return pipe.image_processor.resize(image, height, width)


def pil_references(batch):
    from PIL import Image

    array = ((batch["reference_pixels"] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in array]


@pytest.mark.parametrize("family", BOTH)
def test_text_conditioning_equals_the_pipelines_encode_prompt_with_the_reference(family, family_models, edit_pairs,
                                                                                  tmp_path):
    trainer = trainer_for(family_models[family], edit_pairs, tmp_path / "o", family=family)
    model = trainer.model
    batch = first_batch(trainer)
    # The tiny tokenizer splits the template as the real one does: the dropped part is the system prompt and header.
    header = EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]
    assert len(model.tokenizers["tokenizer"](header).input_ids) == EDIT_TEMPLATE_TOKENS_DROPPED
    image_pad = model.pipeline.processor.image_token_id
    assert (batch["token_ids"]["text_encoder"] == image_pad).sum() > 2  # the reference's vision tokens are in it
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, batch["token_ids"])
        hidden, mask = pipeline_embeds(model.pipeline, list(batch["caption"]), pil_references(batch))
        other, _ = pipeline_embeds(model.pipeline, list(batch["caption"]), pil_references(batch)[::-1])
    assert 0 < mask.sum() < mask.numel()  # the captions differ in length: the mask matters
    assert torch.equal(ours["mask"], mask)
    torch.testing.assert_close(ours["hidden"], hidden)
    assert (other - hidden).abs().max() > 1e-4  # the reference reaches the text: the comparison above can fail


@pytest.mark.parametrize("family", BOTH)
def test_objective_equals_the_pipelines_step_written_out(family, family_models, edit_pairs, tmp_path):
    """diffusion_loss on a batch against the pipeline's denoiser call with the script's draws: 5-D latents
    (x - mean) / std, x_t = (1 - s) x + s n, the reference's posterior mode normalised alike (the pipeline's
    _encode_vae_image, argmax), both packed and concatenated, img_shapes listing both grids, t / 1000, the prompt
    embeddings of encode_prompt with the reference, the prediction's first tokens unpacked, MSE against n - x."""
    from diffusers import QwenImageEditPipeline

    trainer = trainer_for(family_models[family], edit_pairs, tmp_path / "o", family=family)
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer = model.vae, model.denoiser
    pixels = batch["pixels"]
    height, width = pixels.shape[-2:]
    shape = (16, height // 8, width // 8)
    eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        timesteps.append(model.objective.draw(g, options, torch.Size(shape)))
    eps, noise = torch.stack(eps)[:, :, None], torch.stack(noise)[:, :, None]
    t = torch.cat(timesteps)
    with torch.no_grad():
        posterior = vae.encode(pixels[:, :, None]).latent_dist
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        x = (posterior.mean + posterior.std * eps - mean) / std
        reference = model.pipeline._encode_vae_image(batch["reference_pixels"][:, :, None], None)
        sigmas = (t / 1000).view(-1, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * x + sigmas * noise
        prompt_embeds, prompt_mask = pipeline_embeds(model.pipeline, list(batch["caption"]), pil_references(batch))
        packed = QwenImageEditPipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), 2, 16, shape[1], shape[2])
        packed_reference = QwenImageEditPipeline._pack_latents(reference.permute(0, 2, 1, 3, 4), 2, 16, shape[1],
                                                               shape[2])
        grid = (1, shape[1] // 2, shape[2] // 2)
        pred = transformer(hidden_states=torch.cat([packed, packed_reference], dim=1),
                           encoder_hidden_states=prompt_embeds, encoder_hidden_states_mask=prompt_mask,
                           timestep=t / 1000, img_shapes=[[grid, grid]] * 2, return_dict=False)[0]
        pred = QwenImageEditPipeline._unpack_latents(pred[:, :packed.shape[1]], height, width, 8)[:, :, 0]
        expected = torch.mean((pred.float() - (noise - x)[:, :, 0].float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", BOTH)
def test_samples_equal_the_edit_pipeline_with_the_same_reference_and_seed(family, family_models, edit_pairs,
                                                                          tmp_path, monkeypatch):
    from PIL import Image

    # smaller reference areas for ot_dist's sample and the pipeline's alike (conftest.py; the comparison stays)
    small_edit_reference_areas(monkeypatch)
    images, references = edit_pairs
    reference = references / "0003.png"
    prompt = {"prompt": "make it red", "seed": 3, "steps": 2, "guidance_scale": 20.0, "width": 64, "height": 48,
              "reference_image": str(reference)}
    trainer = trainer_for(family_models[family], edit_pairs, tmp_path / "o", max_steps=1, family=family,
                          **{"sampling.prompts": [prompt]})
    trainer.train()
    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe = load_pipeline(tmp_path / "o" / "model", family)

    def image(given, **guidance):
        return np.asarray(pipe(image=given, prompt="make it red", width=64, height=48, num_inference_steps=2,
                               generator=torch.Generator().manual_seed(3), output_type="pil",
                               **guidance).images[0]).astype(int)

    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    given = Image.open(reference).convert("RGB")
    theirs = image(given, negative_prompt=" ", true_cfg_scale=20.0)
    blank = image(Image.new("RGB", given.size), negative_prompt=" ", true_cfg_scale=20.0)
    assert np.abs(ours - theirs).max() <= 1
    # the reference reached the sample (the random tiny model moves little with it): the comparison above can fail
    assert (ours != blank).sum() > 10 * max(1, (ours != theirs).sum())


@pytest.mark.parametrize("family", BOTH)
def test_the_lora_trains_loads_in_the_edit_pipeline_and_follows_comfyuis_qwen_image_rule(family, family_models,
                                                                                          edit_pairs, tmp_path):
    """The loss falls; the file is Qwen-Image's diffusers layout (ComfyUI's Qwen-Image rule, comfy/lora.py
    model_lora_keys_unet: `transformer.<diffusers module>`), which QwenImageEditPipeline.load_lora_weights reads to
    the trained predictions."""
    base = family_models[family]
    trainer = trainer_for(base, edit_pairs, tmp_path / "o", method="lora", epochs=3, learning_rate=3e-3,
                          output_dtype="float32", family=family, **{"lora.rank": 4, "lora.alpha": 8})
    per_epoch = np.array(trainer.train().losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.01, f"loss did not fall: {per_epoch}"
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    keys = {f"transformer.{k[:-len('.weight')]}" for k in
            load_file(base / "transformer" / "diffusion_pytorch_model.safetensors") if k.endswith(".weight")}
    assert modules and all(m.startswith("transformer.transformer_blocks.") for m in modules) and modules <= keys
    assert not any(k.endswith(".alpha") for k in saved)

    model = trainer.model
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 16, 8, 6), torch.tensor([500.0])
    conditioning = {"hidden": torch.randn(1, 5, 32), "mask": torch.ones(1, 5, dtype=torch.long),
                    "reference_latents": torch.randn(1, 16, 8, 6)}
    loaded = load_pipeline(base, family)
    with torch.no_grad():
        trained = model.family.predict(model.denoiser, noisy, t, conditioning, {})
        plain = model.family.predict(loaded.transformer, noisy, t, conditioning, {})
        loaded.load_lora_weights(tmp_path / "o" / "lora.safetensors")
        again = model.family.predict(loaded.transformer, noisy, t, conditioning, {})
    assert (plain - trained).abs().max() > 1e-4  # the LoRA changed the prediction: the comparison can fail
    torch.testing.assert_close(again, trained, rtol=1e-5, atol=1e-6)


def test_a_full_finetune_lowers_the_loss(family_models, edit_pairs, tmp_path):
    trainer = trainer_for(family_models[FAMILY], edit_pairs, tmp_path / "o", epochs=3)
    per_epoch = np.array(trainer.train().losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.01, f"loss did not fall: {per_epoch}"


def test_the_text_cache_is_refused_before_the_model_loads(family_models, edit_pairs, tmp_path, monkeypatch):
    """The text encoder reads each sample's reference pixels: a caption-keyed text cache cannot serve it (the latent
    cache can: the reader gives the pixels beside it, tests/test_multi_references.py)."""
    option = "cache_text"
    import ot_dist.train.trainer as trainer_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_module, "load_model", no_loading)
    with pytest.raises(ConfigError, match=rf"data.{option}: Qwen-Image-Edit's text encoder reads"):
        trainer_for(family_models[FAMILY], edit_pairs, tmp_path / "o", **{f"data.{option}": True})


def test_data_without_references_is_refused(family_models, shapes_data, tmp_path):
    plain = base_config(family_models[FAMILY], shapes_data, tmp_path / "o", family=FAMILY)
    with pytest.raises(ConfigError, match="16 of 16 samples have no reference image"):
        Trainer(validate(plain), log=quiet)


def test_comfyuis_edit_file_loads_as_the_folder(family_models, tmp_path):
    """qwen_image_edit_*.safetensors is Qwen-Image's layout (bare diffusers keys; ComfyUI loads it with its Qwen-Image
    model class): the transformer from it, the rest (the processor too) from model.config."""
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model

    folder = family_models[FAMILY]
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    single = tmp_path / "qwen_image_edit_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, single)
    loaded = load_model(ModelConfig(family=FAMILY, path=str(single), config=str(folder)))
    assert type(loaded.pipeline).__name__ == "QwenImageEditPipeline"
    assert loaded.pipeline.processor.image_processor.size["longest_edge"] == 112 * 112  # the folder's processor
    got = loaded.denoiser.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_a_sample_prompt_without_a_reference_is_refused(family_models, edit_pairs, tmp_path):
    with pytest.raises(ConfigError, match=r"sampling.prompts\[0\]: model.family qwen_image_edit samples only with a "
                                          "reference image"):
        trainer_for(family_models[FAMILY], edit_pairs, tmp_path / "o", **{"sampling.prompts": [{"prompt": "a dot"}]})


def test_a_float8_stored_vision_tower_sees_the_reference_in_the_compute_dtype(family_models, edit_pairs, tmp_path):
    """weight_dtype float8: Qwen2.5-VL's `.dtype` would read its 1-byte storage (the vision tower casts the pixels to
    it); the reference's pixels must reach the vision tower in the compute dtype (float8 inputs would keep 3 bits of
    each pixel's mantissa)."""
    trainer = trainer_for(family_models[FAMILY], edit_pairs, tmp_path / "o", weight_dtype="float8")
    model = trainer.model
    encoder = model.text_encoders["text_encoder"]
    # the case this guards: the first parameter, whose dtype transformers' `.dtype` reads, is the float8 storage
    assert next(encoder.parameters()).dtype == torch.float8_e4m3fn and encoder.model.visual.dtype == torch.float32
    seen = []
    hook = encoder.model.visual.patch_embed.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    with torch.no_grad():
        model.family.encode_text(model.text_encoders, first_batch(trainer)["token_ids"])
    hook.remove()
    assert seen == [torch.float32]
