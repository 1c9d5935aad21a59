"""`ot-dist import simpletuner`: SimpleTuner setups (config.json with `--flag` keys, config.toml, config.env, the
multidatabackend.json of its datasets, lycoris_config.json, a user prompt library) become ot_dist configs that
validate and keep each setting's meaning, with everything ot_dist cannot honour listed. Each config below states, per
key, what SimpleTuner's documentation (documentation/OPTIONS.md, DATALOADER.md) says it does; no process is
launched. SimpleTuner's defaults are its parser's (`get_argument_parser()` of SimpleTuner bc8e6ab, August 2026, as
ot_dist/migrate/simpletuner_defaults.py records them)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from ot_dist.cli import main
from ot_dist.config.load import load_config


def run_import(*args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["import", "simpletuner", *map(str, args)])
    return code, err.getvalue()


def images(folder: Path, names: list[str], captions: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(folder / f"{name}.png")
        if captions and name in captions:
            (folder / f"{name}.txt").write_text(captions[name], encoding="utf-8")
    return folder


def setup(tmp_path: Path, config: dict, backends: list[dict] | None = None) -> Path:
    """SimpleTuner's layout: config/config.json and config/multidatabackend.json below the folder it runs in."""
    (tmp_path / "config").mkdir(exist_ok=True)
    if backends is None:
        images(tmp_path / "data" / "cats", ["cat"], {"cat": "a cat"})
        backends = [{"id": "cats", "type": "local", "instance_data_dir": "data/cats", "caption_strategy": "textfile"}]
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(backends), encoding="utf-8")
    config = {"--data_backend_config": "config/multidatabackend.json", "--pretrained_model_name_or_path": "model",
              **config}
    path = tmp_path / "config" / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def imported(tmp_path: Path, config: dict, backends: list[dict] | None = None, *extra) -> tuple[dict, str]:
    out = tmp_path / "out.yaml"
    code, err = run_import(setup(tmp_path, config, backends), "--out", out, "--force", *extra)
    assert code == 0, err
    text = out.read_text(encoding="utf-8")
    load_config(out)  # what is written is a config ot_dist accepts
    return yaml.safe_load(text), text


def test_lora_config_with_several_datasets(tmp_path):
    """An SDXL LoRA over four datasets maps key by key, each dataset a concept, and the file loads."""
    images(tmp_path / "data" / "dogs", ["dog"], {"dog": "a dog\na dog on grass"})
    images(tmp_path / "data" / "named", ["a red car"])
    images(tmp_path / "data" / "reg", ["r0", "r1"])
    images(tmp_path / "data" / "sub" / "deeper", ["x"], {"x": "deep"})
    backends = [
        {"id": "dogs", "type": "local", "instance_data_dir": "data/dogs",
         "caption_strategy": "textfile",          # img.txt beside img.png, each line a caption
         "prepend_instance_prompt": True, "instance_prompt": "sks",  # "sks " before every caption
         "repeats": 2,                             # every image 2 more times per epoch
         "cache_dir_vae": "cache/vae/dogs"},       # where SimpleTuner keeps its latents
        {"id": "named", "type": "local", "instance_data_dir": "data/named",
         "caption_strategy": "filename"},          # the file name is the caption
        {"id": "reg", "type": "local", "instance_data_dir": "data/reg",
         "caption_strategy": "instanceprompt", "instance_prompt": "a photo of a dog",  # one caption for all
         "is_regularisation_data": True},          # LoRA: trained towards the base model's prediction
        {"id": "nested", "type": "local", "instance_data_dir": "data/sub", "caption_strategy": "textfile"},
        {"id": "off", "type": "local", "instance_data_dir": "data/none", "disabled": True},  # left out
        {"id": "embeds", "dataset_type": "text_embeds", "default": True, "type": "local", "cache_dir": "cache/te"},
    ]
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "prompts.json").write_text(json.dumps(
        {"dog": "a dog in the snow", "car": {"prompt": "a red car"}}), encoding="utf-8")
    config, text = imported(tmp_path, {
        "--model_family": "sdxl", "--model_type": "lora",
        "--lora_rank": 32, "--lora_alpha": "16",   # the update scaled by alpha / rank
        "--lora_dropout": 0.0,
        "--learning_rate": "1e-4", "--train_batch_size": 2, "--gradient_accumulation_steps": 2,
        "--max_train_steps": 3000, "--num_train_epochs": 0,  # steps, not epochs
        "--optimizer": "bnb-adamw8bit", "--optimizer_config": "weight_decay=0.02,eps=1e-8",
        "--lr_scheduler": "linear", "--lr_warmup_steps": 100,  # optimizer steps
        "--checkpointing_steps": 250,              # the old name of checkpoint_step_interval
        "--checkpoints_total_limit": 3,
        "--validation_prompt": "a dog", "--user_prompt_library": "config/prompts.json",
        "--validation_resolution": "1024,832x1216", "--validation_step_interval": 200,
        "--validation_guidance": 5.0, "--validation_num_inference_steps": "25", "--validation_seed": 7,
        "--mixed_precision": "bf16", "--seed": 3, "--resolution": 1024, "--resolution_type": "pixel_area",
        "--snr_gamma": 5, "--use_ema": "true", "--ema_decay": 0.999,
        "--report_to": "wandb",                     # logging: noted, changes nothing trained
    }, backends)
    assert config["model"] == {"family": "sdxl", "path": "model"}
    assert config["method"] == "lora"
    assert config["lora"] == {"rank": 32, "alpha": 16.0, "unet_targets": ["to_k", "to_q", "to_v", "to_out.0"]}
    assert (config["learning_rate"], config["batch_size"], config["gradient_accumulation_steps"]) == (1e-4, 2, 2)
    assert (config["max_steps"], config["seed"], config["train_dtype"], config["weight_dtype"]) == \
        (3000, 3, "bfloat16", "bfloat16")
    assert config["optimizer"] == {"name": "ADAMW_8BIT", "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.02,
                                   "eps": 1e-8}
    assert config["scheduler"] == {"name": "LINEAR", "warmup_steps": 200}  # x accumulation: ot_dist's micro steps
    assert config["checkpoint"] == {"every_n_minutes": None, "every_n_steps": 250, "keep_last": 3}
    assert config["loss"] == {"min_snr_gamma": 5}
    assert config["ema"] == {"enabled": True, "decay": 0.999, "update_step_interval": 1, "device": "cpu"}
    assert (config["resolution"], config["data"]["bucket_step"], config["data"]["crop"]) == (1024, 64, "center")
    dogs, named, reg, nested = config["data"]["concepts"]
    assert dogs == {"path": str(tmp_path / "data" / "dogs"), "name": "dogs", "include_subdirectories": True,
                    "caption_source": "txt", "caption_extension": ".txt", "caption_prefix": "sks", "balancing": 3,
                    "caption_dropout_probability": 0.1}
    assert named["caption_source"] == "filename" and "balancing" not in named
    assert reg["type"] == "prior_prediction" and reg["caption_source"] == "text"
    assert reg["caption_text"] == "a photo of a dog"
    assert nested["include_subdirectories"] is True
    prompts = config["sampling"]["prompts"]
    assert [(p["prompt"], p["width"], p["height"]) for p in prompts] == [
        ("a dog", 1024, 1024), ("a dog", 832, 1216), ("a dog in the snow", 1024, 1024),
        ("a dog in the snow", 832, 1216), ("a red car", 1024, 1024), ("a red car", 832, 1216)]
    assert {(p["steps"], p["guidance_scale"], p["seed"], p["negative_prompt"]) for p in prompts} == \
        {(25, 5.0, 7, "blurry, cropped, ugly")}
    assert config["sampling"]["every_n_steps"] == 200
    assert config["sampling"]["use_ema"] is True and config["sampling"]["non_ema_samples"] is True  # comparison
    assert "report_to: 'wandb' is ignored" in text
    assert "[off]: disabled" in text and "[embeds]: a text_embeds cache" in text


