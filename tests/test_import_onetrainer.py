"""`ot-dist import onetrainer` (issue 17): OneTrainer-shaped configs (field names and enum values of OneTrainer's
modules/util/config/TrainConfig.py, ConceptConfig.py, SampleConfig.py, config version 11, and the flat keys of
version 0) for an SD 1.5 LoRA, an SDXL finetune and an SD 1.5 embedding become ot_dist configs that validate, keep
the settings' meaning, list what they cannot honour, and train 2 steps each."""

from __future__ import annotations

import contextlib
import io
import json

from pathlib import Path

import pytest
import yaml

from ot_dist.cli import main
from ot_dist.config.load import load_config
from ot_dist.train.trainer import Trainer


def run_import(*args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["import", "onetrainer", *map(str, args)])
    return code, err.getvalue()


def sd15_lora(model, data) -> dict:
    return {
        "__version": 11, "training_method": "LORA", "model_type": "STABLE_DIFFUSION_15", "base_model_name": str(model),
        "output_model_destination": "models/my_lora.safetensors", "output_model_format": "SAFETENSORS",
        "resolution": "64", "batch_size": 2, "gradient_accumulation_steps": 2, "epochs": 3, "learning_rate": 2e-4,
        "learning_rate_scheduler": "COSINE", "learning_rate_warmup_steps": 10.0, "learning_rate_cycles": 1.0,
        "learning_rate_min_factor": 0.1, "train_dtype": "BFLOAT_16", "weight_dtype": "FLOAT_32",
        "output_dtype": "FLOAT_16", "gradient_checkpointing": "ON", "lora_rank": 8, "lora_alpha": 4.0,
        "text_encoder_layer_skip": 1, "loss_weight_fn": "P2", "loss_weight_strength": 1.0,
        "layer_filter_preset": "attn-only", "layer_filter": "",
        "optimizer": {"__version": 0, "optimizer": "ADAMW", "beta1": 0.9, "beta2": 0.99, "eps": 1e-8,
                      "weight_decay": 0.01, "foreach": None},
        "unet": {"train": True, "learning_rate": None, "stop_training_after": None,
                 "stop_training_after_unit": "NEVER", "weight_dtype": "FLOAT_32", "model_name": ""},
        "text_encoder": {"train": True, "learning_rate": 5e-5, "stop_training_after": 1,
                         "stop_training_after_unit": "EPOCH", "weight_dtype": "FLOAT_32", "model_name": ""},
        "concepts": [{"name": "shapes", "path": str(data), "enabled": True, "type": "STANDARD", "balancing": 2.0,
                      "balancing_strategy": "REPEATS",
                      "text": {"prompt_source": "sample", "enable_tag_shuffling": True, "keep_tags_count": 2},
                      "image": {"enable_random_flip": True, "enable_fixed_flip": True, "enable_fixed_rotate": True,
                                "random_rotate_max_angle": 10.0}},
                     {"name": "off", "path": str(data), "enabled": False},
                     {"name": "held", "path": str(data), "type": "VALIDATION"},
                     {"name": "distill", "path": str(data), "type": "PRIOR_PREDICTION"}],
        "validation": True, "validate_after": 3, "validate_after_unit": "STEP",
        "samples": [{"enabled": True, "prompt": "a red circle", "negative_prompt": "", "height": 64, "width": 64,
                     "seed": 7, "random_seed": False, "diffusion_steps": 3, "cfg_scale": 5.0}],
        "sample_after": 2, "sample_after_unit": "EPOCH", "save_every": 0, "save_every_unit": "NEVER",
    }


def sdxl_finetune_preset(model) -> dict:
    """A preset: only what differs from OneTrainer's defaults; concepts in the concept file."""
    return {
        "__version": 11, "model_type": "STABLE_DIFFUSION_XL_10_BASE", "base_model_name": str(model),
        "output_model_destination": "out/sdxl.safetensors", "resolution": "64", "batch_size": 2,
        "learning_rate_scheduler": "LINEAR", "learning_rate_warmup_steps": 0.0, "ema": "GPU", "ema_decay": 0.99,
        "loss_weight_fn": "MIN_SNR_GAMMA", "loss_weight_strength": 5.0, "save_every": 1, "save_every_unit": "EPOCH",
        "optimizer": {"optimizer": "ADAFACTOR", "relative_step": False, "scale_parameter": False,
                      "warmup_init": False},
        "text_encoder": {"train": False}, "text_encoder_2": {"train": False},
        "concept_file_name": "concepts.json",
    }


def sd15_embedding_v0(model, data) -> dict:
    """Version 0's flat keys (train_unet, ...), as OneTrainer's own migrations read them."""
    return {
        "training_method": "EMBEDDING", "model_type": "STABLE_DIFFUSION_15", "base_model_name": str(model),
        "output_model_destination": "emb/shape.safetensors", "resolution": "64", "batch_size": 2,
        "learning_rate": 1e-3, "train_unet": False, "train_text_encoder": False, "min_snr_gamma": 0.0,
        "gradient_checkpointing": False, "learning_rate_warmup_steps": 0.0,
        "embedding": {"placeholder": "<shape>", "token_count": 2, "initial_embedding_text": "shape"},
        "concepts": [{"path": str(data), "text": {"prompt_source": "filename"}}],
    }


def import_and_train(tmp_path, name, config, tiny_extra=()):
    source = tmp_path / f"{name}.json"
    source.write_text(json.dumps(config))
    target = tmp_path / f"{name}.yaml"
    code, err = run_import(source, "--out", target)
    assert code == 0, err
    overrides = [f"output_dir={tmp_path / name}", "max_steps=2", "mlflow.enabled=false", "sampling.at_end=false",
                 f"data.shards={tmp_path / name}-shards", *tiny_extra]
    config = load_config(str(target), overrides)
    result = Trainer(config, log=lambda *_: None).train()
    assert result.steps == 2 and all(loss == loss for loss in result.losses)
    return load_config(str(target), []), target.read_text(), err


def test_sd15_lora_keeps_its_settings_and_lists_what_it_drops(tiny_models, shapes_data, tmp_path):
    config, text, err = import_and_train(tmp_path, "lora", sd15_lora(tiny_models["sd1"], shapes_data))
    assert (config.model.family, config.method, config.resolution) == ("sd1", "lora", 64)
    assert (config.batch_size, config.gradient_accumulation_steps, config.epochs) == (2, 2, 3)
    assert (config.lora.rank, config.lora.alpha, config.lora.preset) == (8, 4.0, "attention")
    assert (config.scheduler.name, config.scheduler.warmup_steps, config.scheduler.min_factor) == ("COSINE", 10, 0.1)
    assert (config.optimizer.name, config.optimizer.beta2, config.optimizer.weight_decay) == ("ADAMW", 0.99, 0.01)
    assert (config.train_dtype, config.output_dtype) == ("bfloat16", "float16")
    assert config.model.text_encoder_layer_skip == 1  # clip skip
    assert (config.loss.weight_fn, config.loss.weight_strength) == ("P2", 1.0)
    te = config.text_encoder
    assert (te.train, te.learning_rate, te.stop_training_after, te.stop_training_after_unit) == (True, 5e-5, 1, "epoch")
    concept, held, distill = config.data.concepts  # the disabled one is not imported
    assert (held.name, held.type) == ("held", "validation") and concept.type == "standard"
    assert (distill.name, distill.type) == ("distill", "prior_prediction")  # a LoRA trains it towards its base model
    assert (config.validation.every_n_steps, config.validation.every_n_epochs) == (3, None)
    assert "PRIOR_PREDICTION" not in err
    assert (concept.balancing, concept.caption_source) == (2.0, "txt")
    assert (concept.tag_shuffling, concept.keep_tags_count) == (True, 2)
    [prompt] = config.sampling.prompts
    assert (prompt.prompt, prompt.seed, prompt.steps, prompt.guidance_scale) == ("a red circle", 7, 3, 5.0)
    assert config.sampling.every_n_epochs == 2
    assert config.output_dir == "models/my_lora"
    assert concept.flip_probability == 0.5  # OneTrainer's random flip
    # a fixed rotation has no ot_dist equivalent: said in the file and on stderr; a fixed flip beside the random one
    # is not said: mgds RandomFlip ignores it then
    assert "enable_fixed_rotate" in err and "NOT HONOURED" in text and "enable_fixed_rotate" in text
    assert "enable_fixed_flip" not in err and concept.rotation_degrees == 0


def test_sdxl_preset_takes_onetrainers_defaults_and_the_concept_file(tiny_models, shapes_data, tmp_path):
    (tmp_path / "concepts.json").write_text(json.dumps([{"name": "s", "path": str(shapes_data)}]))
    config, text, _ = import_and_train(tmp_path, "sdxl", sdxl_finetune_preset(tiny_models["sdxl"]))
    assert (config.model.family, config.method) == ("sdxl", "full")
    assert config.epochs == 100 and config.learning_rate == 3e-6  # OneTrainer's defaults, absent from the preset
    assert config.train_dtype == "float16"
    assert (config.optimizer.name, config.optimizer.relative_step) == ("ADAFACTOR", False)
    assert (config.ema.enabled, config.ema.decay) == (True, 0.99)
    assert config.loss.min_snr_gamma == 5.0
    assert config.checkpoint.every_n_epochs == 1
    assert not config.text_encoder.train and not config.text_encoder_2.train
    assert config.data.concepts[0].path == str(shapes_data)


def test_version_0_embedding(tiny_models, shapes_data, tmp_path):
    config, _, _ = import_and_train(tmp_path, "emb", sd15_embedding_v0(tiny_models["sd1"], shapes_data))
    assert config.method == "embedding"
    assert (config.embedding.token, config.embedding.vectors, config.embedding.init_text) == ("<shape>", 2, "shape *")
    assert config.data.concepts[0].caption_source == "filename"
    assert config.gradient_checkpointing is False
    # OneTrainer's EMBEDDING trains the embedding only, whatever its parts' train flags: no part section is written
    assert not {"unet", "text_encoder"} & set(yaml.safe_load((tmp_path / "emb.yaml").read_text()))


@pytest.mark.parametrize("change,message", [({"model_type": "NOT_A_MODEL_TYPE"}, "model_type: NOT_A_MODEL_TYPE"),
                                            ({"training_method": "FINE_TUNE_VAE"}, "training_method")])
def test_what_cannot_be_imported_is_named(tiny_models, shapes_data, tmp_path, change, message):
    source = tmp_path / "c.json"
    source.write_text(json.dumps({**sd15_lora(tiny_models["sd1"], shapes_data), **change}))
    code, err = run_import(source, "--out", tmp_path / "c.yaml")
    assert code == 2 and message in err
    assert not (tmp_path / "c.yaml").exists()


def test_masked_prior_preservation_is_imported_for_lora_only(tiny_models, shapes_data, tmp_path):
    from ot_dist.config.load import load_config

    masked = {"masked_training": True, "unmasked_probability": 0.1, "unmasked_weight": 0.1,
              "normalize_masked_area_loss": False, "masked_prior_preservation_weight": 0.5}
    source = tmp_path / "lora.json"
    source.write_text(json.dumps({**sd15_lora(tiny_models["sd1"], shapes_data), **masked}))
    assert run_import(source, "--out", tmp_path / "lora.yaml")[0] == 0
    assert load_config(tmp_path / "lora.yaml").masked_training.prior_preservation_weight == 0.5
    source.write_text(json.dumps({**sd15_lora(tiny_models["sd1"], shapes_data), **masked, "training_method": "FINE_TUNE"}))
    code, err = run_import(source, "--out", tmp_path / "full.yaml")
    assert code == 0 and "masked_prior_preservation_weight: 0.5: OneTrainer uses it with LORA only" in err
    assert load_config(tmp_path / "full.yaml").masked_training.prior_preservation_weight == 0.0


# --- OneTrainer's own files: presets (only what differs from TrainConfig's defaults, no `__version`: the newest
# layout), UI-saved configs (every field), older versions. Import and validate only: no model is loaded. ---

def import_only(tmp_path, config, concepts=None, samples=None):
    """(validated ot_dist config, not-honoured lines) of a OneTrainer config written to tmp_path."""
    from ot_dist.config.load import validate
    from ot_dist.migrate.onetrainer import import_onetrainer

    (tmp_path / "images").mkdir(exist_ok=True)
    config = {"concepts": [{"path": str(tmp_path / "images")}], **config}
    if samples is not None:
        config["samples"] = samples
    (tmp_path / "ot.json").write_text(json.dumps(config))
    imported = import_onetrainer(tmp_path / "ot.json")
    return validate(imported.config), imported.not_honoured


