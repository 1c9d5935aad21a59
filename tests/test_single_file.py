"""Round trip diffusers folder -> original-layout single .safetensors -> diffusers `from_single_file`."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from ot_dist.errors import InputFileError  # noqa: E402
from ot_dist.models.families.sd_single_file import export_single_file, load_single_file  # noqa: E402
from ot_dist.models.tiny import make_tiny_model  # noqa: E402

FAMILIES = ("sd1", "sd2", "sdxl")
TEXT_PREFIX = {
    "sd1": "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
    "sd2": "cond_stage_model.model.token_embedding.weight",
    "sdxl": "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight",
}


def _components(family: str) -> list[str]:
    return ["unet", "vae", "text_encoder"] + (["text_encoder_2"] if family == "sdxl" else [])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (diffusers folder, pipeline loaded from it, exported single file)."""
    from diffusers import DiffusionPipeline

    root = tmp_path_factory.mktemp("single_file")
    out = {}
    for family in FAMILIES:
        folder = make_tiny_model(root / family, family)
        pipe = DiffusionPipeline.from_pretrained(folder)
        path = export_single_file(pipe.components, family, root / f"{family}.safetensors")
        out[family] = (folder, pipe, path)
    return out


def _assert_same_weights(original, loaded, family):
    for name in _components(family):
        want = getattr(original, name).state_dict()
        got = getattr(loaded, name).state_dict()
        assert set(want) == set(got), f"{name}: key sets differ: {sorted(set(want) ^ set(got))[:5]}"
        for key in want:
            assert got[key].device.type == "cpu", f"{name}.{key} left on {got[key].device}"
            assert torch.equal(want[key], got[key]), f"{name}.{key} differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(models, family):
    folder, pipe, path = models[family]
    assert path.is_file() and path.suffix == ".safetensors"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temp file left behind"

    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        for key in ("model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.encoder.conv_in.weight",
                    "model.diffusion_model.middle_block.1.proj_in.weight",
                    "model.diffusion_model.out.2.weight", TEXT_PREFIX[family]):
            assert key in keys, key
        vae_q = fh.get_slice("first_stage_model.encoder.mid.attn_1.q.weight").get_shape()
        assert len(vae_q) == 4 and vae_q[2:] == [1, 1]
        if family == "sd2":
            assert "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight" in keys
            assert "cond_stage_model.model.positional_embedding" in keys
        if family == "sdxl":
            assert "model.diffusion_model.label_emb.0.0.weight" in keys
            projection = fh.get_tensor("conditioner.embedders.1.model.text_projection")
            assert torch.equal(projection, pipe.text_encoder_2.text_projection.weight.t())
            assert "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_bias" in keys
    assert not any(k.startswith(("model.diffusion_model.down_blocks", "first_stage_model.decoder.up_blocks"))
                   for k in keys)

    loaded = load_single_file(path, family, folder)
    expected_class = "StableDiffusionXLPipeline" if family == "sdxl" else "StableDiffusionPipeline"
    assert type(loaded).__name__ == expected_class
    _assert_same_weights(pipe, loaded, family)
    assert loaded.scheduler.config.prediction_type == pipe.scheduler.config.prediction_type
    assert loaded.vae.config.scaling_factor == pipe.vae.config.scaling_factor


def test_weights_come_from_the_file_not_the_config_folder(models, tmp_path):
    """With a config-only folder every weight must come from the single file (SDXL: both towers)."""
    folder, pipe, path = models["sdxl"]
    config_only = tmp_path / "sdxl_config"
    shutil.copytree(folder, config_only, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    loaded = load_single_file(path, "sdxl", config_only)
    _assert_same_weights(pipe, loaded, "sdxl")


def test_sd2_prediction_type(models):
    folder, _, path = models["sd2"]
    assert load_single_file(path, "sd2", folder).scheduler.config.prediction_type == "v_prediction"
    overridden = load_single_file(path, "sd2", folder, prediction_type="epsilon").scheduler.config
    assert overridden.prediction_type == "epsilon"
    assert overridden.beta_start == pytest.approx(0.00085)  # the config folder's schedule, not a legacy default


def test_export_dtype(models, tmp_path):
    _, pipe, _ = models["sd1"]
    path = export_single_file(pipe.components, "sd1", tmp_path / "half.safetensors", dtype=torch.float16)
    tensors = load_file(str(path))
    assert {t.dtype for t in tensors.values()} == {torch.float16}


def test_missing_file(models, tmp_path):
    folder = models["sd1"][0]
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(InputFileError, match="nope.safetensors"):
        load_single_file(missing, "sd1", folder)


def test_corrupt_file(models, tmp_path):
    folder, _, path = models["sd1"]
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(InputFileError, match="not a valid safetensors") as info:
        load_single_file(garbage, "sd1", folder)
    assert str(garbage) in str(info.value)

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InputFileError, match="not a valid safetensors") as info:
        load_single_file(truncated, "sd1", folder)
    assert str(truncated) in str(info.value)


