"""`ot-dist import diffusers`: a saved diffusers example-script command (`accelerate launch ... train_*.py --key value
...`) becomes an ot_dist config that validates and keeps each argument's meaning (as the script's parse_args and
training loop read it), with everything ot_dist cannot honour listed. The defaults a command leaves out are the
scripts' own (ot_dist/migrate/diffusers_defaults.py, built from their parsers; defaults that differ between scripts
are pinned below). No process is launched."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling
from PIL import Image

from ot_dist.cli import main
from ot_dist.config.load import load_config
from ot_dist.config.loss import LossConfig
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.migrate.diffusers import SCRIPTS, import_diffusers
from ot_dist.migrate.diffusers_defaults import defaults
from ot_dist.models.objectives import FlowMatching

def images(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(folder / f"{i}.png")
    return folder


def data_args(tmp_path: Path, script: str) -> str:
    """The dataset arguments each kind of script needs, with its folders made."""
    kind = SCRIPTS[script][2]
    if kind == "dreambooth":
        return f'--instance_data_dir {images(tmp_path / "inst", 3)} --instance_prompt "a photo of sks dog"'
    if kind == "textual_inversion":
        return f"--train_data_dir {images(tmp_path / 'ti', 2)} --placeholder_token '<cat-toy>' --initializer_token toy"
    folder = images(tmp_path / "imgs", 2)
    rows = [{"file_name": f"{i}.png", "text": f"caption {i}"} for i in range(2)]
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return f"--train_data_dir {folder}"


def run_import(tmp_path: Path, command: str, *extra) -> tuple[dict, str, str]:
    (tmp_path / "cmd.sh").write_text(command, encoding="utf-8")
    out = tmp_path / "out.yaml"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["import", "diffusers", str(tmp_path / "cmd.sh"), "--out", str(out), "--force",
                     "--captions_folder", str(tmp_path / "captions"), *map(str, extra)])
    assert code == 0, err.getvalue()
    text = out.read_text(encoding="utf-8")
    load_config(out)  # what is written is a config ot_dist accepts
    return yaml.safe_load(text), text, err.getvalue()


def not_honoured(text: str) -> list[str]:
    lines = text.split("# NOT HONOURED", 1)[1].splitlines()[1:] if "# NOT HONOURED" in text else []
    return [line[len("#   - "):] for line in lines if line.startswith("#   - ")]


FAMILY_METHOD = {
    "train_text_to_image.py": ("sd1", "full"), "train_text_to_image_lora.py": ("sd1", "lora"),
    "train_text_to_image_sdxl.py": ("sdxl", "full"), "train_text_to_image_lora_sdxl.py": ("sdxl", "lora"),
    "train_dreambooth.py": ("sd1", "full"), "train_dreambooth_lora.py": ("sd1", "lora"),
    "train_dreambooth_lora_sdxl.py": ("sdxl", "lora"), "train_dreambooth_sd3.py": ("sd3", "full"),
    "train_dreambooth_lora_sd3.py": ("sd3", "lora"), "train_dreambooth_flux.py": ("flux", "full"),
    "train_dreambooth_lora_flux.py": ("flux", "lora"), "textual_inversion.py": ("sd1", "embedding"),
    "train_dreambooth_lora_sana.py": ("sana", "lora"), "train_dreambooth_lora_qwen_image.py": ("qwen_image", "lora"),
    "train_dreambooth_lora_flux2.py": ("flux2", "lora"), "train_dreambooth_lora_flux2_klein.py": ("flux2_klein", "lora"),
    "train_dreambooth_lora_hidream.py": ("hidream", "lora"),
    "train_dreambooth_lora_lumina2.py": ("lumina2", "lora"),
}
FAMILY_METHOD["train_dreambooth_lora_z_image.py"] = ("z_image", "lora")
FAMILY_METHOD["train_dreambooth_lora_krea2.py"] = ("krea2", "lora")
# what the Sana / Qwen-Image scripts adapt without --lora_layers
SCRIPT_LORA_TARGETS = {"sana": ["to_k", "to_q", "to_v"], "qwen_image": ["to_k", "to_q", "to_v", "to_out.0"],
                       "lumina2": ["to_k", "to_q", "to_v", "to_out.0"]}
SCRIPT_LORA_TARGETS = {"sana": ["to_k", "to_q", "to_v"], "qwen_image": ["to_k", "to_q", "to_v", "to_out.0"]}
SCRIPT_LORA_TARGETS["z_image"] = ["to_k", "to_q", "to_v", "to_out.0"]
SCRIPT_LORA_TARGETS["hidream"] = ["to_k", "to_q", "to_v", "to_out"]
FAMILY_METHOD["train_dreambooth_lora_ideogram4.py"] = ("ideogram4", "lora")
SCRIPT_LORA_TARGETS["ideogram4"] = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


@pytest.mark.parametrize("script", sorted(FAMILY_METHOD))
def test_each_script_maps_with_the_scripts_defaults(tmp_path, script):
    """A minimal command of each script: its family and method, and the defaults it trains with where ot_dist's
    differ (the table's values, which test_default_table_is_the_scripts_parsers checks against the scripts)."""
    d = defaults(script)
    command = (f"accelerate launch {script} \\\n  --pretrained_model_name_or_path m \\\n  {data_args(tmp_path, script)} "
               f"--output_dir {tmp_path / 'o'}")
    c, text, _ = run_import(tmp_path, command)
    assert (c["model"]["family"], c["method"]) == FAMILY_METHOD[script]
    assert c["learning_rate"] == d["learning_rate"]
    assert c["resolution"] == d["resolution"]
    assert c["batch_size"] == d["train_batch_size"]
    assert c["optimizer"] == {"name": "ADAMW", "beta1": 0.9, "beta2": 0.999, "weight_decay": d["adam_weight_decay"],
                              "eps": 1e-8}
    assert c["scheduler"] == {"name": "CONSTANT", "warmup_steps": 0}  # diffusers' constant ignores the 500 warmup
    assert c["checkpoint"] == {"every_n_steps": 500, "every_n_minutes": None, "keep_last": None}
    assert c["train_dtype"] == "float32" and "weight_dtype" not in c
    assert c["data"]["crop"] == "random"  # center_crop off: RandomCrop
    if d["max_train_steps"]:
        assert c["max_steps"] == d["max_train_steps"]  # textual_inversion.py: 5000
    else:
        assert c["epochs"] == d["num_train_epochs"] and "max_steps" not in c
    if c["method"] == "lora":
        assert c["lora"]["rank"] == d["rank"]  # 4, the Krea 2 script's 32
        assert c["lora"]["alpha"] == float(d.get("lora_alpha", d["rank"]))  # the scripts without it: alpha = rank
    if c["model"]["family"] in ("sd3", "flux") and c["method"] == "lora":  # the scripts' lists, not ot_dist's default
        assert "proj_mlp" not in c["lora"]["transformer_targets"] and "attn.to_k" in c["lora"]["transformer_targets"]
    if SCRIPTS[script][2] == "dreambooth":
        assert c["data"]["concepts"][0]["caption_text"] == "a photo of sks dog"
    if c["model"]["family"] in SCRIPT_LORA_TARGETS:
        assert c["lora"]["transformer_targets"] == SCRIPT_LORA_TARGETS[c["model"]["family"]]
    if c["model"]["family"] in ("flux", "sana", "qwen_image", "flux2", "flux2_klein", "krea2"):  # unshifted sigmas
        assert c["loss"]["timestep_shift"] == 1.0 and c["loss"]["dynamic_timestep_shifting"] is False
        assert c["loss"]["timestep_distribution"] == "uniform"  # weighting_scheme none
    if c["model"]["family"] in ("flux", "flux2"):
        assert c["model"]["guidance_scale"] == 3.5
    if c["model"]["family"] == "sd3":
        assert c["loss"]["timestep_distribution"] == "logit_normal"
        assert any(line.startswith("precondition_outputs") for line in not_honoured(text))
    # the scripts crop squares (the shorter side scaled to resolution): ot_dist's square bucket, not its aspect buckets
    textual_inversion_squashes = SCRIPTS[script][2] == "textual_inversion" and not d["center_crop"]
    assert (c["data"].get("bucket_assignment") == "square") is not textual_inversion_squashes
    assert any(line.startswith("resolution") for line in not_honoured(text)) is textual_inversion_squashes


def test_sana_and_qwen_image_scripts_own_options(tmp_path):
    """--lora_layers and weighting_scheme as the older flow scripts; the Qwen-Image script's caption_dropout (instance
    captions only), final_validation_prompt (the end only) and bnb quantization; Sana's complex_human_instruction."""
    script = "train_dreambooth_lora_qwen_image.py"
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --lora_layers 'to_q, img_mlp.net.2' "
                                      "--weighting_scheme logit_normal --logit_mean 1.0 --logit_std 0.5 --caption_dropout 0.1 "
                                      "--final_validation_prompt 'a dog' --num_validation_images 1 --seed 3 "
                                      "--bnb_quantization_config_path q.json --offload")
    assert c["lora"]["transformer_targets"] == ["to_q", "img_mlp.net.2"]
    # timesteps[(u x 1000)] of a table running from sigma 1 down, as the SD3 / Flux scripts: logit_mean m is -m here
    assert c["loss"] | {"logit_normal_mean": -1.0, "logit_normal_std": 0.5,
                        "timestep_distribution": "logit_normal"} == c["loss"]
    assert c["data"]["concepts"][0]["caption_dropout_probability"] == 0.1
    assert c["sampling"] == {"prompts": [{"prompt": "a dog", "seed": 3}], "at_end": True}
    assert any(line.startswith("bnb_quantization_config_path") for line in not_honoured(text))
    assert not any(line.startswith("offload") for line in not_honoured(text))  # where parts wait: a note
    script = "train_dreambooth_lora_sana.py"
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --complex_human_instruction 'Be vivid.' "
                                      "--validation_prompt 'a dog' --num_validation_images 1")
    assert any(line.startswith("complex_human_instruction") for line in not_honoured(text))
    assert c["sampling"]["every_n_epochs"] == 50 and c["sampling"]["at_end"] is True


