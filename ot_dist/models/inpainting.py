"""Inpainting models: a denoiser that sees, beside the noisy latents, which pixels to repaint and the image without
them. Each family lays that condition out as its inpainting pipeline does (`Family.inpainting_condition`): SD 1.x /
2.x / SDXL's 9-channel UNets take noisy latent 4 + mask 1 + masked-image latent 4 (StableDiffusion(XL)InpaintPipeline);
Flux.1 Fill's transformer takes 384 channels, the packed noisy latents 64 + masked-image latents 64 + the pixel mask
folded 8x8 into 64 latent channels and packed to 256 (FluxFillPipeline).

A loaded pipeline whose denoiser is one is turned into the family's inpainting pipeline (same components),
so the export's model_index.json names the class that `from_pretrained` must build.
"""

from __future__ import annotations

import inspect

from ot_dist.errors import ConfigError

INPAINTING_IN_CHANNELS = 9  # SD's UNets


def check_inpainting_option(option: bool | None, denoiser, family) -> None:
    """`model.inpainting` true / false asserts what the denoiser is; null (auto) accepts either."""
    found = family.is_inpainting(denoiser)
    if option is None or option == found:
        return
    channels = denoiser.config.in_channels
    kind = "UNet" if family.denoiser == "unet" else family.denoiser
    if option:
        raise ConfigError(f"model.inpainting: true, but the {kind} of model.path has {channels} input channels; an "
                          f"inpainting {kind} has {family.inpainting_in_channels} ({family.inpainting_input})")
    raise ConfigError(f"model.inpainting: false, but model.path is an inpainting model ({channels} {kind} input "
                      "channels); set model.inpainting to true or null")


def whole_image_repaint(arguments: dict) -> dict:
    """An inpainting pipeline's call arguments to sample as OneTrainer samples an inpainting model (sample_inpainting
    off): the whole image repainted from pure noise (strength 1), its conditioning a blank masked image (the pipelines
    zero the image under a full mask)."""
    from PIL import Image

    size = (arguments["width"], arguments["height"])
    return {**arguments, "image": Image.new("RGB", size, (128, 128, 128)), "mask_image": Image.new("L", size, 255),
            "strength": 1.0}


def as_inpainting_pipeline(pipeline, pipeline_class: str):
    """`pipeline`'s components in the family's inpainting pipeline class (itself when it already is one)."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    if isinstance(pipeline, cls):
        return pipeline
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in pipeline.components.items() if k in accepted}
    # Non-component settings (requires_safety_checker, force_zeros_for_empty_prompt) carry over too.
    kwargs |= {k: v for k, v in pipeline.config.items() if k in accepted and k not in kwargs}
    return cls(**kwargs)
