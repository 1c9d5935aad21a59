"""`ot-dist import kohya`: kohya sd-scripts setups (training arguments as its --config_file TOML or a saved command
line, the --dataset_config TOML or DreamBooth folders, sample prompt files) become ot_dist configs that validate and
keep each setting's meaning, with everything ot_dist cannot honour listed. Each TOML below states, per key, what
kohya's documentation (docs/train_network_README, config_README, train_README) says it does; no process is launched."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml
from PIL import Image

from ot_dist.cli import main
from ot_dist.config.load import load_config
from ot_dist.errors import ConfigError


def run_import(*args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["import", "kohya", *map(str, args)])
    return code, err.getvalue()


def images(folder: Path, count: int, captions: dict[int, str] | None = None, extension: str = ".caption") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(folder / f"{i}.png")
        if captions and i in captions:
            (folder / f"{i}{extension}").write_text(captions[i], encoding="utf-8")
    return folder


def minimal(tmp_path, resolution: int = 512, bucket: bool = True) -> str:
    """The arguments every kohya setup below shares: a model, an output folder, the DreamBooth folder d/."""
    folder = tmp_path / "d"
    return (f'pretrained_model_name_or_path = "m"\noutput_dir = "o"\ntrain_data_dir = "{folder}"\n'
            f"resolution = {resolution}\n" + ("enable_bucket = true\n" if bucket else ""))


def imported(tmp_path, toml: str, *extra) -> tuple[dict, str, str]:
    (tmp_path / "args.toml").write_text(toml, encoding="utf-8")
    out = tmp_path / "out.yaml"
    code, err = run_import("--config_file", tmp_path / "args.toml", "--out", out, "--force", *extra)
    assert code == 0, err
    text = out.read_text(encoding="utf-8")
    return yaml.safe_load(text), text, err


def test_sd15_lora_example_with_a_dataset_config(tmp_path):
    """kohya's train_network.py example (a LoRA of SD 1.5 from a dataset TOML) maps key by key, and the written
    file loads as an ot_dist config."""
    data = images(tmp_path / "img", 2, {0: "a cat, sitting, indoors", 1: "a cat, lying"})
    (tmp_path / "data.toml").write_text(f"""
[general]
shuffle_caption = true          # shuffle the comma-separated tags of each caption every epoch
caption_extension = ".txt"      # the captions are img.txt beside img.png
keep_tokens = 1                 # the first tag stays in place

[[datasets]]
resolution = 768                # buckets of about 768 x 768 pixels
batch_size = 4                  # images per step
enable_bucket = true            # aspect-ratio buckets
bucket_reso_steps = 64          # bucket sides are multiples of 64

  [[datasets.subsets]]
  image_dir = '{data}'
  num_repeats = 3               # every image 3 times per epoch
  flip_aug = true               # random horizontal flip
  caption_dropout_rate = 0.05   # the whole caption dropped 5% of the time
  caption_tag_dropout_rate = 0.1  # each tag after the kept ones dropped 10% of the time
  keep_tokens_separator = "|||"   # in a caption holding it, the tags before it stay
  secondary_separator = ";;;"     # parts joined by it count as one tag
  caption_dropout_every_n_epochs = 4  # every 4th epoch trains without captions
""", encoding="utf-8")
    config, text, _ = imported(tmp_path, f"""
[model_arguments]
pretrained_model_name_or_path = "{tmp_path / 'sd15.safetensors'}"

[additional_network_arguments]
network_module = "networks.lora"   # kohya's LoRA
network_dim = 32                   # rank 32
network_alpha = 16                 # the update is scaled by alpha / rank
network_dropout = 0.1              # drops the rank features after lora_down, in training
unet_lr = 1e-4                     # the U-Net's learning rate
text_encoder_lr = 5e-5             # the text encoder's

[optimizer_arguments]
optimizer_type = "AdamW8bit"
learning_rate = 1e-4
lr_scheduler = "cosine"
lr_warmup_steps = 50               # optimizer steps
max_grad_norm = 0                  # 0 turns clipping off

[dataset_arguments]
dataset_config = "{tmp_path / 'data.toml'}"

[training_arguments]
output_dir = "{tmp_path / 'models'}"
output_name = "cat"
max_train_epochs = 10
gradient_accumulation_steps = 2
mixed_precision = "fp16"
save_precision = "fp16"
save_every_n_epochs = 2
save_last_n_epochs = 3             # older epoch saves are removed
gradient_checkpointing = true
clip_skip = 2                      # the penultimate layer of CLIP
seed = 1234
noise_offset = 0.0357
min_snr_gamma = 5
min_timestep = 100
max_timestep = 900                 # timesteps drawn by randint(100, 900): 899 is the largest
cache_latents = true
xformers = true
""", "--script", "train_network.py")
    assert config["model"] == {"family": "sd1", "path": str(tmp_path / "sd15.safetensors"),
                               "text_encoder_layer_skip": 1}
    assert config["method"] == "lora" and config["output_dir"] == str(tmp_path / "models" / "cat")
    assert config["lora"] == {"rank": 32, "alpha": 16, "dropout": 0.1}
    assert config["unet"] == {"learning_rate": 1e-4}
    assert config["text_encoder"] == {"train": True, "learning_rate": 5e-5}
    assert config["optimizer"] == {"name": "ADAMW_8BIT"} and config["learning_rate"] == 1e-4
    # 50 optimizer steps of 2 micro steps: ot_dist counts a warmup above 1 in micro steps
    assert config["scheduler"] == {"name": "COSINE", "warmup_steps": 100}
    assert config["clip_grad_norm"] is None
    assert (config["epochs"], config["gradient_accumulation_steps"], config["seed"]) == (10, 2, 1234)
    assert (config["train_dtype"], config["weight_dtype"], config["output_dtype"]) == ("float16",) * 3
    assert config["gradient_checkpointing"] is True
    assert config["checkpoint"] == {"every_n_minutes": None, "every_n_epochs": 2, "keep_last": 3}
    assert config["loss"] == {"offset_noise_weight": 0.0357, "min_snr_gamma": 5, "min_timestep": 100,
                              "max_timestep": 899}
    assert (config["resolution"], config["batch_size"]) == (768, 4)
    assert config["data"]["bucket_step"] == 64
    assert config["data"]["concepts"] == [{
        "path": str(data), "balancing": 3, "caption_extension": ".txt", "tag_delimiter": ",",
        "keep_tags_count": 1, "tag_shuffling": True, "tag_dropout_probability": 0.1, "tag_dropout_mode": "random",
        "keep_tags_separator": "|||", "secondary_separator": ";;;", "caption_dropout_probability": 0.05,
        "caption_dropout_every_n_epochs": 4, "flip_probability": 0.5}]
    assert "cache_latents" not in config["data"]  # the flip changes the image every epoch
    assert "xformers: True is ignored" in text
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    loaded = load_config(tmp_path / "ok.yaml")
    assert loaded.data.concepts[0].keep_tags_count == 1 and loaded.scheduler.warmup_steps == 100


def test_dreambooth_folders_and_regularisation_images(tmp_path):
    """--train_data_dir's `<repeats>_<class tokens>` folders: the number is the repeats, the rest the caption of an
    image without a caption file; --reg_data_dir's give regularisation images, which kohya repeats to as many samples
    per epoch as the training images and weighs by prior_loss_weight."""
    train, reg = tmp_path / "train", tmp_path / "reg"
    images(train / "10_sks dog", 3)                         # no captions: every image is "sks dog"
    images(train / "2_sks_cat", 2, {0: "sks cat on a bed", 1: "sks cat"})  # captions: theirs
    images(train / "misc", 1)                               # no repeats: kohya skips it
    images(reg / "1_dog", 4)
    config, text, _ = imported(tmp_path, f"""
