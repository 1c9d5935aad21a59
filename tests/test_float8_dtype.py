"""weight_dtype float8 in every family: the 1-byte storage never reaches an activation. diffusers / transformers read
a model's `.dtype` (its first parameter's) or a layer's parameter dtype to cast their inputs and draw latents;
with the weights stored in float8 such a read casts activations to float8 (3 mantissa bits) or fails (no float8
kernels). One LoRA step per family (the denoiser's base, text encoders and VAE all stored in float8), with the
caches its family allows encoded first and a sample at the end, watched by a TorchDispatchMode that records every
op making a float8 tensor other than the stored weights (tests/float8_activations.py).

Stored models report the compute dtype as `.dtype` from placement on (memory/float8.py report_compute_dtype), not
only while sampling: the first batch's loss and gradients are the same bits as with `.dtype` reading the storage,
in every family but the two whose training read `.dtype` to cast an input (Qwen-Image-Edit's vision tower: the
reference's pixels), where the storage's read is what cast activations to float8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import base_config, small_edit_reference_areas, with_reference_images
from float8_activations import float8_activation_watch, storage_dtype_reported

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.memory.float8 import FLOAT8
from ot_dist.models.families.registry import FAMILY_NAMES, get_family
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

RESOLUTION = {"stable_cascade": 128, "wuerstchen_v2": 128}
# The families whose training forward reads a float8-stored model's `.dtype` to cast an activation.
STORAGE_DTYPE_CAST_IN_TRAINING = {"qwen_image_edit", "qwen_image_edit_plus"}


def quiet(*_):
    pass


def float8_config(family: str, model, data, out) -> dict:
    size = RESOLUTION.get(family, 64)
    raw = with_reference_images(base_config(model, data, out, family=family, method="lora", batch_size=2,
                                            max_steps=1, resolution=size, weight_dtype="float8"))
    prompt = {"prompt": "a red dot", "steps": 2, "width": size, "height": size}
    if get_family(family).reference_images:
        prompt["reference_image"] = str(Path(raw["data"]["concepts"][0]["reference_path"]) / "0003.png")
    raw["sampling"] = {"prompts": [prompt]}
    if (model / "decoder_stages").is_dir():  # Stable Cascade / Würstchen: the decoder stages sample
        raw["model"]["decoder"] = str(model / "decoder_stages")
    refused = get_family(family).cache_refusals
    raw["data"] |= {f"cache_{kind}": True for kind in ("latents", "text") if f"cache_{kind}" not in refused}
    return raw


def loss_and_gradients(trainer: Trainer, batch: dict):
    with trainer.precision.autocast():  # as the step computes (off in float32)
        loss = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    return loss.detach(), torch.autograd.grad(loss, trainer.params, allow_unused=True)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_no_activation_is_cast_to_float8(family, family_models, shapes_data, tmp_path, monkeypatch):
    # the Qwen-Image-Edit samples encode their reference at 128^2 pixels, not 1024^2: the same ops under the watch
    small_edit_reference_areas(monkeypatch)
    with float8_activation_watch(monkeypatch) as watch:
        with watch:  # placement stores the weights; the caches encode with the frozen VAE / text encoders
            trainer = Trainer(validate(float8_config(family, family_models[family], shapes_data, tmp_path / "o")),
                              log=quiet)
            # the first batch uncached: the text encoders and the VAE run in the step
            batch = trainer.tokenize(collate([trainer.dataset.load(i, 0, use_cache=False) for i in range(2)]))
            reported = loss_and_gradients(trainer, batch)
        assert watch.found == [], f"{family}: activations cast to float8 in the step: {watch.found[:3]}"
        # sampling's structures of the trained modules hold no weights: no second copy of a float8 base
        assert {p.device.type for t in trainer.sampler.templates.values() for p in t.parameters()} == {"meta"}
        model = trainer.model
        stored = [m for m in [*model.pipeline.components.values(), *model.family.sampling_modules(model.pipeline)]
                  if isinstance(m, torch.nn.Module)]
        # the case watched: models holding float8 weights, reporting the compute dtype
        assert any(FLOAT8 in {p.dtype for p in m.parameters()} and getattr(m, "dtype", FLOAT8) != FLOAT8
                   for m in stored)

        with storage_dtype_reported(stored), watch:  # `.dtype` reads the storage, as before
            as_stored = loss_and_gradients(trainer, batch)
        storage_casts, watch.found[:] = list(watch.found), []
        if family in STORAGE_DTYPE_CAST_IN_TRAINING:
            assert storage_casts  # what reporting the compute dtype prevents
        else:
            assert storage_casts == []
            assert torch.equal(reported[0], as_stored[0])
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(reported[1], as_stored[1]))

        with watch:
            trainer.train()  # a step from the caches, and a sample at the end
        assert watch.found == [], f"{family}: activations cast to float8 training or sampling: {watch.found[:3]}"