def test_pickle_checkpoint_is_refused(models, tmp_path):
    folder = models["sd1"][0]
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not opened")
    with pytest.raises(InputFileError, match="model.ckpt"):
        load_single_file(ckpt, "sd1", folder)


def test_wrong_family(models):
    sd1_path = models["sd1"][2]
    sdxl_folder = models["sdxl"][0]
    with pytest.raises(InputFileError, match="missing keys") as info:
        load_single_file(sd1_path, "sdxl", sdxl_folder)
    message = str(info.value)
    assert str(sd1_path) in message
    assert "unexpected keys: cond_stage_model.transformer.text_model." in message
    assert "looks like an sd1 checkpoint" in message


def test_deleted_and_reshaped_keys(models, tmp_path):
    folder, _, path = models["sd1"]
    tensors = load_file(str(path))
    deleted = "model.diffusion_model.output_blocks.3.1.proj_out.weight"
    del tensors[deleted]
    damaged = tmp_path / "damaged.safetensors"
    save_file(tensors, str(damaged))
    with pytest.raises(InputFileError, match="missing keys") as info:
        load_single_file(damaged, "sd1", folder)
    assert str(damaged) in str(info.value) and deleted in str(info.value)

    tensors = load_file(str(path))
    reshaped = "first_stage_model.decoder.conv_in.weight"
    tensors[reshaped] = torch.zeros(3, 3)
    save_file(tensors, str(damaged))
    with pytest.raises(InputFileError, match="shape mismatch") as info:
        load_single_file(damaged, "sd1", folder)
    assert str(damaged) in str(info.value) and reshaped in str(info.value)


def test_comfyuis_scaled_fp8_file_is_refused_by_what_it_is(models, tmp_path):
    """A UNet file in ComfyUI's scaled-fp8 layout (a `.scale_weight` per quantized layer, a `scaled_fp8` marker):
    the error names the quantization and asks for the unquantized file."""
    folder, _, path = models["sdxl"]
    tensors = load_file(str(path))
    layers = [k[: -len(".weight")] for k, v in tensors.items() if k.startswith("model.diffusion_model.") and v.ndim == 2]
    tensors |= {f"{layer}.scale_weight": torch.ones(()) for layer in layers}
    tensors["model.diffusion_model.scaled_fp8"] = torch.empty(0)
    scaled = tmp_path / "scaled.safetensors"
    save_file(tensors, str(scaled))
    with pytest.raises(InputFileError, match="scaled-fp8 quantization.*unquantized"):
        load_single_file(scaled, "sdxl", folder)


def _in_an_older_text_layout(family: str, tensors: dict) -> dict:
    """The export's text-encoder keys as older files have them, which A1111 / Forge and ComfyUI load.

    sd1: CLIP-L without the `text_model.` level (transformers' layout before CLIPTextModel wrapped it: many older
    SD 1.x finetunes), with a float32 `position_ids` a little off the integers as older merges carry it.
    sd2: OpenCLIP-H under SGM's `conditioner.embedders.0.model.` (Stability's SD 2.1 Turbo file), with the
    `text_projection` SD 2 never uses."""
    if family == "sd1":
        current = "cond_stage_model.transformer.text_model."
        out = {("cond_stage_model.transformer." + k[len(current):] if k.startswith(current) else k): v
               for k, v in tensors.items()}
        width = out["cond_stage_model.transformer.embeddings.position_embedding.weight"].shape[0]
        out["cond_stage_model.transformer.embeddings.position_ids"] = torch.arange(width)[None].float() - 1e-4
        return out
    current = "cond_stage_model.model."
    out = {("conditioner.embedders.0.model." + k[len(current):] if k.startswith(current) else k): v
           for k, v in tensors.items()}
    width = out["conditioner.embedders.0.model.ln_final.weight"].shape[0]
    out["conditioner.embedders.0.model.text_projection"] = torch.randn(width, width)
    return out


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_older_text_encoder_key_layouts_load_as_the_current_one(models, family, tmp_path):
    folder, pipe, path = models[family]
    older = tmp_path / "older.safetensors"
    save_file(_in_an_older_text_layout(family, load_file(str(path))), str(older))
    with safe_open(str(older), framework="pt") as fh:
        assert not any(k.startswith(("cond_stage_model.transformer.text_model.", "cond_stage_model.model."))
                       for k in fh.keys())

    loaded = load_single_file(older, family, folder)
    _assert_same_weights(pipe, loaded, family)
    tokens = torch.tensor([[0, 5, 9, 3, 1, 1]])
    with torch.no_grad():
        want = load_single_file(path, family, folder).text_encoder(tokens)
        got = loaded.text_encoder(tokens)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    assert torch.equal(got.pooler_output, want.pooler_output)


def test_text_encoder_keys_in_both_layouts_are_refused_by_name(models, tmp_path):
    """Which copy a file with both forms means cannot be told (the UIs keep whichever they read last)."""
    folder, _, path = models["sd1"]
    tensors = load_file(str(path))
    both = tmp_path / "both.safetensors"
    older = {k: v.clone() for k, v in _in_an_older_text_layout("sd1", tensors).items() if k not in tensors}
    save_file(tensors | older, str(both))
    with pytest.raises(InputFileError, match="twice.*cond_stage_model.transformer.text_model.") as info:
        load_single_file(both, "sd1", folder)
    assert str(both) in str(info.value)