pretrained_model_name_or_path = "{tmp_path / 'model'}"
output_dir = "{tmp_path / 'out'}"
train_data_dir = "{train}"
reg_data_dir = "{reg}"
prior_loss_weight = 0.5
resolution = "512"
enable_bucket = true
network_module = "networks.lora"
""", "--script", "train_network.py")
    concepts = config["data"]["concepts"]
    assert concepts[0] == {"path": str(train / "10_sks dog"), "balancing": 10,
                           "caption_source": "text", "caption_text": "sks dog"}
    assert concepts[1] == {"path": str(train / "2_sks_cat"), "balancing": 2,
                           "caption_extension": ".caption"}
    # 3 x 10 + 2 x 2 = 34 training samples per epoch: as many regularisation samples
    assert concepts[2] == {"path": str(reg / "1_dog"), "type": "prior_preservation",
                           "loss_weight": 0.5, "caption_source": "text", "caption_text": "dog", "balancing": 34,
                           "balancing_strategy": "samples"}
    assert len(concepts) == 3 and "misc has no `<repeats>_` prefix" in text
    # kohya's defaults where ot_dist's differ: rank 4, alpha 1, learning rate 2e-6, 1600 steps, bucket step 64
    assert config["lora"] == {"rank": 4, "alpha": 1}
    assert config["learning_rate"] == 2e-6 and config["max_steps"] == 1600
    assert config["data"]["bucket_step"] == 64


def test_missing_captions_and_first_lines_are_listed(tmp_path):
    images(tmp_path / "d" / "5_x", 2, {0: "first line\nsecond line"})
    _, text, err = imported(tmp_path, minimal(tmp_path) + 'network_module = "networks.lora"\n', "--script",
                            "train_network.py")
    assert "1 of 2 images have no .caption file (kohya trains them with the class tokens 'x')" in err
    assert "kohya reads the first line only" in err


def test_sample_prompt_lines(tmp_path):
    """kohya's prompt syntax: `--n` negative prompt, `--w` / `--h` size (floored to a multiple of 8), `--s` steps,
    `--l` CFG scale, `--d` seed; a missing option takes kohya's default (512, 30 steps, CFG 7.5)."""
    from ot_dist.migrate.kohya_samples import parse_prompt_line

    line = "masterpiece, a girl --n low quality, blurry --w 772 --h 1024 --s 28 --l 6.5 --d 42"
    assert parse_prompt_line(line) == {"prompt": "masterpiece, a girl", "negative_prompt": "low quality, blurry",
                                       "width": 772, "height": 1024, "sample_steps": 28, "scale": 6.5, "seed": 42}
    images(tmp_path / "d" / "1_x", 1)
    (tmp_path / "prompts.txt").write_text(f"# a comment\n{line}\n\na dog --zz 3 --ss dpmsolver++\na cat --ss heun\n",
                                          encoding="utf-8")
    config, _, err = imported(tmp_path, minimal(tmp_path) + f"""network_module = "networks.lora"
sample_prompts = "{tmp_path / 'prompts.txt'}"
sample_every_n_steps = 100
sample_sampler = "k_euler_a"
""", "--script", "train_network.py")
    assert config["sampling"] == {
        "prompts": [{"prompt": "masterpiece, a girl", "width": 768, "height": 1024, "steps": 28, "guidance_scale": 6.5,
                     "negative_prompt": "low quality, blurry", "seed": 42},
                    {"prompt": "a dog", "width": 512, "height": 512, "steps": 30, "guidance_scale": 7.5,
                     "sampler": "dpmpp_2m"},  # a prompt's own --ss
                    {"prompt": "a cat", "width": 512, "height": 512, "steps": 30, "guidance_scale": 7.5}],
        "at_end": False, "every_n_steps": 100, "sampler": "euler_a"}
    assert "sample_prompts[1] --zz 3: not an option" in err
    assert "sampling.prompts[2] --ss heun is not an ot_dist sampler" in err


def test_saved_command_line_wins_over_the_toml(tmp_path):
    """A command line (`accelerate launch ... sdxl_train_network.py --key value ...`, continued lines included) names
    the script; its arguments win over its --config_file's, flags take no value, network_args take several."""
    images(tmp_path / "d" / "3_x", 1)
    (tmp_path / "base.toml").write_text(f"""
pretrained_model_name_or_path = "sdxl.safetensors"
output_dir = "o"
network_module = "networks.lora"
network_dim = 8
train_data_dir = "{tmp_path / 'd'}"
resolution = 1024
enable_bucket = true
""", encoding="utf-8")
    (tmp_path / "cmd.sh").write_text(
        "accelerate launch --num_processes 2 sdxl_train_network.py \\\n"
        f"  --config_file {tmp_path / 'base.toml'} --network_dim=32 --network_alpha 32 \\\n"
        '  --network_args "conv_dim=32" "conv_alpha=32" --network_train_unet_only \\\n'
        "  --optimizer_type Prodigy --optimizer_args d_coef=2 weight_decay=0.01 --learning_rate 1 --lr_warmup_steps 0.1\n",
        encoding="utf-8")
    out = tmp_path / "out.yaml"
    code, err = run_import("--command_line", tmp_path / "cmd.sh", "--out", out)
    assert code == 0, err
    config = yaml.safe_load(out.read_text(encoding="utf-8"))
    assert config["model"]["family"] == "sdxl" and config["lora"]["rank"] == 32 and config["lora"]["alpha"] == 32
    assert {"conv1", "conv2", "conv", "time_emb_proj", "conv_shortcut"} <= set(config["lora"]["unet_targets"])
    assert "text_encoder" not in config and "text_encoder_2" not in config  # --network_train_unet_only
    # prodigyopt's own slice_p 1 (ot_dist's default is OneTrainer's 11), the options given
    assert config["optimizer"] == {"name": "PRODIGY", "slice_p": 1, "d_coef": 2, "weight_decay": 0.01}
    assert config["scheduler"] == {"name": "CONSTANT", "warmup_steps": 0.1}
    assert "the launcher's options (accelerate launch --num_processes 2)" in out.read_text(encoding="utf-8")


