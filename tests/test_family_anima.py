"""Anima on the family contract: the conditioning against diffusers' modular text steps (AnimaTextEncoderStep's
encode_prompt, then AnimaTextConditioningStep: Qwen3's last hidden states through the adapter queried by T5 ids), the
objective against OneTrainer's BaseAnimaSetup.predict written out for one batch (there is no diffusers training
script: per-channel (x - mean) / std, x_t = (1 - s) x + s n, the transformer on one-frame latents at s with a zero
padding mask, MSE against n - x), training (full: the transformer alone moves and the export reloads through diffusers'
ModularPipeline.from_pretrained; LoRA: the file AnimaModularPipeline.load_lora_weights reads) and samples equal to
diffusers' AnimaAutoBlocks with the same seed. The 2-rank comparisons ride in an existing launch
(tests/test_family_strategies.py)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from family_training import family_trainer, first_batch, losses_around_training
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss

FAMILY = "anima"
CAPTIONS = ["a red circle on a blue background", "a big yellow square", ""]


trainer_for = partial(family_trainer, FAMILY)


def modular_prompt_embeds(pipeline, captions, max_sequence_length=32):
    """What diffusers' AnimaAutoBlocks feed the transformer for `captions`: its text step (both tokenizers padded to
    the longest caption, Qwen3's last hidden state zeroed at the padding), then its conditioning step."""
    from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    components, cpu = pipeline.modular(), torch.device("cpu")
    encoded = AnimaTextEncoderStep.encode_prompt(components, list(captions), prepare_unconditional_embeds=False,
                                                 max_sequence_length=max_sequence_length, device=cpu)
    return AnimaTextConditioningStep._condition_prompt_embeds(
        components, encoded["qwen_prompt_embeds"], encoded["qwen_attention_mask"], encoded["t5_input_ids"],
        encoded["t5_attention_mask"], cpu, torch.float32, torch.float32)


