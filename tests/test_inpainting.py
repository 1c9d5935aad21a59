"""Inpainting finetune: random masks drawn per sample, the 9-channel input built the way diffusers'
inpainting pipelines build it, a tiny 9-channel UNet (SD 1.x and SDXL) that trains and exports a
pipeline diffusers' inpainting pipelines load and run, and the configuration errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import base_config
from PIL import Image
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.config.schema import ModelConfig
from ot_dist.errors import ConfigError
from ot_dist.models.loading import load_model
from ot_dist.models.tiny import make_tiny_model
from ot_dist.randomness import generator
from ot_dist.train.inpainting import inpainting_masks, masked_pixels, random_mask
from ot_dist.train.loss import encode_latents, inpainting_condition
from ot_dist.models.families.registry import get_family
from ot_dist.models.loading import LoadedModel
from ot_dist.train.loss_options import per_sample_normal
from ot_dist.train.trainer import Trainer


@pytest.fixture(scope="module")
def inpainting_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inpainting-models")
    return {family: make_tiny_model(root / family, family, inpainting=True) for family in ("sd1", "sdxl")}


@pytest.fixture(scope="module")
def partly_masked_data(shapes_data, tmp_path_factory):
    """The shapes; even images have a mask (a centred box), odd ones none (they get random masks)."""
    folder = tmp_path_factory.mktemp("inpainting-data") / "shapes"
    shutil.copytree(shapes_data, folder)
    for i, image in enumerate(sorted(folder.glob("*.png"))):
        if i % 2 == 0:
            mask = np.zeros((64, 64), dtype=np.uint8)
            mask[16:48, 16:48] = 255
            Image.fromarray(mask).save(folder / f"{image.stem}-masklabel.png")
    return folder


def test_random_masks_are_per_sample_draws_of_every_kind():
    masks = [random_mask(64, 48, generator(7, 0, i, "inpainting_mask")) for i in range(300)]
    again = [random_mask(64, 48, generator(7, 0, i, "inpainting_mask")) for i in range(300)]
    assert all(torch.equal(a, b) for a, b in zip(masks, again))  # the same draw for the same key
    assert not torch.equal(masks[3], random_mask(64, 48, generator(7, 1, 3, "inpainting_mask")))  # redrawn per epoch
    assert all(m.shape == (1, 64, 48) and set(m.unique().tolist()) <= {0.0, 1.0} for m in masks)
    whole = sum(bool(m.all()) for m in masks)
    # a rectangle fills its bounding box; strokes do not
    boxes = [m for m in masks if not m.all() and m.any() and _fills_bounding_box(m)]
    strokes = [m for m in masks if m.any() and not _fills_bounding_box(m)]
    assert 45 < whole < 105 and 75 < len(boxes) < 150 and 75 < len(strokes) < 150
    assert whole + len(boxes) + len(strokes) == len(masks)
    assert all(0.005 < m.mean() < 0.9 for m in strokes)


def _fills_bounding_box(mask: torch.Tensor) -> bool:
    rows, cols = mask[0].any(dim=1).nonzero(), mask[0].any(dim=0).nonzero()
    box = mask[0, rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    return bool(box.all())


def test_the_condition_is_built_as_the_diffusers_pipeline_builds_it(inpainting_models):
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline.from_pretrained(inpainting_models["sd1"])
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    soft = torch.zeros(2, 1, 64, 64)
    soft[0, :, 8:40, 20:60] = 0.7  # a grey (>= 0.5) area: repainted after binarisation
    soft[0, :, 40:50, :] = 0.3  # below 0.5: kept
    batch = {"pixels": pixels, "mask": soft, "mask_given": torch.tensor([True, False]), "sample_id": torch.tensor([4, 9])}
    masks = inpainting_masks(batch, seed=1, epoch=2)
    assert torch.equal(masks[1], random_mask(64, 64, generator(1, 2, 9, "inpainting_mask")))  # no mask: drawn

    # The pipeline's own preprocessing of sample 0's mask and image.
    mask_image = Image.fromarray((soft[0, 0].numpy() * 255).round().astype(np.uint8))
    mask_condition = pipe.mask_processor.preprocess(mask_image, height=64, width=64)
    assert torch.equal(masks[:1], mask_condition)
    torch.testing.assert_close(masked_pixels(pixels[:1], masks[:1]), pixels[:1] * (mask_condition < 0.5))
    pipe_mask, _ = pipe.prepare_mask_latents(mask_condition, torch.zeros(1, 4, 8, 8), 1, 64, 64, torch.float32,
                                             torch.device("cpu"), None, False)

    condition = inpainting_condition(LoadedModel(get_family("sd1"), pipe, None), batch, torch.Size((4, 8, 8)), seed=1, epoch=2)
    assert condition.shape == (2, 5, 8, 8)
    assert torch.equal(condition[:1, :1], pipe_mask)  # channel 4 of the UNet input: the mask
    eps = per_sample_normal([4, 9], (4, 8, 8), 1, 2, "masked_image_latent")
    expected = encode_latents(get_family("sd1"), pipe.vae, {"pixels": masked_pixels(pixels, masks)}, eps)  # scaled posterior sample
    torch.testing.assert_close(condition[:, 1:], expected)  # channels 5-8: the masked image's latent


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_a_tiny_inpainting_model_trains_and_exports_a_pipeline_diffusers_runs(
        family, inpainting_models, partly_masked_data, tmp_path):
    import diffusers

    out = tmp_path / "out"
    sample = {"prompt": "a red circle", "seed": 3, "steps": 2, "width": 64, "height": 48, "guidance_scale": 5.0}
    raw = base_config(inpainting_models[family], partly_masked_data, out, family=family, max_steps=3,
                      **{"model.inpainting": True, "sampling.prompts": [sample]})
    trainer = Trainer(validate(raw), log=print)
    assert trainer.model.inpainting and trainer.model.denoiser.config.in_channels == 9
    result = trainer.train()
    assert result.steps == 3 and all(np.isfinite(result.losses))

    trained = load_file(out / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    base = load_file(inpainting_models[family] / "unet" / "diffusion_pytorch_model.safetensors")
    assert trained["conv_in.weight"].shape[1] == 9
    # the mask and masked-image input channels learn too
    assert (trained["conv_in.weight"][:, 4:] - base["conv_in.weight"][:, 4:]).abs().max() > 1e-6
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 1e-5

    cls = getattr(diffusers, "StableDiffusionXLInpaintPipeline" if family == "sdxl" else "StableDiffusionInpaintPipeline")
    pipe = cls.from_pretrained(out / "model")
    assert type(pipe) is cls
    image = Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8))
    mask = Image.fromarray(np.pad(np.full((32, 32), 255, dtype=np.uint8), 16))
    kwargs = {"strength": 1.0} if family == "sdxl" else {}
    output = pipe("a red circle", image=image, mask_image=mask, height=64, width=64, num_inference_steps=1,
                  generator=torch.Generator().manual_seed(0), output_type="np", **kwargs).images
    assert output.shape == (1, 64, 64, 3) and np.isfinite(output).all()

    # The sample of the end is the inpainting pipeline's, the whole image repainted as OneTrainer samples an
    # inpainting model without a sample image (a full mask, so a blank masked image), from pure noise (strength 1).
    pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    blank, full = Image.new("RGB", (64, 48), (40, 200, 90)), Image.new("L", (64, 48), 255)
    expected = pipe(sample["prompt"], image=blank, mask_image=full, strength=1.0, height=48, width=64,
                    num_inference_steps=2, guidance_scale=5.0, generator=torch.Generator().manual_seed(3)).images[0]
    (written,) = (out / "samples" / "step-3").glob("*.png")
    difference = np.abs(np.asarray(Image.open(written).convert("RGB")).astype(int) - np.asarray(expected).astype(int))
    assert difference.max() <= 1 and np.count_nonzero(difference) <= difference.size // 1000, difference.max()


def test_inpainting_option_and_cached_latents_errors(tiny_models, inpainting_models, shapes_data, tmp_path):
    with pytest.raises(ConfigError, match=r"model.inpainting: true, but the UNet of model.path has 4 input channels"):
        load_model(ModelConfig(family="sd1", path=str(tiny_models["sd1"]), inpainting=True))
    with pytest.raises(ConfigError, match=r"model.inpainting: false, but model.path is an inpainting model"):
        load_model(ModelConfig(family="sd1", path=str(inpainting_models["sd1"]), inpainting=False))
    # auto-detected: the inpainting model needs each step's images
    raw = base_config(inpainting_models["sd1"], shapes_data, tmp_path / "o", **{"data.cache_latents": True})
    with pytest.raises(ConfigError, match=r"data.cache_latents: model.path is an inpainting model"):
        Trainer(validate(raw), log=print)
    with pytest.raises(ConfigError, match=r"data.cache_latents: an inpainting finetune"):
        validate({**raw, "model": {**raw["model"], "inpainting": True}})


def test_a_guidance_rescale_the_inpainting_pipeline_cannot_take_is_refused_before_training(inpainting_models,
                                                                                            shapes_data, tmp_path):
    """SD 1.x samples take guidance_rescale, but StableDiffusionInpaintPipeline has none: known once the model is
    loaded (model.inpainting null detects it), refused then, not at the first sampling point. SDXL's takes it."""
    from ot_dist.models.loading import load_model
    from ot_dist.train.sampling import Sampler

    for family in ("sd1", "sdxl"):
        config = validate(base_config(inpainting_models[family], shapes_data, tmp_path, family=family, **{
            "sampling.prompts": [{"prompt": "a red circle"}, {"prompt": "a red circle", "guidance_rescale": 0.7}]}))
        model = load_model(config.model)
        if family == "sdxl":
            Sampler(config, model)
            continue
        with pytest.raises(ConfigError, match=r"sampling.prompts\[1\].guidance_rescale: this model samples through "
                                              "StableDiffusionInpaintPipeline, which has no guidance_rescale"):
            Sampler(config, model)
