"""Concept types (issue 18): validation concepts are never trained and their fixed-noise loss is logged as
validation/loss/<concept>, the same on 1 and 2 ranks; prior-preservation (regularisation) concepts train with their
own loss weight, the DreamBooth way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config
from test_data_shards import make_images

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three concepts of 64 px squares: 8 standard, 4 regularisation, 5 validation images."""
    root = tmp_path_factory.mktemp("concepts")
    return {name: make_images(root / name, [(64, 64)] * n, seed=s)
            for name, n, s in (("dog", 8, 1), ("class", 4, 2), ("held_out", 5, 3))}


AUGMENTATIONS = {"flip_probability": 0.5, "rotation_degrees": 10.0, "brightness": 0.2, "contrast": 0.2,
                 "saturation": 0.2, "hue": 0.05, "tag_shuffling": True, "tag_dropout_probability": 0.2,
                 "caption_dropout_probability": 0.3}


def concepts_config(models, folders, out, with_validation=True, **overrides):
    concepts = [{"path": str(folders["dog"]), "name": "dog"},
                {"path": str(folders["class"]), "name": "class", "type": "prior_preservation", "loss_weight": 0.5}]
    if with_validation:
        concepts.append({"path": str(folders["held_out"]), "name": "held_out", "type": "validation"})
    raw = base_config(models["sd1"], folders["dog"], out, **{"batch_size": 2, "epochs": 2, **overrides})
    raw["data"] = {"concepts": concepts, "shards": f"{out}-shards"}
    return raw


def test_onetrainer_spellings_and_prior_prediction_needs_lora():
    def concepts(method, kind):
        return validate({"model": {"family": "sd1", "path": "m"}, "method": method, "output_dir": "o",
                         "data": {"concepts": [{"path": "x"}, {"path": "y", "type": kind}]}}).data.concepts

    assert concepts("full", "VALIDATION")[1].type == "validation"
    assert concepts("lora", "PRIOR_PREDICTION")[1].type == "prior_prediction"
    for method in ("full", "embedding"):
        with pytest.raises(ConfigError, match=rf"data.concepts\[1\].type: prior_prediction .* method {method} has no "):
            concepts(method, "prior_prediction")


def prior_prediction_config(models, folders, out, **overrides):
    """dog (standard) and class (prior_prediction) concepts, method lora."""
    raw = concepts_config(models, folders, out, with_validation=False, method="lora", **{"lora.rank": 4, **overrides})
    raw["data"]["concepts"][1] = {"path": str(folders["class"]), "name": "class", "type": "prior_prediction"}
    return raw


