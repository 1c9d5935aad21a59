"""`ot-dist import kohya` of lumina_train_network.py (a LoRA) and lumina_train.py (the full finetune): family lumina2.
kohya's Lumina scripts draw the noise level as its Flux scripts do, at their own defaults (library/lumina_train_util.py's
add_lumina_train_arguments: timestep_sampling shift, model_prediction_type raw, discrete_flow_shift 6.0), and show
NextDiT 1 - sigma against latents - noise: ot_dist's reversed Lumina 2 objective (docs/families.md)."""

from __future__ import annotations

from ot_dist.config.load import load_config
from ot_dist.models.families.lumina2 import SYSTEM_PROMPT
from tests.test_import_kohya import images, imported, minimal, run_import
from tests.test_import_kohya_full import listed

LORA = 'network_module = "networks.lora_lumina"\nnetwork_dim = 16\nnetwork_alpha = 8\n'


def test_lumina_lora_defaults_are_the_scripts_own(tmp_path):
    """Unset, kohya draws sigmoid(N(0, 1)) shifted by 6.0, the raw prediction: nothing about the loss is listed.
    Gemma 2 is adapted beside the transformer unless network_train_unet_only; the system prompt kohya leaves out by
    default is listed (ot_dist always puts the pipeline's in front)."""
    images(tmp_path / "d" / "1_x", 1)
    config, text, _ = imported(tmp_path, minimal(tmp_path, 1024) + LORA, "--script", "lumina_train_network.py")
    assert config["model"]["family"] == "lumina2" and config["method"] == "lora"
    assert config["loss"] == {"timestep_distribution": "logit_normal", "logit_normal_std": 1.0, "timestep_shift": 6.0}
    assert config["lora"] == {"rank": 16, "alpha": 8, "preset": "attention_mlp"}
    assert config["text_encoder"] == {"train": True}
    assert "model_prediction_type" not in listed(text) and "guidance" not in config["model"]
    assert "system_prompt: unset: kohya encodes the bare caption" in listed(text)
    assert "network_module networks.lora_lumina: kohya adapts lumina2's fused qkv" in listed(text)
    loaded = load_config(_write(tmp_path, text))
    assert loaded.model.family == "lumina2" and loaded.loss.timestep_shift == 6.0


def test_lumina_timestep_sampling_and_prediction(tmp_path):
    """Each of kohya's Lumina draws: uniform (unshifted), sigmoid (unshifted logit-normal of sigmoid_scale),
    nextdit_shift and flux_shift (shifted by the resolution), sigma (the scheduler's timesteps: weighting_scheme's
    draw at discrete_flow_shift); sigma_scaled compares another prediction and is listed."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + LORA + 'network_train_unet_only = true\n'
    for extra, loss in (
            ('timestep_sampling = "uniform"\n', {"timestep_distribution": "uniform", "timestep_shift": 1.0}),
            ('timestep_sampling = "sigmoid"\nsigmoid_scale = 1.5\n',
             {"timestep_distribution": "logit_normal", "logit_normal_std": 1.5, "timestep_shift": 1.0}),
            ('timestep_sampling = "nextdit_shift"\n',
             {"timestep_distribution": "uniform", "dynamic_timestep_shifting": True}),
            ('timestep_sampling = "flux_shift"\n',
             {"timestep_distribution": "logit_normal", "logit_normal_std": 1.0, "dynamic_timestep_shifting": True}),
            ('timestep_sampling = "sigma"\nweighting_scheme = "logit_normal"\nlogit_mean = 0.5\n',
             {"timestep_distribution": "logit_normal", "logit_normal_mean": -0.5, "logit_normal_std": 1.0,
              "timestep_shift": 6.0})):
        config, text, _ = imported(tmp_path, common + extra, "--script", "lumina_train_network.py")
        assert config["loss"] == loss, extra
        assert "timestep_sampling" not in listed(text) and "text_encoder" not in config, extra
        load_config(_write(tmp_path, text))
    _, text, _ = imported(tmp_path, common + 'model_prediction_type = "sigma_scaled"\n',
                          "--script", "lumina_train_network.py")
    assert "model_prediction_type: sigma_scaled: kohya compares noisy input - sigma x prediction with latents - " \
           "noise" in listed(text)


def test_lumina_text_options_and_model_files(tmp_path):
    """system_prompt set to Lumina2Pipeline's is what ot_dist encodes (nothing listed); another one, a Gemma length
    other than 256, kohya's separate gemma2 / ae files are listed; the attention kernels are noted."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + LORA
    _, text, _ = imported(tmp_path, common + f'system_prompt = "{SYSTEM_PROMPT}"\nuse_flash_attn = true\n',
                          "--script", "lumina_train_network.py")
    assert "system_prompt" not in listed(text) and "use_flash_attn: True is ignored" in text
    _, text, _ = imported(tmp_path, common + 'system_prompt = "You draw."\ngemma2_max_token_length = 512\n'
                          'gemma2 = "/m/gemma.safetensors"\nae = "/m/ae.safetensors"\n', "--script",
                          "lumina_train_network.py")
    for line in ("system_prompt: 'You draw.'", "gemma2_max_token_length: 512", "gemma2: /m/gemma.safetensors",
                 "ae: /m/ae.safetensors"):
        assert line in listed(text), line


def test_lumina_full_finetune_and_samples(tmp_path):
    """lumina_train.py trains the transformer alone; its fused step maps as the Flux one. A sample prompt takes
    kohya's Lumina defaults (1024 x 1024, 36 steps, CFG 3.5); kohya's truncated CFG is listed."""
    images(tmp_path / "d" / "1_x", 1)
    (tmp_path / "p.txt").write_text("a cat --n ugly --d 3\na dog --w 1000 --h 520 --s 20 --l 5\n", encoding="utf-8")
    config, text, _ = imported(tmp_path, minimal(tmp_path, 1024) + 'optimizer_type = "Adafactor"\n'
                               "fused_backward_pass = true\nmax_grad_norm = 0\n"
                               f'sample_prompts = "{tmp_path / "p.txt"}"\nsample_every_n_steps = 50\n',
                               "--script", "lumina_train.py")
    assert config["model"]["family"] == "lumina2" and config["method"] == "full"
    assert not any(key.startswith("text_encoder") for key in config)
    assert config["optimizer"]["fused_back_pass"] is True
    first, second = config["sampling"]["prompts"]
    assert (first["width"], first["height"], first["steps"], first["guidance_scale"]) == (1024, 1024, 36, 3.5)
    assert first["negative_prompt"] == "ugly"
    assert (second["width"], second["height"], second["steps"], second["guidance_scale"]) == (992, 512, 20, 5.0)
    assert "kohya's Lumina sampler applies CFG only while Lumina's time is below cfg_trunc_ratio 0.25" in listed(text)
    load_config(_write(tmp_path, text))


def test_lumina_network_module_of_another_family_is_refused(tmp_path):
    images(tmp_path / "d" / "1_x", 1)
    (tmp_path / "args.toml").write_text(minimal(tmp_path, 1024) + 'network_module = "networks.lora_flux"\n',
                                        encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "lumina_train_network.py",
                           "--out", tmp_path / "x.yaml")
    assert code == 2 and "networks.lora_flux is kohya's network for flux, chroma, not for lumina_train_network.py" in err


def _write(tmp_path, text: str):
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    return tmp_path / "ok.yaml"