def test_defaults_are_simpletuners(tmp_path):
    """A setup that sets only the model and the data trains as SimpleTuner's parser defaults say, not as ot_dist's:
    a full finetune, learning rate 4e-7, batch 4, one epoch, bf16 with AdamW on bfloat16 weights (eps 1e-6, weight
    decay 1e-2), constant schedule, gradient checkpointing, 10% caption dropout, a checkpoint every 500 steps (5
    kept), 1024 px pixel_area, and its gradient clip by value (listed)."""
    from ot_dist.migrate.simpletuner_defaults import ARGS

    # SimpleTuner's own parser defaults (documentation/OPTIONS.md agrees), as recorded from it
    assert {k: ARGS[k] for k in ("model_type", "learning_rate", "train_batch_size", "num_train_epochs",
                                 "max_train_steps", "optimizer", "lr_scheduler", "mixed_precision", "lora_rank",
                                 "lora_alpha", "lora_dropout", "gradient_checkpointing", "caption_dropout_probability",
                                 "checkpoint_step_interval", "checkpoints_total_limit", "max_grad_norm",
                                 "grad_clip_method", "flow_schedule_shift", "flux_guidance_value", "resolution",
                                 "resolution_type", "caption_strategy", "ema_decay")} == {
        "model_type": "full", "learning_rate": 4e-07, "train_batch_size": 4, "num_train_epochs": 1,
        "max_train_steps": None, "optimizer": "adamw_bf16", "lr_scheduler": "constant_with_warmup",
        "mixed_precision": "bf16", "lora_rank": 16, "lora_alpha": None, "lora_dropout": 0.1,
        "gradient_checkpointing": True, "caption_dropout_probability": 0.1, "checkpoint_step_interval": 500,
        "checkpoints_total_limit": 5, "max_grad_norm": 2.0, "grad_clip_method": "value", "flow_schedule_shift": 3.0,
        "flux_guidance_value": 1.0, "resolution": 1024, "resolution_type": "pixel_area", "caption_strategy": "filename",
        "ema_decay": 0.995}
    config, text = imported(tmp_path, {"--model_family": "sdxl"})
    assert config["method"] == "full"
    assert (config["learning_rate"], config["batch_size"], config["epochs"]) == (4e-7, 4, 1)
    assert "max_steps" not in config
    assert (config["train_dtype"], config["trained_weight_dtype"]) == ("bfloat16", "bfloat16")
    assert config["optimizer"] == {"name": "ADAMW", "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-6,
                                   "stochastic_rounding": True}
    assert config["scheduler"] == {"name": "CONSTANT", "warmup_steps": 0}
    assert config["gradient_checkpointing"] is True
    assert config["data"]["concepts"][0]["caption_dropout_probability"] == 0.1
    assert config["checkpoint"] == {"every_n_minutes": None, "every_n_steps": 500, "keep_last": 5}
    assert config["resolution"] == 1024 and config["clip_grad_norm"] is None
    assert "grad_clip_method: value (SimpleTuner's default)" in text
    assert "seed: not set (SimpleTuner draws one per run)" in text
    assert "sampling" not in config and "ema" not in config and "loss" not in config