def test_prior_prediction_targets_the_model_without_its_lora(tiny_models, folders, tmp_path):
    """OneTrainer's PRIOR_PREDICTION (GenericTrainer: the prior model's prediction replaces the target of those
    samples): a batch of one dog and one prior-prediction class image has the loss (loss_dog + m) / 2, m the mean of
    (prediction - prediction without the LoRA)^2 of the class image at its own noise, timestep and caption, computed
    here from the objective's parts; with the LoRA at zero that term is exactly 0.
    The prior keeps the additional embeddings (OneTrainer's prior_model unhooks the LoRA adapters only, not its
    embedding wrapper): with the class captions holding a token whose vectors have moved away from their start, a zero
    LoRA still predicts the prior itself."""
    from ot_dist.train.loss import adapters_disabled, draw_sample_noise, encode_latents, latent_shape_of, \
        text_conditioning

    raw = prior_prediction_config(tiny_models, folders, tmp_path / "o",
                                  additional_embeddings=[{"token": "<tok>", "vectors": 2}])
    raw["data"]["concepts"][1]["caption_prefix"] = "<tok>"
    trainer = Trainer(validate(raw), log=QUIET)
    dataset, model, seed = trainer.dataset, trainer.model, trainer.config.seed
    dog = next(i for i, s in enumerate(dataset.samples) if s["concept"] == 0)
    reg = next(i for i, s in enumerate(dataset.samples) if s["concept"] == 1)
    samples = [dataset.load(dog, 0), dataset.load(reg, 0)]
    assert [bool(s["prior_prediction"]) for s in samples] == [False, True]

    def loss(chosen, flags=True):
        batch = collate([s if flags else {k: v for k, v in s.items() if k != "prior_prediction"} for s in chosen])
        return float(diffusion_loss(model, trainer.tokenize(batch), seed, 0))

    def prior_term(sample):
        batch = trainer.tokenize(collate([sample]))
        shape = latent_shape_of(model, batch)
        vae_eps, noise, timesteps = draw_sample_noise(batch, shape, model.objective, seed, 0, trainer.config.loss)
        latents = encode_latents(model.family, model.vae, batch, vae_eps)
        noisy = model.objective.noisy(latents, noise, timesteps)
        predict = lambda: model.family.predict(model.denoiser, noisy, timesteps,  # noqa: E731
                                               text_conditioning(model, batch, latents.device, latents.dtype), batch)
        with adapters_disabled(model):
            prior = predict()
        return float(((predict() - prior) ** 2).mean())

    with torch.no_grad():
        (vectors,) = trainer.groups[1].params  # the embedding as training has moved it
        vectors.add_(torch.randn_like(vectors, generator=torch.Generator().manual_seed(5)))
        assert loss([samples[1]]) == 0.0 < loss([samples[1]], flags=False)  # a zero LoRA predicts the prior itself
        for name, param in model.denoiser.named_parameters():  # a LoRA that has learnt something
            if "lora_B" in name:
                param.copy_(torch.randn_like(param, generator=torch.Generator().manual_seed(7)) * 0.05)
        term = prior_term(samples[1])
        assert term > 0
        assert loss([samples[1]]) == pytest.approx(term, rel=1e-5)
        assert loss(samples) == pytest.approx((loss([samples[0]]) + term) / 2, rel=1e-5)


def test_a_validation_concept_is_never_trained_and_its_loss_reaches_mlflow(tiny_models, folders, tmp_path):
    """The same run with and without a validation concept: the same step losses and bit-identical weights. The
    validation loss is computed before the first step, every 3 steps and after the last, and lands in the run's
    MLflow store under validation/loss/held_out."""
    from mlflow.tracking import MlflowClient

    plain = Trainer(validate(concepts_config(tiny_models, folders, tmp_path / "plain", with_validation=False)), log=QUIET)
    plain_result = plain.train()
    lines = []
    raw = concepts_config(tiny_models, folders, tmp_path / "val", **{"validation.every_n_steps": 3,
                                                                      "mlflow.enabled": True})
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'val' / 'mlflow.db'}"
    trainer = Trainer(validate(raw), log=lines.append)
    result = trainer.train()
    assert result.steps == plain_result.steps == 2 * 12 // 2  # dog + class images train, held_out does not
    assert result.losses == plain_result.losses
    for a, b in zip(trainer.params, plain.params):
        assert torch.equal(a, b)
    steps = [step for step, _ in trainer.validation.history]
    assert steps == [0, 3, 6, 9, 12]
    values = [m["validation/loss/held_out"] for _, m in trainer.validation.history]
    assert len(set(values)) == len(values)  # the weights changed between the points, the noise did not
    assert any("validation concept held_out: 5 samples, not trained" in line for line in lines)
    client = MlflowClient(raw["mlflow"]["tracking_uri"])
    history = client.get_metric_history(trainer.tracker.run_id, "validation/loss/held_out")
    history = sorted(history, key=lambda m: m.step)
    assert [m.step for m in history] == steps and [m.value for m in history] == pytest.approx(values)


def test_validation_loss_is_the_same_at_any_point_with_the_same_weights(tiny_models, folders, tmp_path):
    """Fixed noise: computed twice on unchanged weights it is the same number, and training mode is restored."""
    trainer = Trainer(validate(concepts_config(tiny_models, folders, tmp_path / "o")), log=QUIET)
    trainer.model.denoiser.train()
    first = trainer.validation.run(trainer, 0)
    assert trainer.validation.run(trainer, 1) == first
    assert trainer.model.denoiser.training


