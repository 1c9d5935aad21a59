"""The frozen decoder stages that turn a Würstchen-style prior's image embeddings into images, for sampling during
training: Stable Cascade's stage B (`StableCascadeUNet` with EfficientNet conditioning) + the Paella VQGAN (stage A),
Würstchen v2's `WuerstchenDiffNeXt` + the same VQGAN.

diffusers 0.42 keeps PaellaVQModel / WuerstchenDiffNeXt under `pipelines/deprecated/wuerstchen` and a saved decoder
pipeline folder does not reload through `from_pretrained` (the classes are not exported): the components load one by
one from the folder's subfolders (the layout of stabilityai/stable-cascade and warp-ai/wuerstchen) and the pipelines
are built from them. Sampling runs diffusers' combined pipeline (StableCascadeCombinedPipeline /
WuerstchenCombinedPipeline) over the trained prior and these stages: the prior pipeline's image embeddings go to
the decoder pipeline with the same generator, as a user chaining the two pipelines gets them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.errors import InputFileError
from ot_dist.models.load_dtype import component_from_pretrained

# The decoder folder's subfolders each family reads (model_index.json lists them; the official folders hold more,
# e.g. stable-cascade's decoder_lite/).
STABLE_CASCADE_PARTS = ("decoder", "vqgan", "scheduler")
WUERSTCHEN_PARTS = ("decoder", "vqgan", "scheduler", "text_encoder", "tokenizer")


def _check_folder(path: Path, expected_class: str, parts: tuple[str, ...]) -> None:
    import json

    index = path / "model_index.json"
    if not index.is_file():
        raise InputFileError(f"model.decoder: {path} is not a diffusers folder (no model_index.json); expected a "
                             f"{expected_class} folder")
    found = json.loads(index.read_text()).get("_class_name")
    if found != expected_class:
        raise InputFileError(f"model.decoder: {path} holds a {found}, expected a {expected_class}")
    missing = [part for part in parts if not (path / part).is_dir()]
    if missing:
        raise InputFileError(f"model.decoder: {path} has no {', '.join(missing)} folder(s)")


def _vqgan(path: Path):
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel

    return component_from_pretrained(PaellaVQModel, path / "vqgan")


def load_stable_cascade_decoder(path: Path):
    """A StableCascadeDecoderPipeline of the folder's stage B and VQGAN, without a text encoder: stage B reads only
    the pooled CLIP-G embedding, which the combined pipeline hands over from the prior pipeline, so the decoder
    folder's own copy of CLIP-G (0.7 B parameters) is not loaded."""
    from diffusers import DDPMWuerstchenScheduler, StableCascadeDecoderPipeline, StableCascadeUNet

    _check_folder(path, "StableCascadeDecoderPipeline", STABLE_CASCADE_PARTS)
    return StableCascadeDecoderPipeline(
        decoder=component_from_pretrained(StableCascadeUNet, path / "decoder"), tokenizer=None,
        text_encoder=None, scheduler=DDPMWuerstchenScheduler.from_pretrained(path / "scheduler"),
        vqgan=_vqgan(path), **_settings(path))


def load_wuerstchen_decoder(path: Path):
    """A WuerstchenDecoderPipeline of the folder's components (its own CLIP text encoder: Würstchen v2's decoder
    reads CLIP-H text states, the prior CLIP-bigG ones)."""
    from diffusers import DDPMWuerstchenScheduler, WuerstchenDecoderPipeline
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt
    from transformers import CLIPTextModel, CLIPTokenizer

    _check_folder(path, "WuerstchenDecoderPipeline", WUERSTCHEN_PARTS)
    return WuerstchenDecoderPipeline(
        tokenizer=CLIPTokenizer.from_pretrained(path / "tokenizer"),
        text_encoder=component_from_pretrained(CLIPTextModel, path / "text_encoder"),
        decoder=component_from_pretrained(WuerstchenDiffNeXt, path / "decoder"),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(path / "scheduler"), vqgan=_vqgan(path), **_settings(path))


def _settings(path: Path) -> dict:
    import json

    index = json.loads((path / "model_index.json").read_text())
    return {k: index[k] for k in ("latent_dim_scale",) if k in index}


