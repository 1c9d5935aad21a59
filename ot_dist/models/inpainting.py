"""Inpainting models: a UNet with 9 input channels (noisy latent 4 + mask 1 + masked-image latent 4,
in that order, as diffusers' StableDiffusion(XL)InpaintPipeline concatenates them).

A loaded pipeline whose UNet is one is turned into the family's inpainting pipeline (same components),
so the export's model_index.json names the class that `from_pretrained` must build.
"""

from __future__ import annotations

import inspect

from ot_dist.errors import ConfigError

INPAINTING_IN_CHANNELS = 9


def is_inpainting_unet(unet) -> bool:
    return unet.config.in_channels == INPAINTING_IN_CHANNELS


def check_inpainting_option(option: bool | None, unet) -> None:
    """`model.inpainting` true / false asserts what the UNet is; null (auto) accepts either."""
    found = is_inpainting_unet(unet)
    if option is None or option == found:
        return
    channels = unet.config.in_channels
    if option:
        raise ConfigError(f"model.inpainting: true, but the UNet of model.path has {channels} input channels; an "
                          f"inpainting UNet has {INPAINTING_IN_CHANNELS} (noisy latent 4 + mask 1 + masked-image "
                          "latent 4)")
    raise ConfigError(f"model.inpainting: false, but model.path is an inpainting model ({channels} UNet input "
                      "channels); set model.inpainting to true or null")


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
