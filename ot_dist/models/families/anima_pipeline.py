"""A DiffusionPipeline face for Anima, whose only diffusers pipeline is modular (AnimaModularPipeline, built from
AnimaAutoBlocks). ot_dist loads, exports, samples and saves LoRA files through one pipeline object that holds the
components as attributes (`from_pretrained`, `save_pretrained`, `components`, `save_lora_weights`); this class is that
object, and its call runs diffusers' own AnimaAutoBlocks on the same components, so samples are the modular
pipeline's. It also writes `modular_model_index.json` beside `model_index.json`, so that diffusers'
`ModularPipeline.from_pretrained(folder)` reads a folder ot_dist wrote (the way the published Anima folders load).

Cosmos's transformer resizes its padding mask with torchvision, which diffusers imports only where it is installed;
`ensure_padding_mask_resize` supplies the one call it makes (nearest resize of a tensor) where it is not."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from diffusers.loaders import AnimaLoraLoaderMixin
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

# The components, in the names AnimaAutoBlocks expects (and the published folders use)
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "t5_tokenizer", "text_conditioner", "scheduler")


class AnimaPipeline(DiffusionPipeline, AnimaLoraLoaderMixin):
    model_cpu_offload_seq = "text_encoder->text_conditioner->transformer->vae"

    def __init__(self, transformer, vae, text_encoder, tokenizer, t5_tokenizer, text_conditioner, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              t5_tokenizer=t5_tokenizer, text_conditioner=text_conditioner, scheduler=scheduler)

    def modular(self, guidance_scale: float = 4.0):
        """diffusers' AnimaModularPipeline over these very components, its guider at `guidance_scale` (diffusers'
        ClassifierFreeGuidance: uncond + s (cond - uncond), off at s = 1)."""
        from diffusers import AnimaAutoBlocks, ClassifierFreeGuidance

        ensure_padding_mask_resize()
        pipe = AnimaAutoBlocks().init_pipeline()
        pipe.update_components(**{name: getattr(self, name) for name in COMPONENTS},
                               guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
        return pipe

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, width: int | None = None, height: int | None = None,
                 num_inference_steps: int = 25, guidance_scale: float = 4.0, generator=None, output_type: str = "pil",
                 max_sequence_length: int = 512, **options):
        images = self.modular(guidance_scale)(
            prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
            num_inference_steps=num_inference_steps, generator=generator, output_type=output_type,
            max_sequence_length=max_sequence_length, output="images", **options)
        return ImagePipelineOutput(images=images)


def write_modular_index(pipeline, folder: Path) -> None:
    """`modular_model_index.json` for a folder holding the pipeline's components in subfolders: what
    AnimaModularPipeline.save_pretrained writes, each component's repo the folder itself, so that
    `ModularPipeline.from_pretrained(folder).load_components()` reads them from it (diffusers takes a local folder's
    own subfolders over the repo an index names)."""
    import diffusers

    index = {"_class_name": "AnimaModularPipeline", "_diffusers_version": diffusers.__version__,
             "_blocks_class_name": "AnimaAutoBlocks"}
    for name in COMPONENTS:
        component = getattr(pipeline, name)
        library = "diffusers" if type(component).__module__.startswith("diffusers") else "transformers"
        index[name] = [library, type(component).__name__,
                       {"pretrained_model_name_or_path": str(folder), "subfolder": name,
                        "type_hint": [library, type(component).__name__]}]
    (Path(folder) / "modular_model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def ensure_padding_mask_resize() -> None:
    """Cosmos's transformer concatenates a padding mask resized to the latent grid with
    `torchvision.transforms.functional.resize(mask, size, interpolation=NEAREST)`, and diffusers binds `transforms`
    only when torchvision is installed. Where it is not, the same call is given here: torchvision resizes a tensor
    with NEAREST through `torch.nn.functional.interpolate(mode="nearest")`. Anima's mask is all zeros (no padded
    pixels), so any nearest resize of it is exact."""
    from types import SimpleNamespace

    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return

    def resize(mask, size, interpolation=None):
        return torch.nn.functional.interpolate(mask, size=list(size), mode="nearest")

    transformer_cosmos.transforms = SimpleNamespace(
        functional=SimpleNamespace(resize=resize), InterpolationMode=SimpleNamespace(NEAREST="nearest"))