def test_flux_and_sd3_defaults_kohya_trains_with(tmp_path):
    """Where kohya's flow-matching defaults are not ot_dist's: Flux trains at distilled guidance 3.5 with timesteps
    shifted by discrete_flow_shift 3.0 (timestep_sampling sigma) and compares a sigma-scaled prediction; SD3 trains
    unshifted (training_shift 1.0)."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024)
    flux, _, err = imported(tmp_path, common + 'network_module = "networks.lora_flux"\nnoise_offset = 0.1\n',
                            "--script", "flux_train_network.py")
    assert flux["model"]["guidance_scale"] == 3.5
    assert flux["loss"] == {"timestep_distribution": "uniform", "timestep_shift": 3.0}
    assert "model_prediction_type: sigma_scaled" in err
    assert "noise_offset: 0.1: kohya's flux training ignores it" in err  # its noise has no offset
    flux, _, err = imported(tmp_path, common + 'network_module = "networks.lora_flux"\ntimestep_sampling = "shift"\n'
                            'sigmoid_scale = 1.5\nmodel_prediction_type = "raw"\n', "--script", "flux_train_network.py")
    assert flux["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_std": 1.5, "timestep_shift": 3.0}
    assert "model_prediction_type" not in err
    sd3, _, _ = imported(tmp_path, common + 'network_module = "networks.lora_sd3"\nweighting_scheme = "logit_normal"\n',
                         "--script", "sd3_train_network.py")
    assert sd3["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.0,
                           "logit_normal_std": 1.0, "timestep_shift": 1.0}


def test_optimizer_and_schedule_defaults(tmp_path):
    """Adafactor: kohya turns relative steps on unless told (and then schedules with Adafactor's own step);
    Lion8bit keeps bitsandbytes' betas (0.9, 0.99); polynomial power 1 decays linearly to diffusers' lr_end 1e-7."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path) + 'network_module = "networks.lora"\n'
    config, _, _ = imported(tmp_path, common + 'optimizer_type = "Adafactor"\n', "--script", "train_network.py")
    assert config["optimizer"] == {"name": "ADAFACTOR", "relative_step": True, "scale_parameter": True}
    assert config["scheduler"] == {"name": "ADAFACTOR", "warmup_steps": 0}
    config, _, _ = imported(tmp_path, common + 'optimizer_type = "Lion8bit"\nlr_scheduler = "polynomial"\n'
                            "learning_rate = 1e-4\nlr_warmup_steps = 1\ngradient_accumulation_steps = 3\n",
                            "--script", "train_network.py")
    assert config["optimizer"] == {"name": "LION_8BIT", "beta2": 0.99}
    assert config["scheduler"] == {"name": "LINEAR", "warmup_steps": 3, "min_factor": pytest.approx(1e-3)}


def test_refusals_and_what_is_listed(tmp_path):
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, bucket=False)
    for module, args, message in (("networks.dylora", "", "DyLoRA"),
                                  ("lycoris.kohya", 'network_args = ["algo=ia3"]', "algo=ia3"),
                                  ("networks.oft", "", "networks.oft is not a network")):
        (tmp_path / "args.toml").write_text(common + f'network_module = "{module}"\n{args}\n', encoding="utf-8")
        code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_network.py",
                               "--out", tmp_path / "x.yaml")
        assert code == 2 and message in err and not (tmp_path / "x.yaml").exists()
    config, text, err = imported(tmp_path, common + """
network_module = "lycoris.kohya"
network_args = ["algo=loha", "conv_dim=8", "module_dropout=0.1"]
network_dropout = 0.2
v_pred_like_loss = 0.1
loss_type = "quadratic"
full_fp16 = true
color_aug = true
no_such_argument = 3
""", "--script", "train_network.py")
    assert config["lora"]["variant"] == "loha" and "unet_targets" not in config["lora"]
    assert "dropout" not in config["lora"] and "network_dropout: 0.2" in err
    assert config["data"]["bucket_assignment"] == "square"  # no buckets: kohya covers and crops the square
    for line in ("v_pred_like_loss: 0.1", "loss_type: quadratic is not one of kohya's", "full_fp16",
                 "color_aug: True", "no_such_argument: 3 is not an argument of kohya's training scripts",
                 "network_args module_dropout=0.1", "conv_dim=8 conv_alpha=1.0: ot_dist adapts every module at one rank"):
        assert line in err, line
    assert "NOT HONOURED (kohya arguments this config does not reproduce)" in text
    # a rectangle without buckets (kohya crops every image to it) has no ot_dist equivalent: listed, buckets kept
    rectangle = common.replace("resolution = 512\n", 'resolution = "512,768"\n') + 'network_module = "networks.lora"\n'
    config, text, err = imported(tmp_path, rectangle, "--script", "train_network.py")
    assert "enable_bucket: false with resolution 512,768" in err and "bucket_assignment" not in config["data"]


def test_validation_error_names_the_kohya_argument(tmp_path):
    images(tmp_path / "d" / "1_x", 1)
    (tmp_path / "args.toml").write_text(minimal(tmp_path) + 'bucket_reso_steps = 60\nnetwork_module = "networks.lora"\n',
                                        encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_network.py",
                           "--out", tmp_path / "x.yaml")
    assert code == 2 and "data.bucket_step (from bucket_reso_steps)" in err and not (tmp_path / "x.yaml").exists()
    with pytest.raises(ConfigError, match="--script"):
        from ot_dist.migrate.kohya import import_kohya

        import_kohya(tmp_path / "args.toml")