# TrainConfig: every part trains by default, the text encoders until epoch 30 (stop_training_after 30, EPOCH).
@pytest.mark.parametrize("preset,family,trains,stop", [
    ({"model_type": "STABLE_DIFFUSION_15", "training_method": "LORA", "unet": {"weight_dtype": "FLOAT_16"},
      "text_encoder": {"weight_dtype": "FLOAT_16"}}, "sd1", {"unet": True, "text_encoder": True}, 30),
    ({"model_type": "STABLE_DIFFUSION_XL_10_BASE", "training_method": "FINE_TUNE",
      "text_encoder": {"train": False}}, "sdxl", {"unet": True, "text_encoder": False, "text_encoder_2": True}, 30),
    ({"model_type": "PIXART_SIGMA", "training_method": "LORA", "text_encoder": {"train": False}}, "pixart_sigma",
     {"transformer": True, "text_encoder": False}, None),
    ({"model_type": "STABLE_CASCADE_1", "training_method": "FINE_TUNE", "text_encoder": {"train": False},
      "decoder": {"model_name": "/models/stable-cascade"}, "loss_weight_fn": "P2", "loss_weight_strength": 1.0},
     "stable_cascade", {"prior": True, "text_encoder": False}, None),
    ({"model_type": "WUERSTCHEN_2", "training_method": "LORA", "prior": {"learning_rate": 1e-4}}, "wuerstchen_v2",
     {"prior": True, "text_encoder": True}, 30),
    # training_presets/Sana/#sana 1.6b.json
    ({"model_type": "SANA", "training_method": "FINE_TUNE", "text_encoder": {"train": False, "weight_dtype": "BFLOAT_16"},
      "train_dtype": "BFLOAT_16", "resolution": "1024", "text_encoder_layer_skip": 2}, "sana",
     {"transformer": True, "text_encoder": False}, None),
    # training_presets/QwenImage/#qwen LoRA 24GB.json
    ({"model_type": "QWEN", "training_method": "LORA", "batch_size": 2, "learning_rate": 0.0003,
      "output_model_format": "DIFFUSERS_LORA", "resolution": "512",
      "transformer": {"train": True, "weight_dtype": "FLOAT_8", "offload_fraction": 0.1},
      "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"}, "vae": {"weight_dtype": "FLOAT_32"},
      "train_dtype": "BFLOAT_16", "weight_dtype": "BFLOAT_16", "output_dtype": "BFLOAT_16",
      "timestep_distribution": "LOGIT_NORMAL", "layer_filter": "attn,img_mlp,txt_mlp", "layer_filter_preset": "attn-mlp",
      "quantization": {"layer_filter": "transformer_block", "layer_filter_preset": "blocks"}}, "qwen_image",
     {"transformer": True, "text_encoder": False}, None),
    # training_presets/Z-Image/#z-image LoRA 16GB.json
    ({"model_type": "Z_IMAGE", "training_method": "LORA", "batch_size": 2, "learning_rate": 0.0003,
      "output_model_format": "DIFFUSERS_LORA", "resolution": "512", "compile": True,
      "transformer": {"train": True, "weight_dtype": "FLOAT_8"}, "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"},
      "vae": {"weight_dtype": "FLOAT_32"}, "train_dtype": "BFLOAT_16", "weight_dtype": "BFLOAT_16",
      "output_dtype": "BFLOAT_16",
      "layer_filter": "^(?=.*attention)(?!.*refiner).*,^(?=.*feed_forward)(?!.*refiner).*",
      "layer_filter_preset": "attn-mlp", "layer_filter_regex": True,
      "quantization": {"layer_filter": "layers", "layer_filter_preset": "blocks"}, "timestep_distribution": "LOGIT_NORMAL"},
     "z_image", {"transformer": True, "text_encoder": False}, None),
    # training_presets/Anima/#anima LoRA.json
    ({"model_type": "ANIMA", "training_method": "LORA", "batch_size": 2, "learning_rate": 3e-05,
      "output_model_format": "KOHYA_LORA", "resolution": "512", "compile": True,
      "transformer": {"train": True, "weight_dtype": "INT_W8A8"}, "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"},
      "vae": {"weight_dtype": "FLOAT_32"}, "train_dtype": "BFLOAT_16", "weight_dtype": "BFLOAT_16",
      "output_dtype": "BFLOAT_16", "timestep_distribution": "LOGIT_NORMAL", "layer_filter": "attn1,attn2,ff",
      "layer_filter_preset": "attn-mlp",
      "quantization": {"layer_filter": "attn1,attn2,ff", "layer_filter_preset": "attn-mlp"}}, "anima",
     {"transformer": True, "text_encoder": False, "text_conditioner": False}, None),
    # training_presets/HiDream Full/#hidream LoRA.json
    ({"model_type": "HI_DREAM_FULL", "training_method": "LORA", "batch_size": 4, "learning_rate": 0.0003,
      "output_model_format": "DIFFUSERS_LORA", "resolution": "512", "timestep_distribution": "LOGIT_NORMAL",
      "dynamic_timestep_shifting": False, "train_dtype": "BFLOAT_16",
      "transformer": {"train": True, "weight_dtype": "FLOAT_8", "offload_fraction": 0.5},
      "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"},
      "text_encoder_2": {"train": False, "weight_dtype": "FLOAT_8"},
      "text_encoder_3": {"train": False, "weight_dtype": "FLOAT_8", "offload_fraction": 0.5},
      "text_encoder_4": {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "train": False, "weight_dtype": "FLOAT_8",
                         "offload_fraction": 0.5}}, "hidream",
     {"transformer": True, "text_encoder": False, "text_encoder_4": False}, None),
])
def test_presets_take_onetrainers_part_defaults(tmp_path, preset, family, trains, stop):
    config, _ = import_only(tmp_path, {"base_model_name": "/models/base", **preset})
    assert config.model.family == family
    assert {part: config.part_trains(part) for part in trains} == trains
    encoders = [part for part, on in trains.items() if on and part.startswith("text_encoder")]
    for part in encoders:
        assert (getattr(config, part).stop_training_after, getattr(config, part).stop_training_after_unit) == (
            stop, "epoch")
    if family == "stable_cascade":
        assert config.model.decoder == "/models/stable-cascade"
    if family == "wuerstchen_v2":
        assert config.prior.learning_rate == 1e-4
    if family == "sana":  # OneTrainer's Gemma layer skip
        assert config.model.text_encoder_layer_skip == 2
    if family == "qwen_image":  # attn, img_mlp, txt_mlp: both streams' attention and MLPs
        assert config.lora.preset == "attention_mlp"
    if family == "anima":  # attn1, attn2, ff: the self- and cross-attention and the MLP
        assert config.lora.preset == "attention_mlp"
    if family == "z_image":  # attention and feed_forward outside the refiners, OneTrainer's regular expressions
        assert config.lora.layer_filter_regex and config.lora.layer_filter == [
            "^(?=.*attention)(?!.*refiner).*", "^(?=.*feed_forward)(?!.*refiner).*"]
        assert config.loss.timestep_shift == 1.0  # OneTrainer's default: unshifted


def test_z_image_preset_name_alone_is_read_as_onetrainers_regular_expressions(tmp_path):
    """A config that names the attn-only preset and no layer_filter text: OneTrainer matches its Z-Image preset's
    patterns as regular expressions (BaseZImageSetup.LAYER_PRESETS `regex: True`); BaseZImageSetup reads
    dynamic_timestep_shifting."""
    config, _ = import_only(tmp_path, {"model_type": "Z_IMAGE", "training_method": "LORA",
                                       "layer_filter_preset": "attn-only", "dynamic_timestep_shifting": True})
    assert config.lora.layer_filter == ["^(?=.*attention)(?!.*refiner).*"] and config.lora.layer_filter_regex
    assert config.loss.dynamic_timestep_shifting is True


@pytest.mark.parametrize("model_type", ["STABLE_DIFFUSION_15", "STABLE_DIFFUSION_XL_10_BASE"])
def test_embedding_presets_train_only_the_embedding(tmp_path, model_type):
    """OneTrainer's EMBEDDING trains the vectors whatever the parts' `train` (true by default) says."""
    config, _ = import_only(tmp_path, {"model_type": model_type, "training_method": "EMBEDDING",
                                       "unet": {"weight_dtype": "FLOAT_16"}, "latent_caching": False})
    assert config.method == "embedding" and not any(config.part_trains(p) for p in config.part_names())


def test_embedding_model_name_continues_that_embedding(tmp_path):
    """OneTrainer's embedding.model_name starts the vectors from that file, whose vector count is used (BaseModel's
    token_count = the vector's rows): embedding.init_from, with no vectors written (the file sets them)."""
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": "EMBEDDING",
                                             "embedding": {"placeholder": "<Shape>", "token_count": 2,
                                                           "model_name": "emb/old.safetensors"}})
    assert config.embedding.init_from == "emb/old.safetensors" and "vectors" not in config.embedding.model_fields_set
    assert config.embedding.token == "<shape>"  # lower case: the file may hold several vectors
    assert not any(line.startswith("embedding.model_name") for line in skipped)
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": "EMBEDDING",
                                             "embedding": {"placeholder": "<shape>", "model_name": "emb/old.pt"}})
    assert config.embedding.init_from is None and "embedding.model_name: emb/old.pt is not a .safetensors" in skipped[0]


def test_inpainting_presets_do_not_cache_latents(tmp_path):
    """latent_caching is on by default; an inpainting model encodes each step's masked image."""
    config, _ = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15_INPAINTING", "masked_training": True})
    assert config.model.inpainting and not config.data.cache_latents


def test_flux_fill_imports_as_flux_inpainting(tmp_path):
    """FLUX_FILL_DEV_1 (OneTrainer trains it with Flux's setup, its mask and conditioning image as inputs): Flux with
    model.inpainting, so the masked image is encoded each step."""
    config, _ = import_only(tmp_path, {"model_type": "FLUX_FILL_DEV_1", "training_method": "LORA"})
    assert (config.model.family, config.model.inpainting, config.data.cache_latents) == ("flux", True, False)


def test_sd2_depth_imports_as_sd2_without_latent_cache_or_samples(tmp_path):
    """STABLE_DIFFUSION_20_DEPTH: sd2 (the 5-channel UNet is detected when it loads); latent caching (on in OneTrainer
    by default) off, the samples listed (a depth model cannot sample in ot_dist yet)."""
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_20_DEPTH", "training_method": "LORA"},
                                  samples=[{"prompt": "a house"}])
    assert (config.model.family, config.model.inpainting, config.data.cache_latents) == ("sd2", None, False)
    assert not config.sampling.prompts
    assert any(line.startswith("samples: 1 prompt(s) left out: ot_dist cannot sample a depth model") for line in skipped)


def test_part_dtypes_and_checkpointing_of_config_version_11(tmp_path):
    """Since version 9 each part stores its weight_dtype, since 11 its gradient_checkpointing: each frozen part keeps
    its own storage (weight_dtype the LoRA base's, the others where they differ), nothing listed."""
    lora = {"__version": 11, "model_type": "STABLE_DIFFUSION_XL_10_BASE", "training_method": "LORA",
            "unet": {"weight_dtype": "BFLOAT_16", "gradient_checkpointing": False},
            "text_encoder": {"train": False, "weight_dtype": "BFLOAT_16"},
            "text_encoder_2": {"train": False, "weight_dtype": "BFLOAT_16"}, "vae": {"weight_dtype": "FLOAT_32"}}
    config, skipped = import_only(tmp_path, lora)
    assert (config.weight_dtype, config.vae_weight_dtype, config.gradient_checkpointing) == (
        "bfloat16", "float32", False)
    assert {name: config.component_storage(name) for name in ("unet", "text_encoder", "text_encoder_2", "vae")} == {
        "unet": "bfloat16", "text_encoder": "bfloat16", "text_encoder_2": "bfloat16", "vae": "float32"}
    assert not any("weight_dtype" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**lora, "vae": {"weight_dtype": "BFLOAT_16"}})
    assert (config.weight_dtype, config.vae_weight_dtype) == ("bfloat16", None)
    assert not any("weight_dtype" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**lora, "unet": {"weight_dtype": "FLOAT_8"}, "vae": {}})
    assert {name: config.component_storage(name) for name in ("unet", "text_encoder", "vae")} == {
        "unet": "float8", "text_encoder": "bfloat16", "vae": "float32"}
    assert not any("weight_dtype" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**lora, "unet": {"weight_dtype": "INT_W8A8"}})
    assert config.component_storage("unet") == "int8" and not any("weight_dtype" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**lora, "unet": {"weight_dtype": "FLOAT_W8A8"}})
    assert config.component_storage("unet") == "float8"
    assert any(line.startswith("unet.weight_dtype: FLOAT_W8A8 (float8 weights") for line in skipped)
    config, skipped = import_only(tmp_path, {**lora, "text_encoder": {"train": False, "weight_dtype": "GGUF"}})
    assert config.component_storage("text_encoder") == "bfloat16"
    assert any(line.startswith("text_encoder.weight_dtype: GGUF is not") for line in skipped)
    # NFLOAT_4 (QLoRA's NF4 with bitsandbytes) is nf4: OneTrainer's Flux.1 dev LoRA preset (training_presets/
    # Flux Dev.1/#flux LoRA.json) stores the transformer and T5 so, CLIP in bfloat16, the VAE in float32
    flux = {"model_type": "FLUX_DEV_1", "training_method": "LORA", "base_model_name": "black-forest-labs/FLUX.1-dev",
            "transformer": {"train": True, "weight_dtype": "NFLOAT_4"},
            "text_encoder": {"train": False, "weight_dtype": "BFLOAT_16"},
            "text_encoder_2": {"train": False, "weight_dtype": "NFLOAT_4"}, "vae": {"weight_dtype": "FLOAT_32"},
            "train_dtype": "BFLOAT_16"}
    config, skipped = import_only(tmp_path, flux)
    assert {name: config.component_storage(name) for name in ("transformer", "text_encoder", "text_encoder_2",
                                                               "vae")} == {
        "transformer": "nf4", "text_encoder": "bfloat16", "text_encoder_2": "nf4", "vae": "float32"}
    assert config.weight_dtype == "nf4" and not any("weight_dtype" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**flux, "train_dtype": "NFLOAT_4"})
    assert any(line.startswith("train_dtype: NFLOAT_4 is a storage dtype in ot_dist") for line in skipped)
    finetune = {**lora, "training_method": "FINE_TUNE", "train_dtype": "BFLOAT_16",
                "vae": {"weight_dtype": "BFLOAT_16"}}
    config, _ = import_only(tmp_path, finetune)
    assert (config.trained_weight_dtype, config.weight_dtype) == ("bfloat16", "bfloat16")
    # a full finetune's frozen parts: the most common storage, the others their own
    config, _ = import_only(tmp_path, {**finetune, "text_encoder": {"train": False, "weight_dtype": "FLOAT_16"},
                                       "vae": {"weight_dtype": "FLOAT_32"}})
    assert {name: config.component_storage(name) for name in ("text_encoder", "text_encoder_2", "vae")} == {
        "text_encoder": "float16", "text_encoder_2": "bfloat16", "vae": "float32"}