def test_textual_inversion_templates_and_repeats(tmp_path):
    c, _, _ = run_import(tmp_path, f"python textual_inversion.py --pretrained_model_name_or_path m "
                                   f"{data_args(tmp_path, 'textual_inversion.py')} --num_vectors 2 "
                                   f"--learnable_property style --output_dir o")
    assert c["embedding"] == {"token": "<cat-toy>", "vectors": 2, "init_text": "toy"}
    concept = c["data"]["concepts"][0]
    assert concept["balancing"] == 100 and concept["flip_probability"] == 0.5  # the script's repeats, flip_p
    lines = concept["caption_text"].splitlines()
    assert len(lines) == 19 and lines[0] == "a painting in the style of <cat-toy>"


def test_imagefolder_captions_are_written_beside_links(tmp_path):
    c, _, _ = run_import(tmp_path, f"accelerate launch train_text_to_image_lora.py --pretrained_model_name_or_path m "
                                   f"{data_args(tmp_path, 'train_text_to_image_lora.py')} --random_flip "
                                   f"--center_crop --snr_gamma 5 --noise_offset 0.05 --output_dir o")
    concept = c["data"]["concepts"][0]
    folder = Path(concept["path"])
    assert (folder / "1.txt").read_text(encoding="utf-8") == "caption 1"
    assert (folder / "1.png").is_symlink()
    assert concept["flip_probability"] == 0.5 and c["data"]["crop"] == "center"
    assert c["loss"] == {"min_snr_gamma": 5.0, "offset_noise_weight": 0.05}


