"""`ot-dist import ai-toolkit`: ostris ai-toolkit job files become ot_dist configs that validate and keep each key's
meaning, with everything ot_dist cannot honour listed. The fixtures reproduce the structure of ai-toolkit's own
examples (config/examples/*.yaml of ostris/ai-toolkit 27a03a9, August 2026: each test names the one it mirrors);
ai-toolkit's defaults are toolkit/config_modules.py's. No process is launched."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from ot_dist.cli import main
from ot_dist.config.load import load_config


def job(process: dict, name: str = "my_first_lora_v1") -> dict:
    return {"job": "extension", "config": {"name": name, "process": [process]}, "meta": {"name": "[name]"}}


def flux_lora() -> dict:
    """train_lora_flux_24gb.yaml, less its comments and all but two prompts."""
    return {
        "type": "sd_trainer", "training_folder": "output", "device": "cuda:0",
        "network": {"type": "lora", "linear": 16, "linear_alpha": 16},
        "save": {"dtype": "float16", "save_every": 250, "max_step_saves_to_keep": 4, "push_to_hub": False},
        "datasets": [{"folder_path": "/data/images", "caption_ext": "txt", "caption_dropout_rate": 0.05,
                      "shuffle_tokens": False, "cache_latents_to_disk": True, "resolution": [512, 768, 1024]}],
        "train": {"batch_size": 1, "steps": 2000, "gradient_accumulation_steps": 1, "train_unet": True,
                  "train_text_encoder": False, "gradient_checkpointing": True, "noise_scheduler": "flowmatch",
                  "optimizer": "adamw8bit", "lr": 1e-4, "ema_config": {"use_ema": True, "ema_decay": 0.99},
                  "dtype": "bf16"},
        "model": {"name_or_path": "black-forest-labs/FLUX.1-dev", "is_flux": True, "quantize": True},
        "sample": {"sampler": "flowmatch", "sample_every": 250, "sample_start_step": 0, "width": 1024,
                   "height": 1024, "prompts": ["woman with red hair, playing chess at the park",
                                               "[trigger] holding a coffee cup --seed 7 --w 768",
                                               "a bear building a log cabin"],
                   "neg": "", "seed": 42, "walk_seed": True, "guidance_scale": 4, "sample_steps": 20},
    }


def run_import(tmp_path: Path, config: dict, suffix: str = ".yaml") -> tuple[int, str, Path]:
    source = tmp_path / f"job{suffix}"
    source.write_text(yaml.safe_dump(config) if suffix == ".yaml" else json.dumps(config), encoding="utf-8")
    out = tmp_path / "out.yaml"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["import", "ai-toolkit", str(source), "--out", str(out), "--force"])
    return code, err.getvalue(), out


def imported(tmp_path: Path, config: dict, suffix: str = ".yaml") -> tuple[dict, str]:
    code, err, out = run_import(tmp_path, config, suffix)
    assert code == 0, err
    load_config(out)  # what is written is a config ot_dist accepts
    text = out.read_text(encoding="utf-8")
    return yaml.safe_load(text), text


def test_flux_lora_example(tmp_path):
    """train_lora_flux_24gb.yaml: every mapped key carries its value."""
    process = flux_lora()
    process["trigger_word"] = "p3rs0n"
    c, text = imported(tmp_path, job(process))
    assert c["model"] == {"family": "flux", "path": "black-forest-labs/FLUX.1-dev"}
    assert (c["method"], c["output_dir"]) == ("lora", "output/my_first_lora_v1")
    assert (c["max_steps"], c["batch_size"], c["gradient_accumulation_steps"]) == (2000, 1, 1)
    assert (c["learning_rate"], c["train_dtype"], c["weight_dtype"]) == (1e-4, "bfloat16", "bfloat16")
    # quantize: the transformer in float8, and (quantize_te follows quantize) the text encoders; the VAE bfloat16
    assert [c[part]["weight_dtype"] for part in ("transformer", "text_encoder", "text_encoder_2")] == ["float8"] * 3
    assert c["lora"] == {"rank": 16, "alpha": 16.0, "layer_filter": ["transformer_blocks"]}
    assert c["optimizer"] == {"name": "ADAMW_8BIT", "eps": 1e-6, "weight_decay": 0.01}
    assert c["scheduler"] == {"name": "CONSTANT"}
    # ai-toolkit's default timestep_type sigmoid: sigmoid(N(0, 1)), unshifted
    assert c["loss"] == {"timestep_distribution": "logit_normal", "timestep_shift": 1.0,
                         "dynamic_timestep_shifting": False}
    assert c["ema"] == {"enabled": True, "decay": 0.99, "update_step_interval": 1}
    concept = c["data"]["concepts"][0]
    assert concept == {"path": "/data/images", "caption_extension": ".txt", "caption_dropout_probability": 0.05,
                       "caption_prefix": "p3rs0n"}
    assert c["resolution"] == [512, 768, 1024] and c["data"]["cache_latents"] is True
    assert c["checkpoint"] == {"every_n_steps": 250, "keep_last": 4, "every_n_minutes": None}
    assert c["output_dtype"] == "float16"
    first, second, third = c["sampling"]["prompts"]
    assert first == {"prompt": "woman with red hair, playing chess at the park", "seed": 42, "width": 1024,
                     "height": 1024, "guidance_scale": 4.0, "steps": 20}
    # walk_seed: 42 + 1, overridden by the prompt's --seed; --w; [trigger] replaced as in ai-toolkit's samples
    assert (second["prompt"], second["seed"], second["width"]) == ("p3rs0n holding a coffee cup", 7, 768)
    assert third["seed"] == 44  # a prompt's --seed is its own; the walk goes on from sample.seed
    assert c["sampling"]["every_n_steps"] == 250
    assert "NOT HONOURED" in text and "ema_config" in text


def test_qwen_image_edit_plus_control_lists(tmp_path):
    """train_lora_qwen_image_edit_2509_32gb.yaml: control_path as a list, samples with ctrl_img_1 / _2, arch,
    gradient_accumulation, a uint3 qtype (listed)."""
    process = flux_lora()
    process["type"] = "diffusion_trainer"
    process["model"] = {"name_or_path": "Qwen/Qwen-Image-Edit-2509", "arch": "qwen_image_edit_plus",
                        "quantize": True, "qtype": "uint3|ostris/accuracy_recovery_adapters/x.safetensors",
                        "quantize_te": True, "qtype_te": "qfloat8", "low_vram": True}
    process["datasets"][0]["control_path"] = ["/data/c1", "/data/c2"]
    process["train"] |= {"gradient_accumulation": 2, "timestep_type": "weighted", "cache_text_embeddings": True}
    del process["train"]["ema_config"]
    process["sample"] = {"sampler": "flowmatch", "sample_every": 250, "width": 1024, "height": 1024, "seed": 42,
                         "walk_seed": True, "guidance_scale": 3, "sample_steps": 25,
                         "samples": [{"prompt": "Do whatever with Image1 and Image2", "ctrl_img_1": "/data/i1.png",
                                      "ctrl_img_2": "/data/i2.png"},
                                     {"prompt": "Image1 only", "ctrl_img": "/data/i1.png", "seed": 5},
                                     {"prompt": "Image1 again", "ctrl_img": "/data/i1.png"}]}
    c, text = imported(tmp_path, job(process))
    assert c["model"]["family"] == "qwen_image_edit_plus"
    assert c["gradient_accumulation_steps"] == 2 and c["max_steps"] == 2000
    assert c["data"]["concepts"][0]["reference_path"] == ["/data/c1", "/data/c2"]
    first, second, third = c["sampling"]["prompts"]
    assert first["reference_image"] == ["/data/i1.png", "/data/i2.png"] and second["reference_image"] == "/data/i1.png"
    # a sample's own seed is its own; walk_seed gives the others 42 + i (ai-toolkit's current_seed)
    assert (first["seed"], second["seed"], third["seed"]) == (42, 5, 44)
    assert c["weight_dtype"] == "bfloat16" and "weight_dtype" not in c.get("transformer", {})
    assert c["text_encoder"]["weight_dtype"] == "float8"  # qtype_te qfloat8
    assert "model.qtype: uint3" in text and "timestep_type: weighted" in text
    assert c["loss"]["timestep_distribution"] == "uniform"


def test_kontext_numbered_control_paths_and_prompt_ctrl_img(tmp_path):
    """train_lora_flux_kontext_24gb.yaml (arch flux_kontext, `--ctrl_img` in the prompt) with the UI's numbered
    control_path_1 / _2, which win over control_path."""
    process = flux_lora()
    process["model"] = {"name_or_path": "/models/kontext", "arch": "flux_kontext"}
    process["datasets"][0] |= {"control_path": "/data/ignored", "control_path_1": "/data/before"}
    process["sample"]["prompts"] = ["make the person smile  --ctrl_img /data/person1.jpg"]
    process["train"] |= {"noise_offset": 0.05, "min_snr_gamma": 5}
    c, text = imported(tmp_path, job(process), suffix=".json")
    assert c["loss"]["offset_noise_weight"] == 0.05  # ai-toolkit offsets any model's noise
    assert "train.min_snr_gamma: 5: min-SNR weighting is defined for DDPM models only" in text
    assert c["model"]["family"] == "flux_kontext"
    assert c["data"]["concepts"][0]["reference_path"] == "/data/before"
    assert c["sampling"]["prompts"][0]["reference_image"] == "/data/person1.jpg"
    assert c["sampling"]["prompts"][0]["prompt"] == "make the person smile"


def test_sdxl_lokr_prodigy_cosine_and_legacy_accumulation(tmp_path):
    """An SDXL LoKr (is_xl; the UI's network.type lokr) with Prodigy and a cosine schedule, the older
    gradient_accumulation_steps (steps count batches), a regularisation dataset and keys ot_dist lacks."""
    process = flux_lora()
    process["model"] = {"name_or_path": "/models/sdxl", "is_xl": True}
    process["network"] = {"type": "lokr", "linear": 8, "linear_alpha": 4, "lokr_factor": 4}
    process["train"] = {"steps": 1000, "gradient_accumulation_steps": 4, "optimizer": "prodigy", "lr": 1,
                        "optimizer_params": {"weight_decay": 0.01, "betas": [0.9, 0.99], "foo": 1},
                        "lr_scheduler": "cosine", "noise_offset": 0.05, "min_snr_gamma": 5, "dtype": "fp16",
                        "loss_type": "mae", "do_prior_divergence": True}
    process["datasets"].append({"folder_path": "/data/reg", "is_reg": True, "resolution": 1024, "flip_x": True})
    process["train"]["reg_weight"] = 0.5
    process["sample"]["sampler"] = "euler_a"
    c, text = imported(tmp_path, job(process))
    assert c["model"]["family"] == "sdxl"
    assert c["lora"] == {"rank": 8, "alpha": 4.0, "variant": "lokr", "preset": "all_linear"}
    assert (c["max_steps"], c["gradient_accumulation_steps"]) == (250, 4)
    assert c["optimizer"] == {"name": "PRODIGY", "eps": 1e-6, "slice_p": 1, "weight_decay": 0.01, "beta1": 0.9,
                              "beta2": 0.99}
    assert c["scheduler"] == {"name": "COSINE", "min_factor": 0.0}
    assert c["loss"] == {"min_snr_gamma": 5.0, "offset_noise_weight": 0.05, "mse_strength": 0.0,
                         "mae_strength": 1.0}
    reg = c["data"]["concepts"][1]
    assert (reg["type"], reg["loss_weight"], reg["flip_probability"]) == ("prior_preservation", 0.5, 0.5)
    assert "caption_prefix" not in reg  # ai-toolkit puts no trigger word in regularisation captions
    assert "cache_latents" not in c["data"]  # the flipped dataset is not cached
    assert c["sampling"]["sampler"] == "euler_a"
    for listed in ("lokr_full_rank", "lokr_factor", "optimizer_params.foo", "train.do_prior_divergence"):
        assert listed in text, listed


def test_linear_schedule_runs_torchs_class(tmp_path):
    """lr_scheduler linear is torch's LinearLR over train.steps (from 1/3 up to the rate): ot_dist's CUSTOM of the
    same class, not its LINEAR decay."""
    process = flux_lora()
    process["train"]["lr_scheduler"] = "linear"
    c, _ = imported(tmp_path, job(process))
    assert c["scheduler"] == {"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.LinearLR",
                              "params": {"total_iters": "%TOTAL_STEPS%"}}


@pytest.mark.parametrize("change, message", [
    (lambda p: p["model"].pop("name_or_path"), "config.process[0].model.name_or_path: not set"),
    (lambda p: p["train"].update(steps="many"), "config.process[0].train.steps: 'many' is not a number"),
    (lambda p: p["network"].update(linear="wide"), "config.process[0].network.linear: 'wide' is not a number"),
    (lambda p: p["model"].update(arch="auraflow"), "config.process[0].model.arch: auraflow is not a model"),
    (lambda p: p.update(datasets=[]), "config.process[0].datasets: not a list"),
    (lambda p: p["datasets"][0].pop("folder_path"), "config.process[0].datasets[0].folder_path: not set"),
    (lambda p: p["datasets"][0].update(resolution=["big"]), "datasets[0].resolution: 'big' is not a number"),
])
def test_malformed_fields_are_named(tmp_path, change, message):
    process = flux_lora()
    change(process)
    code, err, out = run_import(tmp_path, job(process))
    assert code == 2 and message in err, err
    assert not out.exists()


def test_not_a_job_file(tmp_path):
    code, err, _ = run_import(tmp_path, {"process": []})
    assert code == 2 and "config: " in err and "no `config` mapping" in err
    (tmp_path / "bad.yaml").write_text("config: [unclosed", encoding="utf-8")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["import", "ai-toolkit", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "o.yaml")])
    assert code == 3 and "is not YAML or JSON" in err.getvalue()


SD35_TEXT = """\
---
job: extension
config:
  # this name will be the folder and filename name
  name: "my_first_sd3l_lora_v1"
  process:
    - type: 'sd_trainer'
      training_folder: "output"
      device: cuda:0
      network:
        type: "lora"
        linear: 16
        linear_alpha: 16
      save:
        dtype: float16 # precision to save
        save_every: 250 # save every this many steps
        max_step_saves_to_keep: 4 # how many intermittent saves to keep
        push_to_hub: false
      datasets:
        - folder_path: "${DATA_ROOT}/images"
          caption_ext: "txt"
          caption_dropout_rate: 0.05  # will drop out the caption 5% of time
          shuffle_tokens: false  # shuffle caption order, split by commas
          cache_latents_to_disk: true
          resolution: [ 1024 ]
      train:
        batch_size: 1
        steps: 2000
        gradient_accumulation_steps: 1
        train_unet: true
        train_text_encoder: false  # May not fully work with SD3 yet
        gradient_checkpointing: true
        noise_scheduler: "flowmatch"
        timestep_type: "linear" # linear or sigmoid
        optimizer: "adamw8bit"
        lr: 1e-4
        unet_lr: 5e-5
        dtype: bf16
      model:
        name_or_path: "stabilityai/stable-diffusion-3.5-large"
        is_v3: true
        quantize: true  # run 8bit mixed precision
      sample:
        sampler: "flowmatch"
        sample_every: 250
        width: 1024
        height: 1024
        prompts:
          - "a bear building a log cabin in the snow covered mountains --n blurry --cfg 5.5 --steps 30"
        neg: ""
        seed: 42
        walk_seed: true
        guidance_scale: 4
        sample_steps: 25
meta:
  name: "[name]"
  version: '1.0'
"""


def test_sd35_example_as_written(tmp_path, monkeypatch):
    """train_lora_sd35_large_24gb.yaml as its text reads (comments, `lr: 1e-4`, which plain YAML reads as a string and
    ai-toolkit's loader as a number), with a `${DATA_ROOT}` ai-toolkit takes from the environment."""
    monkeypatch.setenv("DATA_ROOT", "/srv/data")
    source, out = tmp_path / "train_lora_sd35_large_24gb.yaml", tmp_path / "out.yaml"
    source.write_text(SD35_TEXT, encoding="utf-8")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["import", "ai-toolkit", str(source), "--out", str(out)]) == 0, err.getvalue()
    load_config(out)
    text = out.read_text(encoding="utf-8")
    c = yaml.safe_load(text)
    assert c["model"]["family"] == "sd3" and c["learning_rate"] == 1e-4  # unet_lr is not read by ai-toolkit
    assert "train.unet_lr: 5e-05 is not read by ai-toolkit" in text
    assert c["data"]["concepts"][0]["path"] == "/srv/data/images" and c["resolution"] == 1024
    assert c["loss"]["timestep_distribution"] == "uniform" and c["loss"]["timestep_shift"] == 1.0
    prompt = c["sampling"]["prompts"][0]
    assert (prompt["negative_prompt"], prompt["guidance_scale"], prompt["steps"]) == ("blurry", 5.5, 30)
    monkeypatch.delenv("DATA_ROOT")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["import", "ai-toolkit", str(source), "--out", str(out), "--force"]) == 2
    assert "${DATA_ROOT}: the environment variable is not set" in err.getvalue()


