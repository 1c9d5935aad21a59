"""Sana on the family contract: text encoding against SanaPipeline.encode_prompt, the objective against the formulas of
diffusers' train_dreambooth_lora_sana.py (the DC-AE's deterministic latent x 0.41407, x_t = (1 - s) x + s n,
target n - x, the raw timestep in) at the model's flow_shift, training (full: the transformer alone changes; LoRA:
the file SanaPipeline.load_lora_weights reads gives the trained outputs) and samples equal to the pipeline's.
The 2-rank fsdp comparison rides in PixArt-α's launch (tests/test_family_strategies.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.trainer import Trainer

SHIFT = 3.0  # the tiny model's scheduler: DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True)
SCALE = 0.41407  # the DC-AE's scaling_factor


def quiet(*_):
    pass


def trainer_for(model, data, out, method="full", **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, **overrides}
    return Trainer(validate(base_config(model, data, out, family="sana", method=method, **settings)), log=quiet)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    """Captions lowercased as the pipeline does (Gemma's tokens are case-sensitive), right-padded with the mask (the
    pipeline sets padding_side itself, whatever the tokenizer's config says)."""
    model = trainer_for(family_models["sana"], shapes_data, tmp_path / "o").model
    captions = ["A Red Circle", "a big green square on a white background"]
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32 and options["complex_human_instruction"] is None
    model.tokenizers["tokenizer"].padding_side = "left"  # as some tokenizer configs say: Sana pads right regardless
    with torch.no_grad():
        tokens = model.family.tokenize(model.tokenizers, captions)
        ours = model.family.encode_text(model.text_encoders, tokens)
        hidden, mask, _, _ = model.pipeline.encode_prompt(captions, do_classifier_free_guidance=False,
                                                          max_sequence_length=options["max_sequence_length"],
                                                          complex_human_instruction=None)
    assert tokens["text_encoder"][:, 0].eq(model.tokenizers["tokenizer"].bos_token_id).all()
    assert torch.equal(ours["mask"], mask.long()) and 0 < mask.sum() < mask.numel()  # padding is masked
    torch.testing.assert_close(ours["hidden"], hidden)


def test_objective_follows_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """train_dreambooth_lora_sana.py: model_input = vae.encode(pixels).latent x scaling_factor, noisy = (1 - s) x + s n,
    the transformer called with the raw timestep, the mask and the prompt's hidden states, MSE against n - x; s is
    the sample's logit-normal u shifted by the scheduler's flow_shift (3u / (1 + 2u))."""
    trainer = trainer_for(family_models["sana"], shapes_data, tmp_path / "o")
    model = trainer.model
    assert model.objective.shift == SHIFT
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    loss = diffusion_loss(model, batch, 1, 0)
    shape = (8, batch["pixels"].shape[-2] // 32, batch["pixels"].shape[-1] // 32)
    noise, sigmas = [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        torch.randn(shape, generator=g)  # the posterior's draw: unused, the DC-AE is deterministic
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(SHIFT * u / (1 + (SHIFT - 1) * u))
    noise = torch.stack(noise)
    with torch.no_grad():
        x = model.vae.encode(batch["pixels"]).latent * SCALE
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        hidden, mask, _, _ = model.pipeline.encode_prompt(batch["caption"], do_classifier_free_guidance=False,
                                                          max_sequence_length=32, complex_human_instruction=None)
        out = model.denoiser(hidden_states=(1 - sigma) * x + sigma * noise, encoder_hidden_states=hidden,
                             encoder_attention_mask=mask, timestep=sigma.flatten() * 1000, return_dict=False)[0]
    torch.testing.assert_close(loss.detach(), torch.nn.functional.mse_loss(out, noise - x), rtol=1e-5, atol=1e-6)


def test_every_sharding_unit_of_sana_1600m_is_a_few_percent():
    """Sana 1600M's published transformer config on the meta device (the memory table's build), wrapped with the
    family's shard_units as the fsdp strategy does: 20 blocks of under 5 % each, the root's remainder (embedders,
    caption projection) under 3 %. Gemma-2-2B: 26 layers of 3 % each and its embedding table (23 %, one tensor: no
    unit choice splits it) a unit of its own, so that the root, which FSDP2 keeps gathered for the whole step, holds
    only the final norm."""
    from ot_dist.memory.sharding import sharding
    from ot_dist.memory.table import build_components
    from ot_dist.models.families.registry import get_family

    components = build_components(get_family("sana").memory_reference)
    units = sharding(components["transformer"], get_family("sana").shard_units["transformer"])
    assert abs(units.parameters - 1.6e9) / 1.6e9 < 0.01  # the model card's 1.6 B
    assert len(units.unit_parameters) == 20 and units.largest_fraction < 0.05
    assert units.root_parameters / units.parameters < 0.03

    gemma = components["text_encoder"]
    units = sharding(gemma, get_family("sana").shard_units["text_encoder"])
    embedding = gemma.embed_tokens.weight.numel()
    assert units.unit_parameters[0] == embedding and embedding / units.parameters > 0.2
    assert len(units.unit_parameters) == 1 + 26 and max(units.unit_parameters[1:]) / units.parameters < 0.05
    assert units.root_parameters == gemma.norm.weight.numel()  # the final norm alone


def test_gemma_sharded_by_the_family_units_encodes_and_trains_as_unsharded(one_rank_group):
    """The tiny Gemma under FSDP2 with the family's text-encoder units (the embedding one of them), as the fsdp
    strategy wraps a trained text encoder, in a 1-rank gloo group: the family's conditioning and the embedding's
    gradient equal the unwrapped model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ot_dist.models.families.registry import get_family
    from ot_dist.parallel.fsdp import wrap_units

    family = get_family("sana")
    pipeline = family.build_tiny()
    tokens = family.tokenize({"tokenizer": pipeline.tokenizer}, ["a red dot"])
    plain, sharded = pipeline.text_encoder, copy.deepcopy(pipeline.text_encoder)
    mesh = init_device_mesh("cpu", (1,))
    units = wrap_units(sharded, family.shard_units["text_encoder"])
    assert units[0] is sharded.embed_tokens
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    results = []
    for encoder in (plain, sharded):
        hidden = family.encode_text({"text_encoder": encoder}, tokens)["hidden"]
        hidden.square().mean().backward()
        grad = encoder.embed_tokens.weight.grad
        results.append((hidden.detach(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad))
    torch.testing.assert_close(results[1], results[0])


def test_bucket_step_must_follow_the_32_px_grid(family_models, shapes_data, tmp_path):
    from ot_dist.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="multiple of 32"):
        trainer_for(family_models["sana"], shapes_data, tmp_path / "o", **{"data.bucket_step": 48})


def outputs(transformer, text_encoder, tokenizer, family):
    """The transformer's prediction for fixed noisy latents and a caption, the text encoded by `text_encoder`."""
    torch.manual_seed(0)
    noisy, t = torch.randn(1, 8, 2, 2), torch.tensor([500.0])
    conditioning = family.encode_text({"text_encoder": text_encoder}, family.tokenize({"tokenizer": tokenizer},
                                                                                      ["a red dot"]))
    with torch.no_grad():
        return family.predict(transformer, noisy, t, conditioning, {})


def test_full_finetune_trains_the_transformer_and_the_export_loads_in_the_pipeline(family_models, shapes_data,
                                                                                   tmp_path):
    from diffusers import SanaPipeline

    base = family_models["sana"]
    trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-3).train()
    export = tmp_path / "o" / "model"
    assert not (tmp_path / "o" / "model.safetensors").exists()  # no single-file layout: the folder only
    for part, trained in (("transformer", True), ("vae", False), ("text_encoder", False)):
        name = "model.safetensors" if part == "text_encoder" else "diffusion_pytorch_model.safetensors"
        before, after = load_file(base / part / name), load_file(export / part / name)
        changed = max((before[k].float() - after[k].float()).abs().max().item() for k in before)
        assert (changed > 1e-4) if trained else (changed == 0), (part, changed)
    loaded = SanaPipeline.from_pretrained(export, local_files_only=True)
    assert type(loaded.scheduler).__name__ == "DPMSolverMultistepScheduler"  # the model's own scheduler kept


def test_lora_file_loads_in_the_pipeline_and_samples_equal_it(family_models, shapes_data, tmp_path):
    """One LoRA run (attention and the Mix-FFN's pointwise convolutions): its file through
    SanaPipeline.load_lora_weights gives the trained transformer's outputs, and its end-of-training sample equals
    SanaPipeline's on the base model with that file (flow_euler at the model's shift, the caption as training
    encodes it). The default preset is the training script's --lora_layers default."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 64, "height": 64}
    trainer = trainer_for(family_models["sana"], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"lora.rank": 4, "lora.alpha": 2, "lora.preset": "attention_mlp",
                                                 "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0].removesuffix(".0").rsplit(".", 1)[-1] for k in saved}
    assert modules == {"to_q", "to_k", "to_v", "to_out", "conv_inverted", "conv_point"}
    assert family.denoiser_lora_presets["default"] == ("to_q", "to_k", "to_v")
    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], family)

    pipe = SanaPipeline.from_pretrained(family_models["sana"], local_files_only=True)
    base = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    assert (base - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    again = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, family)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=SHIFT)
    image = pipe(prompt="a red circle", width=64, height=64, num_inference_steps=3, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, complex_human_instruction=None,
                 use_resolution_binning=False, output_type="pil").images[0]
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1


def test_gemma_lora_loads_back_through_peft_and_merges(family_models, shapes_data, tmp_path):
    """SanaPipeline's LoRA loader reads the transformer only; a file with a trained Gemma LoRA holds it under
    `text_encoder.`, which load_peft_lora applies: the pipeline then gives the trained model's outputs, as does the
    folder `ot-dist lora merge` writes."""
    from diffusers import SanaPipeline

    from ot_dist.lora_tools.peft_load import load_peft_lora

    trainer = trainer_for(family_models["sana"], shapes_data, tmp_path / "o", method="lora", max_steps=2,
                          learning_rate=1e-2, **{"text_encoder.train": True})
    trainer.train()
    model = trainer.model
    model.text_encoders["text_encoder"].eval()
    trained = outputs(model.denoiser, model.text_encoders["text_encoder"], model.tokenizers["tokenizer"], model.family)
    pipe = SanaPipeline.from_pretrained(family_models["sana"], local_files_only=True)
    assert load_peft_lora(pipe, tmp_path / "o" / "lora.safetensors") == ["text_encoder", "transformer"]
    again = outputs(pipe.transformer, pipe.text_encoder, pipe.tokenizer, model.family)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)
    # ot-dist lora merge reads the file too (Gemma and transformer modules)
    from ot_dist.lora_tools.merge import merge_command

    merged_dir = merge_command(str(family_models["sana"]), "sana", [str(tmp_path / "o" / "lora.safetensors")], [1.0],
                               str(tmp_path / "merged"), "diffusers", None, "float32", log=quiet)
    merged = SanaPipeline.from_pretrained(merged_dir, local_files_only=True)
    again = outputs(merged.transformer, merged.text_encoder, merged.tokenizer, model.family)
    torch.testing.assert_close(again, trained, rtol=1e-4, atol=1e-5)


def test_layer_skip_takes_an_earlier_gemma_layer_through_the_final_norm_in_training_and_samples(
        family_models, shapes_data, tmp_path):
    """model.text_encoder_layer_skip: 1 (OneTrainer's text_encoder_layer_skip): the conditioning of Gemma cut after
    its first layer, then its final norm; samples get that conditioning too (SanaPipeline knows no layer skip): the
    sample equals the pipeline fed the cut model's prompt embeddings."""
    import copy

    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline
    from PIL import Image

    prompt = {"prompt": "a red circle", "seed": 3, "steps": 2, "guidance_scale": 4.0, "width": 64, "height": 64}
    trainer = trainer_for(family_models["sana"], shapes_data, tmp_path / "o", method="lora", max_steps=1,
                          learning_rate=1e-2, **{"model.text_encoder_layer_skip": 1, "sampling.prompts": [prompt]})
    trainer.train()
    model = trainer.model
    pipe = SanaPipeline.from_pretrained(family_models["sana"], local_files_only=True)
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    cut = copy.deepcopy(pipe.text_encoder)
    cut.layers, cut.config.num_hidden_layers = cut.layers[:1], 1  # the tiny Gemma has 2

    def encoded(text):
        tokens = model.family.tokenize(model.tokenizers, [text])
        with torch.no_grad():
            hidden = cut(tokens["text_encoder"], attention_mask=tokens["text_encoder_mask"], use_cache=False)[0]
        return hidden, tokens["text_encoder_mask"]

    hidden, mask = encoded("a red circle")
    ours = model.family.encode_text({"text_encoder": pipe.text_encoder}, model.family.tokenize(model.tokenizers,
                                                                                               ["a red circle"]))
    torch.testing.assert_close(ours["hidden"], hidden)
    with torch.no_grad():  # the skip matters: the whole Gemma's output differs
        whole = pipe.text_encoder(*(model.family.tokenize(model.tokenizers, ["a red circle"]).values()))[0]
    assert (whole - hidden).abs().max() > 1e-3

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    negative, negative_mask = encoded("")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=SHIFT)
    image = pipe(prompt_embeds=hidden, prompt_attention_mask=mask, negative_prompt=None,
                 negative_prompt_embeds=negative, negative_prompt_attention_mask=negative_mask, width=64, height=64,
                 num_inference_steps=2, guidance_scale=4.0, generator=torch.Generator().manual_seed(3),
                 use_resolution_binning=False, output_type="pil").images[0]
    assert np.abs(np.asarray(Image.open(sample).convert("RGB")).astype(int) - np.asarray(image).astype(int)).max() <= 1