def test_prior_preservation_balances_and_weighs_as_the_script(tmp_path):
    """DreamBoothDataset: max(instance x repeats, class) items an epoch, each one instance and one class image; the
    loss is instance mean + prior_loss_weight x class mean, i.e. twice ot_dist's weighted batch mean."""
    cls = images(tmp_path / "cls", 5)
    c, text, _ = run_import(tmp_path, f"accelerate launch train_dreambooth.py --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, 'train_dreambooth.py')} --with_prior_preservation "
                                      f"--class_data_dir {cls} --class_prompt 'a photo of dog' --num_class_images 8 "
                                      f"--prior_loss_weight 0.5 --train_batch_size 2 --output_dir o")
    instance, regularisation = c["data"]["concepts"]
    assert c["batch_size"] == 4
    assert (instance["balancing"], instance["loss_weight"]) == (5, 2.0)
    assert regularisation == {"path": str(cls), "type": "prior_preservation", "caption_source": "text",
                              "caption_text": "a photo of dog", "balancing": 5, "balancing_strategy": "samples",
                              "loss_weight": 1.0}
    assert any("generates the missing class images" in line for line in not_honoured(text))


def test_accelerate_config_precision_processes_and_scale_lr(tmp_path):
    (tmp_path / "acc.yaml").write_text("distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 4\n",
                                       encoding="utf-8")
    c, _, _ = run_import(tmp_path, f"accelerate launch --config_file {tmp_path / 'acc.yaml'} train_dreambooth_lora.py "
                                   f"--pretrained_model_name_or_path m {data_args(tmp_path, 'train_dreambooth_lora.py')} "
                                   "--scale_lr --gradient_accumulation_steps 2 --lr_scheduler cosine_with_restarts "
                                   "--lr_num_cycles 3 --lr_warmup_steps 10 --output_dir o")
    assert (c["train_dtype"], c["weight_dtype"], c["strategy"]) == ("float16", "float16", "ddp")
    assert c["learning_rate"] == pytest.approx(5e-4 * 4 * 2 * 4)  # lr x batch x accumulation x processes
    assert c["scheduler"] == {"name": "COSINE_WITH_HARD_RESTARTS", "warmup_steps": 20, "cycles": 3}
    # the script's own --mixed_precision wins over accelerate's
    c, _, _ = run_import(tmp_path, f"accelerate launch --config_file {tmp_path / 'acc.yaml'} train_dreambooth_lora.py "
                                   f"--pretrained_model_name_or_path m {data_args(tmp_path, 'train_dreambooth_lora.py')} "
                                   "--mixed_precision bf16 --output_dir o")
    assert c["train_dtype"] == "bfloat16"


