"""Cached variations (OneTrainer's per-concept image_variations / text_variations): a latent / text cache holds N
versions of an augmenting concept's images / varying captions, pass p over the concept reads version p mod N, and
version v is what the uncached pipeline reads in epoch v."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.data.caches import attach_latent_cache, attach_text_cache, vae_key
from ot_dist.data.reader import ShardDataset
from ot_dist.data.shards import build_shard_set
from ot_dist.data.variations import Variations
from ot_dist.errors import ConfigError
from ot_dist.models.loading import load_model
from ot_dist.parallel.runtime import Runtime

CHUNK = 5  # 12 samples: chunks of 5, 5 and 2
VARIED = {"flip_probability": 0.5, "rotation_degrees": 10.0, "brightness": 0.4, "image_variations": 2,
          "tag_shuffling": True, "keep_tags_count": 0, "text_variations": 3}


@pytest.fixture(scope="module")
def built(tiny_models, shapes_data, tmp_path_factory):
    """12 images with tag captions (two lines for some), half of them masked, in one augmenting concept whose
    captions shuffle; its shard set, the raw config and the tiny SD 1.x model."""
    from conftest import base_config

    root = tmp_path_factory.mktemp("variations")
    data = root / "data"
    data.mkdir()
    for i in range(12):
        shutil.copy(shapes_data / f"{i:04d}.png", data / f"{i:04d}.png")
        tags = ", ".join(f"tag{i}-{t}" for t in range(5))
        (data / f"{i:04d}.txt").write_text(tags + (f"\nother{i}, more, words, here" if i % 3 == 0 else ""))
        if i % 2:  # a mask on every other image: the versions' masks are augmented as their images
            mask = np.zeros((64, 64), np.uint8)
            mask[8:40, 4 + i:30 + i] = 255
            Image.fromarray(mask, "L").save(data / f"{i:04d}-masklabel.png")
    raw = base_config(tiny_models["sd1"], data, root / "out", seed=7)
    raw["data"] = {"concepts": [{"path": str(data), **VARIED}], "shards": str(root / "set")}
    cfg = validate(raw)
    build_shard_set(cfg, root / "set", log=lambda *_: None)
    return root / "set", raw, load_model(cfg.model)


def fresh(built, folder: Path, **concept) -> ShardDataset:
    """A copy of the built set (no cache yet) at `folder`, read with the concept's options changed by `concept`."""
    shutil.copytree(built[0], folder)
    raw = copy.deepcopy(built[1])
    raw["data"]["concepts"][0].update(concept)
    return ShardDataset(folder, validate(raw))


def cache_of(dataset: ShardDataset, kind: str) -> Path:
    (folder,) = dataset.dir.glob(f"{kind}-*")
    return folder


def test_epochs_read_the_versions_in_turn_each_the_uncached_epochs_image(built, tmp_path):
    dataset, vae, lines = fresh(built, tmp_path / "set"), built[2].vae, []
    attach_latent_cache(dataset, vae, Runtime(), log=lines.append, chunk_size=CHUNK)
    assert "the latents cache holds 24 versions of 12 samples (2.00x the size without variations" in lines[0]
    manifest = json.loads((cache_of(dataset, "latents") / "manifest.json").read_text())
    assert manifest["members"] == ["64.latent.safetensors", "64.latent.v1.safetensors"]
    assert manifest["variations"]["concepts"] == [[2, {"flip_probability": 0.5, "rotation_degrees": 10.0,
                                                       "brightness": 0.4, "contrast": 0.0, "saturation": 0.0,
                                                       "hue": 0.0}]]
    differ = 0
    with torch.no_grad():
        for i in range(0, 12, 3):
            epochs = [dataset.load(i, e) for e in range(3)]
            differ += not torch.equal(epochs[0]["latent_mean"], epochs[1]["latent_mean"])
            for key in ("latent_mean", "mask"):  # 2 versions: epoch 2 reads version 0 again
                assert torch.equal(epochs[2][key], epochs[0][key])
            for version in (0, 1):  # version v: the image (and mask) the uncached pipeline augments in epoch v
                uncached = dataset.load(i, version, use_cache=False)
                torch.testing.assert_close(epochs[version]["latent_mean"],
                                           vae.encode(uncached["pixels"][None]).latent_dist.mean[0],
                                           rtol=1e-5, atol=1e-5)
                assert torch.equal(epochs[version]["mask"], uncached["mask"])
    assert differ == 4  # brightness drawn per version: no two versions alike