def test_text_conditioning_equals_the_modular_pipelines_text_steps(family_models, shapes_data, tmp_path):
    """Ours pads both tokenizations to the maximum (as OneTrainer); the pipeline pads to the longest: the adapter's
    output is the same, zero past each caption's T5 tokens, the empty caption included."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model = trainer.model
    assert model.family.pipeline_call_options(model.pipeline)["max_sequence_length"] == 32  # the tiny tokenizers'
    with torch.no_grad():
        tokens = model.family.tokenize(model.tokenizers, CAPTIONS)
        ours = model.family.encode_text(model.text_encoders, tokens)
        theirs = modular_prompt_embeds(model.pipeline, CAPTIONS)
    assert set(ours) == {"hidden"}
    lengths = tokens["text_conditioner_mask"].sum(1).tolist()
    assert len(set(lengths)) == 3 and tokens["text_encoder_mask"][2].sum() == 0  # padded captions, one empty
    assert ours["hidden"].shape == theirs.shape == (3, 32, 32)  # the adapter's min_sequence_length
    torch.testing.assert_close(ours["hidden"], theirs, rtol=1e-5, atol=1e-5)
    for row, length in zip(ours["hidden"], lengths):
        assert row[:length].abs().sum(-1).min() > 0 and not row[length:].any()


def test_objective_equals_onetrainers_step(family_models, shapes_data, tmp_path):
    """diffusion_loss on a batch against OneTrainer's BaseAnimaSetup.predict written out with the same draws."""
    trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    batch = first_batch(trainer)
    vae, transformer = model.vae, model.denoiser
    pixels = batch["pixels"]
    shape = (16, pixels.shape[-2] // 8, pixels.shape[-1] // 8)
    eps, noise, timesteps = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        timesteps.append(model.objective.draw(g, options, torch.Size(shape)))
    eps, noise, timesteps = torch.stack(eps), torch.stack(noise), torch.cat(timesteps)
    with torch.no_grad():
        posterior = vae.encode(pixels.unsqueeze(2)).latent_dist
        sample = (posterior.mean + posterior.std * eps.unsqueeze(2))
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        x = (sample - mean) / std  # AnimaModel.scale_latents
        sigmas = (timesteps / 1000).view(-1, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * x + sigmas * noise.unsqueeze(2)
        prompt_embeds = modular_prompt_embeds(model.pipeline, batch["caption"])
        h, w = noisy.shape[-2:]
        pred = transformer(hidden_states=noisy, timestep=timesteps / 1000, encoder_hidden_states=prompt_embeds,
                           padding_mask=noisy.new_zeros(1, 1, h * 8, w * 8), return_dict=False)[0]
        expected = torch.mean((pred.float() - (noise.unsqueeze(2) - x).float()) ** 2)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # the scheduler config's fixed shift 3: s = 3u / (1 + 2u)
    u = torch.tensor([0.25], dtype=torch.float64)
    torch.testing.assert_close(model.objective.shifted(u, torch.Size(shape)), 3 * u / (1 + 2 * u))


def prediction(family, pipeline):
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 16, 8, 6), torch.tensor([300.0, 800.0])
    encoders = {name: getattr(pipeline, name) for name in family.text_encoders}
    tokenizers = {name: getattr(pipeline, name) for name in family.tokenizers}
    with torch.no_grad():
        conditioning = family.encode_text(encoders, family.tokenize(tokenizers, ["a dot", "a big yellow circle"]))
        return family.predict(pipeline.transformer, noisy, t, conditioning, {})


def modular_folder(path):
    """The folder as diffusers' own ModularPipeline loads it (modular_model_index.json), every component read."""
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.load_components(dtype=torch.float32)
    return pipe


def assert_diffusers_reads_the_original_file(single: dict, transformer: dict, adapter: dict):
    """The file in the layout diffusers' scripts/convert_anima_to_diffusers.py reads: `net.llm_adapter.` split off
    as the adapter's own keys (its split_anima_transformer_checkpoint, restated), the rest through Cosmos-Predict2's
    converter (convert_cosmos_transformer_checkpoint_to_diffusers), both equal to the folder's components."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    assert all(k.startswith("net.") for k in single)
    split = {k.removeprefix("net.llm_adapter."): v for k, v in single.items() if k.startswith("net.llm_adapter.")}
    rest = {k: v for k, v in single.items() if not k.startswith("net.llm_adapter.")}
    converted = convert_cosmos_transformer_checkpoint_to_diffusers(rest)
    for ours, theirs in ((converted, transformer), (split, adapter)):
        assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))[:4]
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_full_finetune_moves_the_transformer_only_and_reloads_through_diffusers(family_models, shapes_data, tmp_path):
    """The export reloads through diffusers' ModularPipeline.from_pretrained (an AnimaModularPipeline) with the
    trained transformer's weights; the frozen components as loaded. Beside it, the single file in the original layout,
    which diffusers' Anima conversion reads to the same transformer and adapter."""
    from diffusers import AnimaModularPipeline

    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", max_steps=2, learning_rate=1e-2)
    trainer.train()
    export = tmp_path / "o" / "model"
    assert_diffusers_reads_the_original_file(load_file(tmp_path / "o" / "model.safetensors"),
                                             load_file(export / "transformer" / "diffusion_pytorch_model.safetensors"),
                                             load_file(export / "text_conditioner" / "diffusion_pytorch_model.safetensors"))
    original, loaded = modular_folder(base), modular_folder(export)
    assert type(loaded) is AnimaModularPipeline
    for component, moves in (("transformer", True), ("vae", False), ("text_encoder", False),
                             ("text_conditioner", False)):
        before, after = (getattr(pipe, component).state_dict() for pipe in (original, loaded))
        assert before.keys() == after.keys(), component
        moved = max((before[k] - after[k]).abs().max().item() for k in before)
        assert (moved > 1e-4) == moves, (component, moved)
    model = trainer.model
    assert all(torch.equal(v, model.denoiser.state_dict()[k]) for k, v in loaded.transformer.state_dict().items())
    torch.testing.assert_close(prediction(model.family, loaded), prediction(model.family, model.pipeline),
                               rtol=1e-5, atol=1e-6)


def test_lora_file_loads_in_diffusers_and_samples_equal_the_modular_pipeline(family_models, shapes_data, tmp_path):
    """LoRA on the attention and MLP (OneTrainer's attn-mlp): AnimaModularPipeline.load_lora_weights on the base
    folder gives the trained outputs; the end-of-training sample equals diffusers' AnimaAutoBlocks with the same seed,
    guidance and size."""
    from PIL import Image

    base = family_models[FAMILY]
    prompt = {"prompt": "a red circle", "negative_prompt": "a blue square", "seed": 3, "steps": 3,
              "guidance_scale": 6.0, "width": 64, "height": 48}
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8, "sampling.prompts": [prompt]})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert {m.split(".", 3)[-1] for m in modules} == set(family.denoiser_lora_presets["default"])
    assert all(m.startswith("transformer.transformer_blocks.") for m in modules)
    trained = prediction(family, model.pipeline)
    pipe = modular_folder(base)
    before = prediction(family, pipe)
    assert (before - trained).abs().max() > 1e-4  # the LoRA changed the output: the comparison below means something
    pipe.load_lora_weights(str(tmp_path / "o" / "lora.safetensors"))
    torch.testing.assert_close(prediction(family, pipe), trained, rtol=1e-5, atol=1e-6)

    def image(guidance_scale):
        from diffusers import ClassifierFreeGuidance

        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
        out = pipe(prompt="a red circle", negative_prompt="a blue square", width=64, height=48,
                   num_inference_steps=3, generator=torch.Generator().manual_seed(3), max_sequence_length=32,
                   output_type="pil", output="images")
        return np.asarray(out[0]).astype(int)

    (sample,) = sorted((tmp_path / "o" / "samples").glob("step-*/*.png"))
    ours = np.asarray(Image.open(sample).convert("RGB")).astype(int)
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours - image(6.0)).max() <= 1
    assert np.abs(ours - image(1.0)).max() > 4  # unguided differs: the comparison above can fail