def test_lora_and_flux_defaults(tmp_path):
    """A Flux LoRA with SimpleTuner's defaults: rank 16 with alpha = rank, flux_lora_target all (its attention
    projections), the transformer shown guidance 1.0, timesteps drawn as sigmoid(N(0, 1)) shifted by 3.0; peft's
    lora_dropout 0.1 drops the layer input, which ot_dist's lora.dropout does not: listed."""
    config, text = imported(tmp_path, {"--model_family": "flux", "--model_type": "lora"})
    assert config["lora"] == {"rank": 16, "alpha": 16.0, "transformer_targets": [
        "to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"]}
    assert config["model"]["guidance_scale"] == 1.0
    assert config["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                              "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert "lora_dropout: 0.1" in text.split("NOT HONOURED")[1]
    auto, _ = imported(tmp_path, {"--model_family": "flux", "--model_type": "lora", "--flow_schedule_shift": 0,
                                  "--flow_schedule_auto_shift": True, "--flux_lora_target": "all+ffs",
                                  "--use_dora": True, "--flow_use_uniform_schedule": True})
    assert auto["loss"] == {"timestep_distribution": "uniform", "dynamic_timestep_shifting": True}
    assert auto["lora"]["variant"] == "dora" and auto["lora"]["dropout"] == 0.1
    assert "ff.net.0.proj" in auto["lora"]["transformer_targets"]


def test_sana_and_qwen_image_defaults(tmp_path):
    """Sana: SimpleTuner's model class draws u uniformly and reads its scheduler's unshifted table, whatever the
    flow_* settings say, trains the MSE whatever loss_type says, and halves the latents (listed); Qwen-Image: the
    common draw (sigmoid(N(0, 1)) shifted by 3.0), buckets aligned to 32 pixels, Qwen-Image-Edit-2511 (edit-v3) listed. Both adapt
    their DEFAULT_LORA_TARGET, the attention projections."""
    sana, text = imported(tmp_path, {"--model_family": "sana", "--model_type": "lora", "--flow_schedule_shift": 2,
                                     "--loss_type": "huber"})
    assert sana["model"]["family"] == "sana"
    assert sana["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert sana["loss"] == {"timestep_distribution": "uniform", "timestep_shift": 1.0,
                            "dynamic_timestep_shifting": False}
    assert "LATENT_RESCALE" in text.split("NOT HONOURED")[1]
    qwen, text = imported(tmp_path, {"--model_family": "qwen_image", "--model_type": "lora",
                                     "--model_flavour": "edit-v3"})
    assert qwen["model"]["family"] == "qwen_image" and qwen["data"]["bucket_step"] == 32
    assert qwen["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert qwen["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                            "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert "model_flavour: edit-v3" in text.split("NOT HONOURED")[1]


def test_wan_defaults(tmp_path):
    """Wan: the common flow draw (sigmoid(N(0, 1)) shifted by flow_schedule_shift's 3.0, Wan 2.1 480p's own flow_shift),
    its DEFAULT_LORA_TARGET (the attention projections); a flavour ot_dist refuses (Wan 2.2 stages, image-to-video) is
    listed as not honoured."""
    wan, text = imported(tmp_path, {"--model_family": "wan", "--model_type": "lora"})
    assert wan["model"]["family"] == "wan"
    assert wan["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert wan["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                           "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert "model_flavour" not in text.split("NOT HONOURED")[-1]
    _, text = imported(tmp_path, {"--model_family": "wan", "--model_type": "lora", "--model_flavour": "i2v-14b-2.2-low"})
    assert "model_flavour: i2v-14b-2.2-low" in text.split("NOT HONOURED")[1]
    # the Wan 2.2 T2V A14B stages: one expert each (model.wan_expert), AnimeGen's own transformer file not read
    for flavour, expert in (("animegen-t2v-high", "high_noise"), ("animegen-t2v-low", "low_noise")):
        wan, text = imported(tmp_path, {"--model_family": "wan", "--model_type": "lora", "--model_flavour": flavour})
        assert wan["model"]["wan_expert"] == expert
        assert f"model_flavour: {flavour}: SimpleTuner reads" in text.split("NOT HONOURED")[1]


def test_lumina2_defaults(tmp_path):
    """Lumina 2: the common flow draw (sigmoid(N(0, 1)) shifted by flow_schedule_shift's 3.0 towards noise, as its
    model_predict feeds 1 - t to the transformer), the attention targets, 64 px buckets; a tokenizer_max_length other
    than the pipeline's 256 is listed."""
    lumina, text = imported(tmp_path, {"--model_family": "lumina2", "--model_type": "lora",
                                       "--tokenizer_max_length": 512})
    assert lumina["model"]["family"] == "lumina2" and lumina["data"]["bucket_step"] == 64
    assert lumina["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert lumina["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                              "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert "tokenizer_max_length: 512" in text.split("NOT HONOURED")[1]


def test_z_image_flavours(tmp_path):
    """Z-Image: the common flow draw (sigmoid(N(0, 1)) shifted by 3.0), its DEFAULT_LORA_TARGET (the foundation's
    attention projections); the turbo flavours' assistant LoRA and ostris-de-turbo's transformer are listed, the base
    flavour is not."""
    config, text = imported(tmp_path, {"--model_family": "z_image", "--model_type": "lora",
                                       "--pretrained_model_name_or_path": "/models/z-image"})
    assert config["model"]["family"] == "z_image"
    assert config["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert config["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                              "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert "model_flavour: turbo-ostris-v2: SimpleTuner trains Z-Image-Turbo through an assistant LoRA" in text
    for flavour, listed in (("ostris-de-turbo", "loads ostris/Z-Image-De-Turbo's transformer"), ("base", None)):
        _, text = imported(tmp_path, {"--model_family": "z_image", "--model_type": "lora", "--model_flavour": flavour,
                                      "--pretrained_model_name_or_path": "/models/z-image"})
        if listed:
            assert listed in text, flavour
        else:
            assert "assistant LoRA" not in text and "De-Turbo" not in text, flavour


@pytest.mark.parametrize("family, settings, expected, listed", [
    # the formulas of kohya's loss_type / huber_schedule / huber_c (ot_dist's pseudo_huber_*), huber_scale 1
    ("sdxl", {"--loss_type": "huber"}, {"pseudo_huber_schedule": "snr", "pseudo_huber_form": "huber"}, None),
    ("flux", {"--loss_type": "smooth_l1", "--huber_schedule": "exponential", "--huber_c": 0.2},
     {"pseudo_huber_schedule": "exponential", "pseudo_huber_form": "smooth_l1", "pseudo_huber_c": 0.2}, None),
    ("qwen_image", {"--loss_type": "huber", "--huber_schedule": "constant"},
     {"pseudo_huber_schedule": "constant", "pseudo_huber_c": 0.1}, None),
    # a flow model's snr schedule is SimpleTuner's own: listed, the MSE kept
    ("sd3", {"--loss_type": "huber"}, None, "loss_type: huber with huber_schedule snr"),
])
def test_huber_loss_types_as_kohyas_pseudo_huber(tmp_path, family, settings, expected, listed):
    config, text = imported(tmp_path, {"--model_family": family, "--model_type": "lora", **settings})
    loss = config.get("loss", {})
    if expected:
        assert loss | expected == loss and loss["mse_strength"] == 0.0 and loss["pseudo_huber_strength"] == 1.0
    else:
        assert "pseudo_huber_strength" not in loss and listed in text.split("NOT HONOURED")[1]


def test_lycoris_config(tmp_path):
    """lora_type lycoris reads lycoris_config.json: algo loha with linear_dim / linear_alpha; LoKr's factor and
    LyCORIS' module classes other than Attention are listed."""
    setup(tmp_path, {})
    (tmp_path / "config" / "lycoris_config.json").write_text(json.dumps(
        {"algo": "loha", "multiplier": 1.0, "linear_dim": 8, "linear_alpha": 4}), encoding="utf-8")
    config, _ = imported(tmp_path, {"--model_family": "sd1x", "--model_type": "lora", "--lora_type": "lycoris",
                                    "--lycoris_config": "config/lycoris_config.json"})
    assert config["lora"] == {"rank": 8, "alpha": 4.0, "variant": "loha", "preset": "attention"}
    (tmp_path / "config" / "lokr.json").write_text(json.dumps(
        {"algo": "lokr", "factor": 16, "apply_preset": {"target_module": ["Attention", "FeedForward"]}}),
        encoding="utf-8")
    config, text = imported(tmp_path, {"--model_family": "sd3", "--model_type": "lora", "--lora_type": "lycoris",
                                       "--lycoris_config": "config/lokr.json"})
    assert config["lora"] == {"rank": 4, "alpha": 1.0, "variant": "lokr", "preset": "attention"}  # trainer defaults
    listed = text.split("NOT HONOURED")[1]
    assert "lycoris_config factor: 16" in listed and "['Attention', 'FeedForward']" in listed


def test_what_is_not_honoured_is_listed(tmp_path):
    """Each setting ot_dist does not reproduce is listed with its reason (and the config still validates)."""
    images(tmp_path / "data" / "a", ["my_image"])
    backends = [{"id": "a", "type": "local", "instance_data_dir": "data/a", "probability": 0.5,
                 "resolution": 512, "resolution_type": "pixel", "crop": True, "crop_style": "corner",
                 "crop_aspect": "square", "minimum_image_size": 256, "caption_filter_list": "filters.txt"},
                {"id": "s3", "type": "aws", "aws_bucket_name": "b", "instance_data_dir": "x"}]
    config, text = imported(tmp_path, {
        "--model_family": "flux", "--model_type": "lora", "--lora_dropout": 0,
        "--offset_noise": True,                     # flow models: SimpleTuner adds none
        "--snr_gamma": 5, "--lr_scheduler": "cosine", "--lr_warmup_steps": 500,
        "--base_model_precision": "int8-quanto", "--made_up_flag": 1,
        "--mixed_precision": "fp8", "--lr_scale": True,
    }, backends)
    listed = text.split("NOT HONOURED")[1]
    assert config["data"]["bucket_assignment"] == "square" and "crop_aspect" not in listed  # every dataset: squares
    for line in ("a].probability: 0.5", "a].resolution_type: pixel", "a].crop_style: corner",
                 "a].minimum_image_size: 256", "a].caption_filter_list",
                 "s3].type: aws", "a].caption_strategy: filename: SimpleTuner reads the underscores",
                 "offset_noise: SimpleTuner adds no offset noise", "snr_gamma: 5", "lr_scheduler: cosine",
                 "base_model_precision: int8-quanto", "made_up_flag: 1 is not an argument of SimpleTuner",
                 "mixed_precision: fp8", "lr_scale:"):
        assert line in listed, line
    assert len(config["data"]["concepts"]) == 1 and config["resolution"] == 512
    assert config["scheduler"] == {"name": "CONSTANT", "warmup_steps": 0}


@pytest.mark.parametrize("config, backend, message", [
    ({}, None, "model_family: not set"),
    ({"--model_family": "ltxvideo"}, None, "model_family: ltxvideo is not a model family ot_dist trains"),
    ({"--model_family": "sdxl", "--max_train_steps": 100, "--num_train_epochs": 3}, None,
     "max_train_steps: 100 with num_train_epochs 3"),
    ({"--model_family": "sdxl"}, [{"id": "x", "type": "local", "instance_data_dir": "data/x",
                                   "caption_strategy": "instanceprompt"}], "multidatabackend.json[x].instance_prompt"),
    ({"--model_family": "sdxl"}, [{"id": "x", "type": "local", "instance_data_dir": "data/x",
                                   "caption_strategy": "parquet"}], "multidatabackend.json[x].caption_strategy"),
    ({"--model_family": "sdxl", "--train_batch_size": 0}, None, "batch_size (from train_batch_size)"),
    ({"--model_family": "sdxl", "--model_type": "lora", "--lora_rank": 0}, None, "(from lora_rank / linear_dim)"),
])
def test_errors_name_the_simpletuner_field(tmp_path, config, backend, message):
    code, err = run_import(setup(tmp_path, config, backend), "--out", tmp_path / "o.yaml")
    assert code == 2 and message in err, err
    assert not (tmp_path / "o.yaml").exists()


def test_env_and_toml_read_as_the_json(tmp_path):
    """config.env (`export VAR=value`, each variable a flag, TRAINER_EXTRA_ARGS more flags) and config.toml give the
    config config.json gives."""
    json_config, _ = imported(tmp_path, {"--model_family": "sdxl", "--model_type": "lora", "--lora_rank": 8,
                                         "--learning_rate": 1e-4, "--use_ema": True, "--seed": 5})
    config_dir = tmp_path / "config"
    (config_dir / "config.env").write_text(
        "export MODEL_FAMILY=sdxl\nexport MODEL_TYPE='lora'\nexport MODEL_NAME=model\nLEARNING_RATE=1e-4\n"
        "export USE_EMA=true\nexport TRAINING_SEED=5\nexport DATALOADER_CONFIG=config/multidatabackend.json\n"
        "export PUSH_TO_HUB=false\nexport CUDA_VISIBLE_DEVICES=0\nexport TRAINER_EXTRA_ARGS='--lora_rank=8'\n",
        encoding="utf-8")
    (config_dir / "config.toml").write_text(
        'model_family = "sdxl"\nmodel_type = "lora"\npretrained_model_name_or_path = "model"\nlora_rank = 8\n'
        'learning_rate = "1e-4"\nuse_ema = "true"\nseed = 5\n'
        'data_backend_config = "config/multidatabackend.json"\n', encoding="utf-8")
    for name in ("config.env", "config.toml"):
        out = tmp_path / f"{name}.yaml"
        code, err = run_import(config_dir / name, "--out", out)
        assert code == 0, err
        assert yaml.safe_load(out.read_text(encoding="utf-8")) == json_config, name
    assert "CUDA_VISIBLE_DEVICES stand for no SimpleTuner argument" in (tmp_path / "config.env.yaml").read_text()


def test_files_named_on_the_command_line_win_and_area_resolutions(tmp_path):
    """--databackend / --lycoris_config / --user_prompt_library name files here (relative to the working folder) over
    the config's settings, which start in SimpleTuner's folder; resolution_type area is megapixels, written as the
    side of the square of that area at SimpleTuner's 64-pixel alignment."""
    images(tmp_path / "elsewhere" / "imgs", ["a"], {"a": "a cat"})
    other = tmp_path / "elsewhere" / "backends.json"
    other.write_text(json.dumps([{"id": "mp", "type": "local", "instance_data_dir": str(other.parent / "imgs"),
                                  "caption_strategy": "textfile", "resolution": 0.5, "resolution_type": "area"}]),
                     encoding="utf-8")
    library = tmp_path / "elsewhere" / "library.json"
    library.write_text(json.dumps({"x": "a cat on a mat"}), encoding="utf-8")
    config, text = imported(tmp_path, {"--model_family": "sd1x"}, None, "--databackend", other,
                            "--user_prompt_library", library)
    assert config["data"]["concepts"][0]["name"] == "mp"
    assert config["resolution"] == 704  # sqrt(0.5e6) = 707 px, at the 64-pixel alignment
    assert "is a square of 707.107 px; 704" in text
    assert [p["prompt"] for p in config["sampling"]["prompts"]] == ["a cat on a mat"]
    assert "data_backend_config" not in text.split("NOT HONOURED")[-1]


def test_one_folder_at_several_resolutions(tmp_path):
    """SimpleTuner's multi-resolution example: one folder in a dataset per resolution. ot_dist writes its
    multi-resolution list (one drawn per step for all datasets, listed: SimpleTuner trains each at its own)."""
    images(tmp_path / "data" / "db", ["a"], {"a": "sks dog"})
    backends = [{"id": f"db-{side}", "type": "local", "instance_data_dir": "data/db", "caption_strategy": "textfile",
                 "resolution": side, "resolution_type": "pixel_area", "repeats": 10} for side in (1024, 512)]
    config, text = imported(tmp_path, {"--model_family": "sdxl"}, backends)
    assert config["resolution"] == [512, 1024]
    assert [c["balancing"] for c in config["data"]["concepts"]] == [11, 11]
    assert "the datasets train at [512, 1024] px, each at its own" in text.split("NOT HONOURED")[1]


def test_flux2_flavours(tmp_path):
    """model_family flux2: the default flavour (klein-9b) and the klein ones are flux2_klein, dev is flux2 with
    flux_guidance_value as its guidance; SimpleTuner's DEFAULT_LORA_TARGET (the double blocks' image attention, the
    single blocks' fused projection); the common flow draw (sigmoid(N(0, 1)) shifted by 3.0)."""
    klein, _ = imported(tmp_path, {"--model_family": "flux2", "--model_type": "lora"})
    assert klein["model"]["family"] == "flux2_klein" and "guidance_scale" not in klein["model"]
    assert klein["lora"]["transformer_targets"] == ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                    "attn.to_qkv_mlp_proj"]
    assert klein["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                             "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    dev, _ = imported(tmp_path, {"--model_family": "flux2", "--model_type": "lora", "--model_flavour": "dev",
                                 "--pretrained_model_name_or_path": str(tmp_path), "--flux_guidance_value": 2.5})
    assert dev["model"]["family"] == "flux2" and dev["model"]["guidance_scale"] == 2.5


def test_hidream_maps_and_its_load_balancing_loss_is_listed(tmp_path):
    """HiDream: the common flow draw (sigmoid(N(0, 1)) shifted by 3.0), SimpleTuner's DEFAULT_LORA_TARGET (its
    to_out.0 names no HiDream module, whose to_out is a plain Linear, in SimpleTuner too); its optional MoE
    load-balancing loss has no counterpart in ot_dist and is listed."""
    hidream, text = imported(tmp_path, {"--model_family": "hidream", "--model_type": "lora",
                                        "--hidream_use_load_balancing_loss": True,
                                        "--hidream_load_balancing_loss_weight": 0.01})
    assert hidream["model"]["family"] == "hidream"
    assert hidream["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert hidream["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                               "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert "hidream_use_load_balancing_loss" in text.split("NOT HONOURED")[1]


def test_flux_kontext_takes_its_conditioning_dataset_as_reference_images(tmp_path):
    """SimpleTuner's Kontext (model_family flux, model_flavour kontext; documentation/quickstart/FLUX_KONTEXT.md): the
    edit dataset's conditioning_data names a reference_strict dataset of the same file names, which becomes the
    concept's reference_path (and no concept of its own); Flux's mapping (loss, LoRA targets) stays."""
    images(tmp_path / "data" / "edited", ["a", "b"], {"a": "make it red", "b": "make it blue"})
    images(tmp_path / "data" / "reference", ["a", "b"])
    backends = [{"id": "edits", "type": "local", "instance_data_dir": "data/edited", "caption_strategy": "textfile",
                 "conditioning_data": ["refs"]},
                {"id": "refs", "type": "local", "instance_data_dir": "data/reference", "caption_strategy": None,
                 "conditioning_type": "reference_strict"}]
    config, text = imported(tmp_path, {"--model_family": "flux", "--model_flavour": "kontext",
                                       "--model_type": "lora"}, backends)
    assert config["model"]["family"] == "flux_kontext"
    (concept,) = config["data"]["concepts"]
    assert Path(concept["reference_path"]) == tmp_path / "data" / "reference"
    assert Path(concept["path"]) == tmp_path / "data" / "edited"
    assert config["loss"]["timestep_shift"] == 3.0  # Flux's import
    assert "give each sampling.prompts[] a reference_image" in text.split("NOT HONOURED")[1]
    loose = [dict(backends[0]), {**backends[1], "conditioning_type": "reference_loose"}]
    _, text = imported(tmp_path, {"--model_family": "flux", "--model_flavour": "kontext", "--model_type": "lora"},
                       loose)
    assert "reference_loose" in text.split("NOT HONOURED")[1]
    plain, text = imported(tmp_path, {"--model_family": "flux", "--model_type": "lora"}, backends)
    assert plain["model"]["family"] == "flux" and "reference_path" not in plain["data"]["concepts"][0]
    assert "conditioning_type: reference_strict" in text.split("NOT HONOURED")[1]


def test_flux2_takes_a_conditioning_dataset_as_reference_images_and_trains_text_to_image_without(tmp_path):
    """SimpleTuner's flux2 takes conditioning datasets optionally (supports_conditioning_dataset): a dataset naming a
    reference_strict one gets its folder as reference_path; without conditioning_data it stays text-to-image."""
    images(tmp_path / "data" / "edited", ["a", "b"], {"a": "make it red", "b": "make it blue"})
    images(tmp_path / "data" / "reference", ["a", "b"])
    backends = [{"id": "edits", "type": "local", "instance_data_dir": "data/edited", "caption_strategy": "textfile",
                 "conditioning_data": ["refs"]},
                {"id": "refs", "type": "local", "instance_data_dir": "data/reference", "caption_strategy": None,
                 "conditioning_type": "reference_strict"}]
    config, text = imported(tmp_path, {"--model_family": "flux2", "--model_type": "lora"}, backends)
    assert config["model"]["family"] == "flux2_klein"
    (concept,) = config["data"]["concepts"]
    assert Path(concept["reference_path"]) == tmp_path / "data" / "reference"
    assert "give each sampling.prompts[] a reference_image" in text.split("NOT HONOURED")[1]
    plain = [{k: v for k, v in backends[0].items() if k != "conditioning_data"}]
    config, text = imported(tmp_path, {"--model_family": "flux2", "--model_type": "lora"}, plain)
    assert "reference_path" not in config["data"]["concepts"][0]
    assert "reference" not in text.split("NOT HONOURED")[-1]


def test_qwen_image_edit_v1_takes_its_conditioning_dataset_as_reference_images(tmp_path):
    """SimpleTuner's Qwen-Image-Edit (model_family qwen_image, model_flavour edit-v1): the conditioning dataset becomes
    the concept's reference_path; its validation prompts are left out (the edit pipeline samples only with a reference
    image) and listed; the 2509 flavours stay listed as not honoured (test_sana_and_qwen_image_defaults)."""
    images(tmp_path / "data" / "edited", ["a", "b"], {"a": "make it red", "b": "make it blue"})
    images(tmp_path / "data" / "reference", ["a", "b"])
    backends = [{"id": "edits", "type": "local", "instance_data_dir": "data/edited", "caption_strategy": "textfile",
                 "conditioning_data": ["refs"]},
                {"id": "refs", "type": "local", "instance_data_dir": "data/reference", "caption_strategy": None,
                 "conditioning_type": "reference_strict"}]
    config, text = imported(tmp_path, {"--model_family": "qwen_image", "--model_flavour": "edit-v1",
                                       "--model_type": "lora", "--validation_prompt": "make it green"}, backends)
    assert config["model"]["family"] == "qwen_image_edit"
    (concept,) = config["data"]["concepts"]
    assert Path(concept["reference_path"]) == tmp_path / "data" / "reference"
    assert config["loss"]["timestep_shift"] == 3.0  # Qwen-Image's import
    assert not config.get("sampling", {}).get("prompts")
    not_honoured = text.split("NOT HONOURED")[1]
    assert "qwen_image_edit samples only with a reference image" in not_honoured
    assert "model_flavour: edit-v1" not in not_honoured
    plus, _ = imported(tmp_path, {"--model_family": "qwen_image", "--model_flavour": "edit-v2",
                                  "--model_type": "lora"}, backends)
    assert plus["model"]["family"] == "qwen_image_edit_plus"  # 2509, one reference per sample


def test_several_conditioning_datasets_combined_are_a_list_of_reference_folders(tmp_path):
    """Qwen-Image-Edit-2509 (edit-v2) with two reference_strict datasets: conditioning_multidataset_sampling combined
    (every conditioning dataset shown with each image) is reference_path [first, second] in conditioning_data's order,
    which builds two references per sample; random (SimpleTuner's default: one drawn per sample) keeps the first and
    is listed."""
    from ot_dist.config.schema import ConceptConfig
    from ot_dist.data.concepts import list_images, reference_partners

    images(tmp_path / "data" / "edited", ["a", "b"], {"a": "the hat of picture 2", "b": "the coat of picture 2"})
    images(tmp_path / "data" / "people", ["a", "b"])
    images(tmp_path / "data" / "clothes", ["a", "b"])
    backends = [{"id": "edits", "type": "local", "instance_data_dir": "data/edited", "caption_strategy": "textfile",
                 "conditioning_data": ["people", "clothes"]},
                {"id": "clothes", "type": "local", "instance_data_dir": "data/clothes", "caption_strategy": None,
                 "conditioning_type": "reference_strict"},
                {"id": "people", "type": "local", "instance_data_dir": "data/people", "caption_strategy": None,
                 "conditioning_type": "reference_strict"}]
    settings = {"--model_family": "qwen_image", "--model_flavour": "edit-v2", "--model_type": "lora"}
    config, text = imported(tmp_path, {**settings, "--conditioning_multidataset_sampling": "combined"}, backends)
    assert config["model"]["family"] == "qwen_image_edit_plus"
    (concept,) = config["data"]["concepts"]
    assert [Path(p) for p in concept["reference_path"]] == [tmp_path / "data" / "people", tmp_path / "data" / "clothes"]
    assert "conditioning_multidataset_sampling" not in text.split("NOT HONOURED")[1]
    built = ConceptConfig(**concept)
    partners = reference_partners("concepts[0]", built, list_images("concepts[0]", built))
    assert [[p.parent.name for p in found] for found in partners.values()] == [["people", "clothes"]] * 2
    config, text = imported(tmp_path, settings, backends)
    (concept,) = config["data"]["concepts"]
    assert Path(concept["reference_path"]) == tmp_path / "data" / "people"
    assert "conditioning_multidataset_sampling random draws one of them per sample" in text.split("NOT HONOURED")[1]


def test_ernie_family(tmp_path):
    """ERNIE-Image (simpletuner/examples/ernie.peft-lora): model_family ernie is ernie_image, its DEFAULT_LORA_TARGET
    (the attention projections), the common flow draw (sigmoid(N(0, 1)) shifted by 3.0)."""
    config, _ = imported(tmp_path, {"--model_family": "ernie", "--model_type": "lora", "--model_flavour": "base",
                                    "--pretrained_model_name_or_path": "/models/ernie-image"})
    assert config["model"]["family"] == "ernie_image"
    assert config["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert config["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                              "logit_normal_std": 1.0, "timestep_shift": 3.0, "dynamic_timestep_shifting": False}


def test_anima_flavours(tmp_path):
    """Anima: SimpleTuner's DEFAULT_LORA_TARGET (to_q / to_k / to_v / to_out.0: both attentions of every block), its
    16-pixel bucket alignment; the single-file 2.9B flavour is listed, the release flavour is not."""
    config, text = imported(tmp_path, {"--model_family": "anima", "--model_type": "lora",
                                       "--pretrained_model_name_or_path": "/models/anima"})
    assert config["model"] == {"family": "anima", "path": "/models/anima"}
    assert config["lora"]["transformer_targets"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert config["data"]["bucket_step"] == 16
    for flavour, listed in (("gazingstars123-2.9b", True), ("release", False)):
        _, text = imported(tmp_path, {"--model_family": "anima", "--model_type": "lora", "--model_flavour": flavour,
                                      "--pretrained_model_name_or_path": "/models/anima"})
        assert ("SimpleTuner loads its transformer from a single file" in text) == listed, flavour


def test_ideogram_maps_its_schedule_and_lists_its_json_captions_and_fused_qkv(tmp_path):
    """SimpleTuner's `ideogram`: sigma = sigmoid(ideogram_schedule_mu + 0.5 ln(pixels / 512^2) + ideogram_schedule_std
    z): ot_dist's logit-normal at the family's resolution shift (no shift written; its common flow settings not read);
    its DEFAULT_LORA_TARGET in diffusers' names; the JSON caption rewriting (on by default) and the fused qkv adapter
    are listed, its own checkpoint format noted."""
    config, text = imported(tmp_path, {"--model_family": "ideogram", "--model_type": "lora",
                                       "--pretrained_model_name_or_path": "/models/ideogram4-diffusers",
                                       "--ideogram_schedule_mu": 0.25, "--flow_schedule_shift": 3.0})
    assert config["model"]["family"] == "ideogram4"
    assert config["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.25,
                              "logit_normal_std": 1.5}
    assert config["lora"]["transformer_targets"] == ["attention.to_q", "attention.to_k", "attention.to_v",
                                                     "attention.to_out.0", "feed_forward.w1", "feed_forward.w2",
                                                     "feed_forward.w3"]
    listed = text.split("NOT HONOURED")[1]
    assert "ideogram_auto_json" in listed and "fused qkv" in listed
    assert "flow_schedule_shift" not in listed  # noted: SimpleTuner's Ideogram 4 does not read it
    _, text = imported(tmp_path, {"--model_family": "ideogram", "--model_type": "full", "--ideogram_auto_json": False,
                                  "--pretrained_model_name_or_path": "/models/ideogram4-diffusers"})
    listed = text.split("NOT HONOURED")[1] if "NOT HONOURED" in text else ""
    assert "ideogram_auto_json" not in listed and "llm_cond_proj" in listed


def test_square_crops_of_some_datasets_only_are_listed(tmp_path):
    """bucket_assignment is one setting: a square-cropping dataset beside one that keeps its aspects leaves ot_dist's
    aspect buckets on, and the square crop is listed as not honoured."""
    images(tmp_path / "data" / "a", ["one"])
    images(tmp_path / "data" / "b", ["two"])
    backends = [{"id": "a", "type": "local", "instance_data_dir": "data/a", "crop": True, "crop_aspect": "square"},
                {"id": "b", "type": "local", "instance_data_dir": "data/b"}]
    config, text = imported(tmp_path, {"--model_family": "sdxl", "--model_type": "lora"}, backends)
    assert "bucket_assignment" not in config["data"]
    assert "a].crop_aspect: square: the other datasets keep their images' aspects" in text.split("NOT HONOURED")[1]


def test_precisions_store_each_component_as_simpletuner_loads_it(tmp_path):
    """base_model_precision quantises the denoiser, text_encoder_<n>_precision the n-th text encoder, vae_dtype is
    the VAE's (bfloat16 by default), mixed_precision the other frozen weights'."""
    from ot_dist.config.load import load_config

    images(tmp_path / "data" / "a", ["my_image"])
    backends = [{"id": "a", "type": "local", "instance_data_dir": "data/a", "resolution": 512}]
    imported(tmp_path, {"--model_family": "sd3", "--model_type": "lora", "--mixed_precision": "bf16",
                        "--base_model_precision": "fp8-torchao", "--text_encoder_3_precision": "fp8-quanto",
                        "--text_encoder_1_precision": "int8-quanto", "--vae_dtype": "fp32"}, backends)
    config = load_config(tmp_path / "out.yaml")
    assert {name: config.component_storage(name) for name in (
        "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")} == {
        "transformer": "float8", "text_encoder": "bfloat16", "text_encoder_2": "bfloat16", "text_encoder_3": "float8",
        "vae": "float32"}
    listed = (tmp_path / "out.yaml").read_text().split("NOT HONOURED")[1]
    assert "text_encoder_1_precision: int8-quanto" in listed
    imported(tmp_path, {"--model_family": "sdxl", "--model_type": "lora", "--mixed_precision": "no"}, backends)
    config = load_config(tmp_path / "out.yaml")
    assert (config.component_storage("unet"), config.component_storage("vae")) == ("float32", "bfloat16")
    # nf4-bnb (bitsandbytes NF4) is ot_dist's nf4 (docs/low-memory.md); int4 quanto is listed
    imported(tmp_path, {"--model_family": "flux", "--model_type": "lora", "--mixed_precision": "bf16",
                        "--base_model_precision": "nf4-bnb", "--text_encoder_2_precision": "nf4-bnb",
                        "--text_encoder_1_precision": "int4-quanto"}, backends)
    config = load_config(tmp_path / "out.yaml")
    assert {name: config.component_storage(name) for name in ("transformer", "text_encoder", "text_encoder_2")} == {
        "transformer": "nf4", "text_encoder": "bfloat16", "text_encoder_2": "nf4"}
    listed = (tmp_path / "out.yaml").read_text().split("NOT HONOURED")[1]
    assert "text_encoder_1_precision: int4-quanto: integer / other 4-bit quantisation" in listed
    assert "nf4-bnb" not in listed