def test_conv_dim_and_lycoris_full_adapt_the_modules_they_name(tmp_path):
    """kohya's networks.lora with conv_dim adapts, besides every Linear / 1x1 conv of the Transformer2DModel blocks,
    every Linear and Conv2d of the ResnetBlock2D, Downsample2D and Upsample2D blocks (its target classes); LyCORIS'
    preset full (its default, convolutions at network_dim / network_alpha unless told) those and conv_in, conv_out,
    time_embedding.linear_1 / _2 by name. The targets written adapt exactly those modules of a diffusers UNet, the
    names kohya's SD 1.x UNet has."""
    import torch
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model

    images(tmp_path / "d" / "1_x", 1)
    kohya_blocks = ("Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D")
    lycoris_names = ("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2")
    for network, names in (('network_module = "networks.lora"\nnetwork_args = ["conv_dim=4", "conv_alpha=1"]', ()),
                           ('network_module = "lycoris.kohya"\nnetwork_args = ["algo=locon"]', lycoris_names)):
        config, _, _ = imported(tmp_path, minimal(tmp_path) + network + "\n", "--script", "train_network.py")
        unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, cross_attention_dim=8,
                                    attention_head_dim=2, norm_num_groups=4, sample_size=8,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
        expected = set(names)
        for name, block in unet.named_modules():
            if type(block).__name__ in kohya_blocks:
                expected |= {f"{name}.{child}" for child, m in block.named_modules()
                             if child and isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
        inject_adapter_in_model(LoraConfig(r=2, target_modules=config["lora"]["unet_targets"]), unet)
        adapted = {name.removesuffix(".lora_A") for name, _ in unet.named_modules() if name.endswith(".lora_A")}
        assert adapted == expected, network


def test_lycoris_presets(tmp_path):
    """LyCORIS' attn-only is ot_dist's attention preset; attn-mlp leaves SD 1.x's 1x1-conv proj_in / proj_out out."""
    images(tmp_path / "d" / "1_x", 1)
    base = minimal(tmp_path) + 'network_module = "lycoris.kohya"\n'
    config, _, _ = imported(tmp_path, base + 'network_args = ["algo=loha", "preset=attn-only"]\n', "--script",
                            "train_network.py")
    assert config["lora"] == {"rank": 4, "alpha": 1, "variant": "loha", "preset": "attention"}
    config, _, _ = imported(tmp_path, base + 'network_args = ["preset=attn-mlp"]\n', "--script", "train_network.py")
    assert config["lora"]["unet_targets"] == ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


def test_train_db_full_finetune(tmp_path):
    """train_db.py trains the whole model and the text encoder until stop_text_encoder_training steps, at
    learning_rate_te; D-Adaptation takes one learning rate for every group (kohya: only the first group's counts)."""
    images(tmp_path / "d" / "1_x", 1)
    config, _, err = imported(tmp_path, minimal(tmp_path) + "stop_text_encoder_training = 500\nlearning_rate_te = 1e-6\n"
                              'mixed_precision = "fp16"\nno_half_vae = true\n', "--script", "train_db.py")
    assert config["method"] == "full" and config["weight_dtype"] == "float16"
    assert config["text_encoder"] == {"train": True, "learning_rate": 1e-6, "stop_training_after": 500,
                                      "stop_training_after_unit": "step"}
    assert config["vae_weight_dtype"] == "float32" and "no_half_vae" not in err  # kohya keeps the VAE in float32
    config, _, err = imported(tmp_path, minimal(tmp_path) + 'learning_rate_te = 1e-6\noptimizer_type = "DAdaptLion"\n'
                              "learning_rate = 1.0\n", "--script", "train_db.py")
    assert config["optimizer"] == {"name": "DADAPT_LION", "beta2": 0.99} and config["text_encoder"] == {"train": True}
    assert "text_encoder learning rate 1e-06: DADAPT_LION takes one learning rate" in err


def test_sample_prompts_toml_and_json(tmp_path):
    """kohya's .toml prompts: [prompt] settings shared by each [[prompt.subset]] (a key in both is an error in
    kohya: dict(**prompt, **subset)); .json: a list of dicts or lines."""
    from ot_dist.migrate.kohya_samples import read_prompts

    (tmp_path / "p.toml").write_text("""
[prompt]
width = 1024
height = 1024
sample_steps = 20
scale = 5.0

  [[prompt.subset]]
  prompt = "a cat"
  seed = 1

  [[prompt.subset]]
  prompt = "a dog"
  negative_prompt = "blurry"
""", encoding="utf-8")
    assert read_prompts(tmp_path / "p.toml") == [
        {"width": 1024, "height": 1024, "sample_steps": 20, "scale": 5.0, "prompt": "a cat", "seed": 1},
        {"width": 1024, "height": 1024, "sample_steps": 20, "scale": 5.0, "prompt": "a dog",
         "negative_prompt": "blurry"}]
    (tmp_path / "p.json").write_text('[{"prompt": "a cat", "seed": 3}, "a dog --d 4"]', encoding="utf-8")
    assert read_prompts(tmp_path / "p.json") == [{"prompt": "a cat", "seed": 3}, {"prompt": "a dog", "seed": 4}]


def test_finetuning_metadata_json_becomes_a_folder_of_captions(tmp_path):
    """kohya's fine-tuning dataset (sdxl_train.py --in_json with --train_data_dir, kohya's fine_tune docs): the
    metadata JSON made by finetune/merge_captions_to_metadata.py and merge_dd_tags_to_metadata.py maps each image's
    key (its file name without extension unless --full_path, relative to train_data_dir) to a `caption` and `tags`;
    kohya trains the caption, caption_separator (default ","), then the tags; --dataset_repeats repeats every image.
    ot_dist reads a caption file beside each image, so the import writes links and captions into --captions_folder,
    once the config validates; the user's image folder is not changed."""
    import json

    data = images(tmp_path / "d", 3)  # minimal()'s train_data_dir
    (data / "1.webp").write_bytes(b"")  # not an image of the metadata: the key "1" is 1.png, found by extension
    (tmp_path / "meta.json").write_text(json.dumps({
        "0": {"caption": "a cat on a bed", "tags": "cat, bed", "train_resolution": [512, 512]},
        "1": {"tags": "cat, outdoors"},                          # tags only: the tags
        str(data / "2.png"): {"caption": "a red square"},         # a --full_path key
        "gone": {"caption": "no such image"},                    # kohya trains it from its latent cache only
    }), encoding="utf-8")
    before = sorted(p.name for p in data.iterdir())
    captions = tmp_path / "captions"
    config, text, err = imported(tmp_path, minimal(tmp_path, 1024) + f'in_json = "{tmp_path / "meta.json"}"\n'
                                 "dataset_repeats = 4\n", "--script", "sdxl_train.py", "--captions_folder", captions)
    folder = captions / "0_meta"
    assert config["data"]["concepts"] == [{"path": str(folder), "caption_extension": ".txt", "balancing": 4}]
    written = {p.name: p.read_text(encoding="utf-8") for p in folder.glob("*.txt")}
    assert written == {"0.txt": "a cat on a bed,cat, bed", "1.txt": "cat, outdoors", "2.txt": "a red square"}
    assert all((folder / f"{i}.png").resolve() == (data / f"{i}.png").resolve() for i in range(3))
    assert "1 of 4 images of meta.json are not found here (gone" in err
    assert sorted(p.name for p in data.iterdir()) == before
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    load_config(tmp_path / "ok.yaml")
    # what ot_dist will train: the images' captions read from the folder, as kohya joins them
    from ot_dist.config.schema import ConceptConfig
    from ot_dist.data.concepts import list_images, read_caption

    concept = ConceptConfig(**config["data"]["concepts"][0])
    assert {p.name: read_caption(concept, p) for p in list_images(str(folder), concept)} == {
        "0.png": "a cat on a bed,cat, bed", "1.png": "cat, outdoors", "2.png": "a red square"}


def test_finetuning_subset_of_a_dataset_toml_and_without_a_captions_folder(tmp_path):
    """A dataset TOML subset with metadata_file (kohya's config_README: a fine-tuning subset; image_dir optional when
    the keys are absolute) in kohya's JSONL form (image_path, caption, tags). With enable_wildcard every line of the
    caption gets the tags. Without --captions_folder nothing is written: the subset is refused naming the option."""
    import json

    data = images(tmp_path / "img", 1)
    (tmp_path / "m.jsonl").write_text(json.dumps({"image_path": str(data / "0.png"), "caption": "a cat\nthe cat",
                                                  "tags": "sitting"}) + "\n", encoding="utf-8")
    (tmp_path / "data.toml").write_text(f"""
[general]
caption_separator = "; "
enable_wildcard = true
[[datasets]]
resolution = 512
[[datasets.subsets]]
metadata_file = "{tmp_path / 'm.jsonl'}"
num_repeats = 2
""", encoding="utf-8")
    args = 'pretrained_model_name_or_path = "m"\noutput_dir = "o"\nnetwork_module = "networks.lora"\n'
    config, _, _ = imported(tmp_path, args, "--script", "train_network.py", "--dataset_config", tmp_path / "data.toml",
                            "--captions_folder", tmp_path / "c")
    assert config["data"]["concepts"][0]["balancing"] == 2
    assert (tmp_path / "c" / "0_m" / "0.txt").read_text(encoding="utf-8") == "a cat; sitting\nthe cat; sitting"
    (tmp_path / "args.toml").write_text(args, encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_network.py",
                           "--dataset_config", tmp_path / "data.toml", "--out", tmp_path / "x.yaml")
    assert code == 2 and "--captions_folder DIR" in err and not (tmp_path / "x.yaml").exists()
    # a config that does not validate writes no caption folder either
    (tmp_path / "args.toml").write_text(args + "bucket_reso_steps = 60\n", encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_network.py",
                           "--dataset_config", tmp_path / "data.toml", "--captions_folder", tmp_path / "c2",
                           "--out", tmp_path / "x.yaml")
    assert code == 2 and "bucket_step" in err and not (tmp_path / "c2").exists()


def test_fine_tune_script(tmp_path):
    """fine_tune.py (SD 1.x / 2.x) trains the whole UNet, and the text encoder only with --train_text_encoder, at
    --learning_rate_te when given; it reads only fine-tuning datasets (kohya's ConfigSanitizer without DreamBooth)."""
    import json

    data = images(tmp_path / "train", 1)
    (tmp_path / "meta.json").write_text(json.dumps({"0": {"caption": "a cat"}}), encoding="utf-8")
    common = f'pretrained_model_name_or_path = "m"\noutput_dir = "o"\ntrain_data_dir = "{data}"\nresolution = 512\n'
    json_args = f'in_json = "{tmp_path / "meta.json"}"\n'
    config, _, _ = imported(tmp_path, common + json_args + "train_text_encoder = true\nlearning_rate_te = 1e-6\n",
                            "--script", "fine_tune.py", "--captions_folder", tmp_path / "c")
    assert config["method"] == "full" and config["text_encoder"] == {"train": True, "learning_rate": 1e-6}
    config, _, _ = imported(tmp_path, common + json_args, "--script", "fine_tune.py", "--captions_folder",
                            tmp_path / "c2")
    assert "text_encoder" not in config
    (tmp_path / "args.toml").write_text(common, encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "fine_tune.py",
                           "--out", tmp_path / "x.yaml")
    assert code == 2 and "fine_tune.py trains a fine-tuning dataset only" in err


def test_textual_inversion(tmp_path):
    """kohya's train_textual_inversion.py / sdxl_train_textual_inversion.py (docs/train_textual_inversion.md):
    --token_string is the new word (the output file's name when output_name is not set), --num_vectors_per_token its
    vectors, --init_word the text whose token embeddings start them: ot_dist's method embedding with token, vectors and
    init_text, --weights (continue from a file) embedding.init_from. Templates (captions replaced by kohya's
    built-in ones) are refused by name; no init_word is listed (kohya starts from the new rows the resize adds)."""
    images(tmp_path / "d" / "5_mychar", 1)
    common = minimal(tmp_path) + 'token_string = "mychar"\n'
    config, text, err = imported(tmp_path, common + 'init_word = "girl"\nnum_vectors_per_token = 4\n'
                                 'mixed_precision = "bf16"\ncache_latents = true\n', "--script",
                                 "sdxl_train_textual_inversion.py")
    assert config["method"] == "embedding" and config["model"]["family"] == "sdxl"
    assert config["embedding"] == {"token": "mychar", "vectors": 4, "init_text": "girl"}
    assert config["output_dir"] == "o/mychar" and "text_encoder" not in config and "lora" not in config
    assert "not honoured:" not in err and config["data"]["cache_latents"] is True
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "ok.yaml").embedding.vectors == 4
    config, _, err = imported(tmp_path, common, "--script", "train_textual_inversion.py")
    assert config["embedding"] == {"token": "mychar", "vectors": 1, "init_text": "*"}
    assert "init_word: not set" in err
    config, _, _ = imported(tmp_path, common + 'weights = "old.safetensors"\nnum_vectors_per_token = 2\n', "--script",
                            "train_textual_inversion.py")  # --weights continues that file
    assert config["embedding"] == {"token": "mychar", "vectors": 2, "init_text": "*", "init_from": "old.safetensors"}
    for extra, message in (("use_object_template = true\n", "use_object_template: kohya ignores the captions"),
                           ("use_style_template = true\n", "use_style_template: kohya ignores the captions"),
                           ('weights = "old.pt"\n', "embedding.init_from: old.pt is not a .safetensors file"),
                           ('token_string = ""\n', "token_string: not set")):
        (tmp_path / "args.toml").write_text(minimal(tmp_path) + extra + ("" if "token_string" in extra else
                                                                        'token_string = "mychar"\n'), encoding="utf-8")
        code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_textual_inversion.py",
                               "--out", tmp_path / "x.yaml")
        assert code == 2 and message in err and not (tmp_path / "x.yaml").exists()
    # ot_dist's lower-case rule for several vectors names kohya's argument
    (tmp_path / "args.toml").write_text(minimal(tmp_path) + 'token_string = "MyChar"\nnum_vectors_per_token = 2\n',
                                        encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_textual_inversion.py",
                           "--out", tmp_path / "x.yaml")
    assert code == 2 and "embedding" in err and "token_string" in err


