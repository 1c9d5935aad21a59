"""The denoisers `ot-dist bench` builds: the published configs of real models (embedded: nothing can be downloaded)
and the `tiny-*` variant of each family (the family's own tiny build, `Family.build_tiny`).

A bench model is only its denoiser, a scheduler of the published config (the objective reads it) and the shapes of
cached inputs: latents and text-encoder outputs come as random tensors (cached-latent / cached-text training, the
large-run setup), so no VAE weights or text encoders are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# Published denoiser configs (the config.json of each model's unet / transformer folder, architecture keys only).
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
    cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)
SD35_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
SD35_LARGE = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
    pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm",
)
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)

# Text tokens of the cached text-encoder outputs, as the families' pipelines encode them.
CLIP_TOKENS = 77
SD3_T5_TOKENS = 256  # StableDiffusion3Pipeline's max_sequence_length
FLUX_T5_TOKENS = 512  # FluxPipeline's


def unet_text_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    shapes = {"hidden": (CLIP_TOKENS, config["cross_attention_dim"])}
    if config.get("addition_embed_type") == "text_time":  # SDXL: pooled CLIP-G + 6 size / crop numbers
        shapes["pooled"] = (config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"],)
    return shapes


def sd3_text_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    return {"hidden": (CLIP_TOKENS + SD3_T5_TOKENS, config["joint_attention_dim"]),
            "pooled": (config["pooled_projection_dim"],)}


def flux_text_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    return {"hidden": (FLUX_T5_TOKENS, config["joint_attention_dim"]), "pooled": (config["pooled_projection_dim"],)}


def ddpm_scheduler():
    from ot_dist.models.tiny import tiny_ddim

    return tiny_ddim("epsilon")  # SD 1.5's / SDXL's published scheduler config


def sd3_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ot_dist.models.families.flux import FLUX_SCHEDULERS

    return FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULERS["dev"])


@dataclass(frozen=True)
class BenchModel:
    name: str  # --model
    family: str  # the ot_dist family (its objective, predict and LoRA targets are used)
    denoiser_class: str  # the diffusers class
    text_shapes: Callable[[dict], dict[str, tuple[int, ...]]]  # cached text conditioning (per sample), from the config
    scheduler: Callable[[], object]
    latent_channels: int
    vae_scaling: tuple[float, float | None]  # the VAE's scaling_factor, shift_factor (the latent space trained in)
    config: dict | None = None  # None: the family's tiny denoiser config
    tiny_options: dict = field(default_factory=dict)
    size_conditioning: bool = False  # SDXL's original size / crop / target size in the batch

    @property
    def tiny(self) -> bool:
        return self.config is None

    def denoiser_config(self) -> dict:
        if self.config is not None:
            return dict(self.config)
        return tiny_config(self.family, tuple(sorted(self.tiny_options.items())))


def tiny_config(family: str, options: tuple) -> dict:
    """The denoiser config of the family's tiny build (the one tests and the demo train)."""
    cached = _TINY_CONFIGS.get((family, options))
    if cached is None:
        from ot_dist.models.families.registry import get_family

        spec = get_family(family)
        denoiser = getattr(spec.build_tiny(seed=0, **dict(options)), spec.denoiser)
        cached = _TINY_CONFIGS[(family, options)] = {k: v for k, v in denoiser.config.items() if not k.startswith("_")}
    return dict(cached)


_TINY_CONFIGS: dict = {}


def _models() -> dict[str, BenchModel]:
    unet, sd3, flux = "UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel"
    real = [
        BenchModel("sd15", "sd1", unet, unet_text_shapes, ddpm_scheduler, 4, (0.18215, None), SD15_UNET),
        BenchModel("sdxl", "sdxl", unet, unet_text_shapes, ddpm_scheduler, 4, (0.13025, None), SDXL_UNET,
                   size_conditioning=True),
        BenchModel("sd35-medium", "sd3", sd3, sd3_text_shapes, sd3_scheduler, 16, (1.5305, 0.0609), SD35_MEDIUM),
        BenchModel("sd35-large", "sd3", sd3, sd3_text_shapes, sd3_scheduler, 16, (1.5305, 0.0609), SD35_LARGE),
        BenchModel("flux-dev", "flux", flux, flux_text_shapes, flux_scheduler, 16, (0.3611, 0.1159), FLUX_DEV),
    ]
    tiny_options = {"sd35-medium": {"variant": "sd35"}, "sd35-large": {"variant": "sd35"}, "flux-dev": {"variant": "dev"}}
    tiny = [BenchModel(f"tiny-{m.name}", m.family, m.denoiser_class, m.text_shapes, m.scheduler, m.latent_channels,
                       m.vae_scaling, None, tiny_options.get(m.name, {}), m.size_conditioning) for m in real]
    return {m.name: m for m in real + tiny}


BENCH_MODELS = _models()