def test_older_versions_fan_their_global_settings_out_to_the_parts(tmp_path):
    """Version 9 moved weight_dtype into the parts (NONE meant the global one), 10 gradient_checkpointing, and 8
    gave the transformer models the settings kept in `prior` until then."""
    config, skipped = import_only(tmp_path, {
        "__version": 3, "model_type": "STABLE_DIFFUSION_15", "weight_dtype": "FLOAT_16",
        "gradient_checkpointing": False,
        "unet": {"train": False, "weight_dtype": "NONE"}, "text_encoder": {"train": True, "weight_dtype": "NONE"},
        "vae": {"weight_dtype": "NONE"}})
    assert (config.weight_dtype, config.gradient_checkpointing) == ("float16", False)
    assert any(line.startswith("text_encoder.weight_dtype: FLOAT_16 (a trained part)") for line in skipped)
    config, _ = import_only(tmp_path, {"__version": 7, "model_type": "STABLE_DIFFUSION_3", "training_method": "LORA",
                                       "prior": {"train": True, "learning_rate": 2e-4}})
    assert config.transformer.learning_rate == 2e-4
    # version 0: the optimizer's options were flat optimizer_<option> keys, the parts' too (vae_weight_dtype)
    config, _ = import_only(tmp_path, {"training_method": "LORA", "optimizer": "ADAMW", "optimizer_weight_decay": 0.05,
                                       "weight_dtype": "FLOAT_16", "unet_weight_dtype": "NONE",
                                       "text_encoder_weight_dtype": "NONE", "vae_weight_dtype": "FLOAT_32"})
    assert (config.optimizer.name, config.optimizer.weight_decay, config.weight_dtype, config.vae_weight_dtype) == (
        "ADAMW", 0.05, "float16", "float32")


def test_a_ui_saved_optimizer_section_lists_only_what_is_set(tmp_path):
    """The UI saves every optimizer's options in one section, unset ones at TrainOptimizerConfig's defaults (None,
    False, {} and a few True); a preset has no section, which is those defaults too."""
    saved = {"optimizer": "ADAFACTOR", "adam_w_mode": False, "beta1": None, "eps": 1e-30, "eps2": 0.001,
             "clip_threshold": 1.0, "decay_rate": -0.8, "relative_step": False, "scale_parameter": False,
             "warmup_init": False, "weight_decay": 0.0, "stochastic_rounding": True, "use_stableadamw": True,
             "factored": True, "d_limiter": True, "muon_adam_config": {}, "MuonWithAuxAdam": False, "compile": False}
    base = {"model_type": "STABLE_DIFFUSION_15", "training_method": "LORA"}
    config, skipped = import_only(tmp_path, {**base, "optimizer": saved})
    assert (config.optimizer.name, config.optimizer.eps2) == ("ADAFACTOR", 0.001)
    assert not [line for line in skipped if line.startswith("optimizer")]
    _, skipped = import_only(tmp_path, {**base, "optimizer": {**saved, "use_grams": True}})
    assert [line for line in skipped if line.startswith("optimizer")] == [
        "optimizer.use_grams: True is not an option of ot_dist's ADAFACTOR"]
    preset, _ = import_only(tmp_path, base)
    unset = {key: value for key, value in saved.items() if any(value is v for v in (None, False, True)) or value == {}}
    saved_adamw, _ = import_only(tmp_path, {**base, "optimizer": {**unset, "optimizer": "ADAMW", "foreach": False,
                                                                  "fused": False}})
    assert preset.optimizer == saved_adamw.optimizer


@pytest.mark.parametrize("settings,family,loss", [
    # the draw is floor(t) of t in [1000 min, 1000 max): the last timestep is 1000 max - 1 (ot_dist's is inclusive)
    ({"min_noising_strength": 0.25, "max_noising_strength": 0.75}, "sd1", {"min_timestep": 250, "max_timestep": 749}),
    ({"min_noising_strength": 0.25, "max_noising_strength": 0.5}, "stable_cascade",  # 10000 steps of continuous t
     {"min_timestep": 2500, "max_timestep": 4999}),
    ({"timestep_distribution": "LOGIT_NORMAL", "noising_bias": 0.5, "noising_weight": 0.2}, "sd1",
     {"logit_normal_mean": 0.5, "logit_normal_std": 1.2}),  # sigmoid(N(bias, weight + 1))
    # the other shapes read noising_weight / noising_bias as they are (0, OneTrainer's default, is ot_dist's null)
    ({"timestep_distribution": "SIGMOID", "noising_weight": 6.0, "noising_bias": -0.2}, "sd1",
     {"timestep_distribution": "sigmoid", "noising_weight": 6.0, "noising_bias": -0.2}),
    ({"timestep_distribution": "HEAVY_TAIL", "noising_weight": 1.2, "noising_bias": 0.3}, "flux",  # bias unread
     {"timestep_distribution": "heavy_tail", "noising_weight": 1.2, "noising_bias": None}),
    ({"timestep_distribution": "COS_MAP", "noising_weight": 2.0, "timestep_shift": 3.0}, "sd3",
     {"timestep_distribution": "cos_map", "noising_weight": None, "timestep_shift": 3.0}),
    ({"timestep_distribution": "INVERTED_PARABOLA", "noising_weight": 3.0, "min_noising_strength": 0.25,
      "max_noising_strength": 0.5}, "stable_cascade", {"timestep_distribution": "inverted_parabola",
                                                       "noising_weight": 3.0, "noising_bias": None,
                                                       "min_timestep": 2500, "max_timestep": 4999}),
    # version 2: a noising_weight was a sigmoid centred on noising_bias (OneTrainer's own migration: bias - 0.5)
    ({"__version": 2, "noising_weight": 4.0, "noising_bias": 0.75}, "sd1",
     {"timestep_distribution": "sigmoid", "noising_weight": 4.0, "noising_bias": 0.25}),
])
def test_timestep_draw_as_onetrainer(tmp_path, settings, family, loss):
    model_type = {"sd1": "STABLE_DIFFUSION_15", "stable_cascade": "STABLE_CASCADE_1", "flux": "FLUX_DEV_1",
                  "sd3": "STABLE_DIFFUSION_3"}[family]
    config, skipped = import_only(tmp_path, {"model_type": model_type, **settings})
    assert {key: getattr(config.loss, key) for key in loss} == pytest.approx(loss)
    assert not any(line.startswith("timestep_distribution") for line in skipped)


@pytest.mark.parametrize("settings,listed", [
    ({"timestep_distribution": "BETA", "noising_weight": 0.5, "noising_bias": 1.0}, "timestep_distribution: BETA"),
    # a heavy-tail scale outside [-1, 2 / (pi - 2)] draws outside the noising strengths' range
    ({"timestep_distribution": "HEAVY_TAIL", "noising_weight": 3.0},
     "timestep_distribution: HEAVY_TAIL with noising_weight 3.0, noising_bias 0.0: loss.noising_weight: 3.0 is "
     "outside [-1, 1.7519]"),
    # std noising_weight + 1 = 0: the import wrote logit_normal_std 0, and the whole config failed validation
    ({"timestep_distribution": "LOGIT_NORMAL", "noising_weight": -1.0},
     "timestep_distribution: LOGIT_NORMAL with noising_weight -1.0, noising_bias 0.0: loss.logit_normal_std: Input "
     "should be greater than 0")])
def test_a_timestep_draw_ot_dist_refuses_is_listed(tmp_path, settings, listed):
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", **settings})
    lines = [line for line in skipped if line.startswith("timestep_distribution")]
    assert len(lines) == 1 and lines[0].startswith(listed)
    assert config.loss.timestep_distribution == "auto"


@pytest.mark.parametrize("settings,shift,dynamic", [
    ({"model_type": "STABLE_DIFFUSION_3"}, 1.0, "auto"),  # OneTrainer's default: unshifted, not the scheduler's 3.0
    ({"model_type": "STABLE_DIFFUSION_35", "timestep_shift": 3.0}, 3.0, "auto"),
    ({"model_type": "CHROMA_1", "timestep_shift": 2.5, "dynamic_timestep_shifting": True}, 2.5, "auto"),  # ignored
    ({"model_type": "FLUX_DEV_1"}, 1.0, "auto"),  # dynamic shifting off: unshifted, not by the resolution
    ({"model_type": "SANA"}, 1.0, "auto"),  # OneTrainer's default: unshifted, not the model's flow_shift
    ({"model_type": "FLUX_DEV_1", "timestep_shift": 2.0, "dynamic_timestep_shifting": True}, "auto", True),
    ({"model_type": "QWEN"}, 1.0, "auto"),  # BaseQwenSetup: timestep_shift unless dynamic_timestep_shifting
    ({"model_type": "QWEN", "dynamic_timestep_shifting": True}, "auto", True),
    ({"model_type": "HI_DREAM_FULL"}, 1.0, "auto"),  # BaseHiDreamSetup: timestep_shift, no dynamic shifting
    ({"model_type": "STABLE_DIFFUSION_15"}, "auto", "auto")])
def test_the_timestep_shift_is_mapped(tmp_path, settings, shift, dynamic):
    """OneTrainer shifts SD3 / Flux / Chroma timesteps by timestep_shift (1.0: none), Flux by the resolution with
    dynamic_timestep_shifting (its SD3 / Chroma setups ignore that switch, its Flux setup then timestep_shift)."""
    config, skipped = import_only(tmp_path, {"training_method": "LORA", **settings})
    assert (config.loss.timestep_shift, config.loss.dynamic_timestep_shifting) == (shift, dynamic)
    assert not any(line.startswith(("timestep_shift", "dynamic_timestep_shifting")) for line in skipped)


@pytest.mark.parametrize("model_type,listed", [("FLUX_DEV_1", True), ("STABLE_DIFFUSION_3", True),
                                               ("HI_DREAM_FULL", True), ("Z_IMAGE", False), ("QWEN", False)])
def test_the_text_attention_mask_switch_is_listed_where_onetrainer_reads_it(tmp_path, model_type, listed):
    """transformer.attention_mask: OneTrainer's Flux, SD3 and HiDream setups read it (HiDream zeroes T5's and Llama's
    outputs at the padding), which ot_dist does not do: listed. Its Z-Image and Qwen-Image setups never read it."""
    _, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "LORA",
                                        "transformer": {"attention_mask": True}})
    assert any(line.startswith("transformer.attention_mask: true") for line in skipped) == listed


@pytest.mark.parametrize("model_type", ["STABLE_DIFFUSION_15", "STABLE_DIFFUSION_XL_10_BASE", "PIXART_ALPHA",
                                        "STABLE_CASCADE_1"])
@pytest.mark.parametrize("settings,shift", [({"timestep_shift": 2.0}, 2.0), ({"timestep_shift": 0.5}, 0.5),
                                            ({"timestep_shift": 1.0}, "auto"),
                                            ({"timestep_shift": 3.0, "dynamic_timestep_shifting": True}, 3.0)])
def test_a_timestep_shift_of_a_ddpm_family_is_mapped(tmp_path, model_type, settings, shift):
    """OneTrainer shifts the discrete draw of SD / SDXL / PixArt and Würstchen / Stable Cascade by timestep_shift
    (1.0: none, as ot_dist's auto) and ignores dynamic_timestep_shifting there."""
    config, skipped = import_only(tmp_path, {"model_type": model_type, **settings})
    assert (config.loss.timestep_shift, config.loss.dynamic_timestep_shifting) == (shift, "auto")
    assert not any(line.startswith(("timestep_shift", "dynamic_timestep_shifting")) for line in skipped)


def test_sample_definitions_with_onetrainers_defaults(tmp_path):
    """SampleConfig's defaults depend on the model (SDXL: 1024 px, 30 steps, CFG 7.5, EULER_A); random_seed and an
    empty prompt (both legal in OneTrainer) are listed, not a config error."""
    samples = [{"prompt": "a cat"}, {"prompt": "a dog", "random_seed": True, "seed": 3}, {"prompt": ""},
               {"prompt": "a bird", "noise_scheduler": "DDIM"}]
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_XL_10_BASE", "sample_after": 1,
                                             "sample_after_unit": "EPOCH"}, samples=samples)
    cat, dog, bird = config.sampling.prompts
    assert (cat.width, cat.height, cat.steps, cat.guidance_scale, cat.seed) == (1024, 1024, 30, 7.5, 42)
    assert (dog.prompt, dog.seed, bird.prompt) == ("a dog", 3, "a bird")
    # each prompt carries its own sampler (SDXL's default EULER_A; bird's DDIM) and OneTrainer's cfg_rescale (0: the
    # schedule is not zero-terminal-SNR), explicitly, whatever ot_dist's defaults are
    assert [(p.sampler, p.guidance_rescale) for p in (cat, dog, bird)] == [("euler_a", 0.0), ("euler_a", 0.0),
                                                                             ("ddim", 0.0)]
    assert config.sampling.sampler == "auto" and config.sampling.non_ema_samples is False  # EMA off
    assert [line.split(":")[0] for line in skipped] == ["samples[1].random_seed", "samples[2]"]


@pytest.mark.parametrize("model_type, expected", [("QWEN", (1024, 1024, 25, 3.5)), ("SANA", (1024, 1024, 20, 4.5)),
                                                   ("HI_DREAM_FULL", (1024, 1024, 28, 5.0))])
def test_sample_defaults_of_the_newer_model_types(tmp_path, model_type, expected):
    """SampleConfig._get_model_defaults' is_qwen() and is_sana() branches (OneTrainer 23df383, August 2026)."""
    config, _ = import_only(tmp_path, {"model_type": model_type}, samples=[{"prompt": "a cat"}])
    [cat] = config.sampling.prompts
    assert (cat.width, cat.height, cat.steps, cat.guidance_scale) == expected


def test_anima_samples_take_onetrainers_anima_defaults(tmp_path):
    """SampleConfig._get_model_defaults' is_anima() branch (1024 px, 25 steps, cfg 4.0, its negative prompt) and
    AnimaSampler's 64 px grid."""
    config, _ = import_only(tmp_path, {"model_type": "ANIMA"}, samples=[{"prompt": "a cat"},
                                                                       {"prompt": "a dog", "width": 520, "height": 1000}])
    cat, dog = config.sampling.prompts
    assert (cat.width, cat.height, cat.steps, cat.guidance_scale) == (1024, 1024, 25, 4.0)
    assert cat.negative_prompt == "worst quality, low quality, score_1, score_2, score_3, artist name"
    assert (dog.width, dog.height) == (512, 1024)