def combined_pipeline(combined_class: str, prior_components: dict, decoder) -> object:
    """diffusers' combined pipeline over the prior pipeline's components (the trained modules' gathered copies, a
    fresh scheduler) and the decoder stages (a fresh copy of their scheduler: sampling never changes the loaded
    one). Decoder stages without a text encoder of their own (Stable Cascade's) get the prior's."""
    import diffusers

    scheduler = type(decoder.scheduler).from_config(decoder.scheduler.config)
    pipeline = getattr(diffusers, combined_class)(
        tokenizer=prior_components["tokenizer"] if decoder.tokenizer is None else decoder.tokenizer,
        text_encoder=prior_components["text_encoder"] if decoder.text_encoder is None else decoder.text_encoder,
        decoder=decoder.decoder,
        scheduler=scheduler, vqgan=decoder.vqgan, prior_prior=prior_components["prior"],
        prior_text_encoder=prior_components["text_encoder"], prior_tokenizer=prior_components["tokenizer"],
        prior_scheduler=prior_components["scheduler"])
    pipeline.decoder_pipe.register_to_config(latent_dim_scale=decoder.config.latent_dim_scale)
    return pipeline


def decoder_modules(decoder) -> list[torch.nn.Module]:
    """The decoder stages' modules with weights."""
    return [m for m in (decoder.decoder, decoder.vqgan, decoder.text_encoder) if m is not None]


# -- tiny decoder stages for the demo and tests: the real architectures, narrow -----------------------------------

def tiny_vqgan():
    """Paella's VQGAN with the real 4x up / down scaling (pixel shuffle 2, two levels), 4 latent channels."""
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel

    return PaellaVQModel(in_channels=3, out_channels=3, up_down_scale_factor=2, levels=2, bottleneck_blocks=1,
                         embed_dim=16, latent_channels=4, num_vq_embeddings=32)


def tiny_stable_cascade_decoder(tokenizer, text_encoder, pooled_channels: int):
    """Stage B's layout (EfficientNet and pixel mappers, sca time conditioning, attention on the lower level, the
    up blocks' repeat mappers), two levels."""
    from diffusers import DDPMWuerstchenScheduler, StableCascadeDecoderPipeline, StableCascadeUNet

    decoder = StableCascadeUNet(
        in_channels=4, out_channels=4, timestep_ratio_embedding_dim=64, patch_size=2, conditioning_dim=32,
        block_out_channels=(16, 32), num_attention_heads=(0, 2), down_num_layers_per_block=(1, 1),
        up_num_layers_per_block=(1, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(2, 2),
        block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                               ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock")),
        clip_text_pooled_in_channels=pooled_channels, clip_seq=4, effnet_in_channels=16, pixel_mapper_in_channels=3,
        kernel_size=3, dropout=(0.0, 0.0), self_attn=True, timestep_conditioning_type=("sca",))
    return StableCascadeDecoderPipeline(decoder=decoder, tokenizer=tokenizer, text_encoder=text_encoder,
                                        scheduler=DDPMWuerstchenScheduler(), vqgan=tiny_vqgan())


def tiny_wuerstchen_decoder(tokenizer, text_encoder, text_channels: int):
    """WuerstchenDiffNeXt's layout (EfficientNet injected into the lower level, CLIP text conditioning), two levels."""
    from diffusers import DDPMWuerstchenScheduler, WuerstchenDecoderPipeline
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt

    decoder = WuerstchenDiffNeXt(c_in=4, c_out=4, c_r=64, patch_size=2, c_cond=32, c_hidden=[16, 32], nhead=[-1, 2],
                                 blocks=[1, 1], level_config=["CT", "CTA"], inject_effnet=[False, True],
                                 effnet_embd=16, clip_embd=text_channels, dropout=0.0)
    # WuerstchenDiffNeXt zero-initialises its output layer and time mappers and starts its EfficientNet mappers
    # near zero (a model to be trained): a random tiny decoder like that draws nearly the same image from any prior
    # output. Here they are random, so a sample shows what the prior drew.
    with torch.no_grad():
        for parameter in decoder.parameters():
            if parameter.dim() > 1 and not parameter.any():
                parameter.normal_(std=0.05)
        for mapper in decoder.effnet_mappers:
            if mapper is not None:
                mapper.weight.normal_(std=2.0)
    return WuerstchenDecoderPipeline(tokenizer=tokenizer, text_encoder=text_encoder, decoder=decoder,
                                     scheduler=DDPMWuerstchenScheduler(), vqgan=tiny_vqgan())


def save_decoder(decoder, folder: Path) -> None:
    """The decoder stages as a diffusers folder (the layout load_*_decoder reads)."""
    decoder.save_pretrained(folder, safe_serialization=True)
