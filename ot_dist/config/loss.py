"""The `loss` and `masked_training` sections: what the training objective weights and how it draws
timesteps and noise. Every option is off by default, and off means the objective of a run without
the section, bit for bit (ot_dist/train/loss_options.py, ot_dist/train/masking.py)."""

from __future__ import annotations

import math

from typing import Literal

from pydantic import Field, model_validator

from ot_dist.config.section import Section


# OneTrainer's TimestepDistribution: the continuous ones (uniform, logit_normal, heavy_tail) draw u in [0, 1] that is
# spread over the range and shifted; the weighted ones pick a timestep of the range by weights with the shift built in
# (ot_dist/train/timestep_distributions.py)
WEIGHTED_DISTRIBUTIONS = ("sigmoid", "cos_map", "inverted_parabola")
# which of OneTrainer's noising_weight / noising_bias each distribution reads
SHAPE_FIELDS = {"sigmoid": ("noising_weight", "noising_bias"), "heavy_tail": ("noising_weight",),
                "inverted_parabola": ("noising_weight", "noising_bias")}
# Where the heavy-tail map 1 - u - s (cos^2(pi u / 2) - 1 + u) is a decreasing bijection of [0, 1] (Esser et al.
# 2024, "Scaling Rectified Flow Transformers", section 3.1, mode sampling); outside it the draw leaves the range.
HEAVY_TAIL_SCALES = (-1.0, 2.0 / (math.pi - 2.0))


