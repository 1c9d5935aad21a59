"""Depth-conditioned models: SD 2.0 depth's UNet takes a 5th input channel, a depth map of the image, which
diffusers' StableDiffusionDepth2ImgPipeline computes with its DPT depth estimator (`prepare_depth_map`). Training
builds the same map from each step's images, so the model sees at inference what it trained on.
"""

from __future__ import annotations

import numpy as np
import torch

DEPTH_IN_CHANNELS = 5  # noisy latent 4 + depth 1


def images_of(pixels: torch.Tensor) -> list:
    """Batch pixels in [-1, 1] as the 8-bit RGB images a user hands the pipeline (the shards' own values: the data
    path makes pixels as uint8 / 127.5 - 1)."""
    from PIL import Image

    array = ((pixels.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy())) for image in array]


def depth_map(estimator, processor, pixels: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
    """(B, 1, h, w) in [-1, 1]: `prepare_depth_map` for images given as pixels: the processor's input of the 8-bit
    images, the estimator's predicted depth scaled to latent size (bicubic), each map stretched to [-1, 1] by its
    own minimum and maximum. A flat map (the estimator sees no depth) is 0, where the pipeline would divide by 0."""
    parameter = next(estimator.parameters())
    values = processor(images=images_of(pixels), return_tensors="pt").pixel_values
    with torch.no_grad():
        depth = estimator(values.to(parameter.device, parameter.dtype)).predicted_depth
    depth = torch.nn.functional.interpolate(depth.unsqueeze(1).float(), size=tuple(latent_size), mode="bicubic",
                                            align_corners=False)
    low = torch.amin(depth, dim=[1, 2, 3], keepdim=True)
    high = torch.amax(depth, dim=[1, 2, 3], keepdim=True)
    span = high - low
    return torch.where(span > 0, 2.0 * (depth - low) / span.clamp(min=torch.finfo(span.dtype).tiny) - 1.0,
                       torch.zeros_like(depth))


def tiny_depth_estimator(seed: int = 0):
    """(DPTForDepthEstimation, DPTImageProcessor): a random DPT of a few layers on a 32 px input. Weights drawn wider
    than DPT's default (std 0.2, not 0.02) so its ReLU head gives a map with depth in it, not ~1e-10 everywhere."""
    from transformers import DPTConfig, DPTForDepthEstimation, DPTImageProcessor

    torch.manual_seed(seed)
    config = DPTConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32, image_size=32,
                       patch_size=8, neck_hidden_sizes=[8, 8, 8, 8], fusion_hidden_size=8,
                       backbone_out_indices=[0, 1, 2, 3], is_hybrid=False, initializer_range=0.2)
    processor = DPTImageProcessor(size={"height": 32, "width": 32}, keep_aspect_ratio=False)
    return DPTForDepthEstimation(config).eval(), processor


def load_renamed_processor_folder(path, index: dict, pipeline_class: str):
    """A depth pipeline folder whose model_index.json names its processor `DPTFeatureExtractor` (stabilityai's
    stable-diffusion-2-depth): transformers 5 dropped that alias of DPTImageProcessor, and diffusers' from_pretrained
    checks the named class even for a component handed to it, so the folder is read component by component, in
    float32 from safetensors as the pipelines' from_pretrained reads them."""
    import importlib
    from pathlib import Path

    import diffusers
    from transformers import DPTImageProcessor

    path = Path(path)
    components = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        if name == "feature_extractor":
            components[name] = DPTImageProcessor.from_pretrained(path / name)
            continue
        cls = getattr(importlib.import_module(entry[0]), entry[1])
        weights = {"dtype": torch.float32, "use_safetensors": True} if issubclass(cls, torch.nn.Module) else {}
        components[name] = cls.from_pretrained(path / name, **weights)
    return getattr(diffusers, pipeline_class)(**components)
