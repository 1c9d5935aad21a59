"""The `sampling` section: images generated with the model being trained, at set steps / epochs and
at the end (ot_dist/train/sampling.py), written under output_dir/samples/ and logged to MLflow."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ot_dist.config.section import Section

# Sampler name -> (diffusers scheduler class, config entries it is given), made from the model's own scheduler config
# (its betas, spacing, offsets and prediction type, as diffusers' `Scheduler.from_config(pipe.scheduler.config)`), so
# a v-prediction model samples as one. The entries set what the name promises whatever the model's config says (a
# DPMSolver config with use_karras_sigmas or the SDE variant stays what the name says). The DDPM samplers are
# OneTrainer's NoiseScheduler choices (modules/util/create.py create_noise_scheduler).
KARRAS = {"use_karras_sigmas": True}
PLAIN = {"use_karras_sigmas": False}
SAMPLERS: dict[str, tuple[str, dict]] = {
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", PLAIN),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {**PLAIN, "algorithm_type": "dpmsolver++"}),
    "dpmpp_sde": ("DPMSolverMultistepScheduler", {**PLAIN, "algorithm_type": "sde-dpmsolver++"}),
    "unipc": ("UniPCMultistepScheduler", PLAIN),
    "euler_karras": ("EulerDiscreteScheduler", KARRAS),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {**KARRAS, "algorithm_type": "dpmsolver++"}),
    "dpmpp_sde_karras": ("DPMSolverMultistepScheduler", {**KARRAS, "algorithm_type": "sde-dpmsolver++"}),
    "unipc_karras": ("UniPCMultistepScheduler", KARRAS),
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}),  # flow-matching families (SD3, Flux, Chroma)
    # Würstchen's continuous cosine schedule (Stable Cascade, Würstchen v2)
    "wuerstchen": ("DDPMWuerstchenScheduler", {}),
}
# The samplers of a DDPM (epsilon / v) family, in OneTrainer's NoiseScheduler order.
DDPM_SAMPLERS = ("ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_sde", "unipc", "euler_karras", "dpmpp_2m_karras",
                 "dpmpp_sde_karras", "unipc_karras")
SamplerName = Literal["ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_sde", "unipc", "euler_karras", "dpmpp_2m_karras",
                      "dpmpp_sde_karras", "unipc_karras", "flow_euler", "wuerstchen"]
SAMPLER_HELP = ("ddim, euler, euler_a, dpmpp_2m, dpmpp_sde (DPM++ SDE: DPMSolverMultistepScheduler's sde-dpmsolver++), "
                "unipc and their Karras-sigma forms euler_karras, dpmpp_2m_karras, dpmpp_sde_karras, unipc_karras "
                "(OneTrainer's DDIM ... UNIPC_KARRAS) for SD 1.x / 2.x / SDXL / PixArt; flow_euler for SD3 / Flux / "
                "Chroma / Sana; wuerstchen for Stable Cascade / Würstchen v2")


class SamplePrompt(Section):
    """One sample image: what to draw and how."""

    prompt: str = Field(min_length=1, description="The prompt. With method embedding, write the embedding's token "
                        "where it belongs (as in a prompt for the exported embedding).")
    negative_prompt: str = Field(default="", description="What the image should not show (classifier-free guidance; "
                                 "not for Flux.1, whose pipeline samples without it).")
    seed: int = Field(default=42, ge=0, description="Seed of the starting noise: same seed and weights, same image.")
    width: int | None = Field(default=None, description="Width in pixels, a multiple of the family's pixel grid (8; "
                              "16 for SD3, Flux, Chroma, PixArt); null = the (largest) training resolution.")
    height: int | None = Field(default=None, description="Height in pixels, a multiple of the family's pixel grid "
                               "(8; 16 for SD3, Flux, Chroma, PixArt); null = the (largest) training resolution.")
    steps: int = Field(default=20, ge=1, description="Denoising steps. 20 for every family: a preview's cost, and "
                       "enough for the default samplers; OneTrainer's sample defaults are 30 (SD 1.x / 2.x / SDXL, "
                       "Flux, Chroma), 28 (SD3), 25 (PixArt, Stable Cascade), the diffusers pipelines' 50 (SD, SDXL), "
                       "28 (SD3, Flux), 35 (Chroma), 20 (PixArt). `ot-dist import onetrainer` writes OneTrainer's.")
    guidance_scale: float | None = Field(
        default=None, ge=0, description="Classifier-free guidance scale (1 or less = off; Flux.1 dev: its distilled "
        "guidance). null = OneTrainer's sample default for the family: 7.5 SD 1.x / 2.x / SDXL, 7.0 SD3, 3.5 Flux / "
        "Chroma, 4.5 PixArt, 4.0 Stable Cascade / Würstchen v2; 2.5 Flux.1 Kontext (its pipeline's example).")
    sampler: Literal["auto", SamplerName] | None = Field(
        default=None, description="This prompt's sampler, one the family's objective allows (the names of "
        "sampling.sampler; auto = the family's first); null = sampling.sampler.")
    reference_image: str | list[str] | None = Field(
        default=None, description="An edit model's reference image (flux_kontext, flux2, flux2_klein, qwen_image_edit, "
        "qwen_image_edit_plus): the picture the prompt's edit applies to, scaled to cover the sample's size and "
        "centre-cropped, as training pairs' references are. Other families refuse it; without one an edit model samples "
        "from the prompt alone (qwen_image_edit needs one: its pipeline scales it to 1024^2 pixels itself). A list "
        "gives several, in order (Picture 1, Picture 2, ...: the pipelines' image=[...]), up to the family's most: "
        "flux2 / flux2_klein 10, qwen_image_edit_plus 3, the others 1.")
    guidance_rescale: float | None = Field(
        default=None, ge=0, le=1, description="Rescales the guided prediction toward the standard deviation of the "
        "prompt's own (Lin et al. 2023, section 3.4; diffusers' guidance_rescale, OneTrainer's cfg_rescale): 0 = off, "
        "0.7 the paper's choice. SD 1.x / 2.x / SDXL only (their pipelines take it; another family's refuse it). null = "
        "OneTrainer's: 0.7 on a zero-terminal-SNR schedule (model.zero_terminal_snr), else 0.")

    def reference_images(self) -> list[str]:
        """The prompt's reference images in order: none, one, or the list given."""
        given = self.reference_image
        return [] if given is None else [given] if isinstance(given, str) else list(given)


