"""Samples during training: made at the configured steps / epochs and at the end, from the weights
being trained (EMA, LoRA adapters, embeddings active), identical for the same seed and weights, logged
to MLflow, spread over ranks, and invisible to training (same losses with or without)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
from forked_ranks import run_ranks
import torch
from conftest import base_config, in_aligned_memory
from PIL import Image

from ot_dist.config.load import validate
from ot_dist.config.sampling import SAMPLERS, SamplePrompt, SamplingConfig
from ot_dist.errors import ConfigError
from ot_dist.tracking import local_store_uri
from ot_dist.train import sampling
from ot_dist.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RED = {"prompt": "a red circle", "seed": 1, "steps": 2, "width": 64, "height": 64}
BLUE = {"prompt": "a blue square on a green background", "negative_prompt": "red", "seed": 7, "steps": 2,
        "width": 64, "height": 48, "guidance_scale": 5.0}
FILES = ["0-a-red-circle.png", "1-a-blue-square-on-a-green-background.png"]


def quiet(*_):
    pass


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def assert_same_image(got: np.ndarray, expected: np.ndarray) -> None:
    """Two code paths' images of one model (ot_dist's sampler, diffusers' pipeline with the exported file): the same
    up to rounding: at most 0.1 % of the values one level apart. One float32 ulp can flip a value's rounding (on an
    AVX2 CPU one value of 12288 did); a LoRA or embedding left out moves them by tens."""
    assert got.shape == expected.shape
    apart = np.abs(got.astype(int) - expected.astype(int))
    assert apart.max() <= 1 and (apart > 0).mean() <= 1e-3, f"{(apart > 0).sum()} values differ, by up to {apart.max()}"


def images_of(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: pixels(p) for p in sorted(folder.glob("*.png"))}


def diffusers_pipeline(model_dir: Path, scheduler: str = "DDIMScheduler", **scheduler_options):
    """The export loaded with plain diffusers, its scheduler replaced as diffusers' docs do it:
    `Scheduler.from_config(pipe.scheduler.config, **options)` (DDIM: ot_dist's default sampler)."""
    import diffusers
    from diffusers import DiffusionPipeline

    options = {}
    if json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline":
        options = {"safety_checker": None, "requires_safety_checker": False}
    pipe = in_aligned_memory(DiffusionPipeline.from_pretrained(model_dir, local_files_only=True, **options))
    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config, **scheduler_options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe, prompt: dict, **extra) -> np.ndarray:
    image = pipe(prompt["prompt"], negative_prompt=prompt.get("negative_prompt") or None, width=prompt["width"],
                 height=prompt["height"], num_inference_steps=prompt["steps"],
                 guidance_scale=prompt.get("guidance_scale", 7.5),  # a prompt without one: SD 1.x's default
                 generator=torch.Generator().manual_seed(prompt["seed"]), **extra).images[0]
    return np.asarray(image.convert("RGB"))


def diffusers_sample(model_dir: Path, prompt: dict, lora: Path | None = None, embedding: Path | None = None,
                     token: str | None = None) -> np.ndarray:
    """The image a user gets from an export with plain diffusers (DDIM, the default sampler)."""
    pipe = diffusers_pipeline(model_dir)
    if lora is not None:
        pipe.load_lora_weights(lora.parent, weight_name=lora.name)
        pipe.unet.eval()  # the loader leaves the new LoRA layers in training mode: their dropout would act
    if embedding is not None:
        pipe.load_textual_inversion(embedding, token=token)
    return draw(pipe, prompt)


@pytest.fixture(scope="module")
def ema_run(tiny_models, shapes_data, tmp_path_factory):
    """8 steps (4 per epoch) with the EMA on, sampling every 3 steps, every epoch and at the end,
    tracked in the local MLflow store."""
    out = tmp_path_factory.mktemp("ema-run")
    raw = base_config(tiny_models["sd1"], shapes_data, out, epochs=2, **{
        "ema.enabled": True, "ema.decay": 0.9, "ema.update_step_interval": 1, "mlflow.enabled": True,
        "sampling.prompts": [RED, BLUE], "sampling.every_n_steps": 3, "sampling.every_n_epochs": 1,
    })
    trainer = Trainer(validate(raw), log=quiet)
    result = trainer.train()
    return trainer, result, out


