"""Training objectives: how a clean latent, its noise and a drawn time become the denoiser's input and
target. No family names inside: a family picks an objective and its convention (ot_dist/models/families/).

- `DDPM`: epsilon or v-prediction over a discrete noise schedule (SD 1.x / 2.x / SDXL, PixArt, ...); its draw
  (and `ContinuousCosine`'s) takes loss.timestep_shift as OneTrainer does (ot_dist/train/loss_options.py).
- `FlowMatching`: rectified flow, x_t = (1 - s) x + s n with target n - x (SD3, Flux, Chroma, ...), where the
  noise level s is a draw u in [0, 1) pushed through the family's shift: a fixed one (SD3: s = k u / (1 + (k - 1) u),
  k = 3) or a resolution-dependent one (Flux: s = e^mu / (e^mu + 1/u - 1), mu interpolated in the number of image
  tokens between base_shift and max_shift); loss.timestep_shift / loss.dynamic_timestep_shifting replace the
  family's shift with OneTrainer's settings. A weighted loss.timestep_distribution (sigmoid, cos_map,
  inverted_parabola) picks a step i of the range with that shift in its weights, s = (i + 1) / N, as OneTrainer.

Every draw comes from the sample's own generator (seed, epoch, sample id), so a sample trains the same in any
batch, on any rank, at any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ot_dist.config.loss import WEIGHTED_DISTRIBUTIONS, LossConfig
from ot_dist.train.loss_functions import pseudo_huber_thresholds
from ot_dist.train.loss_options import (ddpm_weights, draw_timestep, generalized_offset_psi, last_timestep_drawn,
                                       timestep_bounds)
from ot_dist.train.timestep_distributions import unit_draw, weighted_index


class Objective:
    kind: str  # "ddpm" or "flow": what loss options may ask of it
    num_timesteps: int

    def draw(self, g: torch.Generator, options: LossConfig | None, latent_shape: torch.Size) -> torch.Tensor:
        """One sample's time, shape (1,), in the diffusers scheduler's timestep units (0 .. num_timesteps)."""
        raise NotImplementedError

    def noisy(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sample_weights(self, timesteps: torch.Tensor, options: LossConfig) -> torch.Tensor | None:
        """Per-sample loss weights from the options (loss.weight_fn), or None."""
        return None

    def offset_noise_psi(self, timesteps: torch.Tensor, options: LossConfig) -> torch.Tensor | None:
        """Per-sample factor of the offset noise (generalized offset noise), or None for a constant one."""
        return None

    def pseudo_huber_thresholds(self, timesteps: torch.Tensor, options: LossConfig) -> torch.Tensor | None:
        """Each sample's pseudo-Huber threshold c (loss.pseudo_huber_schedule), or None when that loss is off."""
        if not options.pseudo_huber_strength:
            return None
        return pseudo_huber_thresholds(options, self.schedule_time(timesteps), self.num_timesteps,
                                       self.alphas_cumprod_at(timesteps))

    def schedule_time(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The time in [0, num_timesteps] that kohya's exponential threshold reads: the timesteps themselves (a
        flow family's are sigma x N, as kohya's Flux / SD3 scripts pass theirs)."""
        return timesteps

    def alphas_cumprod_at(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Each sample's alpha-bar, None where the objective has no DDPM schedule (flow matching)."""
        return None

    def describe(self) -> str:
        raise NotImplementedError


