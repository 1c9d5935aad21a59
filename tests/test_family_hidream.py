"""HiDream-I1 on the family contract: text encoding against HiDreamImagePipeline.encode_prompt (CLIP-L / CLIP-G
pooled, T5, every Llama layer), the objective against diffusers' train_dreambooth_lora_hidream.py step (its
transformer loaded with force_inference_output=True, in train mode; raw t in, the output negated, target n - x), the
mixture of experts (gradients reach the routed experts and the gate, which the script's no_grad inference branch
never trains), training (full: the transformer alone changes, the export reloads through from_pretrained; LoRA: the
file HiDreamImagePipeline.load_lora_weights reads, ComfyUI's HiDream key rule), ComfyUI's diffusion-model file and
samples equal to the pipeline's.
The 2-rank fsdp comparison rides in PixArt-α's launch (tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from family_training import family_trainer, first_batch, quiet
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "hidream"
SHIFT = 3.0  # the tiny model's FlowMatchEulerDiscreteScheduler (the training script forces 3.0 too)
SCALE, OFFSET = 0.3611, 0.1159  # the Flux VAE's scaling and shift factors


trainer_for = partial(family_trainer, FAMILY)


def test_text_conditioning_equals_the_pipelines_encode_prompt(family_models, shapes_data, tmp_path):
    model = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o").model
    captions = ["a red circle on a blue background", "a big green square"]
    options = model.family.pipeline_call_options(model.pipeline)
    assert options["max_sequence_length"] == 32  # 128, bounded by the tiny T5 tokenizer's model_max_length
    with torch.no_grad():
        tokens = model.family.tokenize(model.tokenizers, captions)
        ours = model.family.encode_text(model.text_encoders, tokens)
        t5, _, llama, _, pooled, _ = model.pipeline.encode_prompt(captions, device="cpu",
                                                                  do_classifier_free_guidance=False, **options)
    llama_tokenizer = model.tokenizers["tokenizer_4"]
    assert tokens["text_encoder_4"][:, 0].eq(llama_tokenizer.bos_token_id).all()
    assert tokens["text_encoder_4"][:, -1].eq(llama_tokenizer.eos_token_id).all()  # padded with the end token
    assert 0 < tokens["text_encoder_4_mask"].sum() < tokens["text_encoder_4_mask"].numel()
    assert ours["llama"].shape[:2] == (2, model.text_encoders["text_encoder_4"].config.num_hidden_layers)
    torch.testing.assert_close(ours["pooled"], pooled)
    torch.testing.assert_close(ours["t5"], t5)
    torch.testing.assert_close(ours["llama"].transpose(0, 1), llama)


def script_transformer(folder):
    """The transformer as train_dreambooth_lora_hidream.py loads it: force_inference_output=True, train mode."""
    from diffusers import HiDreamImageTransformer2DModel

    transformer = HiDreamImageTransformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                                 force_inference_output=True, local_files_only=True)
    return transformer.train()


def test_objective_equals_the_diffusers_training_script(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against the script's step written out with the same draws: (x - shift) x scale,
    x_t = (1 - s) x + s n, the transformer at the raw timestep with the pipeline's prompt embeddings, its output
    negated, MSE against n - x; s is the logit-normal u at the scheduler's shift (3u / (1 + 2u))."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model = trainer.model
    assert model.objective.shift == SHIFT
    batch = first_batch(trainer)
    pixels = batch["pixels"]
    shape = (16, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(SHIFT * u / (1 + (SHIFT - 1) * u))
    eps, noise = torch.stack(eps), torch.stack(noise)
    transformer = script_transformer(family_models[FAMILY])
    with torch.no_grad():
        posterior = model.vae.encode(pixels).latent_dist
        x = (posterior.mean + posterior.std * eps - OFFSET) * SCALE
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1)
        t5, _, llama, _, pooled, _ = model.pipeline.encode_prompt(list(batch["caption"]), device="cpu",
                                                                  do_classifier_free_guidance=False,
                                                                  max_sequence_length=32)
        pred = transformer(hidden_states=(1 - sigma) * x + sigma * noise, encoder_hidden_states_t5=t5,
                           encoder_hidden_states_llama3=llama, pooled_embeds=pooled, timesteps=sigma.flatten() * 1000,
                           return_dict=False)[0] * -1
        expected = torch.mean((pred.float() - (noise - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(ours.detach(), expected, rtol=1e-5, atol=1e-6)


def test_gradients_reach_the_routed_experts_and_the_gate(family_models):
    """The family's prediction (the model in eval mode, as ot_dist trains it) runs the MoE's differentiable branch: the
    routed experts and the gate get gradients and the prediction equals the script's (force_inference_output, whose
    no_grad moe_infer leaves them without any). Without grad, predict takes the pipeline's own branch."""
    from diffusers import HiDreamImagePipeline

    from ot_dist.models.families.registry import get_family

    family = get_family(FAMILY)
    pipe = HiDreamImagePipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    tokens = family.tokenize({k: getattr(pipe, k) for k in family.tokenizers}, ["a red dot", "a big blue ring"])
    with torch.no_grad():
        conditioning = family.encode_text({k: getattr(pipe, k) for k in family.text_encoders}, tokens)
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, 8, 6), torch.tensor([300.0, 800.0])
    script = script_transformer(family_models[FAMILY])

    def moe_grads(transformer):
        moe = transformer.single_stream_blocks[0].block.ff_i
        return [moe.gate.weight.grad] + [p.grad for p in moe.experts.parameters()]

    ours = family.predict(pipe.transformer, noisy, t, conditioning, {})
    ours.square().mean().backward()
    theirs = -script(hidden_states=noisy, timesteps=t, encoder_hidden_states_t5=conditioning["t5"],
                     encoder_hidden_states_llama3=conditioning["llama"].transpose(0, 1),
                     pooled_embeds=conditioning["pooled"], return_dict=False)[0]
    theirs.square().mean().backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert all(g is not None and g.abs().sum() > 0 for g in moe_grads(pipe.transformer))
    assert all(g is None for g in moe_grads(script))
    assert not pipe.transformer.training  # the model's mode untouched
    with torch.no_grad():
        torch.testing.assert_close(family.predict(pipe.transformer, noisy, t, conditioning, {}), ours.detach(),
                                   rtol=1e-5, atol=1e-6)