class LossConfig(Section):
    """Loss weighting, noise and timestep options (OneTrainer's), each off by default."""

    min_snr_gamma: float | None = Field(
        default=None, gt=0,
        description="Min-SNR-gamma weighting (Hang et al. 2023), e.g. 5: each sample's loss is multiplied by "
        "min(SNR, gamma) / SNR (epsilon prediction) or min(SNR, gamma) / (SNR + 1) (v-prediction), SNR of its "
        "timestep = alphas_cumprod / (1 - alphas_cumprod). null = off.",
    )
    weight_fn: Literal["CONSTANT", "MIN_SNR_GAMMA", "P2", "DEBIASED_ESTIMATION", "SIGMA"] = Field(
        default="CONSTANT",
        description="Timestep loss weighting, OneTrainer's loss_weight_fn with its formulas (SNR = alphas_cumprod / "
        "(1 - alphas_cumprod), + 1 for v-prediction where marked): MIN_SNR_GAMMA min(SNR, s) / SNR(+1); P2 "
        "(1 + SNR(+1))^-s; DEBIASED_ESTIMATION 1 / sqrt(min(SNR, 1000)(+1)) (DDPM families); SIGMA the sample's "
        "noise level sigma (flow-matching families). s = weight_strength. loss.min_snr_gamma: g is MIN_SNR_GAMMA "
        "with strength g.",
    )
    weight_strength: float | None = Field(
        default=None, gt=0,
        description="Strength s of MIN_SNR_GAMMA (gamma) and P2 (the exponent); default 5.0 (OneTrainer's "
        "loss_weight_strength).",
    )
    generalized_offset_noise: bool = Field(
        default=False,
        description="Generalized offset noise (Kutsuna 2025, OneTrainer's generalized_offset_noise): the offset is "
        "scaled by psi_t, from the DDPM betas (balanced phi_t, psi_t strategy), instead of a constant. Needs "
        "offset_noise_weight > 0 and a DDPM family.",
    )
    offset_noise_weight: float = Field(
        default=0.0, ge=0,
        description="Offset noise: weight x one N(0,1) value per sample and channel is added to the noise "
        "(learns very dark / bright images). 0 = off; 0.05-0.1 is usual.",
    )
    input_perturbation: float = Field(
        default=0.0, ge=0,
        description="Input perturbation (Ning et al. 2023): the noisy input is made with noise + gamma x N(0,1) "
        "while the target stays the noise. 0 = off; 0.1 is usual.",
    )
    min_timestep: int = Field(default=0, ge=0, description="Smallest timestep trained (inclusive).")
    max_timestep: int | None = Field(
        default=None, ge=0,
        description="Largest timestep trained (inclusive); null = the scheduler's last (num_train_timesteps - 1).",
    )
    timestep_distribution: Literal["auto", "uniform", "logit_normal", "heavy_tail", "sigmoid", "cos_map",
                                   "inverted_parabola"] = Field(
        default="auto",
        description="How timesteps are drawn in [min_timestep, max_timestep] (OneTrainer's timestep_distribution, "
        "w = noising_weight, b = noising_bias). Continuous ones draw u in [0, 1], spread over the range, then "
        "shifted (timestep_shift; a flow family's shift): uniform; logit_normal: sigmoid of N(logit_normal_mean, "
        "logit_normal_std), concentrating on the middle of the range (SD3's choice); heavy_tail: 1 - u - w "
        "(cos^2(pi u / 2) - 1 + u) of a uniform u (SD3 paper's mode sampling; w in [-1, 1.75], 0 = uniform). "
        "Weighted ones pick one of the range's timesteps by a weight over x = 0 .. 1 across the range, the shift k "
        "built into the weights (read at the inverse shift, times its derivative): sigmoid 1 / (1 + exp(-w (x - 0.5 "
        "- b))); cos_map 2 / (pi (1 - 2 x + 2 x^2)) (Esser et al.'s CosMap); inverted_parabola max(0, 2 - w (x - 0.5 "
        "- b)^2). auto: uniform for DDPM families (SD 1.x / 2.x / SDXL), logit_normal for flow-matching ones (SD3, "
        "Flux, Chroma), as their training scripts do; a flow family's shift is applied after the draw.",
    )
    noising_weight: float | None = Field(
        default=None, allow_inf_nan=False,
        description="OneTrainer's noising_weight, the shape w of timestep_distribution sigmoid (steepness), "
        "heavy_tail (scale, in [-1, 2 / (pi - 2)]) and inverted_parabola (curvature); null = 0. logit_normal takes "
        "logit_normal_std instead (OneTrainer's noising_weight + 1).",
    )
    noising_bias: float | None = Field(
        default=None, allow_inf_nan=False,
        description="OneTrainer's noising_bias, the centre 0.5 + b of timestep_distribution sigmoid and "
        "inverted_parabola over the range; null = 0. logit_normal takes logit_normal_mean instead (OneTrainer's "
        "noising_bias).",
    )
    vb_loss_strength: float | None = Field(
        default=None, ge=0,
        description="Weight of the variational-bound (VB) loss that trains a learned variance output (PixArt-α / Σ: "
        "the second half of the transformer's 8 output channels; ot_dist/models/learned_variance.py), added to the "
        "epsilon MSE. null = the family's default: 1.0 for PixArt, as OneTrainer (vb_loss_strength); 0 = off (the "
        "variance channels then do not train). Families without a variance output ignore it.",
    )
    timestep_shift: Literal["auto"] | float = Field(
        default="auto",
        description="Flow-matching families (SD3, Flux, Chroma): the shift k applied to each drawn time u, sigma = "
        "k u / (1 + (k - 1) u), as OneTrainer's timestep_shift (whose default 1.0 is no shift). auto: the model "
        "scheduler's shift (SD3 / 3.5: 3.0; Flux.1 dev: its resolution-dependent one). An explicit value is a fixed "
        "shift, also for Flux, unless dynamic_timestep_shifting is true. DDPM families (SD 1.x / 2.x / SDXL, "
        "PixArt) and Würstchen / Stable Cascade (over its 10000 steps), as OneTrainer: a continuous t drawn in "
        "[min_timestep, max_timestep + 1) becomes N k t / ((k - 1) t + N), floored (the bounds move with the shift); "
        "auto and 1.0 = unshifted.",
    )
    dynamic_timestep_shifting: Literal["auto"] | bool = Field(
        default="auto",
        description="Flow-matching families: true = the resolution-dependent shift k = e^mu, mu interpolated in the "
        "number of image tokens between the scheduler config's base_shift and max_shift (diffusers' defaults 0.5 / "
        "1.15 over 256 .. 4096 tokens where it has none), as OneTrainer's dynamic_timestep_shifting and diffusers' "
        "calculate_shift; false = the fixed shift (timestep_shift, auto: the scheduler's `shift`); auto = as the "
        "scheduler config says (use_dynamic_shifting), fixed when timestep_shift is a number. Refused for the other "
        "families (OneTrainer's setups of those ignore it).",
    )
    scaler: Literal["NONE", "BATCH", "GLOBAL_BATCH", "GRADIENT_ACCUMULATION", "BOTH", "GLOBAL_BOTH"] = Field(
        default="NONE",
        description="OneTrainer's loss_scaler: the loss that is backpropagated is multiplied by a constant, so the "
        "gradient is closer to a sum over samples than a mean: BATCH batch_size (per process, as OneTrainer's), "
        "GLOBAL_BATCH batch_size x processes, GRADIENT_ACCUMULATION gradient_accumulation_steps, BOTH batch_size x "
        "gradient_accumulation_steps, GLOBAL_BOTH the global batch (batch_size x accumulation x processes). The "
        "GLOBAL ones give the same update for the same global batch at any number of processes; BATCH and BOTH "
        "change with the split (a warning says so). Scales the gradients (plain SGD's step, the gradient norm that "
        "clip_grad_norm compares), not the logged loss. NONE = off.",
    )
    mse_strength: float = Field(
        default=1.0, ge=0, allow_inf_nan=False,
        description="Weight of the squared error (prediction - target)^2 in the per-element loss, OneTrainer's "
        "mse_strength (kohya's / diffusers' loss_type l2). The per-element loss is the sum of the *_strength terms, "
        "each over the same prediction and target (the family's epsilon, v or flow target); masks, loss.weight_fn, "
        "concept loss weights and loss.scaler then weigh it as they weigh the squared error. 1 with the others 0 "
        "(the defaults) is the plain MSE, bit for bit.",
    )
    mae_strength: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="Weight of the absolute error |prediction - target| (OneTrainer's mae_strength; kohya's loss_type "
        "l1). 0 = off.",
    )
    log_cosh_strength: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="Weight of log(cosh(prediction - target)), computed as OneTrainer's log_cosh_strength: d + "
        "softplus(-2 d) - log 2. 0 = off.",
    )
    huber_strength: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="Weight of the Huber loss with threshold huber_delta (OneTrainer's huber_strength, "
        "torch.nn.functional.huber_loss): d^2 / 2 where |d| <= delta, delta (|d| - delta / 2) beyond. 0 = off.",
    )
    huber_delta: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="The Huber loss threshold delta (OneTrainer's huber_delta); null = 1.0. Needs huber_strength.",
    )
    pseudo_huber_strength: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="Weight of kohya's / diffusers' scheduled pseudo-Huber loss (loss_type huber / smooth_l1, "
        "pseudo_huber_form): 2 c (sqrt(d^2 + c^2) - c) (huber) or 2 (sqrt(d^2 + c^2) - c) (smooth_l1), the "
        "threshold c per sample from pseudo_huber_schedule. 0 = off.",
    )
    pseudo_huber_form: Literal["huber", "smooth_l1"] | None = Field(
        default=None,
        description="kohya's loss_type of the pseudo-Huber term: huber 2 c (sqrt(d^2 + c^2) - c), about d^2 for "
        "small d and 2 c |d| for large; smooth_l1 the same divided by c, about d^2 / c and 2 |d|. null = huber. "
        "Needs pseudo_huber_strength.",
    )
    pseudo_huber_schedule: Literal["constant", "exponential", "snr"] | None = Field(
        default=None,
        description="kohya's huber_schedule, the threshold c of a sample at timestep t (C = pseudo_huber_c, "
        "S = pseudo_huber_scale, N = the scheduler's num_train_timesteps): constant C S; exponential "
        "exp(-alpha t) S with alpha = -ln(C) / N, i.e. S C^(t / N) (S at t = 0, C S at t = N; a flow family's t is "
        "sigma N, so S C^sigma, as kohya's Flux / SD3 scripts; Würstchen's continuous t is its own fraction); snr "
        "(1 - C) / (1 + sigma)^2 + C with sigma = sqrt((1 - alpha-bar_t) / alpha-bar_t) from the DDPM schedule "
        "(S unused, as kohya; refused for flow-matching families, where kohya's scripts stop too). null = snr, "
        "kohya's and diffusers' default. Needs pseudo_huber_strength.",
    )
    pseudo_huber_c: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="kohya's huber_c, the schedule's C; null = 0.1 (kohya's default). Needs pseudo_huber_strength.",
    )
    pseudo_huber_scale: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="kohya's huber_scale, the schedule's S (constant, exponential); null = 1.0. Needs "
        "pseudo_huber_strength.",
    )
    logit_normal_mean: float = Field(default=0.0, description="Mean of the normal under the sigmoid (logit_normal).")
    logit_normal_std: float = Field(default=1.0, gt=0, description="Std of the normal under the sigmoid (logit_normal).")

    @model_validator(mode="after")
    def _range(self) -> "LossConfig":
        if self.min_snr_gamma is not None and self.weight_fn not in ("CONSTANT", "MIN_SNR_GAMMA"):
            raise ValueError(f"loss.min_snr_gamma: is weight_fn MIN_SNR_GAMMA; it cannot go with weight_fn "
                             f"{self.weight_fn}")
        if self.weight_strength is not None and self.weight_fn not in ("MIN_SNR_GAMMA", "P2"):
            raise ValueError(f"loss.weight_strength: weight_fn {self.weight_fn} takes no strength (MIN_SNR_GAMMA "
                             "and P2 do)")
        if self.generalized_offset_noise and not self.offset_noise_weight:
            raise ValueError("loss.generalized_offset_noise: scales the offset noise; set loss.offset_noise_weight > 0")
        if self.timestep_shift != "auto" and not 0 < self.timestep_shift < math.inf:
            raise ValueError(f"loss.timestep_shift: {self.timestep_shift} must be a finite number > 0 (1.0 = no shift) or auto")
        if self.dynamic_timestep_shifting is True and self.timestep_shift != "auto":
            raise ValueError(f"loss.timestep_shift: {self.timestep_shift} is a fixed shift, but "
                             "loss.dynamic_timestep_shifting: true computes the shift from the resolution; leave "
                             "timestep_shift at auto (or set dynamic_timestep_shifting: false)")
        self._check_distribution_shape()
        self._check_loss_functions()
        if self.max_timestep is not None and self.max_timestep < self.min_timestep:
            raise ValueError(f"loss.max_timestep ({self.max_timestep}) is below loss.min_timestep ({self.min_timestep})")
        return self

    def _check_distribution_shape(self) -> None:
        """noising_weight / noising_bias only where the distribution reads them, and values it can draw with."""
        distribution = self.timestep_distribution
        takes = SHAPE_FIELDS.get(distribution, ())
        for name in ("noising_weight", "noising_bias"):
            if getattr(self, name) is not None and name not in takes:
                users = ", ".join(d for d, fields in SHAPE_FIELDS.items() if name in fields)
                instead = {"noising_weight": " (its std is logit_normal_std, OneTrainer's noising_weight + 1)",
                           "noising_bias": " (its mean is logit_normal_mean, OneTrainer's noising_bias)"}
                raise ValueError(f"loss.{name}: timestep_distribution {distribution} does not use it"
                                 f"{instead[name] if distribution == 'logit_normal' else ''}; {users} do")
        weight, bias = self.noising_weight or 0.0, self.noising_bias or 0.0
        low, high = HEAVY_TAIL_SCALES
        if distribution == "heavy_tail" and not low <= weight <= high:
            raise ValueError(f"loss.noising_weight: {weight} is outside [-1, {high:.4f}], where heavy_tail's "
                             "1 - u - w (cos^2(pi u / 2) - 1 + u) maps [0, 1] onto itself (beyond it timesteps "
                             "leave the range)")
        # the weights over x in [0, 1] (0 and 1 always among them): a centre outside with nothing above 0 there
        outside = max(0.0, -(0.5 + bias), (0.5 + bias) - 1.0)
        if distribution == "inverted_parabola" and weight > 0 and 2 - weight * outside ** 2 <= 0:
            raise ValueError(f"loss.noising_bias: {bias} puts inverted_parabola's centre 0.5 + b so far outside the "
                             f"range that max(0, 2 - {weight} (x - 0.5 - b)^2) is 0 on all of it; move it towards 0 "
                             "or lower loss.noising_weight")

    def _check_loss_functions(self) -> None:
        """Some loss function on, and no threshold setting without the loss it shapes."""
        strengths = ("mse_strength", "mae_strength", "log_cosh_strength", "huber_strength", "pseudo_huber_strength")
        if not any(getattr(self, name) for name in strengths):
            raise ValueError(f"loss: {', '.join(strengths)} are all 0: nothing would train (mse_strength: 1 is the "
                             "default)")
        for name, strength in (("huber_delta", "huber_strength"), *((f"pseudo_huber_{key}", "pseudo_huber_strength")
                                                                     for key in ("form", "schedule", "c", "scale"))):
            if getattr(self, name) is not None and not getattr(self, strength):
                raise ValueError(f"loss.{name}: shapes the loss that loss.{strength} weighs, which is 0; set "
                                 f"{strength} or remove {name}")
        if self.pseudo_huber_scale is not None and self.pseudo_huber_threshold()[0] == "snr":
            raise ValueError("loss.pseudo_huber_scale: the snr schedule (the default) does not read it (kohya's "
                             "neither); use pseudo_huber_schedule constant or exponential, or remove it")

    def pseudo_huber_threshold(self) -> tuple[str, float, float]:
        """(schedule, C, S) of the pseudo-Huber threshold, kohya's defaults filled in."""
        return (self.pseudo_huber_schedule or "snr", 0.1 if self.pseudo_huber_c is None else self.pseudo_huber_c,
                1.0 if self.pseudo_huber_scale is None else self.pseudo_huber_scale)

    def plain_mse(self) -> bool:
        """The loss is the squared error alone, weight 1 (the defaults)."""
        return (self.mse_strength == 1.0 and not self.mae_strength and not self.log_cosh_strength
                and not self.huber_strength and not self.pseudo_huber_strength)

    def scale(self, batch_size: int, accumulation: int, processes: int) -> int:
        """The factor loss.scaler puts on the backpropagated loss (OneTrainer's LossScaler.get_scale, whose
        batch_size is the per-process one and whose GLOBAL_ variants multiply by the world size)."""
        return {"NONE": 1, "BATCH": batch_size, "GLOBAL_BATCH": batch_size * processes,
                "GRADIENT_ACCUMULATION": accumulation, "BOTH": batch_size * accumulation,
                "GLOBAL_BOTH": batch_size * accumulation * processes}[self.scaler]

    def weighting(self) -> tuple[str, float]:
        """(weight function, strength), min_snr_gamma folded in."""
        if self.min_snr_gamma is not None:
            return "MIN_SNR_GAMMA", self.min_snr_gamma
        return self.weight_fn, 5.0 if self.weight_strength is None else self.weight_strength