def test_sdxl_train_text_encoders(tmp_path):
    """sdxl_train.py trains the text encoders only with --train_text_encoder, each at learning_rate_te1 / _te2 (None:
    learning_rate; 0: that encoder frozen)."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, resolution=1024) + "learning_rate = 1e-5\n"
    for extra, te1, te2 in (("", False, False), ("train_text_encoder = true\n", None, None),
                            ("train_text_encoder = true\nlearning_rate_te1 = 3e-6\nlearning_rate_te2 = 0\n", 3e-6, False),
                            ("learning_rate_te1 = 3e-6\n", False, False)):
        config, text, _ = imported(tmp_path, common + extra, "--script", "sdxl_train.py")
        assert config["model"]["family"] == "sdxl" and config["method"] == "full"
        (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
        loaded = load_config(tmp_path / "ok.yaml")
        for part, expected in (("text_encoder", te1), ("text_encoder_2", te2)):
            trains = bool(getattr(loaded, part).train)  # None: a text encoder does not train
            assert trains == (expected is not False), (extra, part)
            if trains:  # a learning rate of its own, or the global one
                assert getattr(loaded, part).learning_rate == expected, (extra, part)


def test_network_args_that_are_no_number_name_the_argument(tmp_path):
    """kohya's networks read conv_dim with int(), conv_alpha / rank_dropout / module_dropout with float(): a word that
    is no number was a bare ValueError (a traceback); it is an import error naming the argument (exit 2)."""
    images(tmp_path / "d" / "1_x", 1)
    for module, words in (("networks.lora", ["rank_dropout=abc"]), ("networks.lora", ["conv_dim=x"]),
                          ("networks.lora", ["conv_dim=4", "conv_alpha=half"]), ("lycoris.kohya", ["conv_dim=4.5"])):
        word = words[-1]
        (tmp_path / "args.toml").write_text(minimal(tmp_path) + f'network_module = "{module}"\n'
                                            f"network_args = {words!r}\n".replace("'", '"'), encoding="utf-8")
        code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "train_network.py",
                               "--out", tmp_path / "x.yaml")
        assert code == 2 and f"network_args: {word}" in err and not (tmp_path / "x.yaml").exists(), err


def test_caption_prefix_and_suffix(tmp_path):
    """A subset's caption_prefix and caption_suffix (kohya: prefix, a space, the caption, a space, suffix) become the
    concept's; the suffix was listed as not honoured."""
    data = images(tmp_path / "img", 1, {0: "a cat"}, extension=".txt")
    (tmp_path / "data.toml").write_text(f"""
[[datasets]]
resolution = 512
  [[datasets.subsets]]
  image_dir = '{data}'
  caption_extension = ".txt"
  caption_prefix = "photo of"
  caption_suffix = ", sks style"
""", encoding="utf-8")
    config, text, err = imported(tmp_path, minimal(tmp_path) + f'network_module = "networks.lora"\n'
                                 f'dataset_config = "{tmp_path / "data.toml"}"\n', "--script", "train_network.py")
    concept = config["data"]["concepts"][0]
    assert (concept["caption_prefix"], concept["caption_suffix"]) == ("photo of", ", sks style")
    assert "caption_suffix" not in err
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    from ot_dist.data.concepts import read_caption

    assert read_caption(load_config(tmp_path / "ok.yaml").data.concepts[0], data / "0.png") == \
        "photo of a cat , sks style"