# OneTrainer's NoiseScheduler (modules/util/enum/NoiseScheduler.py) -> the scheduler create_noise_scheduler builds.
NOISE_SCHEDULERS = {"DDIM": "ddim", "EULER": "euler", "EULER_A": "euler_a", "DPMPP": "dpmpp_2m", "DPMPP_SDE": "dpmpp_sde",
                    "UNIPC": "unipc", "EULER_KARRAS": "euler_karras", "DPMPP_KARRAS": "dpmpp_2m_karras",
                    "DPMPP_SDE_KARRAS": "dpmpp_sde_karras", "UNIPC_KARRAS": "unipc_karras"}


@pytest.mark.parametrize("model_type", ["STABLE_DIFFUSION_15", "PIXART_SIGMA"])
def test_every_noise_scheduler_is_the_prompts_sampler(tmp_path, model_type):
    """OneTrainer's SD / SDXL / PixArt samplers build each sample's noise_scheduler: every value becomes that prompt's
    sampler, none is listed."""
    samples = [{"prompt": f"a cat {name}", "noise_scheduler": name} for name in NOISE_SCHEDULERS]
    config, skipped = import_only(tmp_path, {"model_type": model_type}, samples=samples)
    assert [p.sampler for p in config.sampling.prompts] == list(NOISE_SCHEDULERS.values())
    assert not any("noise_scheduler" in line for line in skipped), skipped


@pytest.mark.parametrize("settings,rescale,non_ema", [
    # OneTrainer's SD samplers: cfg_rescale 0.7 with the zero-terminal-SNR schedule (force_last_timestep), else 0
    ({"model_type": "STABLE_DIFFUSION_XL_10_BASE", "rescale_noise_scheduler_to_zero_terminal_snr": True}, 0.7, False),
    # with the EMA on, non_ema_sampling (on by default) samples the trained weights too
    ({"model_type": "STABLE_DIFFUSION_15", "ema": "GPU"}, 0.0, True),
    ({"model_type": "STABLE_DIFFUSION_15", "ema": "CPU", "non_ema_sampling": False}, 0.0, False),
    # Flux: its own scheduler (noise_scheduler ignored, not listed) and no cfg_rescale
    ({"model_type": "FLUX_DEV_1", "ema": "GPU"}, None, True),
])
def test_cfg_rescale_and_non_ema_sampling_are_carried(tmp_path, settings, rescale, non_ema):
    config, skipped = import_only(tmp_path, settings, samples=[{"prompt": "a cat", "noise_scheduler": "EULER"}])
    [cat] = config.sampling.prompts
    assert cat.guidance_rescale == rescale and config.sampling.non_ema_samples is non_ema
    assert cat.sampler == (None if settings["model_type"] == "FLUX_DEV_1" else "euler")
    assert not any(line.startswith(("samples", "non_ema")) for line in skipped), skipped


def test_a_noise_scheduler_ot_dist_lacks_sample_inpainting_and_skip_first_are_listed(tmp_path):
    samples = [{"prompt": "a cat", "noise_scheduler": "LCM"},
               {"prompt": "a dog", "sample_inpainting": True, "base_image_path": "b.png", "mask_image_path": "m.png"}]
    config, skipped = import_only(tmp_path, {"sample_skip_first": 2, "sample_after_unit": "EPOCH"}, samples=samples)
    assert config.sampling.prompts[0].sampler is None
    assert [line.split(":")[0] for line in skipped if line.startswith("sample")] == [
        "samples[0].noise_scheduler", "samples[1].sample_inpainting", "sample_skip_first"]
    assert any(line.startswith("samples[0].noise_scheduler: LCM is not an ot_dist sampler") for line in skipped)


@pytest.mark.parametrize("model_type,sizes", [
    ("STABLE_DIFFUSION_3", (512, 992)), ("FLUX_DEV_1", (512, 1024)), ("STABLE_DIFFUSION_XL_10_BASE", (512, 1024)),
    ("STABLE_DIFFUSION_15", (520, 1000)), ("SANA", (512, 992)), ("QWEN", (512, 1024))])
def test_sample_sizes_are_the_ones_onetrainer_samples(tmp_path, model_type, sizes):
    """OneTrainer's samplers round width and height to their model's grid (round(side / q) x q: 16 for SD3, 64 for
    SDXL and Flux, 8 for SD 1.x): the imported prompt samples that size, which the pipeline accepts."""
    config, _ = import_only(tmp_path, {"model_type": model_type}, samples=[{"prompt": "a cat", "width": 520,
                                                                             "height": 1000}])
    [cat] = config.sampling.prompts
    assert (cat.width, cat.height) == sizes


def test_a_flux_samples_negative_prompt_is_listed_not_kept(tmp_path):
    """OneTrainer's Flux sampler takes a negative prompt and ignores it (no classifier-free guidance pass)."""
    config, skipped = import_only(tmp_path, {"model_type": "FLUX_DEV_1"},
                                  samples=[{"prompt": "a cat", "negative_prompt": "blurry"}])
    assert config.sampling.prompts[0].negative_prompt == ""
    assert any(line.startswith("samples[0].negative_prompt: flux samples without") for line in skipped)


def test_random_hue_turns_by_half_the_max_strength(tmp_path):
    """mgds RandomHue shifts the hue by uniform(-s/2, s/2) of a turn for random_hue_max_strength s; ot_dist's `hue`
    is the turn's bound itself."""
    concepts = [{"path": str(tmp_path / "images"), "image": {"enable_random_hue": True,
                                                             "random_hue_max_strength": 0.4}}]
    config, _ = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "concepts": concepts})
    assert config.data.concepts[0].hue == 0.2


def test_jitter_strengths_of_1_or_more_import(tmp_path):
    """OneTrainer takes any max strength (mgds clamps the drawn factor at 0); the import was a config error at 1."""
    image = {"enable_random_brightness": True, "random_brightness_max_strength": 1.0,
             "enable_random_contrast": True, "random_contrast_max_strength": 1.5}
    config, _ = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15",
                                       "concepts": [{"path": str(tmp_path / "images"), "image": image}]})
    assert (config.data.concepts[0].brightness, config.data.concepts[0].contrast) == (1.0, 1.5)


def test_windows_paths(tmp_path):
    """A config saved on Windows: relative paths are converted, absolute ones listed; the run is named after the
    file, not the whole Windows path."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "concepts.json").write_text(json.dumps([{"path": "D:\\data\\cats", "name": "cats"},
                                                                {"path": "images\\dogs"}]))
    (tmp_path / "images" / "dogs").mkdir(parents=True)
    config, skipped = import_only(tmp_path, {"concepts": None, "concept_file_name": "cfg\\concepts.json",
                                             "base_model_name": "C:\\models\\sd15.safetensors",
                                             "output_model_destination": "C:\\OneTrainer\\models\\my lora.safetensors"})
    assert config.mlflow.run_name == "my lora"
    assert config.data.concepts[1].path == "images/dogs"
    assert {line.split(": ")[0] for line in skipped} == {"base_model_name", "output_model_destination",
                                                          "concepts[0] (cats).path"}


def test_old_concept_files_and_crop_jitter(tmp_path):
    """ConceptConfig versions 0 / 1 had `repeats` and `validation_concept`; enable_crop_jitter (on by default) is a
    random crop, here with latent caching off."""
    images = str(tmp_path / "images")
    config, _ = import_only(tmp_path, {"latent_caching": False, "validation": True, "concepts": [
        {"path": images, "repeats": 3.0}, {"path": images, "name": "held", "validation_concept": True}]})
    trained, held = config.data.concepts
    assert (trained.balancing, held.type) == (3.0, "validation")
    assert config.data.crop == "random"


def test_lora_model_name_continues_that_lora(tmp_path):
    config, _ = import_only(tmp_path, {"training_method": "LORA", "lora_model_name": "/loras/start.safetensors"})
    assert config.lora.init_from == "/loras/start.safetensors"


def test_a_continued_lora_trains_at_the_files_alpha_as_in_onetrainer(tmp_path):
    """OneTrainer loads the continued file's `.alpha` tensors into its LoRA modules (a buffer each), so it trains and
    saves them at the file's alpha / rank, not lora_alpha's: the import takes the file's alpha as lora.alpha."""
    import torch
    from safetensors.torch import save_file

    start = tmp_path / "start.safetensors"
    save_file({"lora_unet_a.lora_down.weight": torch.randn(4, 8), "lora_unet_a.lora_up.weight": torch.randn(8, 4),
               "lora_unet_a.alpha": torch.tensor(8.0)}, str(start))
    settings = {"training_method": "LORA", "lora_rank": 4, "lora_alpha": 1.0}
    config, _ = import_only(tmp_path, {**settings, "lora_model_name": str(start)})
    assert (config.lora.init_from, config.lora.alpha) == (str(start), 8.0)
    config, _ = import_only(tmp_path, {**settings, "lora_model_name": str(tmp_path / "elsewhere.safetensors")})
    assert config.lora.alpha == 1.0  # not on this machine: kept, with a note


@pytest.mark.parametrize("optimizer,schedule,scheduler", [
    # transformers' AdafactorSchedule only reports the step size: without relative steps the rate is constant
    ({"optimizer": "ADAFACTOR", "relative_step": False}, "ADAFACTOR", ("CONSTANT", 0)),
    ({"optimizer": "ADAMW"}, "ADAFACTOR", ("CONSTANT", 0)),
    ({"optimizer": "ADAFACTOR", "relative_step": True}, "ADAFACTOR", ("ADAFACTOR", 0)),
    # OneTrainer forces schedule-free optimizers to CONSTANT; SCHEDULE_FREE_ADAMW takes the warmup (200) as its own
    # count of optimizer steps: 800 micro steps with 4 accumulated
    ({"optimizer": "SCHEDULE_FREE_ADAMW"}, "COSINE", ("CONSTANT", 800)),
    ({"optimizer": "PRODIGY_PLUS_SCHEDULE_FREE"}, "LINEAR", ("CONSTANT", 0)),
])
def test_schedules_as_onetrainer_builds_them(tmp_path, optimizer, schedule, scheduler):
    config, _ = import_only(tmp_path, {"training_method": "LORA", "learning_rate_scheduler": schedule,
                                       "gradient_accumulation_steps": 4, "optimizer": optimizer})
    assert (config.scheduler.name, config.scheduler.warmup_steps) == scheduler


@pytest.mark.parametrize("scaler,factor", [("BATCH", 2.0), ("GRADIENT_ACCUMULATION", 3.0), ("BOTH", 6.0)])
def test_learning_rate_scaler_is_applied(tmp_path, scaler, factor):
    """Every parameter group's learning rate times sqrt(batch / accumulation / both), as OneTrainer's groups."""
    config, _ = import_only(tmp_path, {"training_method": "LORA", "learning_rate": 1e-4, "batch_size": 4,
                                       "gradient_accumulation_steps": 9, "learning_rate_scaler": scaler,
                                       "text_encoder": {"learning_rate": 1e-5}})
    assert (config.learning_rate, config.text_encoder.learning_rate) == pytest.approx((1e-4 * factor, 1e-5 * factor))


def test_fixed_resolution_pixart_vb_loss_and_no_bucketing(tmp_path):
    """resolution "WxH" is mgds' one fixed size (listed); PixArt's vb_loss_strength; aspect_ratio_bucketing off is
    ot_dist's square bucket (mgds SingleAspectCalculation: every image covered and cropped to the square)."""
    config, skipped = import_only(tmp_path, {"model_type": "PIXART_SIGMA", "resolution": "1024x768",
                                             "vb_loss_strength": 0.5, "aspect_ratio_bucketing": False})
    assert (config.resolution, config.loss.vb_loss_strength) == (896, 0.5)  # a square of about the same area
    assert "resolution" in {line.split(":")[0] for line in skipped}
    assert config.data.bucket_assignment == "square"
    (tmp_path / "on").mkdir()
    assert import_only(tmp_path / "on", {"model_type": "PIXART_SIGMA"})[0].data.bucket_assignment == "rounded_aspect"


@pytest.mark.parametrize("model_type,settings,lora", [
    # the UI writes the preset's patterns into layer_filter; a built-in preset names only the preset
    ("STABLE_DIFFUSION_15", {"layer_filter_preset": "attn-only", "layer_filter": "attn"}, {"preset": "attention"}),
    ("STABLE_DIFFUSION_XL_10_BASE", {"layer_filter_preset": "attn-only"}, {"preset": "attention"}),
    ("STABLE_DIFFUSION_15", {"layer_filter_preset": "attn-mlp", "layer_filter": "attentions"}, {"preset": "default"}),
    # "full" (OneTrainer's default): every Linear and Conv2d (test_lora_layouts.py: all_layers adapts those)
    ("STABLE_DIFFUSION_15", {"layer_filter_preset": "full", "layer_filter": ""}, {"preset": "all_layers"}),
    ("STABLE_DIFFUSION_XL_10_BASE", {}, {"preset": "all_layers"}),
    ("PIXART_SIGMA", {"layer_filter_preset": "attn-mlp"}, {"preset": "attention_mlp"}),
    # Sana: attn1, attn2, "ff." (its Mix-FFN's convolutions; the depthwise one left out, noted)
    ("SANA", {"layer_filter_preset": "attn-mlp"}, {"preset": "attention_mlp"}),
    ("SANA", {"layer_filter_preset": "attn-only"}, {"preset": "attention"}),
    # Qwen-Image: "attn" (both streams' projections), with img_mlp and txt_mlp
    ("QWEN", {"layer_filter_preset": "attn-only"}, {"preset": "attention"}),
    ("QWEN", {"layer_filter_preset": "attn-mlp"}, {"preset": "attention_mlp"}),
    # HiDream: attn1 holds both streams' attention; ff_i (the image stream's experts) is no preset: OneTrainer's rule
    ("HI_DREAM_FULL", {"layer_filter_preset": "attn-only"}, {"preset": "attention"}),
    ("HI_DREAM_FULL", {"layer_filter_preset": "attn-mlp"}, {"layer_filter": ["attn1", "ff_i"], "preset": "default"}),
    ("CHROMA_1", {"layer_filter_preset": "custom", "layer_filter": "attn,ff.net,proj_mlp"},
     {"transformer_targets": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                              "to_add_out", "ff.net.0.proj", "ff.net.2", "proj_mlp"]}),
    # no preset is the same set: OneTrainer's own rule (lora.layer_filter; test_lora_filters_dropouts.py)
    ("FLUX_DEV_1", {"layer_filter_preset": "blocks"}, {"layer_filter": ["transformer_block"], "preset": "default"}),
    ("STABLE_DIFFUSION_15", {"layer_filter_preset": "custom", "layer_filter": r" up_blocks\.[01]\..*to_q$ ,conv1",
                             "layer_filter_regex": True},
     {"layer_filter": [r"up_blocks\.[01]\..*to_q$", "conv1"], "layer_filter_regex": True}),
    ("STABLE_DIFFUSION_15", {"layer_filter_preset": "custom", "layer_filter": "attn1, time_emb"},
     {"layer_filter": ["attn1", "time_emb"], "layer_filter_regex": False}),
])
def test_lora_layer_filter_as_onetrainer_applies_it(tmp_path, model_type, settings, lora):
    """OneTrainer adapts the modules whose names contain a layer_filter pattern (its model setups' LAYER_PRESETS)."""
    config, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "LORA", **settings})
    assert {key: getattr(config.lora, key) for key in lora} == lora
    assert not [line for line in skipped if line.startswith("layer_filter")]