def test_text_versions_are_the_uncached_epochs_captions(built, tmp_path):
    dataset, model = fresh(built, tmp_path / "set"), built[2]
    attach_text_cache(dataset, model, Runtime(), log=print, chunk_size=CHUNK)
    family = model.family
    uncached = ShardDataset(dataset.dir, validate(built[1]))
    seen = set()
    for i in range(12):
        for epoch in range(4):
            cached = dataset.load(i, epoch)
            if epoch < 3:  # the line drawn in epoch v, in version v: the uncached epoch v's caption
                assert cached["caption"] == uncached.load(i, epoch)["caption"]
            elif len(dataset.captions(i)) == 1:  # 3 versions: epoch 3 reads version 0
                assert cached["caption"] == uncached.load(i, 0)["caption"]
            else:  # ... of the line epoch 3 draws
                assert cached["caption"] in {dataset.caption_version(i, line, 0) for line in dataset.captions(i)}
            seen.add((i, cached["caption"]))
            with torch.no_grad():
                expected = family.encode_text(model.text_encoders, family.tokenize(model.tokenizers,
                                                                                   [cached["caption"]]))
            torch.testing.assert_close(cached["text_hidden"], expected["hidden"][0], rtol=1e-5, atol=1e-5)
    assert len(seen) > 12 * 2  # the versions differ


def test_variation_of_a_pass_is_mgds_diskcache_rule():
    """mgds DiskCache: a concept of n images drawing m samples an epoch reads, at output position k of epoch e,
    version ((k + e m) // n) mod N of image (k + e m) mod n. With whole repeats ot_dist's copy c of image j is output
    position c n + j."""
    concepts = {0: SimpleNamespace(balancing=1.0, balancing_strategy="repeats", image_variations=3,
                                   flip_probability=0.5, rotation_degrees=0, brightness=0, contrast=0, saturation=0,
                                   hue=0),
                1: SimpleNamespace(balancing=2.0, balancing_strategy="repeats", image_variations=3,
                                   flip_probability=0.5, rotation_degrees=0, brightness=0, contrast=0, saturation=0,
                                   hue=0),
                2: SimpleNamespace(balancing=8, balancing_strategy="samples", image_variations=2,
                                   flip_probability=0, rotation_degrees=0, brightness=0, contrast=0, saturation=0,
                                   hue=0)}  # does not augment: one version
    column = np.array([0] * 4 + [1] * 5 + [2] * 3)
    variations = Variations("latents", concepts, column, seed=1)
    assert variations.counts(column).tolist() == [3] * 9 + [1] * 3
    for concept, members, repeats in ((0, np.arange(4), 1), (1, np.arange(4, 9), 2)):
        n, m = len(members), len(members) * repeats
        for epoch in range(7):
            for k in range(m):
                image, copy_ = members[k % n], k // n
                expected = ((k + epoch * m) // n) % 3
                assert variations.of(int(image) + copy_ * len(column), concept, epoch) == expected
    assert variations.of(4, 1, -1) == 0  # an evaluation reads version 0
    assert {variations.of(9 + c * 12, 2, e) for c in range(3) for e in range(5)} == {0}


def test_a_rerun_reuses_the_cache_and_other_versions_are_another_cache(built, tmp_path):
    dataset, vae = fresh(built, tmp_path / "set"), built[2].vae
    attach_latent_cache(dataset, vae, Runtime(), log=print, chunk_size=CHUNK)
    first = cache_of(dataset, "latents")
    again, lines, loads = ShardDataset(dataset.dir, validate(built[1])), [], []
    load = again.load
    again.load = lambda i, *a, use_cache=True, **k: (loads.append(i) if not use_cache else None) or load(
        i, *a, use_cache=use_cache, **k)
    attach_latent_cache(again, vae, Runtime(), log=lines.append, chunk_size=CHUNK)
    assert loads == [] and not any("caching" in line for line in lines)  # read as it is (a resume, a rerun)
    assert torch.equal(again.load(3, 1)["latent_mean"], dataset.load(3, 1)["latent_mean"])
    for change in ({"image_variations": 3}, {"brightness": 0.3}):  # other versions: another folder beside it
        other = ShardDataset(dataset.dir, validate({**built[1], "data": {**built[1]["data"], "concepts": [
            {**built[1]["data"]["concepts"][0], **change}]}}))
        attach_latent_cache(other, vae, Runtime(), log=print, chunk_size=CHUNK)
        assert other.caches["latents"].dir != first
    reseeded = ShardDataset(dataset.dir, validate({**built[1], "seed": 8}))
    attach_latent_cache(reseeded, vae, Runtime(), log=print, chunk_size=CHUNK)
    assert reseeded.caches["latents"].dir != first
    assert len(list(dataset.dir.glob("latents-*"))) == 4


def test_without_versions_the_cache_keeps_its_key_members_and_record(built, tmp_path):
    """A concept that does not augment (or image_variations 1 without augmentation): the cache is the one ot_dist
    computed before variations existed, in the folder of the VAE's key, its manifest without a variations field."""
    plain = {name: 0.0 for name in ("flip_probability", "rotation_degrees", "brightness")}
    for concept in ({**plain, "image_variations": 1}, {**plain, "image_variations": 4}):
        dataset = fresh(built, tmp_path / f"set{concept['image_variations']}", **concept)
        lines = []
        attach_latent_cache(dataset, built[2].vae, Runtime(), log=lines.append, chunk_size=CHUNK)
        cache = cache_of(dataset, "latents")
        assert cache.name == f"latents-{vae_key(built[2].vae)[:16]}"
        manifest = json.loads((cache / "manifest.json").read_text())
        assert "variations" not in manifest and manifest["members"] == ["64.latent.safetensors"]
        assert not any("versions of" in line for line in lines), lines
    first, second = (cache_of(ShardDataset(tmp_path / f"set{n}", validate(built[1])), "latents") for n in (1, 4))
    assert {p.name: p.read_bytes() for p in first.glob("chunk-*")} == \
        {p.name: p.read_bytes() for p in second.glob("chunk-*")}


def test_the_mask_of_a_cached_version_is_augmented_as_its_image():
    from ot_dist.data.augment import augment, augment_mask

    concept = SimpleNamespace(flip_probability=0.5, rotation_degrees=30.0, brightness=0.3, contrast=0, saturation=0,
                              hue=0)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (16, 24, 3), dtype=np.uint8))
    mask = Image.fromarray(rng.integers(0, 255, (16, 24), dtype=np.uint8), "L")
    for seed in range(6):
        for given in (mask, None):
            _, expected = augment(image, given, concept, torch.Generator().manual_seed(seed))
            got = augment_mask(given, image.size, concept, torch.Generator().manual_seed(seed))
            assert np.array_equal(np.asarray(got), np.asarray(expected))


