"""The `sampling` section: images generated with the model being trained, at set steps / epochs and
at the end (ot_dist/train/sampling.py), written under output_dir/samples/ and logged to MLflow."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ot_dist.config.section import Section

# Sampler name -> diffusers scheduler class, made from the model's own scheduler config (its betas and
# prediction type), so a v-prediction model samples as one.
SAMPLERS = {
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
    "flow_euler": "FlowMatchEulerDiscreteScheduler",  # flow-matching families (SD3, Flux, Chroma)
    "wuerstchen": "DDPMWuerstchenScheduler",  # Würstchen's continuous cosine schedule (Stable Cascade, Würstchen v2)
}


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
    steps: int = Field(default=20, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(
        default=None, ge=0, description="Classifier-free guidance scale (1 or less = off; Flux.1 dev: its distilled "
        "guidance). null = OneTrainer's sample default for the family: 7.5 SD 1.x / 2.x / SDXL, 7.0 SD3, 3.5 Flux / "
        "Chroma, 4.5 PixArt, 4.0 Stable Cascade / Würstchen v2.")


class SamplingConfig(Section):
    """Samples during training: every prompt is generated with the weights being trained (the EMA weights
    when the EMA is on, unless use_ema is false), with LoRA adapters / embeddings active. Under sharded
    strategies the full weights are gathered once per sampling point and the prompts are spread over the
    ranks (prompt i on rank i mod world size). Images go to output_dir/samples/step-N/I-PROMPT.png and to
    the MLflow run's artifacts (samples/step-N/). Sampling leaves the training random stream alone: a run
    with samples has the same losses as one without."""

    prompts: list[SamplePrompt] = Field(default_factory=list, description="The sample prompts (see below).")
    every_n_steps: int | None = Field(default=None, ge=1, description="Sample after every N optimizer steps.")
    every_n_epochs: int | None = Field(default=None, ge=1, description="Sample after every N epochs.")
    at_end: bool | None = Field(default=None, description="Sample after the last step; null = true when there are "
                                "prompts.")
    use_ema: bool = Field(default=True, description="Sample with the EMA weights when ema.enabled; false = the "
                          "trained weights.")
    sampler: Literal["auto", "ddim", "euler", "euler_a", "dpmpp_2m", "unipc", "flow_euler", "wuerstchen"] = Field(
        default="auto", description="The diffusers scheduler that samples, configured from the model's scheduler. "
        "auto = the family's first: ddim for SD 1.x / 2.x / SDXL, flow_euler (flow-matching Euler) for SD3 / Flux / "
        "Chroma, wuerstchen (DDPMWuerstchenScheduler, the prior's steps) for Stable Cascade / Würstchen v2. Flow-matching "
        "families sample with flow_euler only.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        for i, prompt in enumerate(self.prompts):  # checked here, where the prompt's index is known
            for key in ("width", "height"):
                value = getattr(prompt, key)
                if value is not None and (value < 8 or value % 8):
                    raise ValueError(f"sampling.prompts[{i}].{key}: {value} is not a multiple of 8 (at least 8); "
                                     "the VAE works in 8x8 pixel blocks")
        if not self.prompts:
            for key in ("every_n_steps", "every_n_epochs"):
                if getattr(self, key) is not None:
                    raise ValueError(f"sampling.{key}: set, but sampling.prompts is empty: nothing to sample")
            if self.at_end:
                raise ValueError("sampling.at_end: true, but sampling.prompts is empty: nothing to sample")
        return self

    def samples_at_end(self) -> bool:
        return bool(self.prompts) if self.at_end is None else self.at_end