@pytest.mark.parametrize("model_type,parts,targets", [
    ("STABLE_DIFFUSION_XL_10_BASE", {"text_encoder_2": {"train": True}},
     ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "text_projection"]),
    ("STABLE_DIFFUSION_XL_10_BASE", {"text_encoder": {"train": True}, "text_encoder_2": {"train": False}}, None),
    ("STABLE_DIFFUSION_3", {"text_encoder": {"train": True}, "text_encoder_3": {"train": True}}, None),
])
def test_trained_clip_with_projection_adapts_it_as_onetrainer(tmp_path, model_type, parts, targets):
    """OneTrainer adapts every Linear of a trained text encoder: a CLIP with projection (SDXL's second, SD3's, Stable
    Cascade's) also its text_projection, which makes the pooled embedding. With a T5 training beside (one
    lora.text_encoder_targets list for every encoder) it is listed instead."""
    config, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "LORA", **parts})
    assert config.lora.text_encoder_targets == targets
    assert any(line.startswith("text_encoder.text_projection") for line in skipped) == (model_type.endswith("_3"))


@pytest.mark.parametrize("settings,checkpoint", [
    # backups every 30 minutes by default, all kept; saves (save_every) are all kept too
    ({}, (None, 30, None)),
    ({"save_every": 500, "save_every_unit": "STEP", "backup_after": 10}, (500, 10, None)),
    ({"backup_after": 2, "backup_after_unit": "HOUR", "rolling_backup": True, "rolling_backup_count": 5},
     (None, 120, 5)),
    ({"backup_after_unit": "NEVER"}, (None, None, None)),
])
def test_backups_and_saves_as_checkpoints(tmp_path, settings, checkpoint):
    config, _ = import_only(tmp_path, settings)
    saved = config.checkpoint
    assert (saved.every_n_steps, saved.every_n_minutes, saved.keep_last) == checkpoint


@pytest.mark.parametrize("settings,prediction", [
    # force_v_prediction trains an SD 2.x base (epsilon) model as v-prediction: model.prediction_type; v wins over
    # epsilon where both are set (StableDiffusionFineTuneSetup: elif)
    ({"model_type": "STABLE_DIFFUSION_21_BASE", "force_v_prediction": True}, "v_prediction"),
    ({"model_type": "STABLE_DIFFUSION_XL_10_BASE", "force_v_prediction": True, "force_epsilon_prediction": True},
     "v_prediction"),
    # only OneTrainer's SD / SDXL FINE_TUNE setups read the switches: its LoRA, embedding and PixArt training ignore them
    ({"model_type": "STABLE_DIFFUSION_21_BASE", "force_v_prediction": True, "training_method": "LORA"}, "auto"),
    ({"model_type": "PIXART_SIGMA", "force_epsilon_prediction": True}, "auto"),
])
def test_forced_prediction_type(tmp_path, settings, prediction):
    config, skipped = import_only(tmp_path, settings)
    assert config.model.prediction_type == prediction
    assert any(line.startswith("force_") for line in skipped) is (prediction == "auto"), skipped


def test_an_automatic_embedding_token_count_is_imported_as_auto(tmp_path):
    """token_count null: OneTrainer sizes the embedding by the initial text's tokens (counted when the model loads:
    tests/test_embedding_init_from.py), the text itself unpadded, the placeholder lower case (several vectors); the
    same for an additional embedding."""
    config, skipped = import_only(tmp_path, {"training_method": "EMBEDDING", "latent_caching": False, "embedding": {
        "placeholder": "<Cat>", "token_count": None, "initial_embedding_text": "a grey cat"}})
    assert (config.embedding.vectors, config.embedding.init_text, config.embedding.token) == ("auto", "a grey cat",
                                                                                            "<cat>")
    assert not any("token_count" in line for line in skipped)
    (tmp_path / "lora").mkdir()
    config, skipped = import_only(tmp_path / "lora", {"training_method": "LORA", "additional_embeddings": [{
        "placeholder": "dog", "token_count": None, "initial_embedding_text": "a brown dog", "train": True}]})
    (entry,) = config.additional_embeddings
    assert (entry.vectors, entry.init_text) == ("auto", "a brown dog")
    assert not any("token_count" in line for line in skipped)


def test_concepts_and_samples_given_on_the_command_line_win(tmp_path):
    """A packed config holds its concepts and samples; --concepts / --samples name the ones to use instead."""
    from ot_dist.migrate.onetrainer import import_onetrainer

    (tmp_path / "other").mkdir()
    (tmp_path / "c.json").write_text(json.dumps([{"path": str(tmp_path / "other")}]))
    (tmp_path / "s.json").write_text(json.dumps([{"prompt": "from the file"}]))
    (tmp_path / "ot.json").write_text(json.dumps({"concepts": [{"path": str(tmp_path)}],
                                                  "samples": [{"prompt": "packed"}], "sample_after_unit": "EPOCH"}))
    config = import_onetrainer(tmp_path / "ot.json", str(tmp_path / "c.json"), str(tmp_path / "s.json")).config
    assert config["data"]["concepts"][0]["path"] == str(tmp_path / "other")
    assert config["sampling"]["prompts"][0]["prompt"] == "from the file"


def test_lokr_rank_is_lokr_dim(tmp_path):
    """OneTrainer's LoKr modules take lokr_dim as their rank (LoRAModuleWrapper), not lora_rank."""
    config, skipped = import_only(tmp_path, {"training_method": "LORA", "peft_type": "LOKR", "lora_rank": 16,
                                             "lokr_dim": 4, "lokr_decompose_factor": 8})
    assert (config.lora.variant, config.lora.rank) == ("lokr", 4)
    assert any(line.startswith("lokr_decompose_factor: 8") for line in skipped)


@pytest.mark.parametrize("settings,weighting,offset,listed", [
    # OneTrainer stores a strength for every weight function (5.0 by default); only P2 and MIN_SNR_GAMMA use it
    ({"model_type": "STABLE_DIFFUSION_15", "loss_weight_fn": "DEBIASED_ESTIMATION"},
     ("DEBIASED_ESTIMATION", 5.0), False, None),
    ({"model_type": "STABLE_DIFFUSION_3", "loss_weight_fn": "SIGMA", "loss_weight_strength": 2.0},
     ("SIGMA", 5.0), False, None),
    ({"model_type": "STABLE_DIFFUSION_15", "loss_weight_fn": "P2", "loss_weight_strength": 1.5}, ("P2", 1.5),
     False, None),
    ({"model_type": "STABLE_DIFFUSION_15", "loss_weight_fn": "MIN_SNR_GAMMA", "loss_weight_strength": 3.0},
     ("MIN_SNR_GAMMA", 3.0), False, None),
    # what OneTrainer stops on at its first step is listed, and the rest of the config imports
    ({"model_type": "FLUX_DEV_1", "loss_weight_fn": "MIN_SNR_GAMMA"}, ("CONSTANT", 5.0), False,
     "loss_weight_fn: MIN_SNR_GAMMA is not defined for flux"),
    ({"model_type": "STABLE_DIFFUSION_XL_10_BASE", "loss_weight_fn": "SIGMA"}, ("CONSTANT", 5.0), False,
     "loss_weight_fn: SIGMA is not defined for sdxl"),
    # generalized offset noise: plain offset noise on a flow model (as OneTrainer falls back), nothing without an offset
    ({"model_type": "FLUX_DEV_1", "generalized_offset_noise": True, "offset_noise_weight": 0.1}, ("CONSTANT", 5.0),
     False, "generalized_offset_noise: true needs DDPM betas"),
    ({"model_type": "STABLE_DIFFUSION_15", "generalized_offset_noise": True}, ("CONSTANT", 5.0), False,
     "generalized_offset_noise: true scales the offset noise, and offset_noise_weight is 0"),
    ({"model_type": "STABLE_DIFFUSION_15", "generalized_offset_noise": True, "offset_noise_weight": 0.1},
     ("CONSTANT", 5.0), True, None),
])
def test_loss_weighting_and_offset_noise_import_as_onetrainer_applies_them(tmp_path, settings, weighting, offset,
                                                                            listed):
    """Each imports to a config that validates (a strength on DEBIASED_ESTIMATION / SIGMA, or an SNR weight on a
    flow model, made the whole import fail before)."""
    config, skipped = import_only(tmp_path, {"training_method": "LORA", **settings})
    assert config.loss.weighting() == weighting
    assert config.loss.generalized_offset_noise is offset
    if listed:
        assert any(line.startswith(listed) for line in skipped), skipped
    else:
        assert not any(line.startswith(("loss_weight_fn", "generalized_offset_noise")) for line in skipped)


@pytest.mark.parametrize("settings,zero_terminal_snr,prediction", [
    # OneTrainer's SD / SDXL setups rescale the schedule and force v-prediction, force_epsilon_prediction or not
    ({"model_type": "STABLE_DIFFUSION_15", "training_method": "LORA"}, True, "v_prediction"),
    ({"model_type": "STABLE_DIFFUSION_XL_10_BASE", "force_epsilon_prediction": True}, True, "v_prediction"),
    # its PixArt setups ignore the switch: listed, and the model trains as OneTrainer trains it
    ({"model_type": "PIXART_SIGMA"}, False, "auto"),
])
def test_zero_terminal_snr_as_onetrainer_applies_it(tmp_path, settings, zero_terminal_snr, prediction):
    config, skipped = import_only(tmp_path, {"rescale_noise_scheduler_to_zero_terminal_snr": True, **settings})
    assert config.model.zero_terminal_snr is zero_terminal_snr
    assert config.model.prediction_type == "auto"
    assert (config.model.training_prediction_type() or "auto") == prediction
    listed = [line for line in skipped if line.startswith("rescale_noise_scheduler_to_zero_terminal_snr")]
    assert bool(listed) is not zero_terminal_snr, listed


@pytest.mark.parametrize("scaler", ["BATCH", "GLOBAL_BATCH", "GRADIENT_ACCUMULATION", "BOTH", "GLOBAL_BOTH"])
def test_loss_scaler_is_imported(tmp_path, scaler):
    config, skipped = import_only(tmp_path, {"loss_scaler": scaler})
    assert config.loss.scaler == scaler and not any(line.startswith("loss_scaler") for line in skipped)


def test_prior_prediction_concepts_of_other_methods_are_listed(tmp_path):
    """OneTrainer's prior model is the model without its LoRA ("only available with LoRA training")."""
    concepts = [{"path": str(tmp_path / "images")}, {"name": "distill", "path": str(tmp_path / "images"),
                                                    "type": "PRIOR_PREDICTION"}]
    config, skipped = import_only(tmp_path, {"training_method": "FINE_TUNE", "concepts": concepts})
    assert [c.type for c in config.data.concepts] == ["standard"]
    assert any(line.startswith("concepts[1] (distill).type: PRIOR_PREDICTION") and "LORA only" in line
               for line in skipped), skipped


def test_concept_prompt_files_tag_dropout_one_and_lowercasing(tmp_path):
    """prompt_source concept: OneTrainer draws one of the prompt file's lines per image (mgds SelectRandomText), so
    every line is a caption (the first alone was used); tag dropout probability 1 (its UI: 0 to 1) imports; Force
    Lowercase (caps_randomize_lowercase) lower-cases even with randomisation off, and imports as lowercase_caption."""
    (tmp_path / "prompts.txt").write_text("a photo of sks\n\n  sks on grass \n")
    config, skipped = import_only(tmp_path, {"concepts": [{"path": str(tmp_path / "images"), "text": {
        "prompt_source": "concept", "prompt_path": str(tmp_path / "prompts.txt"), "tag_dropout_enable": True,
        "tag_dropout_probability": 1.0, "caps_randomize_lowercase": True}}]})
    concept = config.data.concepts[0]
    assert (concept.caption_source, concept.caption_text) == ("text", "a photo of sks\nsks on grass")
    assert (concept.tag_dropout_mode, concept.tag_dropout_probability) == ("full", 1.0)
    assert concept.lowercase_caption and skipped == []


@pytest.mark.parametrize("text,count,expected", [
    ("red circle", 4, ["red", "circle", "*", "*"]),  # ot_dist alone repeats the text: red circle red circle
    ("red circle on grass", 2, ["red", "circle"]),
    ("", 3, ["*", "*", "*"]), ("*", 2, ["*", "*"]), ("red", 1, ["red"]),
])
def test_an_imported_embedding_starts_from_onetrainers_rows(tmp_path, text, count, expected):
    """OneTrainer starts the vectors at the rows of the initial text's tokens, cut at token_count, and fills the rest
    with the token of "*" (ModelSetupEmbeddingMixin._create_new_embedding)."""
    from ot_dist.methods.token_vectors import init_token_ids
    from ot_dist.models.tiny import tiny_clip_tokenizer

    config, _ = import_only(tmp_path, {"training_method": "EMBEDDING", "latent_caching": False, "embedding": {
        "placeholder": "<cat>", "token_count": count, "initial_embedding_text": text}})
    tokenizer = tiny_clip_tokenizer()
    rows = [tokenizer(word, add_special_tokens=False).input_ids[0] for word in expected]
    assert init_token_ids(tokenizer, config.embedding.init_text, config.embedding.vectors) == rows