class MaskedTrainingConfig(Section):
    """Masked training (OneTrainer's): learn only where each image's mask (`a-masklabel.png` beside
    `a.png`; white = learn, black = ignore) is white. The mask follows the image through the bucket
    resize and crop and is scaled to latent resolution (area average); each latent element's loss is
    weighted by the mask clamped to [unmasked_weight, 1], as OneTrainer weights it."""

    enabled: bool = Field(default=False, description="Train with the masks (OneTrainer: masked_training).")
    unmasked_probability: float = Field(
        default=0.1, ge=0, le=1,
        description="Probability that a sample trains without its mask on a step (drawn per sample, epoch and "
        "seed: the same on any rank or batch split).",
    )
    unmasked_weight: float = Field(
        default=0.1, ge=0, le=1, description="Loss weight of the masked-out (black) area; 0 = it is ignored."
    )
    normalize_masked_area_loss: bool = Field(
        default=False,
        description="Divide each sample's loss by the mean of its weights (the mask's area, the rest counted at "
        "unmasked_weight), as OneTrainer: a small mask then counts as much as a large one. Raises the loss for "
        "masks well under the whole image. A sample with nothing to learn (black mask, unmasked_weight 0) adds 0.",
    )
    prior_preservation_weight: float = Field(
        default=0.0, ge=0,
        description="OneTrainer's masked_prior_preservation_weight (method lora): outside the mask the prediction is "
        "also pulled towards the model's own without the LoRA, with this weight x (1 - the clamped mask), so the "
        "background keeps what the base model does. Costs one more denoiser forward per micro batch (no "
        "gradients). 0 = off.",
    )
    missing_mask: Literal["error", "unmasked"] = Field(
        default="error",
        description="An image without a mask: error = stop before training, naming it; unmasked = train it on the "
        "whole image.",
    )