def test_samples_at_the_configured_steps_and_the_end_are_logged_to_mlflow(ema_run, tmp_path):
    from mlflow.tracking import MlflowClient

    trainer, result, out = ema_run
    assert result.steps == 8
    steps = [3, 4, 6, 8]  # every 3 steps, every epoch (4 steps); the end of epoch 2 is the end: sampled once
    assert sorted(p.name for p in (out / "samples").iterdir()) == sorted(f"step-{s}" for s in steps)
    for step in steps:
        images = images_of(out / "samples" / f"step-{step}")
        assert list(images) == FILES
        assert images[FILES[0]].shape == (64, 64, 3) and images[FILES[1]].shape == (48, 64, 3)
    # the weights changed between samples, and so did the images
    assert not np.array_equal(pixels(out / "samples/step-3" / FILES[0]), pixels(out / "samples/step-8" / FILES[0]))

    client = MlflowClient(local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("ot_dist").experiment_id])
    assert {a.path for a in client.list_artifacts(run.info.run_id, "samples")} == {f"samples/step-{s}" for s in steps}
    for step in steps:
        logged = client.list_artifacts(run.info.run_id, f"samples/step-{step}")
        assert sorted(a.path for a in logged) == [f"samples/step-{step}/{name}" for name in FILES]
    logged = client.download_artifacts(run.info.run_id, f"samples/step-8/{FILES[1]}", str(tmp_path))
    assert Path(logged).read_bytes() == (out / "samples" / "step-8" / FILES[1]).read_bytes()
    # and per step in the UI's image view (MlflowClient.log_image's layout: images/KEY+step+N+..., / as ~)
    stepped = sorted(re.match(r"images/(.+)\+step\+(\d+)\+timestamp\+\d+\+[0-9a-f-]{36}\.png$", a.path).groups()
                     for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png"))
    assert stepped == sorted((f"samples~{Path(name).stem}", str(s)) for s in steps for name in FILES)


def test_the_samples_come_from_the_ema_weights_or_the_trained_ones(ema_run, tmp_path, monkeypatch):
    trainer, _, out = ema_run
    final = out / "samples" / "step-8"
    for prompt, name in zip([RED, BLUE], FILES):
        assert_same_image(pixels(final / name), diffusers_sample(out / "model_ema", prompt))
    # the EMA is not the trained weights (decay 0.9: it lags); use_ema: false samples those
    trained = diffusers_sample(out / "model", RED)
    assert not np.array_equal(pixels(final / FILES[0]), trained)
    monkeypatch.setattr(trainer.sampler, "output_dir", tmp_path)
    monkeypatch.setattr(trainer.config.sampling, "use_ema", False)
    (red, _) = trainer.sampler.sample(trainer, 8)
    assert np.array_equal(pixels(red), trained)


def no_ema(name: str) -> str:
    return name.replace(".png", "-no-ema.png")


def test_non_ema_samples_are_the_trained_weights_beside_the_ema_ones(ema_run, tmp_path, monkeypatch):
    """sampling.non_ema_samples (OneTrainer's non_ema_sampling): each prompt from the EMA and from the trained weights,
    the latter named apart; the EMA ones as without the option."""
    trainer, _, out = ema_run
    monkeypatch.setattr(trainer.sampler, "output_dir", tmp_path)
    monkeypatch.setattr(trainer.config.sampling, "non_ema_samples", True)
    written = trainer.sampler.sample(trainer, 8)
    assert [p.name for p in written] == FILES + [no_ema(name) for name in FILES]
    for prompt, name in zip([RED, BLUE], FILES):
        ema, trained = pixels(tmp_path / "samples/step-8" / name), pixels(tmp_path / "samples/step-8" / no_ema(name))
        assert np.array_equal(ema, pixels(out / "samples/step-8" / name))
        assert np.array_equal(trained, diffusers_sample(out / "model", prompt))
        assert not np.array_equal(ema, trained)
    monkeypatch.setattr(trainer.config.sampling, "use_ema", False)  # the trained weights only: no second set
    assert [p.name for p in trainer.sampler.sample(trainer, 9)] == FILES


def test_same_seed_and_weights_give_identical_images(ema_run, tmp_path, monkeypatch):
    trainer, _, out = ema_run
    monkeypatch.setattr(trainer.sampler, "output_dir", tmp_path)  # the run's own samples stay as they are
    again = trainer.sampler.sample(trainer, 8)  # the weights of the end, sampled again
    assert [p.name for p in again] == FILES
    for path in again:
        assert np.array_equal(pixels(path), pixels(out / "samples" / "step-8" / path.name))
    monkeypatch.setattr(trainer.config.sampling.prompts[0], "seed", 2)  # another seed, another image
    (other, _) = trainer.sampler.sample(trainer, 9)
    assert not np.array_equal(pixels(other), pixels(out / "samples" / "step-8" / FILES[0]))


def lora_config(tiny_models, shapes_data, out: Path, **extra) -> dict:
    # LoRA dropout draws from torch's global random stream every step: sampling that consumed from it
    # would change the losses that follow. A high learning rate makes the adapters show in the images.
    return base_config(tiny_models["sd1"], shapes_data, out, method="lora", max_steps=3, learning_rate=0.05,
                       **{"lora.rank": 4, "lora.dropout": 0.2, **extra})


def test_sampling_leaves_the_training_losses_unchanged(tiny_models, shapes_data, tmp_path, monkeypatch):
    # The image comparison below is to rounding (assert_same_image): it reads the LoRA in the diffusers layout, which
    # diffusers loads into the very layers training used. From the default kohya layout diffusers builds the same weights, yet
    # its UNet output is ~1e-6 off (one float32 ulp at a 1x1-conv LoRA with equal weights and inputs), enough to
    # flip a pixel; tests/test_lora_layouts.py checks that load to 1e-5.
    sampled_config = {"sampling.prompts": [RED], "sampling.every_n_steps": 2, "lora.file_layout": "diffusers"}
    plain = Trainer(validate(lora_config(tiny_models, shapes_data, tmp_path / "plain")), log=quiet).train()
    # A sampler that also draws from the global random streams (as a scheduler drawing noise without
    # the generator would): the isolation must hide that from training.
    generate = sampling.Sampler.generate

    def greedy_generate(self, pipeline, prompt):
        torch.rand(100), random.random()
        return generate(self, pipeline, prompt)

    monkeypatch.setattr(sampling.Sampler, "generate", greedy_generate)
    sampled_out = tmp_path / "sampled"
    sampled = Trainer(validate(lora_config(tiny_models, shapes_data, sampled_out, **sampled_config)), log=quiet).train()
    assert sorted(p.name for p in (sampled_out / "samples").iterdir()) == ["step-2", "step-3"]  # and the end
    assert len(plain.losses) == 3
    assert sampled.losses == plain.losses  # exactly

    # The LoRA adapters were active: the last sample is what diffusers makes of the exported LoRA.
    lora_image = diffusers_sample(tiny_models["sd1"], RED, lora=sampled_out / "lora.safetensors")
    assert_same_image(pixels(sampled_out / "samples" / "step-3" / FILES[0]), lora_image)
    assert np.abs(lora_image.astype(int) - diffusers_sample(tiny_models["sd1"], RED)).max() > 20

    # Without the isolation the losses after the first sample differ: the comparison above can fail.
    monkeypatch.setattr(sampling, "isolated_randomness", lambda device: contextlib.nullcontext())
    leaky = Trainer(validate(lora_config(tiny_models, shapes_data, tmp_path / "leaky", **sampled_config)), log=quiet).train()
    assert leaky.losses[:2] == plain.losses[:2] and leaky.losses[2:] != plain.losses[2:]


def test_embedding_samples_use_the_trained_vectors(tiny_models, shapes_data, tmp_path):
    token = "<shape>"
    prompt = {**RED, "prompt": f"a photo of {token}"}
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, method="embedding", learning_rate=0.05,
                      max_steps=3, **{"embedding.token": token, "embedding.vectors": 2,
                                      "sampling.prompts": [prompt]})
    Trainer(validate(raw), log=quiet).train()
    (sample,) = (tmp_path / "samples" / "step-3").glob("*.png")
    assert sample.name == "0-a-photo-of-shape.png"
    expected = diffusers_sample(tiny_models["sd1"], prompt, embedding=tmp_path / "embedding.safetensors", token=token)
    assert_same_image(pixels(sample), expected)