def test_an_upper_case_placeholder_of_several_vectors_is_imported_lower_case(tmp_path):
    """OneTrainer swaps its placeholder for its own tokens whatever their case; ot_dist needs a token of several
    vectors in lower case (diffusers expands only that), and matches it in captions in any case."""
    from ot_dist.migrate.onetrainer import import_onetrainer

    (tmp_path / "images").mkdir()
    (tmp_path / "ot.json").write_text(json.dumps({"training_method": "EMBEDDING", "latent_caching": False,
                                                  "concepts": [{"path": str(tmp_path / "images")}],
                                                  "embedding": {"placeholder": "<MyChar>", "token_count": 2}}))
    imported = import_onetrainer(tmp_path / "ot.json")
    assert imported.config["embedding"]["token"] == "<mychar>"
    assert any(note.startswith("embedding.placeholder: <MyChar> is written <mychar>") for note in imported.notes)



def test_additional_embeddings_are_imported_and_bundled_by_default(tmp_path):
    """OneTrainer's additional_embeddings (TrainEmbeddingConfig each, one embedding_learning_rate for all) become
    additional_embeddings entries; bundle_additional_embeddings (OneTrainer's default: true) is kept for LoRA; a .pt
    continued file is listed, a placeholder with a space rewritten. Output embeddings: tests/test_output_embeddings.py
    (the import of is_output_embedding below)."""
    embeddings = [
        {"placeholder": "<Cat Toy>", "token_count": 2, "initial_embedding_text": "cat", "stop_training_after": 3,
         "stop_training_after_unit": "STEP"},
        {"placeholder": "<style>", "model_name": "emb/style.safetensors", "train": False},
        {"placeholder": "<old>", "model_name": "emb/old.pt"},
    ]
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": "LORA",
                                             "embedding_learning_rate": 3e-3, "additional_embeddings": embeddings})
    first, style, old = config.additional_embeddings
    assert (first.token, first.vectors, first.init_text, first.learning_rate) == ("<cat_toy>", 2, "cat *", 3e-3)
    assert (first.stop_training_after, first.stop_training_after_unit) == (3, "step")
    assert (style.token, style.init_from, style.train) == ("<style>", "emb/style.safetensors", False)
    assert (old.token, old.init_from, old.init_text) == ("<old>", None, "*")
    assert config.bundle_additional_embeddings is True
    assert any(s.startswith("additional_embeddings[2].model_name: emb/old.pt") for s in skipped)

    config, _ = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": "FINE_TUNE",
                                       "bundle_additional_embeddings": True,
                                       "additional_embeddings": [{"placeholder": "<a>"}]})
    assert [e.token for e in config.additional_embeddings] == ["<a>"]
    assert config.bundle_additional_embeddings is False  # OneTrainer bundles into LoRA files only


@pytest.mark.parametrize("method,embeddings,preserved", [
    ("EMBEDDING", [], True),
    ("LORA", [{"placeholder": "<a>"}], True),
    ("FINE_TUNE", [{"placeholder": "<a>"}, {"placeholder": "<b>", "model_name": "emb/b.safetensors", "train": False}],
     True),
    # nothing trains a vector: OneTrainer's rescale does nothing, and ot_dist refuses the option there
    ("LORA", [{"placeholder": "<b>", "model_name": "emb/b.safetensors", "train": False}], False),
])
def test_preserve_embedding_norm_is_imported(tmp_path, method, embeddings, preserved):
    """OneTrainer's preserve_embedding_norm becomes ot_dist's (ot_dist/train/embedding_norm.py), not a listed line."""
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": method,
                                             "preserve_embedding_norm": True, "additional_embeddings": embeddings})
    assert config.preserve_embedding_norm is preserved
    assert not any("preserve_embedding_norm" in line for line in skipped)
    config, _ = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": method,
                                       "additional_embeddings": embeddings})
    assert config.preserve_embedding_norm is False  # OneTrainer's default


@pytest.mark.parametrize("model_type,t5", [("CHROMA_1", "text_encoder"), ("PIXART_SIGMA", "text_encoder"),
                                           ("PIXART_ALPHA", "text_encoder"), ("FLUX_DEV_1", "text_encoder_2"),
                                           ("STABLE_DIFFUSION_3", "text_encoder_3")])
def test_t5_embeddings_are_imported(tmp_path, model_type, t5):
    """OneTrainer trains the embedding's vectors in the T5 too (its *ModelEmbedding: a vector per text encoder; the
    file's `t5` key): method embedding and additional embeddings of the T5 families import and validate, and a T5
    part's train_embedding: false (ot_dist trains every encoder's vectors) is listed. tests/test_t5_embeddings.py."""
    from ot_dist.models.families.registry import get_family

    config, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "EMBEDDING",
                                             "embedding": {"placeholder": "<tok>", "token_count": 2}})
    assert config.method == "embedding" and t5 in get_family(config.model.family).embedding_keys and not skipped
    config, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "LORA",
                                             "additional_embeddings": [{"placeholder": "<add>"}]})
    assert [e.token for e in config.additional_embeddings] == ["<add>"]
    assert not any("embedding" in line for line in skipped)
    _, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "EMBEDDING",
                                        t5: {"train_embedding": False}})
    assert skipped == [f"{t5}.train_embedding: false: ot_dist trains the embedding in every encoder that takes one"]
    # an output embedding: every one of these T5s takes one (OneTrainer's t5 / t5_out; Flux's CLIP-L and SD3's CLIPs
    # beside it as OneTrainer's Flux and SD3 embeddings have them)
    config, skipped = import_only(tmp_path, {"model_type": model_type, "training_method": "EMBEDDING",
                                             "embedding": {"placeholder": "<tok>", "is_output_embedding": True}})
    assert t5 in get_family(config.model.family).output_embedding_keys
    assert config.embedding.output_embedding and not skipped


def test_cached_variations_keep_latent_caching_of_augmented_concepts(tmp_path):
    """OneTrainer caches image_variations augmented versions of each image (mgds DiskCache) and text_variations
    versions of each caption: the concepts keep their numbers, and latent caching stays on where they make the
    augmentation cacheable; an augmenting concept with one variation still turns it off (ot_dist refuses one fixed
    augmented version)."""
    from ot_dist.migrate.onetrainer import import_onetrainer

    images = str(tmp_path / "images")
    flip = {"enable_random_flip": True}
    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "concepts": [
        {"path": images, "image": flip, "image_variations": 3, "text_variations": 2},
        {"path": images, "name": "plain", "image": {"enable_crop_jitter": False}}]})
    varied, plain = config.data.concepts
    assert (varied.image_variations, varied.text_variations, varied.flip_probability) == (3, 2, 0.5)
    assert (plain.image_variations, plain.text_variations) == (1, 1)
    assert config.data.cache_latents and not config.data.cache_text
    assert not any("variations" in line for line in skipped)
    imported = import_onetrainer(tmp_path / "ot.json")
    assert any(note.startswith("text_variations: ") for note in imported.notes)

    config, _ = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "concepts": [
        {"path": images, "image": flip, "image_variations": 3}, {"path": images, "image": flip}]})
    assert not config.data.cache_latents  # the second concept has one variation
    (tmp_path / "ot.json").write_text(json.dumps({"model_type": "STABLE_DIFFUSION_15", "concepts": [
        {"path": images, "image": flip}]}))
    assert any("image_variations > 1 caches that many versions" in note
               for note in import_onetrainer(tmp_path / "ot.json").notes)


@pytest.mark.parametrize("settings,tokens", [
    ({"model_type": "FLUX_DEV_1"}, 77),  # text_encoder_2_sequence_length's default
    ({"model_type": "FLUX_DEV_1", "text_encoder_2_sequence_length": 512}, None),  # ot_dist's default
    ({"model_type": "STABLE_DIFFUSION_3"}, 77),  # StableDiffusion3Model pads T5 to 77, ot_dist to 256
    ({"model_type": "CHROMA_1"}, None)])  # the tokenizer's 512, as ot_dist
def test_the_t5_caption_length_is_onetrainers(tmp_path, settings, tokens):
    config, _ = import_only(tmp_path, {"training_method": "LORA", **settings})
    assert config.model.t5_max_tokens == tokens


def test_loss_functions_import_with_their_strengths(tmp_path):
    """OneTrainer's mse / mae / log_cosh / huber strengths (and huber_delta where the Huber term is on) are ot_dist's
    loss options of the same names; all of them 0 (OneTrainer fails on its first step) is listed."""
    settings = {"training_method": "LORA", "model_type": "STABLE_DIFFUSION_15", "mse_strength": 0.5,
                "mae_strength": 0.25, "log_cosh_strength": 1.0, "huber_strength": 0.5, "huber_delta": 0.3}
    config, skipped = import_only(tmp_path, settings)
    loss = config.loss
    assert (loss.mse_strength, loss.mae_strength, loss.log_cosh_strength, loss.huber_strength, loss.huber_delta) == \
        (0.5, 0.25, 1.0, 0.5, 0.3)
    assert not any("strength" in line for line in skipped), skipped
    config, _ = import_only(tmp_path, {**settings, "huber_strength": 0.0})
    assert config.loss.huber_delta is None  # OneTrainer stores it always; it shapes nothing there
    config, skipped = import_only(tmp_path, {**settings, "mse_strength": 0.0, "mae_strength": 0.0,
                                             "log_cosh_strength": 0.0, "huber_strength": 0.0})
    assert config.loss.plain_mse() and any(line.startswith("mse_strength, mae_strength") for line in skipped)


def test_output_embeddings_are_imported(tmp_path):
    """is_output_embedding: true becomes output_embedding: true (method embedding's and an additional one's), with
    OneTrainer's initial text as it is (both start from the encoder's output of the text and a "*" per vector); an
    LoRA's bundling, which takes no output embedding, is listed and left off; a family without output embeddings
    (HiDream's T5 / Llama) and SD's and Sana's layer skip list the entry instead."""
    config, skipped = import_only(tmp_path, {
        "model_type": "STABLE_DIFFUSION_XL_10_BASE", "training_method": "EMBEDDING",
        "embedding": {"placeholder": "<main>", "token_count": 3, "initial_embedding_text": "a dog",
                      "is_output_embedding": True},
        "additional_embeddings": [{"placeholder": "<out>", "is_output_embedding": True}, {"placeholder": "<in>"}]})
    assert (config.embedding.output_embedding, config.embedding.vectors, config.embedding.init_text) == \
        (True, 3, "a dog")
    out, plain = config.additional_embeddings
    assert (out.token, out.output_embedding, out.init_text) == ("<out>", True, "*")
    assert plain.output_embedding is False
    assert not any("is_output_embedding" in s for s in skipped)

    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": "LORA",
                                             "additional_embeddings": [{"placeholder": "<out>",
                                                                        "is_output_embedding": True}]})
    assert config.additional_embeddings[0].output_embedding and not config.bundle_additional_embeddings
    assert any(s.startswith("bundle_additional_embeddings: true: additional_embeddings[0] is an output embedding")
               for s in skipped)

    config, skipped = import_only(tmp_path, {"model_type": "STABLE_DIFFUSION_15", "training_method": "EMBEDDING",
                                             "text_encoder_layer_skip": 1,
                                             "embedding": {"placeholder": "<main>", "is_output_embedding": True}})
    assert config.embedding.output_embedding is False
    assert any(s.startswith("embedding.is_output_embedding: true (an embedding of the text encoder's output): not "
                            "with model.text_encoder_layer_skip") for s in skipped)
    config, skipped = import_only(tmp_path, {"model_type": "SANA", "training_method": "EMBEDDING",
                                             "embedding": {"placeholder": "<main>", "is_output_embedding": True}})
    assert config.embedding.output_embedding and not any("is_output_embedding" in s for s in skipped)
    config, skipped = import_only(tmp_path, {"model_type": "SANA", "training_method": "EMBEDDING",
                                             "text_encoder_layer_skip": 1,
                                             "embedding": {"placeholder": "<main>", "is_output_embedding": True}})
    assert config.embedding.output_embedding is False  # Sana's layer skip, as SD's
    assert any(s.startswith("embedding.is_output_embedding: true (an embedding of the text encoder's output): not "
                            "with model.text_encoder_layer_skip") for s in skipped)
    config, skipped = import_only(tmp_path, {"model_type": "HI_DREAM_FULL", "training_method": "LORA",
                                             "additional_embeddings": [{"placeholder": "<out>",
                                                                        "is_output_embedding": True}]})
    assert not config.additional_embeddings
    assert any(s.startswith("additional_embeddings[0].is_output_embedding: true (an embedding of the text encoder's "
                            "output): hidream takes no output embeddings") for s in skipped)


@pytest.mark.parametrize("base,family", [("black-forest-labs/FLUX.2-klein-base-9B", "flux2_klein"),
                                         ("black-forest-labs/FLUX.2-dev", "flux2")])
def test_flux2_presets_import_as_dev_or_klein_by_the_base_model(tmp_path, base, family):
    """OneTrainer's one FLUX_2 model type (training_presets/Flux 2/#flux2 LoRA 16GB.json, klein-base-9B) is flux2_klein
    for a [klein] base model and flux2 for [dev]: its `blocks` layer filter stays OneTrainer's rule, dynamic timestep
    shifting on, [dev]'s transformer guidance_scale carried, a caption length other than 512 named as not honoured."""
    preset = {"base_model_name": base, "batch_size": 2, "learning_rate": 3e-5, "model_type": "FLUX_2",
              "resolution": "512", "output_model_format": "DIFFUSERS_LORA",
              "transformer": {"train": True, "weight_dtype": "FLOAT_8", "guidance_scale": 2.0},
              "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"}, "training_method": "LORA",
              "vae": {"weight_dtype": "FLOAT_32"}, "train_dtype": "BFLOAT_16", "output_dtype": "BFLOAT_16",
              "layer_filter": "transformer_block", "layer_filter_preset": "blocks",
              "timestep_distribution": "LOGIT_NORMAL", "dynamic_timestep_shifting": True,
              "text_encoder_sequence_length": 256}
    config, not_honoured = import_only(tmp_path, preset)
    assert config.model.family == family
    assert config.lora.layer_filter == ["transformer_block"]
    assert config.loss.dynamic_timestep_shifting is True
    assert config.model.guidance_scale == (2.0 if family == "flux2" else None)
    assert any(line.startswith("text_encoder_sequence_length: 256") for line in not_honoured), not_honoured


