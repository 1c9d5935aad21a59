"""Each method on the tiny SD 1.x and SDXL models: training lowers the fixed-noise loss, and the
exported files load back through diffusers' own loaders and reproduce the in-memory modules."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config, in_aligned_memory
from diffusers import DiffusionPipeline

from ot_dist.config.load import validate
from ot_dist.methods.lora import ADAPTER
from ot_dist.train.evaluate import fixed_noise_loss
from ot_dist.train.trainer import Trainer

# family, method, extra config, minimal relative drop of the fixed-noise loss
CASES = [
    ("sd1", "full", {"text_encoder.train": True}, 0.15),
    ("sd1", "lora", {"learning_rate": 2e-3, "lora.rank": 4, "lora.alpha": 8, "text_encoder.train": True}, 0.02),
    ("sd1", "embedding", {"learning_rate": 5e-2, "embedding.vectors": 2}, 0.002),
    ("sdxl", "full", {"text_encoder.train": True, "text_encoder_2.train": True}, 0.15),
    ("sdxl", "lora", {"learning_rate": 2e-3, "lora.rank": 4, "lora.alpha": 2, "text_encoder_2.train": True}, 0.004),
    ("sdxl", "embedding", {"learning_rate": 5e-2}, 0.001),
]


def unet_inputs(pipe, family, seed=0):
    """A fixed UNet input (latents, timestep, text conditioning) for output comparisons."""
    g = torch.Generator().manual_seed(seed)
    config = pipe.unet.config
    latents = torch.randn(2, config.in_channels, 8, 8, generator=g)
    timesteps = torch.tensor([10, 700])
    dim = config.cross_attention_dim
    kwargs = {"encoder_hidden_states": torch.randn(2, 77, dim, generator=g)}
    if family == "sdxl":
        pooled = pipe.text_encoder_2.config.projection_dim
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, pooled, generator=g),
            "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2),
        }
    return latents, timesteps, kwargs


@torch.no_grad()
def unet_output(unet, inputs):
    latents, timesteps, kwargs = inputs
    return unet(latents.to(unet.dtype), timesteps, **kwargs, return_dict=False)[0].float()


@torch.no_grad()
def text_output(tokenizer, encoder, prompt):
    ids = tokenizer(prompt, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    return ids, encoder(ids, output_hidden_states=True).hidden_states[-2]


@pytest.mark.parametrize("family,method,extra,min_drop", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_method_trains_and_exports_loadable_files(tiny_models, shapes_data, tmp_path, family, method, extra, min_drop):
    config = validate(
        base_config(tiny_models[family], shapes_data, tmp_path / "out", family=family, method=method, epochs=3, **extra)
    )
    trainer = Trainer(config, log=lambda *_: None)
    before = fixed_noise_loss(trainer)
    result = trainer.train()
    after = fixed_noise_loss(trainer)
    assert result.steps == 3 * 16 // 4
    assert after < before * (1 - min_drop), f"fixed-noise loss {before:.4f} -> {after:.4f}"

    model, out = trainer.model, tmp_path / "out"
    inputs = unet_inputs(model.pipeline, family)
    base = DiffusionPipeline.from_pretrained(tiny_models[family])
    if method == "full":
        assert {p.name for p in result.exported} == {"model", "model.safetensors"}
        loaded = in_aligned_memory(DiffusionPipeline.from_pretrained(out / "model"))
        torch.testing.assert_close(unet_output(loaded.unet, inputs), unet_output(model.denoiser, inputs), rtol=0, atol=0)
        assert not torch.equal(unet_output(base.unet, inputs), unet_output(model.denoiser, inputs))
        for name, encoder in model.text_encoders.items():
            for key, value in encoder.state_dict().items():
                assert torch.equal(loaded.components[name].state_dict()[key], value), f"{name}.{key}"
        from ot_dist.models.families.sd_single_file import load_single_file

        single = load_single_file(out / "model.safetensors", family, out / "model")
        for key, value in model.denoiser.state_dict().items():
            assert torch.equal(single.unet.state_dict()[key], value), key
    elif method == "lora":
        assert [p.name for p in result.exported] == ["lora.safetensors"]
        before_lora = unet_output(base.unet, inputs)
        base.load_lora_weights(out, weight_name="lora.safetensors")
        torch.testing.assert_close(unet_output(base.unet, inputs), unet_output(model.denoiser, inputs), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(before_lora, unet_output(model.denoiser, inputs), atol=1e-4)
        for name in config.part_names()[1:]:
            if config.part_trains(name):
                tokenizer = base.components[name.replace("text_encoder", "tokenizer")]
                _, mine = text_output(tokenizer, model.text_encoders[name], "a red circle")
                _, theirs = text_output(tokenizer, base.components[name], "a red circle")
                torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6)
        assert model.denoiser.peft_config[ADAPTER].r == 4
    else:
        from safetensors.torch import load_file

        assert [p.name for p in result.exported] == ["embedding.safetensors"]
        saved = load_file(out / "embedding.safetensors")
        token = config.embedding.token
        prompt = f"a photo of {token} on a white background"
        if family == "sdxl":
            base.load_textual_inversion(saved["clip_l"], token=token, text_encoder=base.text_encoder, tokenizer=base.tokenizer)
            base.load_textual_inversion(
                saved["clip_g"], token=token, text_encoder=base.text_encoder_2, tokenizer=base.tokenizer_2
            )
        else:
            base.load_textual_inversion(out / "embedding.safetensors")  # the file names its token
        for encoder_name, tokenizer_name in zip(model.family.text_encoders, model.family.tokenizers):
            # diffusers expands a multi-vector token in the prompt the same way training did
            expanded = base.maybe_convert_prompt(prompt, base.components[tokenizer_name])
            assert expanded == trainer.method.caption(prompt)
            ids_mine, mine = text_output(model.tokenizers[tokenizer_name], model.text_encoders[encoder_name], expanded)
            ids_theirs, theirs = text_output(base.components[tokenizer_name], base.components[encoder_name], expanded)
            assert torch.equal(ids_mine, ids_theirs)
            torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6)
        init = base_embedding_rows(tiny_models[family], family, config.embedding.init_text)
        assert not torch.allclose(saved[list(model.family.embedding_keys.values())[0].format(token=token)][0], init, atol=1e-3), "embedding did not train"


def base_embedding_rows(model_path, family, text):
    pipe = DiffusionPipeline.from_pretrained(model_path)
    ids = pipe.tokenizer(text, add_special_tokens=False).input_ids
    return pipe.text_encoder.get_input_embeddings().weight[ids[0]].detach()


def test_a_token_of_several_vectors_is_lower_case_and_matched_in_any_case(tmp_path):
    """CLIP tokenizers lower-case the prompt; diffusers' maybe_convert_prompt expands TOKEN to TOKEN TOKEN_1 ... only
    when the lower-cased word is the registered token. `<MyTok>` with 3 vectors trained all 3 but gave diffusers'
    pipelines (and ot_dist's own samples) the first alone: it is refused. A caption writing the token in another case
    reads as the token (the tokenizer matches it so), so it is expanded there too, not prepended a second time."""
    from diffusers.loaders.textual_inversion import TextualInversionLoaderMixin

    from ot_dist.errors import ConfigError
    from ot_dist.methods.embedding import EmbeddingMethod
    from ot_dist.models.tiny import tiny_clip_tokenizer

    raw = base_config(tmp_path, tmp_path, tmp_path / "o", method="embedding", **{"embedding.vectors": 3})
    tokenizer = tiny_clip_tokenizer()
    tokenizer.add_tokens(["<MyTok>", "<MyTok>_1", "<MyTok>_2"])
    assert TextualInversionLoaderMixin._maybe_convert_prompt(None, "a <MyTok>", tokenizer) == "a <MyTok>"
    with pytest.raises(ConfigError, match="embedding.token: '<MyTok>' with 3 vectors must be lower case"):
        validate({**raw, "embedding": {**raw["embedding"], "token": "<MyTok>"}})
    validate({**raw, "embedding": {"token": "<MyTok>", "vectors": 1}})  # one vector: nothing to expand

    method = EmbeddingMethod(validate({**raw, "embedding": {**raw["embedding"], "token": "<mytok>"}}))
    tokenizer = tiny_clip_tokenizer()
    tokenizer.add_tokens(method.token_strings())
    for prompt in ("a photo of <mytok>, red", "a photo of <MyTok>, red"):
        expanded = TextualInversionLoaderMixin._maybe_convert_prompt(None, prompt.lower(), tokenizer)
        assert method.caption(prompt) == expanded == "a photo of <mytok> <mytok>_1 <mytok>_2, red"
