"""Clip skip (model.text_encoder_layer_skip, OneTrainer's text_encoder_layer_skip) through the family contract:
the conditioning equals what the diffusers pipeline computes with `clip_skip`, samples pass it on, and families
without it refuse the key."""

from __future__ import annotations

import pytest
import torch

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.models.families.registry import get_family

PROMPT = "a red cube on a blue floor"


def model_section(family, **skips):
    return validate({"model": {"family": family, "path": "m", **skips}, "method": "lora", "output_dir": "o",
                     "data": {"path": "d"}}).model


def ours(name, pipe, **skips):
    family = get_family(name).configure(model_section(name, **skips))
    tokens = family.tokenize({n: getattr(pipe, n) for n in family.tokenizers}, [PROMPT])
    with torch.no_grad():
        return family, family.encode_text({n: getattr(pipe, n) for n in family.text_encoders}, tokens)


@pytest.mark.parametrize("name", ["sd1", "sd2"])
def test_sd_conditioning_is_the_pipelines_with_clip_skip(name):
    pipe = get_family(name).build_tiny()
    family, conditioning = ours(name, pipe)
    assert family.pipeline_call_options(pipe) == {}
    with torch.no_grad():
        plain = pipe.encode_prompt(PROMPT, "cpu", 1, False)[0]
    torch.testing.assert_close(conditioning["hidden"], plain, rtol=0, atol=0)  # no skip: unchanged, bit for bit
    family, conditioning = ours(name, pipe, text_encoder_layer_skip=1)
    # what sampling passes to the pipeline (with diffusers 0.42 and transformers 5 it also lets clip_skip run)
    options = family.pipeline_call_options(pipe)
    assert options == {"clip_skip": 1}
    with torch.no_grad():
        skipped = pipe.encode_prompt(PROMPT, "cpu", 1, False, **options)[0]
        image = pipe(PROMPT, num_inference_steps=1, height=32, width=32, output_type="pt", **options).images
    torch.testing.assert_close(conditioning["hidden"], skipped)
    assert not torch.allclose(skipped, plain) and torch.isfinite(image).all()
    assert "text_model" not in dict(pipe.text_encoder.named_modules()) and pipe.text_encoder.state_dict().keys() == \
        get_family(name).build_tiny().text_encoder.state_dict().keys()


def test_sdxl_conditioning_is_the_pipelines_with_clip_skip_and_skips_each_encoder():
    pipe = get_family("sdxl").build_tiny()
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False, clip_skip=1)
        plain, _, plain_pooled, _ = pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False)
    family, conditioning = ours("sdxl", pipe, text_encoder_layer_skip=1, text_encoder_2_layer_skip=1)
    torch.testing.assert_close(conditioning["hidden"], embeds)
    torch.testing.assert_close(conditioning["pooled"], pooled)  # the pooled output is never skipped
    assert family.pipeline_call_options(pipe) == {"clip_skip": 1}
    # OneTrainer skips each encoder on its own: only the second encoder's half moves
    _, second_only = ours("sdxl", pipe, text_encoder_2_layer_skip=1)
    half = plain.shape[-1] // 2
    torch.testing.assert_close(second_only["hidden"][..., :half], plain[..., :half])
    torch.testing.assert_close(second_only["hidden"][..., half:], embeds[..., half:])
    torch.testing.assert_close(plain_pooled, pooled)


@pytest.mark.parametrize("family,key", [("sd1", "text_encoder_2_layer_skip"), ("flux", "text_encoder_layer_skip"),
                                        ("sd3", "text_encoder_layer_skip")])
def test_a_family_without_the_skip_refuses_the_key(family, key):
    with pytest.raises(ConfigError) as err:
        model_section(family, **{key: 1})
    assert f"model.{key}: {family} has no layer skip" in str(err.value)


def test_too_large_a_skip_names_the_key():
    pipe = get_family("sd1").build_tiny()  # 2 layers: skip 2 is the embeddings, 3 is past them
    ours("sd1", pipe, text_encoder_layer_skip=2)
    with pytest.raises(ConfigError, match="model.text_encoder_layer_skip: 3 skips past the first layer"):
        ours("sd1", pipe, text_encoder_layer_skip=3)