def config(concept: dict, **data) -> dict:
    return {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o",
            "data": {"concepts": [{"path": "x", **concept}], **data}}


def test_the_refusals_point_to_the_variations_and_variations_lift_them():
    with pytest.raises(ConfigError, match=r"augments its images .* set data.concepts\[0\].image_variations to N > 1"):
        validate(config({"flip_probability": 0.5}, cache_latents=True))
    assert validate(config({"flip_probability": 0.5, "image_variations": 2}, cache_latents=True)).data.cache_latents
    with pytest.raises(ConfigError, match=r"varies its captions .* set data.concepts\[0\].text_variations to N > 1"):
        validate(config({"tag_shuffling": True}, cache_text=True))
    assert validate(config({"tag_shuffling": True, "text_variations": 2}, cache_text=True)).data.cache_text
    # whole epochs of empty captions are an epoch's choice, not a draw a cached version could hold
    with pytest.raises(ConfigError, match=r"caption_dropout_every_n_epochs empties the captions of given epochs"):
        validate(config({"caption_dropout_every_n_epochs": 2, "text_variations": 2}, cache_text=True))


def test_a_run_trains_from_cached_versions_and_a_rerun_reads_them(built, tmp_path):
    from conftest import base_config

    from ot_dist.train.trainer import Trainer

    concepts = built[1]["data"]["concepts"]  # 2 image versions, 3 caption versions
    raw = base_config(built[1]["model"]["path"], concepts[0]["path"], tmp_path / "run", seed=7, epochs=2, max_steps=4)
    raw["data"] = {"concepts": concepts, "shards": raw["data"]["shards"], "cache_latents": True, "cache_text": True}
    lines = []
    trainer = Trainer(validate(raw), log=lines.append)
    batches = [trainer.tokenize(next(iter(trainer.epoch_batches(e)))) for e in (0, 1)]
    assert all("pixels" not in b and "latent_mean" in b and "text_hidden" in b for b in batches)
    assert trainer.train().steps == 4
    assert any("latents cache holds 24 versions of 12 samples" in line for line in lines)
    assert any("text cache holds 36 versions of 12 samples" in line for line in lines)
    lines.clear()
    Trainer(validate(raw), log=lines.append, overwrite=True)
    assert not any("data: caching" in line for line in lines)