def test_loss_weights_kohya_combines_or_takes_from_another_schedule(tmp_path):
    """kohya's post_process_loss multiplies min_snr_gamma's weight by debiased_estimation_loss's when both are set;
    ot_dist weighs by one function, so the import keeps min_snr_gamma and lists the other (it wrote both, which the
    config refused). With zero_terminal_snr kohya's get_noise_scheduler computes the SNR table (prepare_scheduler_for_
    custom_training) before it rescales the betas, so its min-SNR weights are the original schedule's: listed."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path) + 'network_module = "networks.lora"\nmin_snr_gamma = 5\n'
    config, _, err = imported(tmp_path, common + "debiased_estimation_loss = true\n", "--script", "train_network.py")
    assert config["loss"] == {"min_snr_gamma": 5}
    assert "debiased_estimation_loss: kohya multiplies its weight" in err
    config, _, err = imported(tmp_path, common + "v_parameterization = true\nzero_terminal_snr = true\n",
                              "--script", "train_network.py")
    assert config["model"]["zero_terminal_snr"] and config["loss"] == {"min_snr_gamma": 5}
    assert "min_snr_gamma: 5 with zero_terminal_snr: kohya weighs by the SNR of the schedule before the rescale" in err
    _, _, err = imported(tmp_path, common + "v_parameterization = true\n", "--script", "train_network.py")
    assert "min_snr_gamma" not in err


def test_network_alpha_0_is_the_rank(tmp_path):
    """kohya's LoRAModule (and LyCORIS' modules): "if alpha == 0 or None, alpha is rank (no scaling)"; conv_alpha 0
    likewise is conv_dim. ot_dist's alpha must be > 0, so 0 was a config error."""
    images(tmp_path / "d" / "1_x", 1)
    config, _, err = imported(tmp_path, minimal(tmp_path) + 'network_module = "networks.lora"\nnetwork_dim = 16\n'
                              'network_alpha = 0\nnetwork_args = ["conv_dim=16", "conv_alpha=0"]\n',
                              "--script", "train_network.py")
    assert (config["lora"]["rank"], config["lora"]["alpha"]) == (16, 16)
    assert "conv1" in config["lora"]["unet_targets"] and "conv_dim" not in err  # the ResNet blocks at the same scale


