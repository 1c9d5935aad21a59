"""`ot-dist import kohya` of the transformer families' full finetunes: flux_train.py (Flux.1 or Chroma, the
transformer alone) and sd3_train.py (the MM-DiT, optionally CLIP-L / CLIP-G / T5-XXL). Their loss, timestep and model
arguments are the network scripts' (tests/test_import_kohya.py); here: the method, which text encoders train, the fused
optimizer steps and the memory arguments they add (read from their setup_parser(), sd-scripts of February 2026)."""

from __future__ import annotations

import pytest

from ot_dist.config.load import load_config
from tests.test_import_kohya import images, imported, minimal, run_import


def listed(text: str) -> str:
    """The written file's NOT HONOURED lines ("" when nothing is listed)."""
    _, _, rest = text.partition("NOT HONOURED")
    return "\n".join(line for line in rest.splitlines() if line.startswith("#"))


def validates(tmp_path, text: str):
    (tmp_path / "ok.yaml").write_text(text, encoding="utf-8")
    return load_config(tmp_path / "ok.yaml")


def test_flux_train_defaults_are_the_network_scripts(tmp_path):
    """flux_train.py unset: kohya's learning rate 2e-6, guidance 3.5, timesteps shifted by discrete_flow_shift 3.0;
    the transformer trains, no text encoder."""
    images(tmp_path / "d" / "1_x", 1)
    config, text, err = imported(tmp_path, minimal(tmp_path, 1024), "--script", "flux_train.py")
    assert config["model"]["family"] == "flux" and config["method"] == "full"
    assert config["learning_rate"] == 2e-6 and config["model"]["guidance_scale"] == 3.5
    assert config["loss"] == {"timestep_distribution": "uniform", "timestep_shift": 3.0}
    assert not any(key.startswith("text_encoder") for key in config)
    loaded = validates(tmp_path, text)
    assert loaded.method == "full" and not loaded.optimizer.fused_back_pass
    chroma, _, _ = imported(tmp_path, minimal(tmp_path, 1024) + 'model_type = "chroma"\napply_t5_attn_mask = true\n'
                            "guidance_scale = 0.0\n", "--script", "flux_train.py")
    assert chroma["model"]["family"] == "chroma" and chroma["method"] == "full"


def test_flux_train_fused_backward_pass_and_memory_arguments(tmp_path):
    """kohya's Adafactor fused_backward_pass is ot_dist's optimizer.fused_back_pass; kohya's per-parameter clipping
    at max_grad_norm (default 1.0) is clip_grad_norm_scope per_tensor. Block swap, CPU-offloaded checkpointing (which
    turns checkpointing on) and the memory-efficient save change no training: noted, not listed."""
    images(tmp_path / "d" / "1_x", 1)
    config, text, err = imported(tmp_path, minimal(tmp_path, 1024) + """
optimizer_type = "Adafactor"
optimizer_args = ["relative_step=False", "scale_parameter=False", "warmup_init=False"]
learning_rate = 5e-5
fused_backward_pass = true
cpu_offload_checkpointing = true
mem_eff_save = true
double_blocks_to_swap = 6
fused_optimizer_groups = 4
full_bf16 = true
mixed_precision = "bf16"
""", "--script", "flux_train.py")
    assert config["optimizer"]["name"] == "ADAFACTOR" and config["optimizer"]["fused_back_pass"] is True
    assert (config["clip_grad_norm"], config["clip_grad_norm_scope"]) == (1.0, "per_tensor")
    assert config["gradient_checkpointing"] is True and config["trained_weight_dtype"] == "bfloat16"
    notes = text.split("NOT HONOURED")[0]
    assert "max_grad_norm: 1.0 with fused_backward_pass -> clip_grad_norm_scope: per_tensor" in notes
    assert "max_grad_norm" not in listed(text)
    for key in ("cpu_offload_checkpointing", "mem_eff_save", "double_blocks_to_swap", "fused_optimizer_groups"):
        assert f"{key}:" in notes and f"{key}:" not in listed(text), key
    loaded = validates(tmp_path, text)
    assert loaded.optimizer.fused_back_pass is True and loaded.clip_grad_norm_scope == "per_tensor"