def test_prodigy_lora_options_and_what_is_listed(tmp_path):
    c, text, _ = run_import(
        tmp_path, f"accelerate launch train_dreambooth_lora_flux.py --pretrained_model_name_or_path m "
                  f"{data_args(tmp_path, 'train_dreambooth_lora_flux.py')} --optimizer prodigy --learning_rate 1 "
                  "--prodigy_safeguard_warmup False --rank 16 --lora_alpha 8 --lora_layers to_q,to_k "
                  "--train_text_encoder --resume_from_checkpoint latest --max_sequence_length 256 --variant fp16 "
                  "--validation_prompt 'sks dog' --num_validation_images 2 --seed 7 --report_to wandb --output_dir o")
    options = c["optimizer"]
    assert options["name"] == "PRODIGY" and options["slice_p"] == 1
    assert options["safeguard_warmup"] is True  # argparse's type=bool reads "False" as True, as the script does
    assert c["lora"]["rank"] == 16 and c["lora"]["alpha"] == 8.0 and c["lora"]["transformer_targets"] == ["to_q", "to_k"]
    assert c["text_encoder"] == {"train": True}  # prodigy: the script gives the text encoder learning_rate
    assert c["sampling"]["prompts"] == [{"prompt": "sks dog", "seed": 7}, {"prompt": "sks dog", "seed": 8}]
    assert c["sampling"]["every_n_epochs"] == 50
    assert c["model"]["t5_max_tokens"] == 256
    listed = not_honoured(text)
    for key in ("resume_from_checkpoint", "variant"):
        assert any(line.startswith(key) for line in listed), key
    assert not any(line.startswith("max_sequence_length") for line in listed)
    assert "report_to: 'wandb' is ignored" in text


def test_sd2_is_told_by_the_model_folder(tmp_path):
    model = tmp_path / "model"
    (model / "text_encoder").mkdir(parents=True)
    (model / "text_encoder" / "config.json").write_text('{"hidden_size": 1024}', encoding="utf-8")
    c, _, _ = run_import(tmp_path, f"accelerate launch train_dreambooth_lora.py --pretrained_model_name_or_path "
                                   f"{model} {data_args(tmp_path, 'train_dreambooth_lora.py')} --output_dir o")
    assert c["model"] == {"family": "sd2", "path": str(model)}