def test_lora_and_full_lower_the_loss_on_the_demo_data(family_models, shapes_data, tmp_path):
    """The same batch's loss with the same draws, before and after an epoch of the demo data, for each method."""
    for method, rate in (("lora", 5e-2), ("full", 2e-3)):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / method, method=method, max_steps=8,
                              learning_rate=rate, **({"lora.rank": 8, "lora.alpha": 8} if method == "lora" else {}))
        before, after = losses_around_training(trainer)
        assert after < before - 0.1, (method, before, after)  # seen: lora 1.85 -> 1.48, full 1.85 -> 1.42


def test_cached_latents_and_text_train_as_the_images_and_captions_do(family_models, shapes_data, tmp_path):
    """data.cache_text stores the adapter's output: the first step's loss is the uncached one."""
    losses = {}
    for cache in (False, True):
        trainer = trainer_for(family_models[FAMILY], shapes_data, tmp_path / f"o{cache}",
                              **{"data.cache_latents": cache, "data.cache_text": cache})
        batch = first_batch(trainer)
        assert ("text_hidden" in batch) == cache
        with torch.no_grad():
            losses[cache] = diffusion_loss(trainer.model, batch, 1, 0, trainer.config.loss)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_the_text_conditioner_trains_as_a_part_and_its_lora_loads_in_diffusers(family_models, shapes_data, tmp_path):
    """text_conditioner.train with LoRA: its modules are written as `text_conditioner.<path>`, which
    AnimaModularPipeline.load_lora_weights puts into the adapter; the conditioning then equals the trained one."""
    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "tc", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"text_conditioner.train": True, "lora.rank": 4, "lora.alpha": 8})
    trainer.train()
    saved = load_file(tmp_path / "tc" / "lora.safetensors")
    assert any(k.startswith("text_conditioner.blocks.") for k in saved)
    assert {k.split(".")[0] for k in saved} == {"transformer", "text_conditioner"}
    model, pipe = trainer.model, modular_folder(base)
    family = model.family
    trained = prediction(family, model.pipeline)
    assert (prediction(family, pipe) - trained).abs().max() > 1e-4
    pipe.load_lora_weights(str(tmp_path / "tc" / "lora.safetensors"))
    torch.testing.assert_close(prediction(family, pipe), trained, rtol=1e-5, atol=1e-6)


def test_a_folder_saved_by_diffusers_modular_pipeline_loads(family_models, tmp_path):
    """The published folders are AnimaModularPipeline.save_pretrained's (modular_model_index.json, no
    model_index.json), as diffusers' convert_anima_to_diffusers.py writes them: model.path takes one, with the same
    components and outputs as the folder it came from."""
    from diffusers import AnimaAutoBlocks

    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.families.anima_pipeline import COMPONENTS
    from ot_dist.models.loading import load_model

    ours = load_model(ModelConfig(family=FAMILY, path=str(family_models[FAMILY])))
    modular = AnimaAutoBlocks().init_pipeline()
    modular.update_components(**{name: getattr(ours.pipeline, name) for name in COMPONENTS})
    modular.save_pretrained(str(tmp_path / "published"), overwrite_modular_index=True)
    assert not (tmp_path / "published" / "model_index.json").exists()
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "published")))
    assert type(loaded.pipeline) is type(ours.pipeline) and loaded.objective.shift == 3.0
    torch.testing.assert_close(prediction(loaded.family, loaded.pipeline), prediction(ours.family, ours.pipeline),
                               rtol=0, atol=0)