class DDPM(Objective):
    """Epsilon or v-prediction on a DDPMScheduler built from the model's own scheduler config."""

    kind = "ddpm"

    def __init__(self, scheduler_config: dict, prediction_type: str | None = None):
        from diffusers import DDPMScheduler

        config = dict(scheduler_config)
        if prediction_type is not None:
            config["prediction_type"] = prediction_type
        self.scheduler = DDPMScheduler.from_config(config)
        self.prediction_type = self.scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            from ot_dist.errors import ConfigError

            # `target` knows these two; any other would silently train the epsilon target
            raise ConfigError(f"model.prediction_type: the model's scheduler config says {self.prediction_type!r}; "
                              "ot_dist trains epsilon or v_prediction (set model.prediction_type to the one the "
                              "model predicts)")
        self.num_timesteps = self.scheduler.config.num_train_timesteps

    def draw(self, g, options, latent_shape):
        return draw_timestep(g, self.num_timesteps, options)

    def noisy(self, latents, noise, timesteps):
        return self.scheduler.add_noise(latents, noise, timesteps)

    def target(self, latents, noise, timesteps):
        if self.prediction_type == "v_prediction":
            return self.scheduler.get_velocity(latents, noise, timesteps)
        return noise

    def zero_terminal_snr(self) -> bool:
        """The schedule ends in pure noise (rescale_betas_zero_snr): SNR 0 at the last timestep."""
        return bool(self.scheduler.alphas_cumprod[-1] == 0)

    def sample_weights(self, timesteps, options):
        name, strength = options.weighting()
        if (name == "DEBIASED_ESTIMATION" and self.prediction_type == "epsilon" and self.zero_terminal_snr()
                and last_timestep_drawn(options, self.num_timesteps)):
            from ot_dist.errors import ConfigError

            raise ConfigError("loss.weight_fn: DEBIASED_ESTIMATION weights epsilon prediction by 1 / sqrt(SNR), "
                              "infinite at the last timestep of this model's zero-terminal-SNR schedule (the loss "
                              "would become inf / NaN whenever it is drawn); train with v_prediction, or lower "
                              f"loss.max_timestep so that timestep {self.num_timesteps - 1} is never drawn "
                              f"({self.num_timesteps - 2} without loss.timestep_shift; a shift moves the bound)")
        return ddpm_weights(name, strength, self.scheduler.alphas_cumprod, timesteps, self.prediction_type)

    def offset_noise_psi(self, timesteps, options):
        if not options.generalized_offset_noise:
            return None
        if self.zero_terminal_snr():
            from ot_dist.errors import ConfigError

            # alpha_T = 0 makes the last C_t of Algorithm 1 infinite: psi_t comes out 0 before T and NaN at T
            raise ConfigError("loss.generalized_offset_noise: this model's noise schedule has zero terminal SNR "
                              "(alphas_cumprod at the last timestep is 0), where psi_t is 0 at every timestep but the "
                              "last and undefined there, so no offset would be trained; use loss.offset_noise_weight "
                              "alone (plain offset noise)")
        if getattr(self, "_psi", None) is None:
            self._psi = generalized_offset_psi(self.scheduler.betas)
        return self._psi.to(timesteps.device)[timesteps]

    def alphas_cumprod_at(self, timesteps):
        # the scheduler's float32 table, indexed on the CPU as kohya's get_huber_threshold_if_needed does
        return self.scheduler.alphas_cumprod[timesteps.cpu()]

    def describe(self) -> str:
        return f"{self.prediction_type} prediction, {self.num_timesteps} DDPM timesteps"