def test_sd3_lora_blocks_and_dropout(tmp_path):
    c, text, _ = run_import(tmp_path, f"accelerate launch train_dreambooth_lora_sd3.py --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, 'train_dreambooth_lora_sd3.py')} --lora_layers attn.to_k,attn.to_q "
                                      "--lora_blocks 0,12 --lora_dropout 0.1 --output_dir o")
    assert c["lora"]["transformer_targets"] == ["transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_q",
                                                "transformer_blocks.12.attn.to_k", "transformer_blocks.12.attn.to_q"]
    assert "dropout" not in c["lora"] and any(line.startswith("lora_dropout") for line in not_honoured(text))


def test_ema_of_the_full_finetune_and_sdxl_empty_prompts(tmp_path):
    c, _, _ = run_import(tmp_path, f"accelerate launch train_text_to_image_sdxl.py --pretrained_model_name_or_path m "
                                   f"{data_args(tmp_path, 'train_text_to_image_sdxl.py')} --use_ema "
                                   "--max_train_steps 100 --checkpoints_total_limit 2 --proportion_empty_prompts 0.1 "
                                   "--lr_scheduler linear --lr_warmup_steps 10 --gradient_accumulation_steps 2 "
                                   "--output_dir o")
    assert c["ema"] == {"enabled": True, "decay": 0.9999, "update_step_interval": 1}
    assert (c["max_steps"], c["checkpoint"]["keep_last"]) == (100, 2)
    assert c["data"]["concepts"][0]["caption_dropout_probability"] == 0.1
    # the SDXL script's warmup: 10 x 2 scheduler steps, one per process and optimizer step: 20 optimizer steps on one
    # process, 40 micro steps in ot_dist's count
    assert c["scheduler"] == {"name": "LINEAR", "warmup_steps": 40}


@pytest.mark.parametrize("args, names", [
    ("--dataset_name lambdalabs/naruto-blip-captions", "dataset_name"),
    ("--instance_data_dir {inst}", "instance_prompt"),
    ("--instance_data_dir {inst} --instance_prompt x --with_prior_preservation", "class_data_dir"),
    ("--instance_data_dir {inst} --instance_prompt x --no_such_flag", "--no_such_flag"),
    ("--instance_data_dir {inst} --instance_prompt x --rank four", "--rank"),
    ("--instance_data_dir {inst} --instance_prompt x --mixed_precision fp8", "mixed_precision"),
])
def test_errors_name_the_argument(tmp_path, args, names):
    inst = images(tmp_path / "inst", 1)
    (tmp_path / "cmd.sh").write_text(f"accelerate launch train_dreambooth_lora.py --pretrained_model_name_or_path m "
                                     f"--output_dir o {args.format(inst=inst)}", encoding="utf-8")
    with pytest.raises((ConfigError, InputFileError)) as err:
        import_diffusers(str(tmp_path / "cmd.sh"))
    assert names in str(err.value)


def test_caption_column_and_validation_errors_name_the_argument(tmp_path):
    data = data_args(tmp_path, "train_text_to_image.py")
    (tmp_path / "cmd.sh").write_text(f"train_text_to_image.py --pretrained_model_name_or_path m {data} "
                                     "--caption_column prompt", encoding="utf-8")
    with pytest.raises(ConfigError, match="caption_column: 'prompt'"):
        import_diffusers(str(tmp_path / "cmd.sh"), captions_folder=str(tmp_path / "c"))
    (tmp_path / "cmd.sh").write_text(f"train_text_to_image.py --pretrained_model_name_or_path m {data} "
                                     "--train_batch_size 0", encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["import", "diffusers", str(tmp_path / "cmd.sh"), "--out", str(tmp_path / "x.yaml"),
                     "--captions_folder", str(tmp_path / "c2")])
    assert code != 0 and "from train_batch_size" in err.getvalue()
    assert not (tmp_path / "x.yaml").exists()