class SamplingConfig(Section):
    """Samples during training: every prompt is generated with the weights being trained (the EMA weights
    when the EMA is on, unless use_ema is false), with LoRA adapters / embeddings active. Under sharded
    strategies the full weights are gathered once per sampling point and the prompts are spread over the
    ranks (prompt i on rank i mod world size). Images go to output_dir/samples/step-N/I-PROMPT.png and to
    the MLflow run's artifacts (samples/step-N/, and per step in its image view, key samples/I-PROMPT). Sampling leaves the training random stream alone: a run
    with samples has the same losses as one without."""

    prompts: list[SamplePrompt] = Field(default_factory=list, description="The sample prompts (see below).")
    every_n_steps: int | None = Field(default=None, ge=1, description="Sample after every N optimizer steps.")
    every_n_epochs: int | None = Field(default=None, ge=1, description="Sample after every N epochs.")
    at_end: bool | None = Field(default=None, description="Sample after the last step; null = true when there are "
                                "prompts.")
    use_ema: bool = Field(default=True, description="Sample with the EMA weights when ema.enabled; false = the "
                          "trained weights.")
    non_ema_samples: bool = Field(
        default=False, description="With ema.enabled and use_ema: also sample the trained (non-EMA) weights at each "
        "sampling point, written beside the EMA samples as I-PROMPT-no-ema.png (OneTrainer's non_ema_sampling, on by "
        "default there; off here, as it doubles the time and the gathering of every sampling point; `ot-dist import "
        "onetrainer` carries OneTrainer's value).")
    sampler: Literal["auto", SamplerName] = Field(
        default="auto", description="The diffusers scheduler that samples (each prompt's `sampler` can name "
        "another), configured from the model's scheduler config as diffusers' from_config does: " + SAMPLER_HELP +
        ". auto = the family's first: ddim for SD 1.x / 2.x / SDXL (OneTrainer's default: EULER_A for SD 1.x and "
        "SDXL, DDIM for SD 2.x and PixArt), dpmpp_2m for PixArt (the scheduler its pipelines ship), flow_euler "
        "(flow-matching Euler) for SD3 / Flux / Chroma / Sana, wuerstchen (DDPMWuerstchenScheduler, the prior's steps) "
        "for Stable Cascade / Würstchen v2. Flow-matching and Würstchen-style families sample with their one sampler.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        for i, prompt in enumerate(self.prompts):  # checked here, where the prompt's index is known
            for key in ("width", "height"):
                value = getattr(prompt, key)
                if value is not None and (value < 8 or value % 8):
                    raise ValueError(f"sampling.prompts[{i}].{key}: {value} is not a multiple of 8 (at least 8); "
                                     "the VAE works in 8x8 pixel blocks")
            if isinstance(prompt.reference_image, list) and not prompt.reference_image:
                raise ValueError(f"sampling.prompts[{i}].reference_image: an empty list; give one image or more, or "
                                 "leave it out (null)")
        if not self.prompts:
            for key in ("every_n_steps", "every_n_epochs"):
                if getattr(self, key) is not None:
                    raise ValueError(f"sampling.{key}: set, but sampling.prompts is empty: nothing to sample")
            if self.at_end:
                raise ValueError("sampling.at_end: true, but sampling.prompts is empty: nothing to sample")
        return self

    def samples_at_end(self) -> bool:
        return bool(self.prompts) if self.at_end is None else self.at_end
