"""Several reference images per sample (FLUX.2, Qwen-Image-Edit-2509): a reference folder's numbered partners
`a_0.png`, `a_1.png` (musubi-tuner's control_directory layout) become each sample's references in order, with the
image's geometry; the denoiser sees them as the pipelines' image lists (FLUX.2's ids 10 + 10 i, Qwen's
"Picture 1: ", "Picture 2: " and img_shapes); a family that takes fewer and samples with different counts are refused
before the model loads; a missing partner is named before any shard; the latent cache keeps every reference's
posterior and trains as the pixels do."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import test_family_qwen_image_edit as qwen_tests
import test_reference_images as data_tests
import torch
from conftest import base_config, small_edit_reference_areas

from ot_dist.config.load import validate
from ot_dist.data.reader import ShardDataset, collate
from ot_dist.data.shards import build_shard_set
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.models.families.flux2 import patchify, unpatchify
from ot_dist.train.references import reference_conditioning
from ot_dist.train.trainer import Trainer


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def numbered_pairs(shapes_data, tmp_path_factory):
    """The shapes demo as edited images, each with two references of its own (two other drawings) as `<name>_0.png`,
    `<name>_1.png`; and a folder with the first of them alone under the image's name (one reference)."""
    from ot_dist.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("numbered_pairs")
    images = shutil.copytree(shapes_data, root / "images")
    count = len(list(images.glob("*.png")))
    (root / "two").mkdir()
    (root / "one").mkdir()
    for number, seed in ((0, 7), (1, 11)):
        drawn = make_demo_dataset(root / f"drawn{number}", count=count, seed=seed)
        for image, drawing in zip(sorted(images.glob("*.png")), sorted(drawn.glob("*.png"))):
            shutil.copy(drawing, root / "two" / f"{image.stem}_{number}.png")
            if number == 0:
                shutil.copy(drawing, root / "one" / image.name)
    return images, root / "two", root / "one"


def edit_config(family, model, images, references, out, concepts=None, **overrides):
    raw = base_config(model, images, out, family=family, **{"batch_size": 2, "learning_rate": 3e-4, **overrides})
    raw["data"].pop("path")
    raw["data"]["concepts"] = concepts or [{"path": str(images), "reference_path": str(references)}]
    return validate(raw)


def no_model_loading(monkeypatch):
    import ot_dist.train.trainer as trainer_module

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer_module, "load_model", no_loading)


# -- data ---------------------------------------------------------------------------------------------------------