def test_defaults_that_differ_between_the_scripts():
    """A few defaults read off the scripts' parse_args by hand; each differs between scripts, so a table keyed
    wrongly shows here."""
    assert defaults("train_dreambooth.py")["learning_rate"] == 5e-6
    assert defaults("train_dreambooth_lora.py")["learning_rate"] == 5e-4
    assert defaults("train_text_to_image.py")["train_batch_size"] == 16
    assert defaults("train_dreambooth_lora_sdxl.py")["resolution"] == 1024
    assert defaults("train_dreambooth_lora_sdxl.py")["adam_weight_decay"] == 1e-4
    assert defaults("textual_inversion.py")["max_train_steps"] == 5000
    assert defaults("textual_inversion.py")["mixed_precision"] == "no"
    assert defaults("train_dreambooth_lora_flux.py")["max_sequence_length"] == 512
    assert defaults("train_dreambooth_flux.py")["weighting_scheme"] == "none"
    assert defaults("train_dreambooth_sd3.py")["weighting_scheme"] == "logit_normal"
    assert defaults("train_dreambooth_lora_sana.py")["max_sequence_length"] == 300
    assert defaults("train_dreambooth_lora_qwen_image.py")["output_dir"] == "hidream-dreambooth-lora"  # sic
    assert defaults("train_dreambooth_lora_flux2.py")["text_encoder_out_layers"] == [10, 20, 30]
    assert defaults("train_dreambooth_lora_flux2_klein.py")["text_encoder_out_layers"] == [10, 20, 30]  # sic
    assert "caption_dropout" in defaults("train_dreambooth_lora_flux2_klein.py")
    assert "caption_dropout" not in defaults("train_dreambooth_lora_flux2.py")
    assert defaults("train_dreambooth_lora_z_image.py")["output_dir"] == "z-image-dreambooth-lora"
    assert defaults("train_dreambooth_lora_z_image.py")["validation_epochs"] == 50
    assert defaults("train_dreambooth_lora_hidream.py")["max_sequence_length"] == 128
    assert "lora_alpha" not in defaults("train_dreambooth_lora_hidream.py")  # peft's lora_alpha = its --rank


def test_z_image_script_draws_at_the_schedulers_shift_and_lists_its_own_options(tmp_path):
    """The Z-Image script reads timesteps[(u x N)] of its scheduler's table, shifted by the config's fixed 3.0: no
    timestep_shift is written (ot_dist's auto is the model's shift); float8 training is listed, FSDP over the frozen
    text encoder is a note."""
    script = "train_dreambooth_lora_z_image.py"
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --weighting_scheme logit_normal --logit_mean 1.0 "
                                      "--do_fp8_training --fsdp_text_encoder")
    assert c["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": -1.0, "logit_normal_std": 1.0}
    assert any(line.startswith("do_fp8_training") for line in not_honoured(text))
    assert not any(line.startswith("fsdp_text_encoder") for line in not_honoured(text))


def test_hidream_script_trains_at_its_own_shift_and_names_its_llama(tmp_path):
    """train_dreambooth_lora_hidream.py loads its scheduler with shift=3.0 whatever the model's config says and draws
    timesteps[(u x 1000)] from it (a descending table: logit_mean m is -m here); its Llama comes from an argument of its
    own, ot_dist's from model.path (noted); a max_sequence_length other than the pipeline's 128 is listed."""
    script = "train_dreambooth_lora_hidream.py"
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --weighting_scheme logit_normal --logit_mean 0.5 "
                                      "--max_sequence_length 256 "
                                      "--pretrained_text_encoder_4_name_or_path /models/llama")
    assert c["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": -0.5, "logit_normal_std": 1.0,
                         "timestep_shift": 3.0, "dynamic_timestep_shifting": False}
    assert any(line.startswith("max_sequence_length: 256") for line in not_honoured(text))
    assert "pretrained_text_encoder_4_name_or_path: /models/llama" in text
    assert not any(line.startswith("pretrained_text_encoder_4") for line in not_honoured(text))


def flow_sigmas(loss: dict, shift: float, count: int = 2000) -> torch.Tensor:
    """`count` noise levels ot_dist draws with an imported `loss` section for a model whose scheduler shifts by
    `shift` (a 64x64 latent)."""
    objective = FlowMatching(shift=shift)
    options, g = LossConfig(**loss), torch.Generator().manual_seed(0)
    return torch.cat([objective.draw(g, options, torch.Size((16, 64, 64))) for _ in range(count)]).double() / 1000