def test_fused_steps_ot_dist_cannot_take_are_listed(tmp_path):
    """blockwise_fused_optimizers steps any optimizer per block; ot_dist's fused back pass needs an optimizer whose
    update of a parameter is its own (not Prodigy's one d), no accumulation and no float16 loss scaling."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + "blockwise_fused_optimizers = true\nmax_grad_norm = 0\n"
    config, text, _ = imported(tmp_path, common + 'optimizer_type = "AdamW"\n', "--script", "sd3_train.py")
    assert config["optimizer"] == {"name": "ADAMW", "fused_back_pass": True}
    assert "blockwise_fused_optimizers" not in listed(text)
    validates(tmp_path, text)
    for extra, why in (('optimizer_type = "Prodigy"\nlearning_rate = 1.0\n', "cannot step inside backward"),
                       ("gradient_accumulation_steps = 2\n", "needs gradient_accumulation_steps 1"),
                       ('mixed_precision = "fp16"\n', "needs gradient_accumulation_steps 1 and a train_dtype")):
        config, text, err = imported(tmp_path, common + extra, "--script", "sd3_train.py")
        assert "fused_back_pass" not in config["optimizer"] and "blockwise_fused_optimizers: " in err, extra
        assert why in listed(text), extra
        validates(tmp_path, text)


@pytest.mark.parametrize("extra, parts", [
    ("", {}),
    ("learning_rate_te1 = 3e-6\n", {}),  # no train_text_encoder: nothing but the MM-DiT trains
    ("train_text_encoder = true\n", {"text_encoder": None, "text_encoder_2": None}),
    ("train_text_encoder = true\nlearning_rate_te1 = 3e-6\nlearning_rate_te2 = 0\n", {"text_encoder": 3e-6}),
    ("train_text_encoder = true\ntrain_t5xxl = true\nlearning_rate_te3 = 1e-6\n",
     {"text_encoder": None, "text_encoder_2": None, "text_encoder_3": 1e-6}),
])
def test_sd3_train_text_encoders(tmp_path, extra, parts):
    """sd3_train.py trains CLIP-L and CLIP-G with --train_text_encoder, T5-XXL also with --train_t5xxl, each at
    learning_rate_te1 / _te2 / _te3 (None: the learning rate; 0: that encoder frozen)."""
    images(tmp_path / "d" / "1_x", 1)
    config, text, _ = imported(tmp_path, minimal(tmp_path, 1024) + "learning_rate = 1e-5\n" + extra,
                               "--script", "sd3_train.py")
    assert config["model"]["family"] == "sd3" and config["method"] == "full"
    loaded = validates(tmp_path, text)
    for part in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        trains = bool(getattr(loaded, part).train)
        assert trains == (part in parts), part
        if trains:
            assert getattr(loaded, part).learning_rate == parts[part], part


def test_sd3_train_refusals_and_listed_arguments(tmp_path):
    """train_t5xxl without train_text_encoder stops kohya, so the import refuses it; num_last_block_to_freeze has no
    counterpart in a full finetune and is listed; use_t5xxl_cache_only is caching, noted."""
    images(tmp_path / "d" / "1_x", 1)
    (tmp_path / "args.toml").write_text(minimal(tmp_path, 1024) + "train_t5xxl = true\n", encoding="utf-8")
    code, err = run_import("--config_file", tmp_path / "args.toml", "--script", "sd3_train.py",
                           "--out", tmp_path / "x.yaml")
    assert code == 2 and "train_t5xxl: kohya's sd3_train.py trains T5-XXL only with train_text_encoder" in err
    config, text, err = imported(tmp_path, minimal(tmp_path, 1024) + "num_last_block_to_freeze = 4\n"
                                 "use_t5xxl_cache_only = true\n", "--script", "sd3_train.py")
    assert "num_last_block_to_freeze: 4" in listed(text) and "use_t5xxl_cache_only" not in listed(text)
    assert "use_t5xxl_cache_only: True is ignored" in text


def test_sdxl_train_fused_optimizer_groups_is_a_fused_step(tmp_path):
    """sdxl_train.py's fused_optimizer_groups works there (one optimizer per group of parameters, stepped when its
    gradients exist): the fused step, as blockwise_fused_optimizers; flux_train.py's does nothing (its help says so)."""
    images(tmp_path / "d" / "1_x", 1)
    common = minimal(tmp_path, 1024) + "fused_optimizer_groups = 10\nmax_grad_norm = 0\n"
    sdxl, text, _ = imported(tmp_path, common, "--script", "sdxl_train.py")
    assert sdxl["optimizer"]["fused_back_pass"] is True and "fused_optimizer_groups" not in listed(text)
    validates(tmp_path, text)
    flux, text, _ = imported(tmp_path, common, "--script", "flux_train.py")
    assert "fused_back_pass" not in flux["optimizer"] and "fused_optimizer_groups: 10: ignored" in text