@dataclass(frozen=True)
class DynamicShift:
    """Flux's resolution-dependent shift: mu grows linearly with the number of image tokens."""

    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    def mu(self, image_tokens: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return self.base_shift + slope * (image_tokens - self.base_image_seq_len)


class FlowMatching(Objective):
    """Rectified flow with the target n - x (velocity towards the noise), as SD3 / Flux train."""

    kind = "flow"

    def __init__(self, shift: float = 1.0, dynamic: DynamicShift | None = None, num_timesteps: int = 1000,
                 patch_size: int = 1, resolution_shift: DynamicShift | None = None):
        self.shift, self.dynamic, self.num_timesteps = shift, dynamic, num_timesteps
        self.patch_size = patch_size  # latent pixels per image token along each side (Flux packs 2x2)
        # what loss.dynamic_timestep_shifting: true uses, also where the scheduler shifts by a fixed amount
        self.resolution_shift = resolution_shift or dynamic or DynamicShift()

    @classmethod
    def from_scheduler_config(cls, config: dict, patch_size: int = 1, shift: float | None = None,
                              dynamic: bool | None = None) -> "FlowMatching":
        """The shift a FlowMatchEulerDiscreteScheduler config describes (`shift`, or `use_dynamic_shifting` with
        its base / max shift and sequence lengths); `shift` / `dynamic` override it."""
        use_dynamic = config.get("use_dynamic_shifting", False) if dynamic is None else dynamic
        defaults = DynamicShift()
        resolution_shift = DynamicShift(**{k: config.get(k) if config.get(k) is not None else getattr(defaults, k)
                                           for k in ("base_image_seq_len", "max_image_seq_len", "base_shift",
                                                     "max_shift")})
        return cls(shift=config.get("shift", 1.0) if shift is None else shift,
                   dynamic=resolution_shift if use_dynamic else None,
                   num_timesteps=config.get("num_train_timesteps", 1000), patch_size=patch_size,
                   resolution_shift=resolution_shift)

    def image_tokens(self, latent_shape: torch.Size) -> int:
        return (latent_shape[-2] // self.patch_size) * (latent_shape[-1] // self.patch_size)

    def shift_for(self, options: LossConfig) -> tuple[float, DynamicShift | None]:
        """(fixed shift, resolution-dependent shift or None) of a draw: the scheduler's while loss.timestep_shift
        and loss.dynamic_timestep_shifting are auto, else theirs as OneTrainer applies them (an explicit
        timestep_shift is a fixed shift; dynamic true the resolution's)."""
        fixed, dynamic = options.timestep_shift, options.dynamic_timestep_shifting
        if dynamic is True:
            return self.shift, self.resolution_shift
        if dynamic is False or fixed != "auto":
            return (self.shift if fixed == "auto" else fixed), None
        return self.shift, self.dynamic

    def shifted(self, u: torch.Tensor, latent_shape: torch.Size, options: LossConfig | None = None) -> torch.Tensor:
        """The noise level sigma for a uniform-scale draw u in (0, 1)."""
        shift, dynamic = self.shift_for(options or LossConfig())
        if dynamic is not None:
            mu = dynamic.mu(self.image_tokens(latent_shape))
            return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        return shift * u / (1 + (shift - 1) * u)

    def shift_value(self, latent_shape: torch.Size, options: LossConfig) -> float:
        """The shift k of a draw as one number: the fixed one, or e^mu of the resolution's (OneTrainer's
        calculate_timestep_shift)."""
        shift, dynamic = self.shift_for(options)
        return math.exp(dynamic.mu(self.image_tokens(latent_shape))) if dynamic is not None else shift

    def draw(self, g, options, latent_shape):
        options = options or LossConfig()
        low, high = timestep_bounds(options, self.num_timesteps)
        distribution = "logit_normal" if options.timestep_distribution == "auto" else options.timestep_distribution
        if distribution in WEIGHTED_DISTRIBUTIONS:
            # OneTrainer's pick i of the range, its shift in the weights, is the noise level sigma = (i + 1) / N
            index = low + weighted_index(g, options, high + 1 - low, self.shift_value(latent_shape, options))
            sigma = ((index.double() + 1) / self.num_timesteps).clamp(max=1 - 1e-6)  # as the clamp below
            return (sigma * self.num_timesteps).float()
        # u covers [low, high + 1) / num_timesteps: the same share of the range that the integer timesteps
        # low..high cover in DDPM, so min_timestep / max_timestep mean the same thing for both objectives.
        unit = unit_draw(g, distribution, options, torch.float64)
        u = (low + unit * (high + 1 - low)) / self.num_timesteps
        u = u.clamp(min=1e-6, max=1 - 1e-6)  # sigma 0 or 1 exactly has no noise or no signal to learn from
        return (self.shifted(u, latent_shape, options) * self.num_timesteps).float()

    def sigmas(self, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return (timesteps.float() / self.num_timesteps).to(like).view(-1, *([1] * (like.dim() - 1)))

    def noisy(self, latents, noise, timesteps):
        sigma = self.sigmas(timesteps, latents)
        return (1 - sigma) * latents + sigma * noise

    def target(self, latents, noise, timesteps):
        return noise - latents

    def sample_weights(self, timesteps, options):
        if options.weighting()[0] != "SIGMA":
            return None
        return (timesteps.float() / self.num_timesteps)  # the sample's sigma (OneTrainer: (index + 1) / N)

    def describe(self) -> str:
        shift = (f"dynamic shift {self.dynamic.base_shift}..{self.dynamic.max_shift}" if self.dynamic
                 else f"shift {self.shift}")
        return f"flow matching (target noise - latents), {shift}"


def cosine_alpha_cumprod(t: torch.Tensor, s: float = 0.008) -> torch.Tensor:
    """Würstchen's continuous cosine schedule (DDPMWuerstchenScheduler with scaler 1): alpha-bar at t in [0, 1],
    clamped to [1e-4, 0.9999]."""
    t = t.double()
    init = math.cos(s / (1 + s) * math.pi * 0.5) ** 2
    return (torch.cos((t + s) / (1 + s) * math.pi * 0.5) ** 2 / init).clamp(0.0001, 0.9999)


class ContinuousCosine(Objective):
    """Epsilon prediction over Würstchen's continuous time t in (0, 1] (Würstchen v2 / Stable Cascade's stage C).
    The time is OneTrainer's: an integer draw among `num_timesteps` = 10000 steps (so loss.min_timestep /
    max_timestep / timestep_distribution apply as for DDPM), t = (i + 1) / 10000, then `t x scale + offset` clamped
    to [offset, 1] (Stable Cascade: scale 1, Würstchen v2: 1.08; offset 0.001). Timesteps are t itself, the unit
    the prior's `timestep_ratio` and DDPMWuerstchenScheduler use."""

    kind = "ddpm"
    prediction_type = "epsilon"  # the only one DDPMWuerstchenScheduler samples with

    def __init__(self, scale: float = 1.0, offset: float = 0.001, num_timesteps: int = 10000):
        self.scale, self.offset, self.num_timesteps = scale, offset, num_timesteps

    def draw(self, g, options, latent_shape):
        discrete = draw_timestep(g, self.num_timesteps, options)
        t = (discrete.double() + 1) / self.num_timesteps
        return (t * self.scale + self.offset).clamp(self.offset, 1.0).float()

    def _view(self, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return values.to(like.device, like.dtype).view(-1, *([1] * (like.dim() - 1)))

    def noisy(self, latents, noise, timesteps):
        alpha_bar = cosine_alpha_cumprod(timesteps)
        return self._view(alpha_bar.sqrt(), latents) * latents + self._view((1 - alpha_bar).sqrt(), latents) * noise

    def target(self, latents, noise, timesteps):
        return noise

    def sample_weights(self, timesteps, options):
        name, strength = options.weighting()
        # ddpm_weights indexes a table by timestep; here each sample brings its own alpha-bar
        index = torch.arange(timesteps.shape[0], device=timesteps.device)
        return ddpm_weights(name, strength, cosine_alpha_cumprod(timesteps), index, self.prediction_type)

    def offset_noise_psi(self, timesteps, options):
        if options.generalized_offset_noise:
            from ot_dist.errors import ConfigError

            raise ConfigError("loss.generalized_offset_noise: needs a discrete beta schedule; Würstchen's is "
                              "continuous")
        return None

    def schedule_time(self, timesteps):
        return timesteps * self.num_timesteps  # t in (0, 1] is its own share of the schedule

    def alphas_cumprod_at(self, timesteps):
        return cosine_alpha_cumprod(timesteps).cpu()

    def describe(self) -> str:
        return f"epsilon prediction, continuous cosine time (scale {self.scale}, offset {self.offset})"