def test_logit_mean_moves_the_noise_level_as_the_sd3_script_does(tmp_path):
    """The SD3 / Flux scripts draw u by weighting_scheme and train on the scheduler's timesteps[(u x 1000)], which
    run from sigma 1 down: logit_mean 1.0 there favours low noise. The imported draw's median sigma is the one
    diffusers' own draw and scheduler give."""
    c, _, _ = run_import(tmp_path, f"accelerate launch train_dreambooth_lora_sd3.py --pretrained_model_name_or_path m "
                                   f"{data_args(tmp_path, 'train_dreambooth_lora_sd3.py')} --logit_mean 1.0")
    assert c["loss"]["logit_normal_mean"] == -1.0
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3's published config
    u = compute_density_for_timestep_sampling("logit_normal", 2000, logit_mean=1.0, logit_std=1.0,
                                              generator=torch.Generator().manual_seed(0))
    reference = scheduler.sigmas[(u * 1000).long()].double()
    assert flow_sigmas(c["loss"], shift=3.0).median().item() == pytest.approx(reference.median().item(), abs=0.02)


def test_lumina2_script_draws_towards_the_image_as_a_shift_of_one_over_the_schedulers(tmp_path):
    """train_dreambooth_lora_lumina2.py takes the scheduler's shifted timesteps[(u x 1000)] sigma as Lumina's t (the
    image's weight): the imported draw (shift 1 / 6 on the noise level, logit_mean kept) has the median noise level
    1 - sigma that diffusers' own draw and Lumina-Image-2.0's scheduler (shift 6) give; its system_prompt and another
    max_sequence_length are listed."""
    script = "train_dreambooth_lora_lumina2.py"
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --weighting_scheme logit_normal --logit_mean 1.0 "
                                      "--system_prompt 'Be brief.' --max_sequence_length 128")
    assert c["loss"]["logit_normal_mean"] == 1.0 and c["loss"]["timestep_shift"] == pytest.approx(1 / 6, abs=1e-6)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0)
    u = compute_density_for_timestep_sampling("logit_normal", 2000, logit_mean=1.0, logit_std=1.0,
                                              generator=torch.Generator().manual_seed(0))
    reference = 1 - scheduler.sigmas[(u * 1000).long()].double()
    ours = flow_sigmas(c["loss"], shift=6.0)  # the model's own shift is replaced by the imported one
    assert ours.median().item() == pytest.approx(reference.median().item(), abs=0.02)
    assert ours.median().item() < 0.5  # towards the image (ot_dist's own draw at shift 6: median 6/7 of noise)
    listed = not_honoured(text)
    assert any(line.startswith("system_prompt") for line in listed)
    assert any(line.startswith("max_sequence_length: 128") for line in listed)


@pytest.mark.parametrize("script,tokens", [("train_dreambooth_lora_sd3.py", 77), ("train_dreambooth_flux.py", 77),
                                           ("train_dreambooth_lora_flux.py", None)])
def test_max_sequence_length_is_the_t5_caption_length(tmp_path, script, tokens):
    """The scripts' max_sequence_length defaults (77, the Flux LoRA script's 512) where ot_dist's differs."""
    c, _, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                   f"{data_args(tmp_path, script)}")
    assert c["model"].get("t5_max_tokens") == tokens


@pytest.mark.parametrize("script,family", [("train_dreambooth_lora_flux2.py", "flux2"),
                                           ("train_dreambooth_lora_flux2_klein.py", "flux2_klein")])
def test_flux2_scripts(tmp_path, script, family):
    """The FLUX.2 scripts: their default LoRA modules are ot_dist's default preset's (the single blocks' attn.to_out by
    path); [dev]'s guidance; the hidden layers: the [klein] script's default (10, 20, 30, [dev]'s) is listed, as
    ot_dist encodes with the pipeline's (9, 18, 27); a caption length other than 512 and float8 training listed; the
    remote text encoder a note."""
    from ot_dist.models.families.registry import get_family

    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --guidance_scale 2.0 --max_sequence_length 256 "
                                      "--do_fp8_training --fsdp_text_encoder")
    targets = c["lora"]["transformer_targets"]
    preset = get_family(family).denoiser_lora_presets["default"]
    assert set(targets) <= set(preset) and {t for t in preset if not t.startswith("single_")} <= set(targets)
    assert c["model"].get("guidance_scale") == (2.0 if family == "flux2" else None)
    listed = not_honoured(text)
    assert any(line.startswith("text_encoder_out_layers: [10, 20, 30]") for line in listed) == (family == "flux2_klein")
    assert any(line.startswith("max_sequence_length: 256") for line in listed)
    assert any(line.startswith("do_fp8_training") for line in listed)
    assert not any(line.startswith("fsdp_text_encoder") for line in listed)
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --text_encoder_out_layers "
                                      f"{' '.join(map(str, get_family(family).layers))}")
    assert not any(line.startswith("text_encoder_out_layers") for line in not_honoured(text))