def test_krea2_preset_imports_as_the_krea2_family(tmp_path):
    """training_presets/Krea 2/#krea2 LoRA 24GB.json: model type KREA_2 is krea2, the transformer trains (the text
    encoder not), its attn-mlp filter ("attn", "ff") is OneTrainer's own substring rule, BaseKrea2Setup reads
    dynamic_timestep_shifting, and Krea2Sampler's defaults (28 steps, cfg 3.5, sides on a 64 px grid) are taken."""
    preset = {"base_model_name": "krea/Krea-2-Raw", "batch_size": 2, "learning_rate": 0.0003, "model_type": "KREA_2",
              "output_model_format": "DIFFUSERS_LORA", "resolution": "512", "compile": True,
              "transformer": {"train": True, "weight_dtype": "INT_W8A8"},
              "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"}, "training_method": "LORA",
              "vae": {"weight_dtype": "FLOAT_32"}, "train_dtype": "BFLOAT_16", "weight_dtype": "BFLOAT_16",
              "output_dtype": "BFLOAT_16", "timestep_distribution": "LOGIT_NORMAL", "layer_filter": "attn,ff",
              "layer_filter_preset": "attn-mlp", "dynamic_timestep_shifting": True,
              "samples": [{"prompt": "a fox", "width": 1000, "height": 700}]}
    config, _ = import_only(tmp_path, preset)
    assert config.model.family == "krea2" and config.method == "lora"
    assert config.part_trains("transformer") and not config.part_trains("text_encoder")
    assert config.lora.layer_filter == ["attn", "ff"] and not config.lora.layer_filter_regex
    assert config.loss.dynamic_timestep_shifting is True
    (sample,) = config.sampling.prompts
    assert (sample.steps, sample.guidance_scale, sample.width, sample.height) == (28, 3.5, 1024, 704)
    (tmp_path / "attn").mkdir()
    attention, _ = import_only(tmp_path / "attn", {"model_type": "KREA_2", "training_method": "LORA",
                                                   "layer_filter_preset": "attn-only"})
    assert attention.lora.preset == "attention"


def test_ernie_preset_imports_as_onetrainer_trains_it(tmp_path):
    """training_presets/Ernie Image/#ernie LoRA 16GB.json: model type ERNIE is ernie_image, its attn-mlp layer filter
    (self_attention, mlp) kept as OneTrainer's own substring rule, the transformer alone trained, the draw unshifted
    (timestep_shift 1.0) unless dynamic_timestep_shifting (BaseErnieSetup reads it); samples on the 16 px grid."""
    preset = {"model_type": "ERNIE", "base_model_name": "/models/ernie", "training_method": "LORA", "batch_size": 2,
              "learning_rate": 3e-4, "output_model_format": "DIFFUSERS_LORA", "resolution": "512", "compile": True,
              "transformer": {"train": True, "weight_dtype": "INT_W8A8"},
              "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"}, "vae": {"weight_dtype": "FLOAT_32"},
              "train_dtype": "BFLOAT_16", "output_dtype": "BFLOAT_16", "layer_filter": "self_attention,mlp",
              "layer_filter_preset": "attn-mlp",
              "quantization": {"layer_filter": "layers", "layer_filter_preset": "blocks"},
              "timestep_distribution": "LOGIT_NORMAL"}
    config, _ = import_only(tmp_path, preset)
    assert config.model.family == "ernie_image"
    assert (config.part_trains("transformer"), config.part_trains("text_encoder")) == (True, False)
    assert config.lora.layer_filter == ["self_attention", "mlp"] and not config.lora.layer_filter_regex
    assert (config.loss.timestep_shift, config.loss.dynamic_timestep_shifting) == (1.0, "auto")
    config, _ = import_only(tmp_path, {**preset, "layer_filter": "", "layer_filter_preset": "attn-only",
                                       "dynamic_timestep_shifting": True})
    assert config.lora.preset == "attention" and config.loss.dynamic_timestep_shifting is True
    samples = [{"prompt": "a dog", "width": 1010, "height": 530}]
    config, _ = import_only(tmp_path, preset, samples=samples)
    (prompt,) = config.sampling.prompts
    assert (prompt.width, prompt.height, prompt.guidance_scale, prompt.steps) == (1008, 528, 4.0, 25)


def test_ideogram4_preset_maps_to_the_ideogram4_family(tmp_path):
    """training_presets/Ideogram 4/#ideogram LoRA 24GB.json: IDEOGRAM_4 -> ideogram4, its attn-mlp filter (attention,
    feed_forward) the family's default preset, the transformer trained alone, OneTrainer's unshifted draw unless
    dynamic_timestep_shifting (BaseIdeogramSetup: then e^mu of the pipeline's resolution-aware mu); its sample default
    (SampleConfig: 1024 px, 25 steps, cfg 3.0)."""
    preset = {"base_model_name": "/models/Ideogram-4-Diffusers", "batch_size": 2, "learning_rate": 5e-5,
              "model_type": "IDEOGRAM_4", "output_model_format": "COMFY_LORA", "resolution": "512", "compile": True,
              "transformer": {"train": True, "weight_dtype": "FLOAT_8"},
              "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"}, "training_method": "LORA",
              "vae": {"weight_dtype": "FLOAT_32"}, "train_dtype": "BFLOAT_16", "output_dtype": "BFLOAT_16",
              "layer_filter": "attention,feed_forward", "layer_filter_preset": "attn-mlp",
              "timestep_distribution": "LOGIT_NORMAL"}
    config, _ = import_only(tmp_path, preset, samples=[{"prompt": "a cat"}])
    assert config.model.family == "ideogram4" and config.method == "lora"
    assert {part: config.part_trains(part) for part in ("transformer", "text_encoder")} == {
        "transformer": True, "text_encoder": False}
    assert "preset" not in config.lora.model_fields_set and config.lora.layer_filter is None  # the default preset
    assert (config.loss.timestep_shift, config.loss.dynamic_timestep_shifting) == (1.0, "auto")
    (sample,) = config.sampling.prompts
    assert (sample.width, sample.height, sample.steps, sample.guidance_scale) == (1024, 1024, 25, 3.0)
    for filter_preset, expected in (("attn-only", "attention"),):
        config, _ = import_only(tmp_path, {**preset, "layer_filter": "attention", "layer_filter_preset": filter_preset,
                                           "dynamic_timestep_shifting": True})
        assert config.lora.preset == expected and config.loss.dynamic_timestep_shifting is True


def test_hunyuan_video_preset_imports_to_the_hunyuan_video_family(tmp_path):
    """OneTrainer's HUNYUAN_VIDEO (training_presets/Hunyuan Video/#hunyuan video LoRA.json): the hunyuan_video family,
    its `blocks` layer filter (every linear of the dual- and single-stream blocks, `transformer_blocks` matching both),
    the transformer's guidance_scale as model.guidance_scale where it is not OneTrainer's 1.0, Llama's layer skip."""
    preset = {"base_model_name": "hunyuanvideo-community/HunyuanVideo", "model_type": "HUNYUAN_VIDEO",
              "training_method": "LORA", "batch_size": 4, "learning_rate": 0.0003, "output_model_format": "COMFY_LORA",
              "resolution": "512", "timestep_distribution": "LOGIT_NORMAL", "dynamic_timestep_shifting": False,
              "train_dtype": "BFLOAT_16",
              "transformer": {"train": True, "weight_dtype": "FLOAT_8", "offload_fraction": 0.5},
              "text_encoder": {"train": False, "weight_dtype": "FLOAT_8", "offload_fraction": 0.5},
              "text_encoder_2": {"train": False, "weight_dtype": "FLOAT_8"},
              "layer_filter": "transformer_blocks", "layer_filter_preset": "blocks"}
    config, skipped = import_only(tmp_path, preset)
    assert config.model.family == "hunyuan_video" and config.method == "lora"
    assert config.model.guidance_scale is None  # OneTrainer's 1.0, the family's default
    assert config.loss.timestep_shift == 1.0  # OneTrainer's default: unshifted (the scheduler's 7.0 otherwise)
    assert config.lora.layer_filter == ["transformer_blocks"]
    assert {part: config.part_trains(part) for part in ("transformer", "text_encoder", "text_encoder_2")} == {
        "transformer": True, "text_encoder": False, "text_encoder_2": False}
    config, _ = import_only(tmp_path, {**preset, "transformer": {"train": True, "guidance_scale": 3.5},
                                       "text_encoder_layer_skip": 1})
    assert config.model.guidance_scale == 3.5 and config.model.text_encoder_layer_skip == 1


def test_hunyuan_video_samples_and_layer_presets_take_onetrainers_defaults(tmp_path):
    """HunyuanVideoSampler's defaults (848 x 480 rounded to its 64 px grid, 30 steps, the distilled guidance 6.0) and
    BaseHunyuanVideoSetup's attn-only preset (every Linear named attn.*: both streams' and the refiner's projections),
    ot_dist's attention preset."""
    config, _ = import_only(tmp_path, {"model_type": "HUNYUAN_VIDEO", "training_method": "LORA",
                                       "layer_filter_preset": "attn-only", "sample_after": 1,
                                       "sample_after_unit": "EPOCH"}, samples=[{"prompt": "a cat"}])
    assert config.lora.preset == "attention"
    (prompt,) = config.sampling.prompts
    assert (prompt.width, prompt.height, prompt.steps, prompt.guidance_scale) == (832, 512, 30, 6.0)


def test_a_transformer_from_its_own_file_is_read_as_a_single_file_over_the_base(tmp_path):
    """`transformer.model_name` (OneTrainer loads the transformer from that file with the base model's config, the
    rest from the base): model.path the file, model.config the base. A URL is listed (ot_dist does not download);
    a family without a single-file layout lists it too."""
    base = {"model_type": "Z_IMAGE", "training_method": "LORA", "base_model_name": "/models/z-image"}
    config, skipped = import_only(tmp_path, {**base, "transformer": {"model_name": "/models/de_turbo.safetensors"}})
    assert (config.model.path, config.model.config) == ("/models/de_turbo.safetensors", "/models/z-image")
    assert not any("model_name" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**base, "transformer": {
        "model_name": "https://huggingface.co/ostris/Z-Image-De-Turbo/blob/main/z_image_de_turbo_v1_bf16.safetensors"}})
    assert (config.model.path, config.model.config) == ("/models/z-image", None)
    assert any(line.startswith("transformer.model_name: https://") and "is a URL" in line for line in skipped)
    config, skipped = import_only(tmp_path, {"model_type": "SANA", "training_method": "LORA",
                                             "base_model_name": "/models/sana",
                                             "transformer": {"model_name": "/models/t.safetensors"}})
    assert config.model.path == "/models/sana"
    assert any(line.startswith("transformer.model_name: /models/t.safetensors (a separately") for line in skipped)