def comfy_anima_lora_names(num_layers: int, adapter_layers: int) -> set[str]:
    """The LoRA module names ComfyUI maps for an Anima model: its generic rule (comfy/lora.py model_lora_keys_unet:
    `diffusion_model.<key without .weight>` for every weight key of the model) over the original model's Linear
    layers, Cosmos-Predict2's MiniTrainDIT with the adapter as `llm_adapter`, the `net.` wrapper stripped (as
    OneTrainer's AnimaModel._diffusers_to_dit lists them for its COMFY format): per block,
    adaln_modulation_{self_attn, cross_attn, mlp}.1 / .2, {self_attn, cross_attn}.{q_proj, k_proj, v_proj,
    output_proj}, mlp.layer1 / layer2; x_embedder.proj.1, t_embedder.1.linear_1 / linear_2,
    final_layer.adaln_modulation.1 / .2, final_layer.linear; in the adapter (its AnimaTextConditioner names are the
    original's), per block {self_attn, cross_attn}.{q,k,v,o}_proj, mlp.0 / mlp.2, and in_proj (absent at equal
    widths), out_proj."""
    block = [f"adaln_modulation_{kind}.{i}" for kind in ("self_attn", "cross_attn", "mlp") for i in (1, 2)]
    block += [f"{attn}.{p}" for attn in ("self_attn", "cross_attn") for p in ("q_proj", "k_proj", "v_proj",
                                                                                "output_proj")]
    block += ["mlp.layer1", "mlp.layer2"]
    names = {f"blocks.{i}.{m}" for i in range(num_layers) for m in block}
    names |= {"x_embedder.proj.1", "t_embedder.1.linear_1", "t_embedder.1.linear_2", "final_layer.adaln_modulation.1",
              "final_layer.adaln_modulation.2", "final_layer.linear"}
    adapter = [f"{attn}.{p}" for attn in ("self_attn", "cross_attn") for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names |= {f"llm_adapter.blocks.{i}.{m}" for i in range(adapter_layers) for m in adapter + ["mlp.0", "mlp.2"]}
    names |= {"llm_adapter.out_proj"}
    return {f"diffusion_model.{n}" for n in names}


def test_comfyui_lora_file_carries_the_original_names_and_loads_in_diffusers(family_models, shapes_data, tmp_path):
    """lora_comfyui.safetensors (every linear layer of the transformer, the adapter's default targets): each module is
    one ComfyUI maps for Anima, lora_A / lora_B without alpha; diffusers' Anima loader converts the same file back and
    gives the trained outputs."""
    base = family_models[FAMILY]
    trainer = trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=2, learning_rate=5e-2,
                          output_dtype="float32", **{"text_conditioner.train": True, "lora.rank": 4, "lora.alpha": 8,
                                                     "lora.preset": "all_linear"})
    trainer.train()
    model, family = trainer.model, trainer.model.family
    saved = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in saved}
    assert {k.rsplit(".lora_", 1)[1] for k in saved} == {"A.weight", "B.weight"}  # no alpha: strength 1
    comfy = comfy_anima_lora_names(model.denoiser.config.num_layers, model.pipeline.text_conditioner.config.num_layers)
    assert modules <= comfy, sorted(modules - comfy)[:3]
    assert {"diffusion_model.x_embedder.proj.1", "diffusion_model.blocks.1.mlp.layer2",
            "diffusion_model.llm_adapter.blocks.0.cross_attn.k_proj"} <= modules
    trained = prediction(family, model.pipeline)
    pipe = modular_folder(base)
    assert (prediction(family, pipe) - trained).abs().max() > 1e-4
    pipe.load_lora_weights(str(tmp_path / "o" / "lora_comfyui.safetensors"))
    torch.testing.assert_close(prediction(family, pipe), trained, rtol=1e-5, atol=1e-6)