def test_prior_preservation_weight_by_hand(tiny_models, folders, tmp_path):
    """A batch of one dog and one class image: the loss is (loss_dog + 0.5 x loss_class) / 2, each sample's loss
    computed alone without weights."""
    trainer = Trainer(validate(concepts_config(tiny_models, folders, tmp_path / "o")), log=QUIET)
    dataset = trainer.dataset
    dog = next(i for i, s in enumerate(dataset.samples) if s["concept"] == 0)
    reg = next(i for i, s in enumerate(dataset.samples) if s["concept"] == 1)
    samples = [dataset.load(dog, 0), dataset.load(reg, 0)]
    assert [float(s["loss_weight"]) for s in samples] == [1.0, 0.5]
    model, seed = trainer.model, trainer.config.seed
    with torch.no_grad():
        together = diffusion_loss(model, trainer.tokenize(collate(samples)), seed, 0)
        alone = []
        for s in samples:
            s = {k: v for k, v in s.items() if k != "loss_weight"}
            alone.append(diffusion_loss(model, trainer.tokenize(collate([s])), seed, 0))
    assert float(together) == pytest.approx((float(alone[0]) + 0.5 * float(alone[1])) / 2, rel=1e-5)
    assert float(together) != pytest.approx((float(alone[0]) + float(alone[1])) / 2, rel=1e-3)