def test_layer_offloading_streams_the_frozen_denoiser_and_lists_what_ot_dist_keeps_on_the_device(tmp_path):
    """OneTrainer's `offload_fraction` (training_presets/QwenImage/#qwen LoRA 16GB.json, Flux 2 LoRA 8GB): a LoRA's
    transformer as `transformer.offload_fraction` (with gradient checkpointing, which it needs), a frozen text
    encoder's and Ideogram's unconditional transformer's as offload_frozen_components; a trained transformer's
    (FINE_TUNE presets) streams with the fused back pass; the transformer's activation offloading is honoured, a
    text encoder's listed."""
    lora = {"model_type": "QWEN", "training_method": "LORA", "base_model_name": "/models/qwen",
            "transformer": {"train": True, "weight_dtype": "FLOAT_8", "offload_fraction": 0.5,
                            "gradient_checkpointing": False},
            "text_encoder": {"train": False, "weight_dtype": "FLOAT_8", "offload_fraction": 0.7}}
    config, skipped = import_only(tmp_path, lora)
    assert (config.transformer.offload_fraction, config.gradient_checkpointing) == (0.5, True)
    assert config.offload_frozen_components and config.component_storage("transformer") == "float8"
    assert not any("offload" in line for line in skipped)
    # a trained transformer (the FINE_TUNE presets) streams too, stepped in backward: with the fused back pass, which
    # OneTrainer requires for it as well
    fine_tune = {**lora, "training_method": "FINE_TUNE", "train_dtype": "BFLOAT_16"}
    config, skipped = import_only(tmp_path, {**fine_tune, "optimizer": {"optimizer": "ADAFACTOR"}})
    assert (config.transformer.offload_fraction, config.optimizer.fused_back_pass) == (0.5, True)
    # OneTrainer's fused step clips each gradient by its own norm (its default clip_grad_norm 1.0)
    assert config.streams_trained_weights() and (config.clip_grad_norm, config.clip_grad_norm_scope) == (1.0, "per_tensor")
    assert not any("offload" in line for line in skipped)
    for changed, why in (({"optimizer": {"optimizer": "PRODIGY"}}, "PRODIGY has not"),
                         ({"optimizer": {"optimizer": "ADAFACTOR"}, "train_dtype": "FLOAT_16"}, "train_dtype float16")):
        config, skipped = import_only(tmp_path, {**fine_tune, **changed})
        assert config.transformer.offload_fraction == 0.0 and not config.optimizer.fused_back_pass
        assert any(line.startswith("transformer.offload_fraction: 0.5: the transformer trains") and why in line
                   for line in skipped), skipped
    # with accumulation the streamed weights stay on the device (they are stepped in each backward); the fused back
    # pass a user turned on imports as it trains in OneTrainer: accumulated, each gradient clipped by its own norm
    config, skipped = import_only(tmp_path, {**fine_tune, "optimizer": {"optimizer": "ADAFACTOR"},
                                             "gradient_accumulation_steps": 4})
    assert config.transformer.offload_fraction == 0.0 and config.gradient_accumulation_steps == 4
    assert any(line.startswith("transformer.offload_fraction: 0.5: the transformer trains") and
               "gradient_accumulation_steps 4" in line for line in skipped), skipped
    plain = {**fine_tune, "transformer": {"train": True}, "gradient_accumulation_steps": 4, "clip_grad_norm": 0.5,
             "optimizer": {"optimizer": "ADAFACTOR", "fused_back_pass": True}}
    config, skipped = import_only(tmp_path, plain)
    assert (config.optimizer.fused_back_pass, config.gradient_accumulation_steps) == (True, 4)
    assert (config.clip_grad_norm, config.clip_grad_norm_scope) == (0.5, "per_tensor")
    assert not any("fused" in line or "clip" in line for line in skipped), skipped
    # on several GPUs (multi_gpu): OneTrainer's fused gradient reduce, each gradient averaged inside backward, within
    # its async buffer (async_gradient_reduce false: each waits for its own reduce)
    multi = {**fine_tune, "optimizer": {"optimizer": "ADAFACTOR"}, "multi_gpu": True}
    for extra, buffer in (({"async_gradient_reduce_buffer": 40}, 40), ({"async_gradient_reduce": False}, 0), ({}, 100)):
        config, skipped = import_only(tmp_path, {**multi, **extra})
        assert (config.strategy, config.optimizer.fused_back_pass, config.streams_trained_weights()) == ("ddp", True, True)
        assert config.ddp.fused_reduce_buffer_mb == buffer
        assert not any("offload" in line or "fused" in line for line in skipped), skipped
    # gradient_reduce_precision: the dtype gradients are averaged in, and (FLOAT_32_STOCHASTIC, the default) the
    # float32 average rounded back into bfloat16 gradients stochastically; all honoured
    for precision, dtype, rounding in (("FLOAT_32", "float32", "nearest"), ("FLOAT_32_STOCHASTIC", "float32", "stochastic"),
                                       ("WEIGHT_DTYPE", "bfloat16", "nearest"),
                                       ("WEIGHT_DTYPE_STOCHASTIC", "bfloat16", "nearest")):
        config, skipped = import_only(tmp_path, {**multi, "gradient_reduce_precision": precision, "transformer": {
            **multi["transformer"], "weight_dtype": "BFLOAT_16"}})
        assert (config.trained_weight_dtype, config.ddp.reduce_dtype, config.ddp.reduce_rounding) == (
            "bfloat16", dtype, rounding)
        assert not any(line.startswith("gradient_reduce_precision") for line in skipped), skipped
    config, _ = import_only(tmp_path, multi)  # float32 weights: nothing to round
    assert (config.ddp.reduce_dtype, config.ddp.reduce_rounding) == ("float32", "nearest")
    # the transformer's activation offloading is honoured (gradient checkpointing with it); a text encoder's is listed
    config, skipped = import_only(tmp_path, {**lora, "transformer": {"train": True, "activation_offloading": True}})
    assert config.activation_offloading and config.gradient_checkpointing
    assert not any("activation_offloading" in line for line in skipped)
    config, skipped = import_only(tmp_path, {**fine_tune, "optimizer": {"optimizer": "ADAFACTOR"},
                                             "text_encoder": {"train": True, "activation_offloading": True}})
    assert not config.activation_offloading
    assert any(line.startswith("text_encoder: activation_offloading") for line in skipped), skipped
    config, skipped = import_only(tmp_path, {"model_type": "IDEOGRAM_4", "training_method": "LORA",
                                             "base_model_name": "/models/ideogram",
                                             "unconditional_transformer": {"offload_fraction": 1.0}})
    assert config.offload_frozen_components and not any("offload" in line for line in skipped)


def test_compile_and_the_attention_mechanism_become_performance_options(tmp_path):
    """`compile` (the transformer's blocks, as OneTrainer compiles them) and `attention_mechanism` (SDP: torch's
    choice; FLASH, CUDNN: SDPA's kernels) as performance.compile / attention_backend; compile beside streamed blocks
    too (their forward compiled: train/fast_path.py compile_forward); FLEX attention is listed."""
    base = {"model_type": "Z_IMAGE", "training_method": "LORA", "base_model_name": "/models/z"}
    config, skipped = import_only(tmp_path, {**base, "compile": True, "attention_mechanism": "CUDNN"})
    assert (config.performance.compile, config.performance.attention_backend) == (True, "cudnn")
    config, _ = import_only(tmp_path, {**base, "attention_mechanism": "FLASH"})
    assert (config.performance.compile, config.performance.attention_backend) == (False, "flash")
    config, skipped = import_only(tmp_path, {**base, "compile": True, "attention_mechanism": "FLEX",
                                             "transformer": {"train": True, "offload_fraction": 0.6}})
    assert (config.performance.compile, config.performance.attention_backend) == (True, "auto")
    assert config.transformer.offload_fraction == 0.6
    assert not any(line.startswith("compile") for line in skipped)
    assert any(line.startswith("attention_mechanism: FLEX") for line in skipped)


# OneTrainer's top-level TrainConfig keys (modules/util/config/TrainConfig.py `default_values()`, the mirror's HEAD of
# November 2026, config version 11).
ONETRAINER_TOP_LEVEL_KEYS = (
    "training_method", "model_type", "debug_mode", "debug_dir", "workspace_dir", "cache_dir",
    "huggingface_cache_dir", "offline_mode", "tensorboard", "tensorboard_expose", "tensorboard_always_on",
    "tensorboard_port", "validation", "validate_after", "validate_after_unit", "continue_last_backup",
    "prevent_overwrites", "include_train_config", "multi_gpu", "device_indexes", "gradient_reduce_precision",
    "fused_gradient_reduce", "async_gradient_reduce", "async_gradient_reduce_buffer", "base_model_name",
    "output_dtype", "output_model_format", "output_model_destination", "async_offloading", "force_circular_padding",
    "compile", "concept_file_name", "concepts", "aspect_ratio_bucketing", "latent_caching",
    "clear_cache_before_training", "learning_rate_scheduler", "custom_learning_rate_scheduler", "scheduler_params",
    "learning_rate", "learning_rate_warmup_steps", "learning_rate_cycles", "learning_rate_min_factor", "epochs",
    "batch_size", "gradient_accumulation_steps", "ema", "ema_decay", "ema_update_step_interval",
    "dataloader_threads", "train_device", "temp_device", "train_dtype", "fallback_train_dtype",
    "enable_autocast_cache", "only_cache", "resolution", "frames", "attention_mechanism", "mse_strength",
    "mae_strength", "log_cosh_strength", "huber_strength", "huber_delta", "vb_loss_strength", "loss_weight_fn",
    "loss_weight_strength", "dropout_probability", "loss_scaler", "learning_rate_scaler", "clip_grad_norm",
    "offset_noise_weight", "generalized_offset_noise", "perturbation_noise_weight",
    "rescale_noise_scheduler_to_zero_terminal_snr", "force_v_prediction", "force_epsilon_prediction",
    "min_noising_strength", "max_noising_strength", "timestep_distribution", "noising_weight", "noising_bias",
    "timestep_shift", "dynamic_timestep_shifting", "unet", "prior", "transformer", "unconditional_transformer",
    "quantization", "text_encoder", "text_encoder_layer_skip", "text_encoder_sequence_length", "text_encoder_2",
    "text_encoder_2_layer_skip", "text_encoder_2_sequence_length", "text_encoder_3", "text_encoder_3_layer_skip",
    "text_encoder_4", "text_encoder_4_layer_skip", "vae", "effnet_encoder", "decoder", "decoder_text_encoder",
    "decoder_vqgan", "masked_training", "unmasked_probability", "unmasked_weight", "normalize_masked_area_loss",
    "masked_prior_preservation_weight", "custom_conditioning_image", "layer_filter", "layer_filter_preset",
    "layer_filter_regex", "embedding_learning_rate", "preserve_embedding_norm", "embedding",
    "additional_embeddings", "embedding_weight_dtype", "cloud", "peft_type", "lora_model_name", "lora_rank",
    "lora_alpha", "lora_decompose", "lora_decompose_norm_epsilon", "lora_decompose_output_axis",
    "lora_weight_dtype", "bundle_additional_embeddings", "oft_block_size", "oft_block_share", "oft_scaled",
    "lokr_dim", "lokr_decompose_both", "lokr_decompose_factor", "lokr_use_tucker", "lokr_weight_decompose",
    "lokr_dora_on_output", "lokr_full_matrix", "lokr_vec_trick", "optimizer", "optimizer_defaults",
    "sample_definition_file_name", "samples", "sample_after", "sample_after_unit", "sample_skip_first",
    "sample_image_format", "sample_video_format", "sample_audio_format", "samples_to_tensorboard",
    "non_ema_sampling", "backup_after", "backup_after_unit", "rolling_backup", "rolling_backup_count",
    "backup_before_save", "save_every", "save_every_unit", "save_skip_first", "save_filename_prefix", "secrets",
)


def test_every_onetrainer_setting_is_read_listed_or_of_no_effect():
    """No top-level setting is dropped without a line: each is read by one of the import's modules, compared with its
    default and listed (onetrainer_unmapped.CHANGES_TRAINING, `quantization`, `multi_gpu`), or named as having no
    effect on what trains (NO_EFFECT: folders, TensorBoard, devices...)."""
    from ot_dist.migrate import onetrainer_unmapped

    import ot_dist.migrate

    folder = Path(ot_dist.migrate.__file__).parent
    sources = "".join(p.read_text() for p in folder.glob("onetrainer*.py")
                      if p.name != "onetrainer_unmapped.py")
    handled = set(onetrainer_unmapped.CHANGES_TRAINING) | onetrainer_unmapped.NO_EFFECT | {"quantization", "multi_gpu"}
    dropped = [k for k in ONETRAINER_TOP_LEVEL_KEYS if k not in handled and f'"{k}"' not in sources]
    assert not dropped, dropped


# The keys of OneTrainer's nested sections (modules/util/config/TrainConfig.py, config version 11):
# TrainModelPartConfig, QuantizationConfig and TrainEmbeddingConfig
ONETRAINER_PART_KEYS = {"model_name", "include", "train", "stop_training_after", "stop_training_after_unit",
                        "learning_rate", "weight_dtype", "dropout_probability", "train_embedding", "attention_mask",
                        "guidance_scale", "gradient_checkpointing", "offload_fraction", "activation_offloading"}
ONETRAINER_QUANTIZATION_KEYS = {"layer_filter", "layer_filter_preset", "layer_filter_regex", "svd_dtype", "svd_rank",
                                "cache_dir"}
ONETRAINER_EMBEDDING_KEYS = {"uuid", "model_name", "placeholder", "train", "stop_training_after",
                             "stop_training_after_unit", "token_count", "initial_embedding_text", "is_output_embedding"}


def test_a_nested_setting_onetrainer_version_11_lacks_is_listed(tmp_path):
    """A key in a part section, the quantization filter or an embedding that config version 11 does not have (a newer
    OneTrainer's setting, a hand edit) is listed as not applied; every key version 11 has is read without a line."""
    from ot_dist.migrate.onetrainer_unmapped import nested_sections

    sections = {name: known for name, _, known in nested_sections({"additional_embeddings": [{}]})}
    assert sections["unet"] == sections["text_encoder_2"] == ONETRAINER_PART_KEYS
    assert sections["quantization"] == ONETRAINER_QUANTIZATION_KEYS
    assert sections["embedding"] == sections["additional_embeddings[0]"] == ONETRAINER_EMBEDDING_KEYS
    base = {"model_type": "STABLE_DIFFUSION_XL_10_BASE", "training_method": "LORA", "base_model_name": "/models/xl",
            "unet": {"weight_dtype": "BFLOAT_16", "offload_fraction": 0.0, "activation_offloading": False},
            "quantization": dict.fromkeys(ONETRAINER_QUANTIZATION_KEYS) | {"layer_filter": "", "svd_dtype": "NONE"}}
    _, skipped = import_only(tmp_path, base)
    assert not [line for line in skipped if "config version 11" in line], skipped
    _, skipped = import_only(tmp_path, {**base, "unet": {**base["unet"], "fp8_attention": True},
                                        "quantization": {**base["quantization"], "group_size": 64},
                                        "additional_embeddings": [{"placeholder": "<x>", "vector_norm": 0.4}]})
    listed = [line.split(":")[0] for line in skipped if "is not a setting of OneTrainer's config version 11" in line]
    assert listed == ["unet.fp8_attention", "quantization.group_size", "additional_embeddings[0].vector_norm"]


def test_settings_no_other_section_reads_are_listed_where_they_change_training(tmp_path):
    base = {"model_type": "STABLE_DIFFUSION_XL_10_BASE", "training_method": "LORA", "base_model_name": "/models/xl"}
    config, skipped = import_only(tmp_path, base)
    assert config.strategy == "single" and not any(
        line.split(":")[0] in ("force_circular_padding", "quantization") for line in skipped)
    config, skipped = import_only(tmp_path, {**base, "force_circular_padding": True, "multi_gpu": True,
                                             "sample_image_format": "PNG", "tensorboard": True,
                                             "quantization": {"layer_filter": "attn,ff", "layer_filter_preset": "attn-mlp"}})
    assert config.strategy == "ddp"
    assert any(line.startswith("force_circular_padding: True: circular padding") for line in skipped)
    assert config.quantization.layer_filter is None  # the UNet is stored in float32: nothing to choose
    assert any(line.startswith("sample_image_format: PNG") for line in skipped)
    assert not any(line.startswith("tensorboard") for line in skipped)
    config, skipped = import_only(tmp_path, {**base, "unet": {"weight_dtype": "FLOAT_8"},
                                             "quantization": {"layer_filter": "attentions, ^up_", "layer_filter_regex": True,
                                                              "svd_dtype": "BFLOAT_16"}})
    assert (config.quantization.layer_filter, config.quantization.layer_filter_regex) == (["attentions", "^up_"], True)
    assert any(line.startswith("quantization.svd_dtype: BFLOAT_16") for line in skipped)