def test_ideogram4_script_draws_at_the_resolution_aware_mean_and_lists_its_own_options(tmp_path):
    """train_dreambooth_lora_ideogram4.py uses compute_density_for_timestep_sampling's u as sigma, its logit-normal
    (default std 1.5) centred at logit_mean + _resolution_aware_mu: ot_dist's logit-normal at the family's resolution
    shift (auto, nothing written), the same draw (tests/test_family_ideogram4.py); the other schemes' u is unshifted.
    Prompt upsampling and the autocast switch are listed, max_sequence_length below the pipeline's 2048 too."""
    script = "train_dreambooth_lora_ideogram4.py"
    assert defaults(script)["max_sequence_length"] == 2048 and defaults(script)["logit_std"] == 1.5
    assert "use_aspect_ratio_buckets" not in defaults(script)
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --logit_mean 0.5 --upsample_prompt "
                                      "--disable_training_autocast")
    assert c["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_mean": 0.5, "logit_normal_std": 1.5}
    assert c["lora"]["transformer_targets"] == SCRIPT_LORA_TARGETS["ideogram4"]
    listed = not_honoured(text)
    assert any(line.startswith("upsample_prompt") for line in listed)
    assert any(line.startswith("disable_training_autocast") for line in listed)
    assert not any(line.startswith("max_sequence_length") for line in listed)
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --weighting_scheme none --max_sequence_length 512")
    assert c["loss"] == {"timestep_distribution": "uniform", "timestep_shift": 1.0, "dynamic_timestep_shifting": False}
    assert any(line.startswith("max_sequence_length: 512") for line in not_honoured(text))


def test_krea2_script_trains_unshifted_with_its_authors_lora_and_lists_its_turbo_validation(tmp_path):
    """train_dreambooth_lora_krea2.py: rank / alpha 32 and the Krea 2 authors' targets by default (ot_dist's krea2
    default preset, written as the list), timesteps[(u x N)] of Krea 2's dynamically shifting scheduler, whose table is
    unshifted (no shift written back on), caption_dropout on the instance concept; validation on another checkpoint
    (--validation_model_path, Krea 2 Turbo) is listed, its steps and guidance are read with it."""
    from ot_dist.migrate.diffusers_defaults import defaults
    from ot_dist.models.families.krea2 import KREA2_LORA_TARGETS

    script = "train_dreambooth_lora_krea2.py"
    assert (defaults(script)["rank"], defaults(script)["lora_alpha"]) == (32, 32)
    assert defaults("train_dreambooth_lora_z_image.py")["rank"] == 4  # the others keep theirs
    c, text, _ = run_import(tmp_path, f"accelerate launch {script} --pretrained_model_name_or_path m "
                                      f"{data_args(tmp_path, script)} --caption_dropout 0.1 "
                                      "--validation_prompt 'a fox' --validation_model_path /models/turbo "
                                      "--validation_num_inference_steps 6")
    assert c["lora"]["rank"] == 32 and c["lora"]["alpha"] == 32.0
    assert sorted(c["lora"]["transformer_targets"]) == sorted(KREA2_LORA_TARGETS)
    assert c["loss"]["timestep_shift"] == 1.0 and c["loss"]["dynamic_timestep_shifting"] is False
    assert c["data"]["concepts"][0]["caption_dropout_probability"] == 0.1
    listed = not_honoured(text)
    assert any(line.startswith("validation_model_path: /models/turbo") for line in listed)
    assert not any(line.startswith("validation_num_inference_steps") for line in listed)