def outputs(pipe, family, side=(8, 8)):
    """The family's prediction by `pipe`'s transformer for fixed noisy latents and two captions."""
    tokens = family.tokenize({k: getattr(pipe, k) for k in family.tokenizers}, ["a red dot", "a big blue ring"])
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, *side), torch.tensor([300.0, 800.0])
    with torch.no_grad():
        conditioning = family.encode_text({k: getattr(pipe, k) for k in family.text_encoders}, tokens)
        return family.predict(pipe.transformer, noisy, t, conditioning, {})


def test_full_finetune_lowers_the_loss_trains_the_experts_and_the_export_reloads(family_models, shapes_data,
                                                                                   tmp_path):
    """Three epochs over the demo set from the latent and text caches (the 4-D Llama stack cached per caption): the
    loss falls; the transformer alone changes, every routed expert and gate with it; the export reloads through
    HiDreamImagePipeline.from_pretrained with the trained outputs; beside it ComfyUI's diffusion-model file: the
    folder's transformer key for key (bare diffusers names, ComfyUI's HiDream detection key among them), which
    diffusers' from_single_file reads."""
    from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", epochs=3, batch_size=4, learning_rate=1e-3,
                          output_dtype="float32", **{"data.cache_text": True, "data.cache_latents": True})
    per_epoch = np.array(trainer.train().losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.1, f"loss did not fall: {per_epoch}"
    export = tmp_path / "o" / "model"
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        name = "diffusion_pytorch_model.safetensors" if part in ("transformer", "vae") else "model.safetensors"
        before, after = load_file(base / part / name), load_file(export / part / name)
        changed = {k: (before[k].float() - after[k].float()).abs().max().item() for k in before}
        if part == "transformer":
            # every routed expert and every gate moved (the script's path would leave them as they were)
            for key in [k for k in before if ".experts." in k or ".gate." in k]:
                assert changed[key] > 0, key
        else:
            assert max(changed.values()) == 0, part
    loaded = HiDreamImagePipeline.from_pretrained(export, local_files_only=True)
    family = trainer.model.family
    trained = outputs(trainer.model.pipeline, family)
    torch.testing.assert_close(outputs(loaded, family), trained, rtol=1e-5, atol=1e-6)
    single = load_file(tmp_path / "o" / "model.safetensors")
    folder_state = loaded.transformer.state_dict()
    assert "caption_projection.0.linear.weight" in single  # comfy/model_detection.py's HiDream key
    assert single.keys() == folder_state.keys() and all(torch.equal(single[k], v) for k, v in folder_state.items())
    read = HiDreamImageTransformer2DModel.from_single_file(str(tmp_path / "o" / "model.safetensors"), config=str(export),
                                                           subfolder="transformer", local_files_only=True)
    assert all(torch.equal(v, folder_state[k]) for k, v in read.state_dict().items())


def test_comfyuis_diffusion_model_file_loads_to_the_same_outputs(family_models, tmp_path):
    """A transformer in ComfyUI's layout (keys under model.diffusion_model., as ComfyUI saves them; bfloat16, as
    Comfy-Org's fp16 / bf16 files) with `model.config` = the diffusers folder predicts as the folder's transformer with
    the same weights rounded to the file's dtype; a key the config's transformer lacks is named before loading."""
    from diffusers import HiDreamImagePipeline
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    folder = HiDreamImagePipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        for t in folder.transformer.state_dict().values():
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    state = {"model.diffusion_model." + k: v.to(torch.bfloat16).contiguous()
             for k, v in folder.transformer.state_dict().items()}
    save_file(state, tmp_path / "hidream.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "hidream.safetensors"), config=str(base)))
    assert torch.equal(outputs(loaded.pipeline, loaded.family), outputs(folder, loaded.family))
    state["model.diffusion_model.double_stream_blocks.0.block.ff_i.experts.9.w1.weight"] = state[
        "model.diffusion_model.double_stream_blocks.0.block.ff_i.experts.0.w1.weight"].clone()
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match="unexpected 1 key.*experts.9.w1.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(base)))


def test_lora_file_loads_in_the_pipeline_follows_comfyuis_rule_and_samples_equal_it(family_models, shapes_data,
                                                                                     tmp_path):
    """A LoRA run over attention and the feed-forwards (the experts' too), three epochs of the demo set: the loss falls;
    its file, in the diffusers layout, through
    HiDreamImagePipeline.load_lora_weights gives the trained transformer's outputs; each module is named as ComfyUI's
    HiDream rule maps it (comfy/lora.py model_lora_keys_unet: `transformer.<key>` for each `.weight` key of its
    model, whose names are diffusers'); the end-of-training sample equals HiDreamImagePipeline's with that file (same
    seed, flow_euler at the model's shift, the requested size kept)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline
    from PIL import Image

    from ot_dist.models.families.hidream import area_keeping_sample_size

    base = family_models[FAMILY]
    prompt = {"prompt": "a red circle", "seed": 3, "steps": 3, "guidance_scale": 4.0, "width": 64, "height": 48}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", epochs=3, batch_size=4, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "lora.preset": "attention_mlp",
                                                     "sampling.prompts": [prompt]})
    per_epoch = np.array(trainer.train().losses).reshape(3, -1).mean(axis=1)
    assert per_epoch[-1] < per_epoch[0] - 0.05, f"loss did not fall: {per_epoch}"
    model, family = trainer.model, trainer.model.family
    assert family.denoiser_lora_presets["default"] == ("to_k", "to_q", "to_v", "to_out")  # the script's default
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert {m.rsplit(".", 1)[-1] for m in modules} == {"to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t",
                                                       "to_out_t", "w1", "w2", "w3"}
    assert any(".ff_i.experts.3.w2" in m for m in modules)
    keys = {f"transformer.{k[:-len('.weight')]}" for k in
            load_file(base / "transformer" / "diffusion_pytorch_model.safetensors") if k.endswith(".weight")}
    assert modules <= keys and not any(k.endswith(".alpha") for k in saved)
    layers = dict(model.denoiser.named_modules())
    for module in modules:  # up @ down at ComfyUI's strength 1 is the trained change
        layer = layers[module[len("transformer."):]]
        change = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        torch.testing.assert_close(saved[f"{module}.lora_B.weight"] @ saved[f"{module}.lora_A.weight"],
                                   change.detach(), rtol=1e-5, atol=1e-7)
    trained = outputs(model.pipeline, family, side=(8, 6))
    pipe = HiDreamImagePipeline.from_pretrained(base, local_files_only=True)
    assert (outputs(pipe, family, side=(8, 6)) - trained).abs().max() > 1e-4  # the LoRA changed the output
    pipe.load_lora_weights(tmp_path / "o" / "lora.safetensors")
    torch.testing.assert_close(outputs(pipe, family, side=(8, 6)), trained, rtol=1e-5, atol=1e-6)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=SHIFT)
    pipe.default_sample_size = area_keeping_sample_size(64, 48, pipe.vae_scale_factor)
    image = pipe(prompt="a red circle", width=64, height=48, num_inference_steps=3, guidance_scale=4.0,
                 generator=torch.Generator().manual_seed(3), max_sequence_length=32, output_type="pil").images[0]
    assert image.size == (64, 48)
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert np.abs(ours - np.asarray(image).astype(int)).max() <= 1


def test_the_pipelines_area_rescaling_keeps_each_requested_size():
    """HiDreamImagePipeline scales every request to its default area; the default ot_dist sets keeps the size (the
    pipeline's own arithmetic, for sides on the 16 px grid)."""
    import math

    from ot_dist.models.families.hidream import area_keeping_sample_size

    for width, height in ((64, 48), (1024, 1024), (1216, 832), (832, 1216), (48, 1024), (1344, 768), (880, 1168)):
        side = area_keeping_sample_size(width, height, 8)
        scale = math.sqrt((side * 8) ** 2 / (width * height))
        assert (int(width * scale // 16 * 16), int(height * scale // 16 * 16)) == (width, height)


def test_a_non_square_latent_over_the_padding_trains_and_samples_unpadded(family_models):
    """The transformer pads a non-square latent to max_seq tokens (1 MP; the tiny one's 8 x 8), so a non-square bucket
    over that fails inside it. Such a latent is handed over as OneTrainer trains every bucket: the transformer's own
    token packing (its patchify's first h x w tokens and ids) unpadded with a mask of ones; the prediction is the
    negated output. The pipeline samples that size too (its own call fails there)."""
    from diffusers import HiDreamImagePipeline

    pipe = HiDreamImagePipeline.from_pretrained(family_models[FAMILY], local_files_only=True)
    family, transformer = pipe_family(), pipe.transformer.eval()
    tokens = family.tokenize({name: getattr(pipe, name) for name in family.tokenizers}, ["a red circle"] * 2)
    noisy = torch.randn(2, 16, 16, 24, generator=torch.Generator().manual_seed(0))  # 8 x 12 = 96 tokens > 64
    assert (16 // 2) * (24 // 2) > transformer.max_seq
    with torch.no_grad():
        conditioning = family.encode_text({name: getattr(pipe, name) for name in family.text_encoders}, tokens)
        ours = family.predict(transformer, noisy, torch.tensor([500.0, 250.0]), conditioning, {})
        wide = type(transformer)(**{**transformer.config, "max_resolution": (32, 32)})  # room for the padding
        packed, _, sizes, ids = wide.patchify(noisy)
        theirs = transformer(hidden_states=packed[:, :96], hidden_states_masks=torch.ones(2, 96), img_sizes=sizes,
                             img_ids=ids[:, :96], timesteps=torch.tensor([500.0, 250.0]),
                             encoder_hidden_states_t5=conditioning["t5"],
                             encoder_hidden_states_llama3=conditioning["llama"].transpose(0, 1),
                             pooled_embeds=conditioning["pooled"], return_dict=False)[0]
    torch.testing.assert_close(ours, -theirs)
    arguments = family.sampling_arguments(pipe, {"prompt": "a red circle", "width": 192, "height": 128,
                                                 "num_inference_steps": 1, "guidance_scale": 1.0})
    image = pipe(**arguments, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert image.shape == (1, 3, 128, 192) and torch.isfinite(image).all()


def pipe_family():
    from ot_dist.models.families.registry import get_family

    return get_family(FAMILY)


def test_a_folder_without_its_llama_is_refused_with_the_step_that_completes_it(family_models, tmp_path):
    """HiDream-ai's folders leave the Llama out (the pipeline takes it as an argument): such a folder is refused by
    name, with how to save a complete one."""
    import json
    import shutil

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.loading import load_model

    folder = tmp_path / "hidream"
    shutil.copytree(family_models[FAMILY], folder, ignore=shutil.ignore_patterns("text_encoder_4", "tokenizer_4"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder_4": [None, None],
                                                         "tokenizer_4": [None, None]}))
    with pytest.raises(InputFileError, match="no Llama.*text_encoder_4=LlamaForCausalLM"):
        load_model(ModelConfig(family=FAMILY, path=str(folder)))


def test_llama_sharded_by_the_family_units_encodes_and_trains_as_unsharded(one_rank_group):
    """The tiny Llama under FSDP2 with the family's text-encoder units (its embedding table, layers and lm_head each a
    unit), as the fsdp strategy wraps a trained text encoder, in a 1-rank gloo group: the family's conditioning (every
    layer's hidden states, the head on one position) and the embedding's gradient equal the unwrapped model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ot_dist.models.families.registry import get_family
    from ot_dist.parallel.fsdp import wrap_units

    family = get_family(FAMILY)
    pipeline = family.build_tiny()
    tokens = family.tokenize({k: getattr(pipeline, k) for k in family.tokenizers}, ["a red dot", "a big blue ring"])
    plain = pipeline.text_encoder_4.eval()
    sharded = copy.deepcopy(plain)
    others = {k: getattr(pipeline, k).eval() for k in family.text_encoders[:3]}
    mesh = init_device_mesh("cpu", (1,))
    units = wrap_units(sharded, family.shard_units["text_encoder_4"])
    assert units[0] is sharded.model.embed_tokens and units[-1] is sharded.lm_head
    assert len(units) == 2 + len(sharded.model.layers)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    results = []
    for encoder in (plain, sharded):
        llama = family.encode_text({**others, "text_encoder_4": encoder}, tokens)["llama"]
        llama.square().mean().backward()
        grad = encoder.model.embed_tokens.weight.grad
        results.append((llama.detach(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad))
    torch.testing.assert_close(results[1], results[0])


def test_t5_llama_and_transformer_lora_loads_through_peft_and_merges(family_models, shapes_data, tmp_path):
    """HiDreamImagePipeline's LoRA loader reads the transformer only; a file with trained T5 and Llama LoRAs holds
    them under the names ComfyUI maps for HiDream (comfy/lora.py model_lora_keys_clip on its HiDreamTEModel:
    `lora_te3_<T5 path with _>`, T5 being its third text encoder, and `text_encoders.<key>` for each weight key of its
    Llama, `llama.transformer.model.<transformers' path under model.>`), which load_peft_lora applies: the pipeline
    then gives the trained model's outputs, as does the folder `ot-dist lora merge` writes."""
    from diffusers import HiDreamImagePipeline

    from ot_dist.lora_tools.merge import merge_command
    from ot_dist.lora_tools.peft_load import load_peft_lora

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"text_encoder_3.train": True, "text_encoder_4.train": True})
    trainer.train()
    model = trainer.model
    for name in ("text_encoder_3", "text_encoder_4"):
        model.text_encoders[name].eval()
    trained = outputs(model.pipeline, model.family)
    pipe = HiDreamImagePipeline.from_pretrained(base, local_files_only=True)
    assert (outputs(pipe, model.family) - trained).abs().max() > 1e-4
    saved = {k.rsplit(".lora_", 1)[0].removesuffix(".alpha") for k in load_file(tmp_path / "o" / "lora.safetensors")}
    linears = {name: [path for path, module in getattr(pipe, name).named_modules()
                      if isinstance(module, torch.nn.Linear) and path != "lm_head"]
               for name in ("text_encoder_3", "text_encoder_4")}
    comfy = {"lora_te3_" + path.replace(".", "_") for path in linears["text_encoder_3"]} | {
        "text_encoders.llama.transformer." + path for path in linears["text_encoder_4"]}
    text = {m for m in saved if not m.startswith("transformer.")}
    assert text and text <= comfy, sorted(text - comfy)[:3]
    assert {m[:9] for m in text} == {"lora_te3_", "text_enco"}  # both encoders are in the file
    assert load_peft_lora(pipe, tmp_path / "o" / "lora.safetensors") == ["text_encoder_3", "text_encoder_4",
                                                                           "transformer"]
    torch.testing.assert_close(outputs(pipe, model.family), trained, rtol=1e-4, atol=1e-5)
    merged = merge_command(str(base), FAMILY, [str(tmp_path / "o" / "lora.safetensors")], [1.0], str(tmp_path / "m"),
                           "diffusers", None, "float32", log=quiet)
    merged = HiDreamImagePipeline.from_pretrained(merged, local_files_only=True)
    torch.testing.assert_close(outputs(merged, model.family), trained, rtol=1e-4, atol=1e-5)