def test_incomplete_config_source(models, tmp_path):
    path = models["sd1"][2]
    with pytest.raises(InputFileError, match="model_index.json") as info:
        load_single_file(path, "sd1", tmp_path)
    assert str(tmp_path) in str(info.value)


def _with_scheduler(pipe, **settings) -> dict:
    """`pipe`'s components with its scheduler changed (what a run on such a model exports)."""
    return {**pipe.components, "scheduler": type(pipe.scheduler).from_config(pipe.scheduler.config, **settings)}


def test_v_prediction_files_carry_the_v_pred_marker_comfyui_and_forge_detect(models, tmp_path):
    """ComfyUI (supported_models.SDXL.model_type) and Forge tell a v-prediction SDXL checkpoint by a root `v_pred`
    key, the marker ComfyUI itself writes when it saves one; without it they sample the model as epsilon. An
    epsilon model's file has no such key. ot_dist reads the marker back the same way (the config folder here says
    epsilon); model.prediction_type still wins."""
    folder, pipe, epsilon_path = models["sdxl"]
    assert pipe.scheduler.config.prediction_type == "epsilon"
    with safe_open(str(epsilon_path), framework="pt") as fh:
        assert not {"v_pred", "ztsnr"} & set(fh.keys())

    v = _with_scheduler(pipe, prediction_type="v_prediction")
    path = export_single_file(v, "sdxl", tmp_path / "v.safetensors", dtype=torch.float16)
    with safe_open(str(path), framework="pt") as fh:
        assert "v_pred" in fh.keys() and fh.get_slice("v_pred").get_shape() == [0]
        assert "ztsnr" not in fh.keys()
    loaded = load_single_file(path, "sdxl", folder)
    assert loaded.scheduler.config.prediction_type == "v_prediction"
    assert not loaded.scheduler.config.get("rescale_betas_zero_snr")
    assert load_single_file(path, "sdxl", folder, prediction_type="epsilon").scheduler.config.prediction_type == \
        "epsilon"


def test_zero_terminal_snr_files_carry_the_ztsnr_marker(models, tmp_path):
    """A v-prediction model on a zero-terminal-SNR schedule (NoobAI-XL v-pred) has `v_pred` and `ztsnr`: ComfyUI
    samples such an SDXL file with zero terminal SNR, Forge any file with `ztsnr`. Exported from the scheduler's
    rescale_betas_zero_snr; read back, it puts the training schedule at SNR 0 at the last timestep."""
    from ot_dist.models.objectives import DDPM

    folder, pipe, _ = models["sdxl"]
    zsnr = _with_scheduler(pipe, prediction_type="v_prediction", rescale_betas_zero_snr=True)
    path = export_single_file(zsnr, "sdxl", tmp_path / "zsnr.safetensors")
    with safe_open(str(path), framework="pt") as fh:
        assert {"v_pred", "ztsnr"} <= set(fh.keys())
    loaded = load_single_file(path, "sdxl", folder)  # the folder's schedule has no zero terminal SNR
    assert loaded.scheduler.config.rescale_betas_zero_snr
    objective = DDPM(loaded.scheduler.config)
    assert objective.prediction_type == "v_prediction" and objective.zero_terminal_snr()


def test_a_prediction_type_override_is_what_the_exports_say(models, tmp_path):
    """A run that trains an epsilon base as v-prediction (model.prediction_type: v_prediction) exports a model that
    predicts v: the diffusers folder's scheduler says so, the single file carries the v_pred marker, and ot_dist
    loads both back as v-prediction without being told."""
    from ot_dist.checkpoint.export import export_diffusers_folder
    from ot_dist.checkpoint.frozen_source import export_source
    from ot_dist.config.schema import ModelConfig
    from ot_dist.methods.base import plain_state_dict
    from ot_dist.models.loading import load_model

    folder = models["sdxl"][0]
    config = ModelConfig(family="sdxl", path=str(folder), prediction_type="v_prediction")
    model = load_model(config)
    assert model.objective.prediction_type == "v_prediction"
    source = export_source(model, config, {"unet"}, plain_state_dict, write=True)
    export_diffusers_folder(source.pipeline, tmp_path / "model", torch.float32, source.states, family=model.family)
    model.family.export_single_file(source.components, source.states, tmp_path / "model.safetensors", torch.float32)

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        assert "v_pred" in fh.keys()
    for again in (ModelConfig(family="sdxl", path=str(tmp_path / "model")),
                  ModelConfig(family="sdxl", path=str(tmp_path / "model.safetensors"), config=str(folder))):
        reloaded = load_model(again)
        assert reloaded.pipeline.scheduler.config.prediction_type == "v_prediction"
        assert reloaded.objective.prediction_type == "v_prediction"