def test_lr_warmup_float_is_a_ratio_up_to_1(tmp_path):
    """kohya's get_scheduler_fix reads any float lr_warmup_steps as a ratio of the training steps: 1.0 (TOML) or
    "100%" (its int_or_float) warms up over the whole run; ot_dist reads a warmup <= 1 as the same ratio. It was
    written as one optimizer step (in micro steps), or no warmup without accumulation."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path) + 'network_module = "networks.lora"\nlr_scheduler = "cosine"\n'
    for accumulation in (1, 3):
        config, _, err = imported(tmp_path, common + "lr_warmup_steps = 1.0\n"
                                  f"gradient_accumulation_steps = {accumulation}\n", "--script", "train_network.py")
        assert config["scheduler"] == {"name": "COSINE", "warmup_steps": 1.0} and "lr_warmup_steps" not in err
    config, _, _ = imported(tmp_path, common + "lr_warmup_steps = 4\ngradient_accumulation_steps = 3\n",
                            "--script", "train_network.py")
    assert config["scheduler"]["warmup_steps"] == 12  # whole optimizer steps: ot_dist counts micro steps above 1


def test_warmup_on_several_processes(tmp_path):
    """accelerate's AcceleratedScheduler (installed accelerate, split_batches off) steps kohya's schedule once per
    process at each optimizer step, and kohya sizes it max_train_steps x processes: on `--num_processes 2` a warmup of
    10 ends after 5 optimizer steps. A ratio is the same share on any number of processes."""
    import inspect

    from accelerate.scheduler import AcceleratedScheduler

    assert "for _ in range(num_processes)" in inspect.getsource(AcceleratedScheduler.step)
    images(tmp_path / "d" / "1_x", 1)
    launch = ("accelerate launch --num_processes 2 train_network.py --pretrained_model_name_or_path m --output_dir o "
              f"--train_data_dir {tmp_path / 'd'} --resolution 512 --enable_bucket --network_module networks.lora "
              "--lr_scheduler cosine --gradient_accumulation_steps 3 --lr_warmup_steps ")
    for warmup, written in (("10", 15), ("11", 18), ("0.1", 0.1)):
        (tmp_path / "cmd.sh").write_text(launch + warmup + "\n", encoding="utf-8")
        code, err = run_import("--command_line", tmp_path / "cmd.sh", "--out", tmp_path / "out.yaml", "--force")
        assert code == 0, err
        config = yaml.safe_load((tmp_path / "out.yaml").read_text(encoding="utf-8"))
        assert config["scheduler"] == {"name": "COSINE", "warmup_steps": written}, warmup


def test_conv_dim_of_another_rank_keeps_the_resnet_linear_layers(tmp_path):
    """networks.lora with conv_dim: the ResNet blocks' linear and 1x1 layers (time_emb_proj, conv_shortcut) are
    adapted at network_dim / network_alpha, conv_dim / conv_alpha apply to the 3x3 convolutions only (kohya's
    create_modules: `is_linear or is_conv2d_1x1` take the network's dim). With conv_dim other than the rank only the 3x3
    convolutions are left out (listed)."""
    images(tmp_path / "d" / "1_x", 1)
    config, _, err = imported(tmp_path, minimal(tmp_path) + 'network_module = "networks.lora"\nnetwork_dim = 8\n'
                              'network_alpha = 4\nnetwork_args = ["conv_dim=4", "conv_alpha=1"]\n',
                              "--script", "train_network.py")
    targets = config["lora"]["unet_targets"]
    assert {"time_emb_proj", "conv_shortcut", "to_q", "proj_in"} <= set(targets)
    assert not {"conv1", "conv2", "conv"} & set(targets)
    assert "the 3x3 convolutions of the ResNet blocks and samplers are not adapted" in err


def test_min_timestep_not_below_max_trains_the_maximum(tmp_path):
    """kohya's get_timesteps draws randint(min_timestep, max_timestep) and, when min_timestep is not below
    max_timestep, trains max_timestep alone (it accepts min 600 / max 500: every step at 500)."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path) + 'network_module = "networks.lora"\n'
    for low, high, written in ((600, 500, (500, 500)), (500, 500, (500, 500)), (100, 500, (100, 499))):
        config, _, _ = imported(tmp_path, common + f"min_timestep = {low}\nmax_timestep = {high}\n",
                                "--script", "train_network.py")
        assert (config["loss"]["min_timestep"], config["loss"]["max_timestep"]) == written


def test_logit_mean_keeps_the_side_of_the_noise_kohya_favours(tmp_path):
    """flux_train_network.py's timestep_sampling sigma trains on the scheduler's timesteps[(u x 1000)], which run from
    sigma 1 down (noise level about 1 - u): logit_mean 1.0 favours low noise, ot_dist's logit_normal_mean -1.0.
    sd3_train_network.py's noise level is u itself (shifted): the mean stays."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + 'weighting_scheme = "logit_normal"\nlogit_mean = 1.0\n'
    flux, _, _ = imported(tmp_path, common + 'network_module = "networks.lora_flux"\nmodel_prediction_type = "raw"\n',
                          "--script", "flux_train_network.py")
    assert flux["loss"]["logit_normal_mean"] == -1.0
    sd3, _, _ = imported(tmp_path, common + 'network_module = "networks.lora_sd3"\n', "--script", "sd3_train_network.py")
    assert sd3["loss"]["logit_normal_mean"] == 1.0


def test_flux_script_model_type_chroma_trains_chroma(tmp_path):
    """flux_train_network.py --model_type chroma trains Chroma (kohya's docs: guidance_scale 0.0, apply_t5_attn_mask,
    no CLIP-L): ot_dist's chroma family, no distilled guidance, its T5 adapted with train_t5xxl; a sample's --l is
    its classifier-free guidance. On Flux.1, apply_t5_attn_mask is listed: diffusers' Flux has no text mask."""
    images(tmp_path / "d" / "1_x", 1)
    (tmp_path / "p.txt").write_text("a cat --n ugly --l 4.0 --d 1\n", encoding="utf-8")
    common = minimal(tmp_path, 1024) + 'network_module = "networks.lora_flux"\nmodel_prediction_type = "raw"\n' \
        'apply_t5_attn_mask = true\n'
    chroma, text, _ = imported(tmp_path, common + f'model_type = "chroma"\nguidance_scale = 0.0\nsample_prompts = '
                               f'"{tmp_path / "p.txt"}"\nsample_every_n_steps = 10\nnetwork_args = ["train_t5xxl=True"]\n',
                               "--script", "flux_train_network.py")
    assert chroma["model"] == {"family": "chroma", "path": "m"}
    assert chroma["text_encoder"] == {"train": True} and "text_encoder_2" not in chroma
    assert chroma["sampling"]["prompts"][0]["guidance_scale"] == 4.0
    listed = text.split("NOT HONOURED")[-1]
    assert "model_type:" not in listed and "apply_t5_attn_mask:" not in listed
    flux, _, err = imported(tmp_path, common, "--script", "flux_train_network.py")
    assert flux["model"]["family"] == "flux" and "apply_t5_attn_mask: True: ot_dist's Flux.1 attends" in err


def test_t5xxl_max_token_length_is_the_t5_caption_length(tmp_path):
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + 'model_prediction_type = "raw"\n'
    sd3, _, _ = imported(tmp_path, common + 'network_module = "networks.lora_sd3"\n', "--script", "sd3_train_network.py")
    assert "t5_max_tokens" not in sd3["model"]  # kohya's SD3 default 256 is ot_dist's
    flux, text, _ = imported(tmp_path, common + 'network_module = "networks.lora_flux"\nt5xxl_max_token_length = 256\n',
                             "--script", "flux_train_network.py")
    assert flux["model"]["t5_max_tokens"] == 256 and "t5xxl_max_token_length:" not in text.split("NOT HONOURED")[-1]


def test_sd3_window_with_a_training_shift_is_listed(tmp_path):
    """sd3_train_network.py spreads the shifted draw over [min_timestep, max_timestep); ot_dist shifts the time inside
    its window: with both, the noise levels differ and the import says so."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + 'network_module = "networks.lora_sd3"\nmax_timestep = 500\n'
    _, _, err = imported(tmp_path, common + "training_shift = 3.0\n", "--script", "sd3_train_network.py")
    assert "min_timestep / max_timestep with training_shift 3.0" in err
    config, _, err = imported(tmp_path, common, "--script", "sd3_train_network.py")
    assert config["loss"]["max_timestep"] == 499 and "training_shift" not in err


def test_flux_sigma_weighting_applies_only_to_a_sigma_scaled_prediction(tmp_path):
    """flux_train_network.py weighs the loss by weighting_scheme sigma_sqrt / cosmap only with model_prediction_type
    sigma_scaled; with raw it draws u uniformly and weighs nothing, which ot_dist reproduces: nothing listed."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + 'network_module = "networks.lora_flux"\nweighting_scheme = "sigma_sqrt"\n'
    raw, _, err = imported(tmp_path, common + 'model_prediction_type = "raw"\n', "--script", "flux_train_network.py")
    assert raw["loss"] == {"timestep_distribution": "uniform", "timestep_shift": 3.0} and "weighting_scheme" not in err
    _, _, err = imported(tmp_path, common, "--script", "flux_train_network.py")
    assert "weighting_scheme: sigma_sqrt weighs the loss" in err and "model_prediction_type: sigma_scaled" in err


def test_loss_type_and_huber_schedule(tmp_path):
    """kohya's conditional_loss: l1 is mae_strength; huber / smooth_l1 the pseudo-Huber with its threshold schedule
    (huber_scale only where the schedule reads it); its Flux / SD3 scripts stop on the snr schedule (the default),
    and take the exponential one over sigma x 1000."""
    images(tmp_path / "d" / "1_x", 1)
    sd = minimal(tmp_path) + 'network_module = "networks.lora"\n'
    config, text, err = imported(tmp_path, sd + 'loss_type = "l1"\nhuber_c = 0.3\n', "--script", "train_network.py")
    assert config["loss"] == {"mse_strength": 0.0, "mae_strength": 1.0}
    assert "huber_c: 0.3 shapes the huber / smooth_l1 loss only; with l1 kohya ignores it" in text
    config, text, err = imported(tmp_path, sd + 'loss_type = "huber"\nhuber_scale = 3.0\nmin_snr_gamma = 5\n',
                              "--script", "train_network.py")
    assert config["loss"] == {"min_snr_gamma": 5, "mse_strength": 0.0, "pseudo_huber_strength": 1.0,
                              "pseudo_huber_form": "huber", "pseudo_huber_schedule": "snr", "pseudo_huber_c": 0.1}
    assert "huber_scale: 3.0: kohya's snr schedule does not read it" in text and "loss_type:" not in text
    config, _, _ = imported(tmp_path, sd + 'loss_type = "smooth_l1"\nhuber_schedule = "exponential"\nhuber_c = 0.2\n'
                            'huber_scale = 1.5\n', "--script", "train_network.py")
    assert config["loss"] == {"mse_strength": 0.0, "pseudo_huber_strength": 1.0, "pseudo_huber_form": "smooth_l1",
                              "pseudo_huber_schedule": "exponential", "pseudo_huber_c": 0.2, "pseudo_huber_scale": 1.5}
    flux = minimal(tmp_path, 1024) + 'network_module = "networks.lora_flux"\ntimestep_sampling = "uniform"\n'
    config, text, err = imported(tmp_path, flux + 'loss_type = "huber"\n', "--script", "flux_train_network.py")
    assert "pseudo_huber_strength" not in config["loss"]
    assert "loss_type: huber with huber_schedule snr (kohya's default): kohya's flux training stops there" in err
    config, _, _ = imported(tmp_path, flux + 'loss_type = "huber"\nhuber_schedule = "constant"\n',
                            "--script", "flux_train_network.py")
    assert config["loss"]["pseudo_huber_schedule"] == "constant" and config["loss"]["pseudo_huber_scale"] == 1.0


def test_fp8_base_stores_what_kohya_casts(tmp_path):
    """kohya's fp8_base casts the denoiser and the text encoders to float8, fp8_base_unet (which wins) the denoiser
    only; the VAE keeps the mixed dtype, float32 with no_half_vae (train_network.py)."""
    from ot_dist.config.load import validate

    images(tmp_path / "d" / "1_x", 1)
    base = minimal(tmp_path) + 'mixed_precision = "bf16"\nnetwork_module = "networks.lora"\n'

    def storage(extra):
        config = validate(imported(tmp_path, base + extra, "--script", "sdxl_train_network.py")[0])
        return {name: config.component_storage(name) for name in ("unet", "text_encoder", "text_encoder_2", "vae")}

    assert storage("fp8_base = true\n") == {"unet": "float8", "text_encoder": "float8", "text_encoder_2": "float8",
                                            "vae": "bfloat16"}
    assert storage("fp8_base = true\nfp8_base_unet = true\nno_half_vae = true\n") == {
        "unet": "float8", "text_encoder": "bfloat16", "text_encoder_2": "bfloat16", "vae": "float32"}