def test_other_trainers_names_merge_as_the_diffusers_file_does(family_models, shapes_data, tmp_path):
    """`ot-dist lora merge` reads the transformer's LoRA in the original DiT's names, ComfyUI's / OneTrainer's COMFY
    `diffusion_model.<key>` (lora_comfyui.safetensors) and kohya's / OneTrainer's KOHYA `lora_unet_<key with _>` (the
    same tensors renamed): the merged transformer is the diffusers-layout file's merge."""
    from safetensors.torch import save_file

    from ot_dist.cli import main
    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model

    base = family_models[FAMILY]
    trainer_for(base, shapes_data, tmp_path / "o", method="lora", max_steps=1, learning_rate=5e-2,
                output_dtype="float32", **{"lora.rank": 4, "lora.alpha": 8}).train()
    comfy = load_file(tmp_path / "o" / "lora_comfyui.safetensors")
    kohya = {}
    for key, value in comfy.items():
        module, suffix = key.rsplit(".lora_", 1)
        kohya["lora_unet_" + module.removeprefix("diffusion_model.").replace(".", "_") + ".lora_" + suffix] = value
    save_file(kohya, tmp_path / "kohya.safetensors")
    merged = {}
    for name, path in (("diffusers", tmp_path / "o" / "lora.safetensors"),
                       ("comfy", tmp_path / "o" / "lora_comfyui.safetensors"),
                       ("kohya", tmp_path / "kohya.safetensors")):
        assert main(["lora", "merge", str(base), str(path), "--family", FAMILY, "--dtype", "float32",
                     "--out", str(tmp_path / name)]) == 0
        merged[name] = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / name))).denoiser.state_dict()
    original = load_model(ModelConfig(family=FAMILY, path=str(base))).denoiser.state_dict()
    assert max((merged["diffusers"][k] - original[k]).abs().max() for k in original) > 1e-4
    for name in ("comfy", "kohya"):
        for key, value in merged["diffusers"].items():
            torch.testing.assert_close(merged[name][key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def test_the_original_single_file_loads_to_the_same_outputs(family_models, tmp_path):
    """circlestone-labs' file layout (the DiT and the adapter under `net.`, in bfloat16, with the non-weights a Cosmos
    checkpoint carries beside them) read as model.path with model.config = the published (modular) folder: the
    transformer and the adapter are the folder's rounded to bfloat16, the outputs the same; a missing or unknown key
    is named before anything loads. The Linear names the LoRA files use are the file's."""
    from diffusers import AnimaAutoBlocks
    from safetensors.torch import save_file

    from ot_dist.config.schema import ModelConfig
    from ot_dist.errors import InputFileError
    from ot_dist.models.families.anima_lora import original_rules
    from ot_dist.models.families.anima_pipeline import COMPONENTS
    from ot_dist.models.families.anima_single_file import to_original, transformer_rules
    from ot_dist.models.loading import load_model

    ours = load_model(ModelConfig(family=FAMILY, path=str(family_models[FAMILY])))
    pipeline = ours.pipeline
    modular = AnimaAutoBlocks().init_pipeline()
    modular.update_components(**{name: getattr(pipeline, name) for name in COMPONENTS})
    modular.save_pretrained(str(tmp_path / "published"), overwrite_modular_index=True)
    with torch.no_grad():
        for part in (pipeline.transformer, pipeline.text_conditioner):
            for t in part.state_dict().values():
                t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    transformer, adapter = pipeline.transformer, pipeline.text_conditioner
    state = {k: v.to(torch.bfloat16) for k, v in to_original(transformer.state_dict(), adapter.state_dict(),
                                                             transformer.config, adapter.config).items()}
    state |= {"net.pos_embedder.dim_spatial_range": torch.zeros(2), "net.accum_iteration": torch.zeros(1)}
    save_file(state, tmp_path / "anima.safetensors")
    loaded = load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "anima.safetensors"),
                                    config=str(tmp_path / "published")))
    for part in ("transformer", "text_conditioner"):
        got, expected = getattr(loaded.pipeline, part).state_dict(), getattr(pipeline, part).state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), part
    torch.testing.assert_close(prediction(loaded.family, loaded.pipeline), prediction(ours.family, pipeline),
                               rtol=0, atol=0)
    lost = dict(state)
    del lost["net.blocks.1.mlp.layer2.weight"]
    lost["net.llm_adapter.blocks.7.mlp.0.weight"] = state["net.llm_adapter.blocks.0.mlp.0.weight"]
    save_file({k: v.clone() for k, v in lost.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(InputFileError, match=r"missing 1 key.*net\.blocks\.1\.mlp\.layer2\.weight.*unexpected 1 key.*"
                                             r"net\.llm_adapter\.blocks\.7\.mlp\.0\.weight"):
        load_model(ModelConfig(family=FAMILY, path=str(tmp_path / "bad.safetensors"), config=str(tmp_path / "published")))
    full = {(r.original, r.diffusers, r.kind) for r in transformer_rules(transformer.config)}
    assert {(r.original, r.diffusers, r.kind) for r in original_rules(transformer.config)} <= full