def test_sdxl_samples_match_its_pipeline(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sdxl"], shapes_data, tmp_path, family="sdxl", max_steps=1,
                      **{"sampling.prompts": [RED]})
    Trainer(validate(raw), log=quiet).train()
    sample = pixels(tmp_path / "samples" / "step-1" / FILES[0]).astype(int)
    expected = diffusers_sample(tmp_path / "model", RED).astype(int)
    # Equal up to float32 rounding, not bit for bit: with the packages setup installed in November 2026 one value
    # of 12,288 is 1 level off (a float landing beside a rounding boundary in one of the two paths). A sampler that
    # differs in anything (scheduler, guidance, conditioning, weights) moves most values by many levels.
    difference = np.abs(sample - expected)
    assert difference.max() <= 1 and np.count_nonzero(difference) <= sample.size // 1000, (
        f"{np.count_nonzero(difference)} values differ, by up to {difference.max()}")


def test_two_ranks_generate_one_prompt_each_and_match_one_process(small_sd1, shapes_data, tmp_path):
    """On the 2-level SD 1.x UNet (conftest.py small_sd1): which rank samples which prompt, and an image equal to one
    process's from the gathered weights, do not depend on the UNet's depth; fsdp's units and gathers grow with it."""
    out = tmp_path / "out"
    raw = base_config(small_sd1, shapes_data, out, batch_size=2, max_steps=4, strategy="fsdp", **{
        "ema.enabled": True, "ema.decay": 0.9, "ema.update_step_interval": 1,
        "sampling.prompts": [RED, BLUE], "sampling.every_n_steps": 2, "sampling.non_ema_samples": True,
    })
    (tmp_path / "config.json").write_text(json.dumps(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_ranks(str(REPO / "tests" / "helpers" / "sample_ranks.py"), str(tmp_path / "config.json"), str(tmp_path),
        env=env, timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # prompt i on rank i mod 2, at steps 2 and 4 (the end: sampled once), from the EMA and the trained weights
    assert json.loads((tmp_path / "rank-0.json").read_text()) == [RED["prompt"]] * 4
    assert json.loads((tmp_path / "rank-1.json").read_text()) == [BLUE["prompt"]] * 4
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-2", "step-4"]
    final = images_of(out / "samples" / "step-4")
    assert sorted(final) == sorted(FILES + [no_ema(name) for name in FILES])
    # Each image is what one process makes of the gathered (EMA) weights the run exported. The weights are
    # the same bit for bit (checked while writing this test), but another process computes them with its
    # own float rounding: measured, at most 2 of 12288 values differ, by 1 level.
    for prompt, name in zip([RED, BLUE], FILES):
        difference = np.abs(final[name].astype(int) - diffusers_sample(out / "model_ema", prompt))
        assert difference.max() <= 1 and (difference > 0).mean() < 1e-3, name
    # a bound that tells weights apart: the trained (not averaged) weights give a visibly other image ...
    trained = diffusers_sample(out / "model", RED)
    assert np.abs(final[FILES[0]].astype(int) - trained).max() > 1
    # ... which the non-EMA samples are: the gathered fsdp shards of the trained weights
    difference = np.abs(final[no_ema(FILES[0])].astype(int) - trained)
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3


def test_sampling_config_errors_name_the_field(tiny_models, shapes_data, tmp_path):
    def check(message: str, **sampling_keys):
        raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, **sampling_keys)
        with pytest.raises(ConfigError, match=message):
            validate(raw)

    check(r"sampling.prompts\[0\].width: 60 is not a multiple of 8", **{"sampling.prompts": [{**RED, "width": 60}]})
    check(r"sampling.prompts.0.steps", **{"sampling.prompts": [{**RED, "steps": 0}]})
    check(r"sampling.prompts.0.prompt: required key is missing", **{"sampling.prompts": [{"seed": 1}]})
    check(r"sampling.prompts.0.sed: unknown key; did you mean 'seed'", **{"sampling.prompts": [{**RED, "sed": 1}]})
    check(r"sampling.every_n_steps: set, but sampling.prompts is empty", **{"sampling.every_n_steps": 10})
    check(r"sampling.sampler", **{"sampling.prompts": [RED], "sampling.sampler": "heun"})
    assert SamplingConfig().samples_at_end() is False
    assert SamplingConfig(prompts=[RED]).samples_at_end() is True
    assert SamplingConfig(prompts=[RED], at_end=False).samples_at_end() is False
    assert set(SAMPLERS) | {"auto"} == set(SamplingConfig.model_fields["sampler"].annotation.__args__)
    assert set(SamplePrompt.model_fields["sampler"].annotation.__args__[0].__args__) == set(SAMPLERS) | {"auto"}


# OneTrainer's sample defaults per model (modules/util/config/SampleConfig.py: cfg_scale) and the side its samplers
# round to (quantize_resolution in modules/modelSampler/*Sampler.py; SD3 and PixArt 16, the VAE x 2x2 patches).
# A side off the grid: StableDiffusion3Pipeline raises, the PixArt pipelines fail mid-sampling, FluxPipeline and
# ChromaPipeline resize it with a warning; Stable Cascade's combined pipeline takes any side.
@pytest.mark.parametrize("family,guidance,grid", [
    ("sd1", 7.5, 8), ("sd2", 7.5, 8), ("sdxl", 7.5, 8), ("sd3", 7.0, 16), ("flux", 3.5, 16), ("chroma", 3.5, 16),
    ("pixart_alpha", 4.5, 16), ("pixart_sigma", 4.5, 16), ("stable_cascade", 4.0, 8), ("wuerstchen_v2", 4.0, 8),
    ("qwen_image", 3.5, 16), ("sana", 4.5, 32), ("z_image", 4.0, 16), ("hidream", 5.0, 16), ("lumina2", 4.0, 16),
    ("flux_kontext", 2.5, 16),  # OneTrainer has no Kontext: FluxKontextPipeline's documented example
    ("flux2", 4.0, 16), ("flux2_klein", 4.0, 16),
    ("wan", 5.0, 16),  # OneTrainer has no Wan: WanPipeline's default
    ("qwen_image_edit", 4.0, 16), ("qwen_image_edit_plus", 4.0, 16),  # nor Qwen-Image-Edit: the pipeline's default
    ("krea2", 3.5, 16),
    ("ernie_image", 4.0, 16)])
def test_sample_sides_are_on_the_familys_grid_and_guidance_defaults_to_onetrainers(family, guidance, grid):
    decoder = {"decoder": "d"} if family in ("stable_cascade", "wuerstchen_v2") else {}
    raw = {"model": {"family": family, "path": "m", **decoder}, "method": "lora", "output_dir": "out",
           "data": {"path": "data"}, "resolution": 512}

    def sampled(*prompts):
        return validate({**raw, "sampling": {"prompts": list(prompts)}}).sampling.prompts

    assert [p.guidance_scale for p in sampled(RED, {**RED, "guidance_scale": 2.0})] == [guidance, 2.0]
    off_grid = {**RED, "height": 56}  # a multiple of 8, not of 16
    if grid == 8:
        assert sampled(RED, off_grid)[1].height == 56
    else:
        with pytest.raises(ConfigError, match=rf"sampling.prompts\[1\].height: 56 is not a multiple of {grid}, the "
                                              rf"pixel grid of {family} samples; use 64"):
            sampled(RED, off_grid)


def test_a_negative_prompt_flux_would_ignore_is_an_error():
    """FluxPipeline uses negative_prompt only with true_cfg_scale > 1 (Flux.1 dev samples with its distilled guidance):
    a Flux prompt's negative prompt is refused instead of dropped in silence; Chroma's true CFG takes it."""
    raw = {"model": {"family": "flux", "path": "m"}, "method": "lora", "output_dir": "out", "data": {"path": "data"},
           "resolution": 512, "sampling": {"prompts": [RED, BLUE]}}
    with pytest.raises(ConfigError, match=r"sampling.prompts\[1\].negative_prompt: flux samples without "
                                          "classifier-free guidance"):
        validate(raw)
    raw["model"]["family"] = "chroma"
    assert validate(raw).sampling.prompts[1].negative_prompt == "red"


# OneTrainer's NoiseScheduler values (create_noise_scheduler) as diffusers schedulers on the model's scheduler config.
DDPM_SCHEDULERS = {
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "dpmpp_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "euler_karras": ("EulerDiscreteScheduler", {"use_karras_sigmas": True}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpmpp_sde_karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}),
    "unipc_karras": ("UniPCMultistepScheduler", {"use_karras_sigmas": True}),
}


def test_each_prompts_sampler_and_guidance_rescale_equal_the_diffusers_pipeline(ema_run, tmp_path, monkeypatch):
    """Every sampler of the family, each on its own prompt in one sampling point, and a guidance rescale: the image
    diffusers' pipeline draws from the exported (EMA) weights with that scheduler, seed and guidance_rescale."""
    trainer, _, out = ema_run
    assert set(trainer.model.family.samplers) == set(DDPM_SCHEDULERS)  # OneTrainer's ten, for SD 1.x
    prompt = {**BLUE, "steps": 3}  # 2 steps: Karras sigmas and linear ones are the same two
    cases = [(name, None) for name in DDPM_SCHEDULERS] + [("ddim", 0.5), ("dpmpp_sde_karras", 1.0)]
    monkeypatch.setattr(trainer.sampler, "output_dir", tmp_path)
    monkeypatch.setattr(trainer.config.sampling, "prompts", [
        SamplePrompt(**prompt, sampler=name, guidance_rescale=rescale) for name, rescale in cases])
    written = trainer.sampler.sample(trainer, 8)
    images = [pixels(path) for path in written]
    assert len(images) == len(cases)
    for (name, rescale), image in zip(cases, images):
        scheduler, options = DDPM_SCHEDULERS[name]
        expected = draw(diffusers_pipeline(out / "model_ema", scheduler, **options), prompt,
                        **({} if rescale is None else {"guidance_rescale": rescale}))
        assert np.array_equal(image, expected), (name, rescale)
    # other samplers and rescales, other images (the comparisons above tell them apart)
    assert len({image.tobytes() for image in images}) == len(cases)
    # a prompt without a sampler takes sampling.sampler; a prompt's auto is the family's first (ddim)
    monkeypatch.setattr(trainer.config.sampling, "sampler", "euler")
    assert [trainer.sampler.sampler_of(SamplePrompt(**prompt, sampler=name)) for name in (None, "auto", "unipc")] == [
        "euler", "ddim", "unipc"]


def test_per_prompt_sampler_and_guidance_rescale_only_where_the_family_takes_them():
    """A prompt's sampler must fit the family's objective, and guidance_rescale needs a pipeline that takes it (SD 1.x
    / 2.x / SDXL): otherwise a config error naming the prompt, not a failure at the first sampling point."""
    def config(family, **prompt):
        return validate({"model": {"family": family, "path": "m"}, "method": "lora", "output_dir": "out",
                         "data": {"path": "data"}, "resolution": 512, "sampling": {"prompts": [RED, {**RED, **prompt}]}})

    assert config("sdxl", sampler="dpmpp_sde_karras", guidance_rescale=0.7).sampling.prompts[1].sampler == (
        "dpmpp_sde_karras")
    assert config("pixart_sigma", sampler="euler_karras").sampling.prompts[1].sampler == "euler_karras"
    assert config("flux", sampler="flow_euler", guidance_rescale=0.0).sampling.prompts[1].sampler == "flow_euler"
    with pytest.raises(ConfigError, match=r"sampling.prompts\[1\].sampler: ddim does not fit flux \(allowed: auto, "
                                          r"flow_euler\)"):
        config("flux", sampler="ddim")
    with pytest.raises(ConfigError, match=r"sampling.prompts\[1\].guidance_rescale: pixart_sigma's pipeline "
                                          r"\(PixArtSigmaPipeline\) has no guidance_rescale"):
        config("pixart_sigma", guidance_rescale=0.7)
    with pytest.raises(ConfigError, match=r"sampling.prompts.1.guidance_rescale"):  # 0 (off) to 1 (fully rescaled)
        config("sd1", guidance_rescale=1.5)
    with pytest.raises(ConfigError, match=r"sampling.prompts.1.sampler"):
        config("sd1", sampler="heun")


@pytest.mark.parametrize("family,method", [("sd1", "lora"), ("flux", "full"), ("z_image", "full"), ("anima", "full"),
                                           ("wuerstchen_v2", "full")])
def test_float8_stored_weights_sample(family, method, family_models, shapes_data, tmp_path):
    """weight_dtype float8: the pipelines take their latents' and embeddings' dtype from a module's `.dtype`, which
    would read the stored float8 parameters (no float8 randn / mul / div). The stored components report the compute
    dtype (a LoRA's float8 base in the trained copy too, and frozen text encoders / VAE), from placement on; that
    training computes the same bits for it is tests/test_float8_dtype.py's. SD 1.x (UNet, CLIP), Flux (CLIP + T5),
    Z-Image and Anima (Qwen3 encoders), and Würstchen v2, whose frozen decoder stages only sampling runs
    (Family.sampling_modules)."""
    from ot_dist.memory.float8 import COMPUTE_DTYPE_ATTR, FLOAT8

    size, prompt, decoder = 64, RED, {}
    if family == "wuerstchen_v2":  # 128 px buckets; its decoder stages beside the tiny prior
        size, prompt = 128, {**RED, "width": 128, "height": 128}
        decoder = {"model.decoder": str(family_models[family] / "decoder_stages")}

    def config(output_dir, **sampled):
        return validate(base_config(family_models[family], shapes_data, output_dir, family=family, method=method,
                                    batch_size=2, max_steps=2, resolution=size, weight_dtype="float8", **decoder,
                                    **sampled))

    plain = Trainer(config(tmp_path / "plain"), log=quiet).train()
    trainer = Trainer(config(tmp_path / "o", **{"sampling.prompts": [prompt], "sampling.every_n_steps": 1}), log=quiet)
    assert trainer.train().losses == plain.losses  # the step after a sample trains as without one
    for step in (1, 2):
        assert pixels(tmp_path / "o" / "samples" / f"step-{step}" / FILES[0]).shape == (size, size, 3)
    model = trainer.model
    components = [*model.pipeline.components.values(), *model.family.sampling_modules(model.pipeline)]
    stored = [m for m in components if getattr(m, COMPUTE_DTYPE_ATTR, None)]
    # Each stored component reports the compute dtype, also where its first parameter is the float8 storage.
    assert all(m.dtype == getattr(m, COMPUTE_DTYPE_ATTR) for m in stored)
    assert any(next(p.dtype for p in m.parameters() if p.is_floating_point()) == FLOAT8 for m in stored)