def test_numbered_partners_are_each_samples_references_in_order_with_the_images_geometry(tmp_path):
    """`_0` is the inverted image, `_1` the image itself: after a random crop and a flip drawn per epoch, the first
    reference is -pixels and the second +pixels (PNG: exactly), so order and geometry both show."""
    images, references = data_tests.paired_folder(tmp_path)
    for first in sorted(references.glob("*.png")):
        first.rename(references / f"{first.stem}_0.png")
        shutil.copy(images / first.name, references / f"{first.stem}_1.png")
    config = data_tests.config_for(images, references, tmp_path / "o", flip_probability=0.5)
    build_shard_set(config, tmp_path / "shards", log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    assert dataset.reference_counts() == {2: [0, 1, 2, 3]}
    assert {"64.reference.png", "64.reference2.png"} <= set(dataset.samples[0]["members"])
    for epoch in range(4):
        for i in range(len(dataset)):
            sample = dataset.load(i, epoch)
            assert sample["more_reference_pixels"].shape == (1, *sample["pixels"].shape)
            np.testing.assert_allclose(sample["reference_pixels"].numpy(), -sample["pixels"].numpy(), atol=1.5 / 127.5)
            np.testing.assert_allclose(sample["more_reference_pixels"][0].numpy(), sample["pixels"].numpy(), atol=1e-6)
    assert collate([dataset.load(0, 0), dataset.load(1, 0)])["more_reference_pixels"].shape[:2] == (2, 1)


def test_a_list_of_reference_folders_gives_one_reference_from_each_in_order(tmp_path):
    """reference_path [inverted/, same/] (ai-toolkit's control_path list, SimpleTuner's conditioning datasets): each
    folder's same-name image is a reference, in list order: the first is -pixels, the second +pixels, as the numbered
    partners are; a folder that lacks an image's partner is named with its index."""
    images, inverted = data_tests.paired_folder(tmp_path)
    same = tmp_path / "same"
    shutil.copytree(images, same, ignore=shutil.ignore_patterns("*.txt"))
    config = data_tests.config_for(images, None, tmp_path / "o", reference_path=[str(inverted), str(same)],
                                   flip_probability=0.5)
    build_shard_set(config, tmp_path / "shards", log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    assert dataset.reference_counts() == {2: [0, 1, 2, 3]}
    for epoch in range(2):
        for i in range(len(dataset)):
            sample = dataset.load(i, epoch)
            np.testing.assert_allclose(sample["reference_pixels"].numpy(), -sample["pixels"].numpy(), atol=1.5 / 127.5)
            np.testing.assert_allclose(sample["more_reference_pixels"][0].numpy(), sample["pixels"].numpy(), atol=1e-6)
    (same / "02.png").unlink()
    with pytest.raises(InputFileError, match=r"reference_path\[1\]: 1 of 4 images have no reference image .*: 02.png"):
        build_shard_set(config, tmp_path / "again", log=quiet)
    with pytest.raises(Exception, match="reference_path: an empty list"):
        data_tests.config_for(images, None, tmp_path / "o", reference_path=[])


def test_a_set_built_in_parts_keeps_each_samples_count(tmp_path):
    from ot_dist.data.shard_parts import build_part, merge_parts

    images, references = data_tests.paired_folder(tmp_path)
    for first in sorted(references.glob("*.png")):
        first.rename(references / f"{first.stem}_0.png")
        shutil.copy(images / first.name, references / f"{first.stem}_1.png")
    config = data_tests.config_for(images, references, tmp_path / "o")
    for part in range(2):
        build_part(config, tmp_path / "shards", (part, 2), log=quiet)
    merge_parts(config, tmp_path / "shards", 2, log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    assert dataset.reference_counts() == {2: [0, 1, 2, 3]} and dataset.samples[3]["reference"] == 2
    assert dataset.load(3, 0)["more_reference_pixels"].shape[0] == 1


def test_one_reference_per_sample_reads_as_before(tmp_path):
    images, references = data_tests.paired_folder(tmp_path)
    config = data_tests.config_for(images, references, tmp_path / "o")
    build_shard_set(config, tmp_path / "shards", log=quiet)
    dataset = ShardDataset(tmp_path / "shards", config)
    assert dataset.reference_counts() == {1: [0, 1, 2, 3]}
    assert "more_reference_pixels" not in dataset.load(0, 0)


def test_a_missing_numbered_partner_is_named_before_any_shard(tmp_path):
    images, references = data_tests.paired_folder(tmp_path)
    for first in sorted(references.glob("*.png")):
        first.rename(references / f"{first.stem}_0.png")
        shutil.copy(images / first.name, references / f"{first.stem}_1.png")
    (references / "02_1.png").unlink()
    with pytest.raises(InputFileError, match=r"reference_path: 1 images have fewer numbered reference images than "
                                             r"the 2 of others .*02.png \(1\)"):
        build_shard_set(data_tests.config_for(images, references, tmp_path / "o"), tmp_path / "shards", log=quiet)
    assert not list((tmp_path / "shards").glob("shard-*.tar"))


# -- refusals -------------------------------------------------------------------------------------------------------

def test_a_family_taking_one_reference_refuses_two_naming_the_field(family_models, numbered_pairs, tmp_path,
                                                                   monkeypatch):
    images, two, _ = numbered_pairs
    no_model_loading(monkeypatch)
    config = edit_config("flux_kontext", family_models["flux_kontext"], images, two, tmp_path / "o")
    with pytest.raises(ConfigError, match=r"data.concepts\[\].reference_path: 16 samples have 2 reference images .*"
                                          r"model.family flux_kontext takes at most 1 per sample; flux2, flux2_klein, "
                                          r"qwen_image_edit_plus take more"):
        Trainer(config, log=quiet)


def test_samples_with_different_counts_are_refused(family_models, numbered_pairs, tmp_path, monkeypatch):
    images, two, one = numbered_pairs
    no_model_loading(monkeypatch)
    mixed = [{"path": str(images), "reference_path": str(two)},
             {"path": str(images), "reference_path": str(one), "name": "again"}]
    config = edit_config("flux2", family_models["flux2"], images, None, tmp_path / "o", concepts=mixed)
    with pytest.raises(ConfigError, match="samples give different numbers of reference images: 16 with 1 .*16 with 2"):
        Trainer(config, log=quiet)


# -- the denoiser's view: the pipelines' image lists --------------------------------------------------------------

def test_flux2_sees_two_references_as_flux2pipeline_does(family_models, numbered_pairs, tmp_path):
    """Flux2Pipeline with image=[a, b]: each reference's patchified, normalised latents packed after the noisy
    tokens, their ids _prepare_image_ids([a, b]) (time 10, then 20)."""
    from diffusers import Flux2Pipeline

    images, two, _ = numbered_pairs
    trainer = Trainer(edit_config("flux2", family_models["flux2"], images, two, tmp_path / "o"), log=quiet)
    model = trainer.model
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    conditioning = reference_conditioning(model, batch, "cpu", torch.float32)
    assert len(conditioning["more_reference_latents"]) == 1
    first, second = conditioning["reference_latents"], conditioning["more_reference_latents"][0]
    vae = model.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    with torch.no_grad():
        conds = [(Flux2Pipeline._patchify_latents(vae.encode(p).latent_dist.mode()) - mean) / std
                 for p in (batch["reference_pixels"], batch["more_reference_pixels"][:, 0])]
    torch.testing.assert_close(patchify(first), conds[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(patchify(second), conds[1], rtol=1e-5, atol=1e-5)
    noisy = torch.randn(2, 128, *conds[0].shape[-2:], generator=torch.Generator().manual_seed(0))
    prompt_embeds, text_ids = model.pipeline.encode_prompt(list(batch["caption"]), device="cpu", max_sequence_length=
                                                           model.family.pipeline_call_options(model.pipeline)[
                                                               "max_sequence_length"])
    timesteps = torch.tensor([500.0, 300.0])
    transformer = model.denoiser
    with torch.no_grad():
        ids = Flux2Pipeline._prepare_latent_ids(noisy)
        image_ids = Flux2Pipeline._prepare_image_ids([c[0:1] for c in conds]).expand(2, -1, -1)
        guidance = model.family.guidance(transformer, 2, "cpu")
        packed = Flux2Pipeline._pack_latents(noisy)
        pred = transformer(hidden_states=torch.cat([packed, *(Flux2Pipeline._pack_latents(c) for c in conds)], dim=1),
                           timestep=timesteps / 1000, guidance=guidance, encoder_hidden_states=prompt_embeds,
                           txt_ids=text_ids, img_ids=torch.cat([ids, image_ids], dim=1), return_dict=False)[0]
        expected = Flux2Pipeline._unpack_latents_with_ids(pred[:, :packed.shape[1]], ids)
        ours = model.family.predict(transformer, unpatchify(noisy), timesteps,
                                    {"hidden": prompt_embeds, **conditioning}, batch)
        del conditioning["more_reference_latents"]
        one = model.family.predict(transformer, unpatchify(noisy), timesteps, {"hidden": prompt_embeds, **conditioning},
                                   batch)
    torch.testing.assert_close(patchify(ours), expected, rtol=1e-5, atol=1e-5)
    assert (ours - one).abs().max() > 1e-3  # the second reference reached the prediction


def test_qwen_plus_reads_two_pictures_as_the_plus_pipeline(family_models, numbered_pairs, tmp_path):
    """The text: QwenImageEditPlusPipeline.encode_prompt with image=[a, b] ("Picture 1: ", "Picture 2: ", each at
    384^2 for the vision tower); the denoiser: both references' tokens after the noisy ones, img_shapes of all three."""
    images, two, _ = numbered_pairs
    family = "qwen_image_edit_plus"
    trainer = Trainer(edit_config(family, family_models[family], images, two, tmp_path / "o"), log=quiet)
    model = trainer.model
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    pipe = model.pipeline
    firsts = qwen_tests.pil_references(batch)
    seconds = qwen_tests.pil_references({"reference_pixels": batch["more_reference_pixels"][:, 0]})
    with torch.no_grad():
        ours = model.family.encode_text(model.text_encoders, batch["token_ids"])
        rows = [pipe.encode_prompt([caption], image=[qwen_tests.condition_image(pipe, a),
                                                     qwen_tests.condition_image(pipe, b)], device="cpu")[0][0]
                for caption, a, b in zip(batch["caption"], firsts, seconds)]
    longest = max(r.shape[0] for r in rows)
    hidden = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    torch.testing.assert_close(ours["hidden"], hidden)
    conditioning = {**ours, **reference_conditioning(model, batch, "cpu", torch.float32)}
    first, second = conditioning["reference_latents"], conditioning["more_reference_latents"][0]
    b, c, h, w = first.shape
    noisy = torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([500.0, 300.0])
    from ot_dist.models.families.flux import pack, unpack

    with torch.no_grad():
        lengths = [int(m.sum()) for m in ours["mask"]]
        pred = model.denoiser(hidden_states=torch.cat([pack(noisy), pack(first), pack(second)], dim=1),
                              encoder_hidden_states=ours["hidden"][:, :max(lengths)],
                              encoder_hidden_states_mask=ours["mask"][:, :max(lengths)], timestep=timesteps / 1000,
                              img_shapes=[[(1, h // 2, w // 2)] * 3] * b, return_dict=False)[0]
        expected = unpack(pred[:, :(h // 2) * (w // 2)], h, w)
        predicted = model.family.predict(model.denoiser, noisy, timesteps, conditioning, batch)
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-5)


# -- training -------------------------------------------------------------------------------------------------------

def test_training_with_two_references_lowers_the_loss_and_differs_from_one(family_models, numbered_pairs, tmp_path):
    images, two, one = numbered_pairs
    runs = {}
    for name, references in (("two", two), ("one", one)):
        config = edit_config("flux2_klein", family_models["flux2_klein"], images, references, tmp_path / name, epochs=3)
        runs[name] = np.array(Trainer(config, log=quiet).train().losses)
    per_epoch = runs["two"].reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.01, f"loss did not fall: {per_epoch}"
    assert runs["two"].shape == runs["one"].shape and np.abs(runs["two"] - runs["one"]).max() > 1e-4


# -- the latent cache -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, count", [("flux2", 2), ("qwen_image_edit_plus", 2), ("qwen_image_edit", 1)])
def test_cached_latents_of_every_reference_train_as_the_pixels(family, count, family_models, numbered_pairs, tmp_path):
    """data.cache_latents keeps each reference's posterior (`reference_latent`, `reference2_latent`): the denoiser sees
    the uncached references' latents in order, and three training steps (batches from a loader worker) have the
    uncached losses. Qwen-Image-Edit's vision tower still reads the references' pixels (given beside the cached
    latents)."""
    from ot_dist.train.references import reference_latents

    images, two, one = numbered_pairs
    losses, seen = {}, {}
    for cache in (False, True):
        config = edit_config(family, family_models[family], images, two if count == 2 else one, tmp_path / f"o{cache}",
                             max_steps=3, **{"data.cache_latents": cache, "data.loader_workers": 1})
        trainer = Trainer(config, log=quiet)
        batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
        assert ("reference_latent_mean" in batch) == cache
        assert ("more_reference_latent_mean" in batch) == (cache and count > 1)
        with torch.no_grad():
            seen[cache] = reference_latents(reference_conditioning(trainer.model, batch, "cpu", torch.float32))
        losses[cache] = trainer.train().losses
    assert len(seen[True]) == len(seen[False]) == count
    for cached, uncached in zip(seen[True], seen[False]):
        torch.testing.assert_close(cached, uncached, rtol=1e-5, atol=1e-5)
    if count > 1:  # the two references differ: their order shows
        assert (seen[True][0] - seen[True][1]).abs().max() > 1e-2
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_changed_references_are_cached_again(family_models, numbered_pairs, tmp_path):
    """A cache belongs to the shard set's fingerprint, which follows every numbered partner: after the second
    references are replaced by copies of the first, the set and its latent cache are rebuilt, and the cached second
    reference is now the first one's posterior."""
    images, two, _ = numbered_pairs
    references = shutil.copytree(two, tmp_path / "references")
    settings = {"data.cache_latents": True, "data.shards": str(tmp_path / "shards")}
    model = family_models["flux2_klein"]
    before = Trainer(edit_config("flux2_klein", model, images, references, tmp_path / "a", **settings),
                     log=quiet).dataset.load(0, 0)
    for second in references.glob("*_1.png"):
        shutil.copy(references / second.name.replace("_1.png", "_0.png"), second)
    after = Trainer(edit_config("flux2_klein", model, images, references, tmp_path / "b", **settings),
                    log=quiet).dataset.load(0, 0)
    assert (before["more_reference_latent_mean"] - before["reference_latent_mean"]).abs().max() > 1e-2
    torch.testing.assert_close(after["more_reference_latent_mean"][0], before["reference_latent_mean"])
    torch.testing.assert_close(after["reference_latent_mean"], before["reference_latent_mean"])


# -- samples --------------------------------------------------------------------------------------------------------

def pipeline_sample(family, folder, images, **options):
    """The family's diffusers pipeline on the model folder, given `images` as its image=[...], at 80 x 64."""
    pipe = qwen_tests.load_pipeline(folder, family)
    if family == "qwen_image_edit_plus":  # ot_dist samples with the blank negative prompt and true CFG
        options |= {"negative_prompt": " ", "true_cfg_scale": options.pop("guidance_scale")}
    else:
        from ot_dist.models.families.registry import get_family

        options["max_sequence_length"] = get_family(family).pipeline_call_options(pipe)["max_sequence_length"]
    return np.asarray(pipe(image=images, prompt="put the hat of picture 2 on picture 1", width=80, height=64,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(3), output_type="pil",
                           **options).images[0]).astype(int)


@pytest.mark.parametrize("family", ["flux2", "qwen_image_edit_plus"])
def test_samples_with_two_references_equal_the_pipeline_given_the_list(family, family_models, numbered_pairs,
                                                                       tmp_path, monkeypatch):
    """A prompt's reference_image list reaches the pipeline as image=[first, second] (FLUX.2: each scaled to cover the
    sample and centre-cropped, as training pairs' references; Qwen-Image-Edit-2509: as read, the pipeline scales
    them); the sample equals the pipeline's with the same seed, and not its sample from the first alone."""
    from PIL import Image

    # smaller reference areas for ot_dist's sample and the pipeline's alike (nearly all of the test's cost)
    small_edit_reference_areas(monkeypatch)

    images, two, _ = numbered_pairs
    paths = [two / "0003_0.png", two / "0003_1.png"]
    prompt = {"prompt": "put the hat of picture 2 on picture 1", "seed": 3, "steps": 2, "guidance_scale": 20.0,
              "width": 80, "height": 64, "reference_image": [str(p) for p in paths]}
    trainer = Trainer(edit_config(family, family_models[family], images, two, tmp_path / "o",
                                  **{"sampling.prompts": [prompt]}), log=quiet)
    (written,) = trainer.sampler.sample(trainer, 0)
    ours = np.asarray(Image.open(written).convert("RGB")).astype(int)
    assert ours.shape == (64, 80, 3)
    given = [Image.open(p).convert("RGB") for p in paths]
    if family == "flux2":  # 64 x 64 drawings covering 80 x 64: scaled to 80 x 80, the middle 64 rows
        given = [g.resize((80, 80), Image.Resampling.BICUBIC).crop((0, 8, 80, 72)) for g in given]
    theirs = pipeline_sample(family, family_models[family], given, guidance_scale=20.0)
    first_only = pipeline_sample(family, family_models[family], given[:1], guidance_scale=20.0)
    assert np.abs(ours - theirs).max() <= 1
    # the second reference reached the sample (the random tiny models move little with it): the comparison above
    # can fail
    assert (ours != first_only).sum() > 10 * max(1, (ours != theirs).sum())


def test_more_sample_references_than_the_family_takes_is_a_config_error_naming_the_prompt(family_models,
                                                                                         numbered_pairs, tmp_path):
    images, two, _ = numbered_pairs
    prompts = [{"prompt": "a dot"}, {"prompt": "the hats of pictures 2 to 4 on picture 1",
                                     "reference_image": [str(two / "0003_0.png")] * 4}]
    with pytest.raises(Exception, match=r"sampling.prompts\[1\].reference_image: 4 reference images for the prompt "
                                        r"'the hats of pictures 2 to 4 on picture 1', and qwen_image_edit_plus takes "
                                        r"at most 3; flux2, flux2_klein take 4"):
        edit_config("qwen_image_edit_plus", family_models["qwen_image_edit_plus"], images, two, tmp_path / "o",
                    **{"sampling.prompts": prompts})
    kontext = [{"prompt": "two pictures", "reference_image": [str(two / "0003_0.png")] * 2}]
    with pytest.raises(Exception, match=r"sampling.prompts\[0\].reference_image: 2 reference images .* flux_kontext "
                                        r"takes at most 1"):
        edit_config("flux_kontext", family_models["flux_kontext"], images, two, tmp_path / "k",
                    **{"sampling.prompts": kontext})
