"""`ot-dist import onetrainer` (issue 17): OneTrainer-shaped configs (field names and enum values of OneTrainer's
modules/util/config/TrainConfig.py, ConceptConfig.py, SampleConfig.py, config version 11, and the flat keys of
version 0) for an SD 1.5 LoRA, an SDXL finetune and an SD 1.5 embedding become ot_dist configs that validate, keep
the settings' meaning, list what they cannot honour, and train 2 steps each."""

from __future__ import annotations

import contextlib
import io
import json

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
                      "image": {"enable_random_flip": True, "enable_fixed_flip": True}},
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
    concept, held = config.data.concepts  # the disabled one is not imported, nor OneTrainer's PRIOR_PREDICTION
    assert (held.name, held.type) == ("held", "validation") and concept.type == "standard"
    assert (config.validation.every_n_steps, config.validation.every_n_epochs) == (3, None)
    assert "PRIOR_PREDICTION" in err and "distill" in err
    assert (concept.balancing, concept.caption_source) == (2.0, "txt")
    assert (concept.tag_shuffling, concept.keep_tags_count) == (True, 2)
    [prompt] = config.sampling.prompts
    assert (prompt.prompt, prompt.seed, prompt.steps, prompt.guidance_scale) == ("a red circle", 7, 3, 5.0)
    assert config.sampling.every_n_epochs == 2
    assert config.output_dir == "models/my_lora"
    assert concept.flip_probability == 0.5  # OneTrainer's random flip
    # a fixed flip has no ot_dist equivalent: said in the file and on stderr
    assert "enable_fixed_flip" in err and "NOT HONOURED" in text and "enable_fixed_flip" in text


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
    assert (config.embedding.token, config.embedding.vectors, config.embedding.init_text) == ("<shape>", 2, "shape")
    assert config.data.concepts[0].caption_source == "filename"
    assert config.gradient_checkpointing is False
    # OneTrainer's EMBEDDING trains the embedding only, whatever its parts' train flags: no part section is written
    assert not {"unet", "text_encoder"} & set(yaml.safe_load((tmp_path / "emb.yaml").read_text()))


@pytest.mark.parametrize("change,message", [({"model_type": "HUNYUAN_VIDEO"}, "model_type: HUNYUAN_VIDEO"),
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