def test_full_finetune_adafactor_and_process_name(tmp_path):
    """train_full_fine_tune_lumina.yaml's shape (no network: the whole model; Adafactor, which SDTrainer does not
    clip) with a process `name`, which wins over config.name."""
    process = flux_lora()
    del process["network"]
    process["name"] = "lumina_ft"
    process["model"] = {"name_or_path": "/models/lumina", "is_lumina2": True}
    process["train"] |= {"optimizer": "adafactor", "lr": 3e-5, "timestep_type": "lumina2_shift"}
    c, _ = imported(tmp_path, job(process))
    assert (c["method"], c["model"]["family"], c["output_dir"]) == ("full", "lumina2", "output/lumina_ft")
    assert c["optimizer"]["name"] == "ADAFACTOR" and c["clip_grad_norm"] is None
    assert c["loss"] == {"timestep_distribution": "uniform", "timestep_shift": "auto"}
    assert "lora" not in c


def test_more_controls_than_the_family_takes(tmp_path):
    """train_lora_qwen_image_edit_32gb.yaml's model (arch qwen_image_edit: one reference per sample) given a
    control_path list and a sample without ctrl_img, which its pipeline cannot sample: the first folder is used, the
    sample left out, both listed."""
    process = flux_lora()
    process["model"] = {"name_or_path": "/models/qwen-edit", "arch": "qwen_image_edit"}
    process["datasets"][0]["control_path"] = ["/data/c1", "/data/c2"]
    process["sample"]["prompts"] = ["make it red --ctrl_img /data/x.png", "no control image"]
    c, text = imported(tmp_path, job(process))
    assert c["data"]["concepts"][0]["reference_path"] == "/data/c1"
    assert [p["prompt"] for p in c["sampling"]["prompts"]] == ["make it red"]
    assert "2 folders; qwen_image_edit takes 1" in text and "samples only with a control image" in text
