"""model.zero_terminal_snr: training, samples and exports on the noise schedule rescaled to zero terminal SNR (Lin et
al. 2023; diffusers' rescale_betas_zero_snr, OneTrainer's rescale_noise_scheduler_to_zero_terminal_snr)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

# alphas_cumprod at t = 0, 250, 500, 750, 998, 999 of SD's schedule (scaled_linear 0.00085 .. 0.012, 1000 steps) after
# OneTrainer's modules/util/convert/rescale_noise_scheduler_to_zero_terminal_snr.py, run on a DDIMScheduler in a
# scratch folder (OneTrainer 23df383). Its float32 arithmetic differs from diffusers' in the last bits only.
ONETRAINER_ALPHAS_CUMPROD = {0: 9.991499782e-01, 250: 6.524566412e-01, 500: 2.410185486e-01, 750: 3.279909864e-02,
                             998: 1.967963499e-07, 999: 0.0}


@pytest.fixture(scope="module")
def rescaled(tiny_models):
    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.loading import load_model

    config = ModelConfig(family="sd1", path=str(tiny_models["sd1"]), zero_terminal_snr=True)
    return config, load_model(config)


def test_training_uses_diffusers_rescaled_schedule_and_predicts_v(tiny_models, rescaled):
    """The objective's schedule is DDPMScheduler(rescale_betas_zero_snr=True)'s, bit for bit; it is the paper's rule
    (sqrt(alpha-bar) shifted to 0 at the last timestep, scaled back to its first value) and OneTrainer's values; the
    target is v (OneTrainer forces v-prediction with the option, the tiny SD 1.x model predicts epsilon)."""
    from diffusers import DDPMScheduler

    original = json.loads((tiny_models["sd1"] / "scheduler" / "scheduler_config.json").read_text())
    assert original["prediction_type"] == "epsilon" and not original.get("rescale_betas_zero_snr")
    _, model = rescaled
    objective = model.objective
    expected = DDPMScheduler.from_config(original, rescale_betas_zero_snr=True).alphas_cumprod
    assert torch.equal(objective.scheduler.alphas_cumprod, expected)
    assert objective.prediction_type == "v_prediction" and objective.zero_terminal_snr()

    root = DDPMScheduler.from_config(original).alphas_cumprod.double().sqrt()
    rule = (root - root[-1]) * root[0] / (root[0] - root[-1])
    torch.testing.assert_close(objective.scheduler.alphas_cumprod.double().sqrt(), rule, rtol=0, atol=1e-6)
    steps = list(ONETRAINER_ALPHAS_CUMPROD)
    torch.testing.assert_close(objective.scheduler.alphas_cumprod[steps].double(),
                               torch.tensor(list(ONETRAINER_ALPHAS_CUMPROD.values()), dtype=torch.float64),
                               rtol=1e-6, atol=1e-12)
    # the v target at the last timestep is -x0: the image itself, where an epsilon target would be the input
    latents, noise = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    last = torch.tensor([999])
    torch.testing.assert_close(objective.noisy(latents, noise, last), noise)
    torch.testing.assert_close(objective.target(latents, noise, last), -latents)


def test_exports_and_samples_carry_the_schedule(tiny_models, rescaled, tmp_path):
    """The diffusers folder's scheduler config and the single file's markers (ComfyUI / Forge: `ztsnr`, `v_pred`) say
    it, so the exported model loads back on the same schedule; samples start at the last timestep (trailing
    spacing) on the rescaled betas with OneTrainer's guidance rescale of 0.7."""
    from ot_dist.checkpoint.export import export_diffusers_folder
    from ot_dist.checkpoint.frozen_source import export_source
    from ot_dist.config.load import validate
    from ot_dist.config.schema import ModelConfig
    from ot_dist.methods.base import plain_state_dict
    from ot_dist.models.loading import load_model
    from ot_dist.train.sampling import Sampler

    config, model = rescaled
    source = export_source(model, config, {"unet"}, plain_state_dict, write=True)
    export_diffusers_folder(source.pipeline, tmp_path / "model", torch.float32, source.states, family=model.family)
    model.family.export_single_file(source.components, source.states, tmp_path / "model.safetensors", torch.float32)
    saved = json.loads((tmp_path / "model" / "scheduler" / "scheduler_config.json").read_text())
    assert (saved["rescale_betas_zero_snr"], saved["timestep_spacing"], saved["prediction_type"]) == (
        True, "trailing", "v_prediction")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        assert {"ztsnr", "v_pred"} <= set(fh.keys())
    for again in (ModelConfig(family="sd1", path=str(tmp_path / "model")),
                  ModelConfig(family="sd1", path=str(tmp_path / "model.safetensors"), config=str(tiny_models["sd1"]))):
        reloaded = load_model(again).objective
        assert reloaded.zero_terminal_snr() and reloaded.prediction_type == "v_prediction"
        assert torch.equal(reloaded.scheduler.alphas_cumprod, model.objective.scheduler.alphas_cumprod)

    train_config = validate({"model": config.model_dump(), "method": "full", "output_dir": str(tmp_path / "run"),
                             "data": {"path": str(tmp_path)}, "sampling": {"prompts": [{"prompt": "a square", "steps": 2, "width": 64,
                                                                  "height": 64}]}})
    pipeline = Sampler(train_config, model).pipeline({})
    pipeline.scheduler.set_timesteps(4)
    assert pipeline.scheduler.timesteps[0] == 999 and pipeline.scheduler.alphas_cumprod[-1] == 0
    assert pipeline.scheduler.config.prediction_type == "v_prediction"
    assert model.family.sampling_arguments(pipeline, {"prompt": "a"})["guidance_rescale"] == 0.7
    # the validated prompt: its guidance_scale is the family's default (None until the config is validated)
    image = Sampler(train_config, model).generate(pipeline, train_config.sampling.prompts[0])
    assert image.size == (64, 64) and len(set(image.getdata())) > 1  # the pipeline takes the arguments (no NaN)


def test_a_scheduler_without_the_option_becomes_ddim():
    """SD 1.5 ships PNDM, which has no rescale_betas_zero_snr (diffusers drops it silently): the model gets DDIM on
    the same betas, which has, without clipping the latents."""
    from types import SimpleNamespace

    from diffusers import PNDMScheduler

    from ot_dist.models.families.sd_single_file import with_zero_terminal_snr

    pndm = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True)
    scheduler = with_zero_terminal_snr(SimpleNamespace(scheduler=pndm)).scheduler
    assert type(scheduler).__name__ == "DDIMScheduler" and scheduler.alphas_cumprod[-1] == 0
    assert (scheduler.config.clip_sample, scheduler.config.timestep_spacing) == (False, "trailing")
    assert scheduler.config.beta_schedule == "scaled_linear"


@pytest.mark.parametrize("model,message", [
    ({"family": "sd1", "prediction_type": "epsilon"}, "model.prediction_type: epsilon cannot be trained with "
                                                      "model.zero_terminal_snr"),
    ({"family": "flux"}, "model.zero_terminal_snr: rescales the DDPM betas of a UNet family"),
    ({"family": "pixart_sigma"}, "pixart_sigma learns its variance"),
    ({"family": "stable_cascade"}, "stable_cascade has no discrete DDPM beta schedule"),
])
def test_what_cannot_train_on_it_is_refused_by_name(model, message):
    from ot_dist.config.load import validate
    from ot_dist.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate({"model": {"path": "m", "zero_terminal_snr": True, **model}, "method": "full", "output_dir": "o",
                  "data": {"path": "d"}})