def launch_cases(cases: dict, tmp_path: Path) -> dict:
    """Train each case in one 2-rank gloo launch (tests/helpers/concept_ranks.py); what every rank recorded."""
    cases_file, results = tmp_path / "cases.json", tmp_path / "results"
    cases_file.write_text(json.dumps(cases))
    done = run_ranks(str(REPO / "tests" / "helpers" / "concept_ranks.py"), str(cases_file), str(results),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {rank: json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_two_rank_launch(small_sd1, folders, tmp_path):
    """One 2-rank gloo launch for two cases.
    validation: the validation loss on 2 ranks (ddp, fsdp, zero3) equals 1 process's (exactly before training, where
    the weights are the same; to float rounding after steps, whose gradients are averaged in another order).
    small buckets: issue 18's 20 images (256x256 ... 1200x400, scaled down 8x to train at 64 px) with a global batch
    of 4: every rank runs the same steps for 2 epochs, at least 95 % of the images train in each epoch, and the
    report at start names where each moved image went.
    On the 2-level SD 1.x UNet (small_sd1): what is compared does not depend on the depth, and fsdp's and zero3's cost
    grows with the module count."""
    from test_small_buckets import ISSUE_SIZES, write_images

    models = {"sd1": small_sd1}
    # validation: one epoch (6 steps) has validations before training, after steps 3 and 6
    raw = concepts_config(models, folders, tmp_path / "single", batch_size=2, epochs=1,
                          **{"validation.every_n_steps": 3})
    single = Trainer(validate(raw), log=QUIET)
    single.train()
    ranked = concepts_config(models, folders, tmp_path / "ddp", batch_size=1, strategy="ddp", epochs=1,
                             **{"validation.every_n_steps": 3})
    issue = base_config(small_sd1, write_images(tmp_path / "issue", ISSUE_SIZES, scale=8), tmp_path / "issue-out",
                        batch_size=2, epochs=2, strategy="ddp", learning_rate=1e-5)
    # fsdp: every forward gathers weights, so both ranks must run as many (5 samples: rank 1 repeats one)
    sharded = concepts_config(models, folders, tmp_path / "fsdp", batch_size=1, strategy="fsdp", epochs=1,
                              **{"validation.every_n_steps": 3})
    # zero3: the validation forwards between steps break the module trace ZeRO-3 replays (it records it anew)
    zero3 = concepts_config(models, folders, tmp_path / "zero3", batch_size=1, strategy="zero3", epochs=1,
                            **{"validation.every_n_steps": 3})
    # every augmentation and caption option at once: drawn per (seed, epoch, sample), so 2 ranks x 1 = 1 x 2
    augmented = {}
    for name, options in (("plain", {}), ("single", AUGMENTATIONS), ("ddp", AUGMENTATIONS)):
        augmented[name] = concepts_config(models, folders, tmp_path / f"aug-{name}", with_validation=False,
                                          batch_size=1 if name == "ddp" else 2,
                                          **({"strategy": "ddp"} if name == "ddp" else {}))
        for concept in augmented[name]["data"]["concepts"]:
            concept.update(options)
    augmented_losses = {name: Trainer(validate(augmented[name]), log=QUIET).train().losses for name in ("plain", "single")}
    # prior_prediction under fsdp: a rank whose micro batch holds no such sample runs the model without its LoRA too
    # (each fsdp forward gathers weights: a forward on one rank only would hang both); 1 x 2 = 2 x 1
    prior = {name: prior_prediction_config(models, folders, tmp_path / f"prior-{name}", batch_size=batch, max_steps=3,
                                           **({"strategy": "fsdp"} if name == "fsdp" else {}))
             for name, batch in (("single", 2), ("fsdp", 1))}
    prior_losses = Trainer(validate(prior["single"]), log=QUIET).train().losses
    got = launch_cases({"validation": ranked, "validation fsdp": sharded, "validation zero3": zero3,
                        "small buckets": issue, "augmented": augmented["ddp"], "prior fsdp": prior["fsdp"]}, tmp_path)
    for rank in (0, 1):
        assert got[rank]["prior fsdp"]["losses"] == pytest.approx(prior_losses, rel=1e-5)

    assert augmented_losses["single"] != augmented_losses["plain"]  # the options change what trains
    for rank in (0, 1):
        assert got[rank]["augmented"]["losses"] == pytest.approx(augmented_losses["single"], rel=1e-5)

    expected = single.validation.history
    assert [s for s, _ in expected] == [0, 3, 6]
    for case in ("validation", "validation fsdp", "validation zero3"):
        for rank in (0, 1):
            history = got[rank][case]["validation"]
            assert [s for s, _ in history] == [s for s, _ in expected]
            # before training the weights are the same: equal up to the rounding of batch 1 per rank against batch 2
            # in one process (bit-identical on some machines, 1e-8 apart on others)
            assert history[0][1]["validation/loss/held_out"] == pytest.approx(
                expected[0][1]["validation/loss/held_out"], rel=1e-6)
            for (_, m), (_, e) in zip(history, expected):
                assert m["validation/loss/held_out"] == pytest.approx(e["validation/loss/held_out"], rel=1e-4)
        assert got[0][case]["validation"] == got[1][case]["validation"]

    ranks = [got[rank]["small buckets"] for rank in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 2 * 20 // 4
    assert ranks[0]["micro_batches"] == ranks[1]["micro_batches"] == 10
    for epoch in (0, 1):
        trained = {i for r in ranks for e, ids in r["seen"] if e == epoch for i in ids}
        assert len(trained) >= 0.95 * 20, (epoch, sorted(trained))
    report = ranks[0]["report"]
    moved = [line for line in report if line.strip().startswith("moved ")]
    assert moved and all(".png" in line for line in moved), report
    assert report[-1].strip().startswith("total: 20 samples/epoch, 5 steps/epoch, 0 dropped per epoch")


def test_the_type_and_small_buckets_are_read_time_options(tiny_models, folders, tmp_path):
    """They change no shard: a shard set stays current when a concept becomes a validation concept or small buckets
    change policy; an option that changes what shards hold (the caption prefix) rebuilds it."""
    from ot_dist.data.shards import default_shard_dir, source_fingerprint

    raw = concepts_config(tiny_models, folders, tmp_path / "o")
    base = source_fingerprint(validate(raw))
    raw["data"]["concepts"][0]["type"] = "validation"
    raw["data"]["small_buckets"] = "drop"
    assert source_fingerprint(validate(raw)) == base
    # nor the options applied as samples are read: each change of them built (and cached) a whole new copy of the set
    read_time = {"loss_weight": 2.0, "tag_shuffling": True, "tag_delimiter": ";", "keep_tags_count": 2,
                 "tag_dropout_probability": 0.5, "tag_dropout_mode": "full", "caption_dropout_probability": 0.1,
                 "flip_probability": 0.5, "rotation_degrees": 5.0, "brightness": 0.1, "contrast": 0.1,
                 "saturation": 0.1, "hue": 0.1, "tag_dropout_special_tags_mode": "whitelist",
                 "tag_dropout_special_tags": ["a.*"], "tag_dropout_special_tags_regex": True,
                 "caps_randomize_probability": 0.2, "caps_randomize_mode": ["title"], "lowercase_caption": True,
                 "keep_tags_separator": "|||", "secondary_separator": ";;;", "caption_dropout_every_n_epochs": 3,
                 "image_variations": 3, "text_variations": 2}  # the caches' versions, not the shards'
    raw["data"]["concepts"][1].update(read_time)
    config = validate(raw)
    assert source_fingerprint(config) == base
    assert default_shard_dir(config) == default_shard_dir(validate(concepts_config(tiny_models, folders, tmp_path / "o")))
    raw["data"]["concepts"][0]["caption_prefix"] = "sks, "
    assert source_fingerprint(validate(raw)) != base


def test_validation_concepts_of_the_same_folder_name_get_their_own_metric():
    from ot_dist.data.plan import SampleTable, bucket_report

    table = SampleTable((0,) * 4, (0, 1, 2, 2), ((1.0, "repeats"),) * 3, ("dog", "held out (a)", "held out (a)"),
                        ("standard", "validation", "validation"))
    assert table.validation_names() == {1: "held out _a_", 2: "held out _a_-2"}
    assert table.epoch_sizes() == {0: 1}  # only the standard concept's sample is drawn
    assert "logged as validation/loss/held out _a_-2" in bucket_report(table, 1, 1, [64], 8)[-1]


def test_unreadable_images_of_concept_folders_are_named_up_to_a_limit():
    """A folder on an unmounted store can make every image unreadable: the message names the first 20 and counts
    the rest, both when it stops the build and when it only warns."""
    from types import SimpleNamespace

    from ot_dist.data.concepts import check_bad_fraction
    from ot_dist.errors import InputFileError

    bad = [(Path(f"/photos/{i}.jpg"), f"/photos/{i}.jpg: not readable") for i in range(25)]
    with pytest.raises(InputFileError) as stopped:
        check_bad_fraction(SimpleNamespace(max_bad_fraction=0.1), bad, 100)
    message = str(stopped.value)
    assert "/photos/19.jpg: not readable; ... 5 more (25 of 100 images unreadable" in message
    assert "/photos/20.jpg" not in message
    warnings = []
    check_bad_fraction(SimpleNamespace(max_bad_fraction=0.5), bad, 100, log=warnings.append)
    [warning] = warnings
    assert warning.startswith("warning: data: 25 of 100 images unreadable, skipped") and warning.endswith("... 5 more")
    check_bad_fraction(SimpleNamespace(max_bad_fraction=0.5), bad[:3], 100, log=warnings.append)
    assert warnings[-1].endswith("/photos/2.jpg: not readable")  # a few are all named, nothing counted


@pytest.mark.parametrize("buckets,balancing,per_epoch", [
    # OneTrainer draws floor(images x repeats) samples of a concept per epoch, or int(samples) (mgds DiskCache)
    ((0, 0, 0, 1, 1, 1, 2, 2, 2, 2), (1.5, "repeats"), 15),  # shares 4.5, 4.5, 6 were rounded to 4 + 4 + 6
    (tuple(range(10)), (0.4, "repeats"), 4),  # ten aspect ratios, one image each: every share 0.4 was rounded to 0
    (tuple(i // 5 for i in range(100)), (10, "samples"), 10),  # regularisation images over 20 buckets: 20 x 0.5 -> 0
    ((0, 0, 1), (0.35, "samples"), 0), ((0, 0, 1), (7.9, "samples"), 7),
])
def test_balancing_draws_onetrainers_number_of_samples_per_epoch(buckets, balancing, per_epoch):
    """A concept spread over many buckets drew far fewer samples than its balancing says, or none at all: each
    bucket's share was rounded on its own. The total is OneTrainer's, the same every epoch, and each bucket
    gives its share of it (the whole part, the rest to the largest fractions)."""
    from ot_dist.data.plan import SampleTable, plan_epoch

    table = SampleTable(buckets, (0,) * len(buckets), (balancing,), ("c",))
    sizes = table.epoch_sizes()
    assert sum(sizes.values()) == per_epoch
    for bucket, n in sizes.items():
        share = per_epoch * buckets.count(bucket) / len(buckets)
        assert int(share) <= n <= int(share) + 1
    for epoch in (0, 1):
        assert sum(len(batch.samples) for batch in plan_epoch(table, 1, [64], 0, epoch)) == per_epoch
