"""Flux.1 (dev with its guidance embedding, schnell without) and Chroma: MMDiT transformers over 16-channel
latents packed 2x2 into 64-channel tokens, trained with flow matching and a resolution-dependent shift.

- Flux: T5 tokens as the text stream, CLIP-L's pooled output as the global vector, zero text position ids,
  (0, row, column) image position ids, timestep / 1000 in, dev's distilled guidance as an input
  (`model.guidance_scale`).
- Flux.1 Fill [dev] (`model.inpainting`, FluxFillPipeline): Flux dev whose transformer takes 384 input channels per
  token, the packed noisy latents (64), then the packed masked-image latents (64) and the pixel mask folded 8x8
  into 64 latent channels and packed (256); it predicts the 64 noisy-latent channels.
- Chroma: T5 only, with its attention mask (the first padding token stays visible, as ChromaPipeline does),
  no pooled vector, no guidance.
"""

from __future__ import annotations

import torch

import copy

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import T5_EMBEDDING_COPIES, T5_EMBEDDING_KEY, T5_LORA_TARGETS, Family
from ot_dist.models.families.full_checkpoint import DENOISER_PREFIX, FullCheckpoint
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# The diffusers Flux LoRA script's default targets (double blocks: both streams' attention and MLPs; single
# blocks: q / k / v and the MLP input).
FLUX_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp")
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
CLIP_SHARD_UNITS = ("encoder.layers",)  # CLIPTextModel (transformers 5: no text_model level) and WithProjection
T5_SHARD_UNITS = ("encoder.block",)
TRANSFORMER_SHARD_UNITS = ("transformer_blocks", "single_transformer_blocks")
T5_MAX_TOKENS = 512  # what FluxPipeline / ChromaPipeline use by default
FLUX_FILL_IN_CHANNELS = 384  # 4 x (noisy latent 16 + masked-image latent 16 + the 8x8-folded mask 64)


def with_t5_tokens(family, model_config):
    """`family` with model.t5_max_tokens applied (a copy when it differs: family instances are shared)."""
    tokens = getattr(model_config, "t5_max_tokens", None)
    if tokens == family.t5_tokens:
        return family
    family = copy.copy(family)
    family.t5_tokens = tokens
    return family


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): each 2x2 patch one token, channels then patch row then column."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack` for a (h, w) latent grid."""
    b, _, channels = tokens.shape
    return tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, channels // 4, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids (0, row, column) of the packed tokens."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return to_device(ids.reshape(-1, 3), device, dtype)


class FlowTransformerFamily(Family):
    """What Flux and Chroma share: the packed transformer, the flow objective, the T5 stream."""

    denoiser = "transformer"
    pixel_multiple = 16  # VAE x8, then 2x2 packing
    # cuDNN attention's backward gave NaN gradients for this joint attention (a tiny Flux, bf16, and diffusers'
    # FluxTransformer2DModel alone) and ended a Flux.1 dev LoRA step at 1024 px with an illegal memory access
    # (torch 2.11 + CUDA 13.0, H200, November 2026); flash / efficient / math gave finite gradients on the same
    # inputs. SDXL and SD3.5 trained with it there.
    attention_kernels_avoided = ("cudnn",)
    # kohya sd-scripts' lora_unet_<BFL path with _> (networks/lora_flux.py) and ComfyUI's diffusion_model.<BFL path>
    lora_original_prefixes = (("lora_unet", "_"), ("diffusion_model", "."))
    denoiser_lora_presets = {"default": FLUX_LORA_TARGETS, "attention": ATTENTION_TARGETS}
    # ComfyUI (Flux, and Chroma, whose model subclasses Flux there) maps transformer.<path> through
    # utils.flux_to_diffusers: whole weights, q / k / v (/ proj_mlp) as row blocks of qkv and linear1
    lora_oft_diffusers_layout = True

    def lora_oft_reordered_modules(self, denoiser):
        return ["norm_out.linear"]  # final_layer.adaLN_modulation.1 there, shift | scale (swap_scale_shift)

    samplers = ("flow_euler",)
    sample_guidance_scale = 3.5  # OneTrainer's for Flux.1 and Chroma; FluxPipeline's default too
    t5_tokenizer = "tokenizer_2"

    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=2)

    def objective_kind(self) -> str:
        return "flow"

    t5_tokens: int | None = None  # model.t5_max_tokens; None: T5_MAX_TOKENS

    def configure(self, model_config) -> "FlowTransformerFamily":
        return with_t5_tokens(super().configure(model_config), model_config)

    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        if tokenizer_name == self.t5_tokenizer:  # bounded by the tokenizer (a tiny test T5 has 32)
            return min(self.t5_tokens or T5_MAX_TOKENS, tokenizer.model_max_length)
        return tokenizer.model_max_length

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens(self.t5_tokenizer, getattr(pipeline, self.t5_tokenizer))}

    def transformer_inputs(self, denoiser, conditioning: dict, noisy: torch.Tensor) -> dict:
        """The family's own keyword arguments of the transformer call."""
        raise NotImplementedError

    def transformer_to_original(self, state: dict, config: dict, prefix: str) -> dict:
        """The transformer's state dict in its original (BFL / lodestones) keys under `prefix`."""
        return self.file_layout().to_original(state, config, prefix)

    def export_single_file(self, components, states, path, dtype, with_text_encoders=False, metadata=None):
        """The transformer alone with bare keys, as Black Forest Labs / lodestones ship it; when a run trained a text
        encoder, a full checkpoint as ComfyUI saves one (the transformer under model.diffusion_model., the VAE and
        every text encoder under the family's prefixes)."""
        from ot_dist.models.families.transformer_single_file import write_transformer_file

        config = dict(components["transformer"].config)
        if not with_text_encoders:
            write_transformer_file(self.transformer_to_original(states["transformer"], config, ""), path, dtype,
                                   metadata)
            return
        state = self.transformer_to_original(states["transformer"], config, DENOISER_PREFIX)
        write_transformer_file(state | self.full_checkpoint.component_keys(components, states), path, dtype,
                               metadata)

    def image_tokens(self, noisy: torch.Tensor, conditioning: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the image stream's tokens, their position ids): the packed noisy latents; an edit model appends its
        reference's (FluxKontext). The prediction is read from the first tokens, the noisy latents' own."""
        h, w = noisy.shape[-2:]
        return pack(noisy), image_ids(h, w, noisy.device, noisy.dtype)

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        h, w = noisy.shape[-2:]
        hidden = conditioning["hidden"]
        tokens, ids = self.image_tokens(noisy, conditioning)
        out = denoiser(
            hidden_states=tokens,
            timestep=(timesteps / 1000).to(noisy.dtype),
            encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            img_ids=ids,
            **self.transformer_inputs(denoiser, conditioning, noisy),
            return_dict=False,
        )[0]
        return unpack(out[:, :(h // 2) * (w // 2)], h, w)


class Flux(FlowTransformerFamily):
    name = "flux"
    memory_reference = "Flux.1 dev"
    description = "Flux.1 dev / schnell (MMDiT, CLIP-L pooled + T5, flow matching with a resolution-dependent shift)"
    pipeline_class = "FluxPipeline"
    transformer_file_layout = "ot_dist.models.families.flux_single_file:FLUX"  # Black Forest Labs' keys
    text_encoders = ("text_encoder", "text_encoder_2")
    tokenizers = ("tokenizer", "tokenizer_2")
    # OneTrainer's FluxEmbeddingSaver: clip_l, t5 (ComfyUI reads the T5's copy t5xxl)
    embedding_keys = {"text_encoder": "clip_l", "text_encoder_2": T5_EMBEDDING_KEY}
    embedding_key_copies = T5_EMBEDDING_COPIES
    embedding_keys_optional = frozenset({"text_encoder_2"})  # a clip_l file (ot_dist's before) starts the T5's
    # OneTrainer's FluxModelEmbedding: an output embedding is one of the T5 (FluxModel.encode_text applies it to the
    # T5's last hidden state) while the CLIP-L, whose pooled output alone Flux reads, trains input vectors beside it
    # (is_output_embedding=False); FluxEmbeddingSaver writes clip_l, t5 (the zero input rows) and t5_out.
    output_embedding_keys = {"text_encoder_2": T5_EMBEDDING_KEY}

    def text_states(self, encoder, output):
        return output.last_hidden_state  # the T5's, read without its mask (FluxPipeline's and OneTrainer's encode_t5)

    shard_units = {"transformer": TRANSFORMER_SHARD_UNITS, "text_encoder": CLIP_SHARD_UNITS,
                   "text_encoder_2": T5_SHARD_UNITS}
    lora_file_prefixes = None
    # CLIP-L's LoRA modules carry the text_model. level transformers 5 dropped: ComfyUI maps Flux's CLIP LoRA keys
    # only as text_encoder.text_model.encoder.layers.N..., and diffusers strips the level again when loading.
    lora_file_roots = {"text_encoder": "text_model"}
    text_lora_targets_by_encoder = {"text_encoder_2": T5_LORA_TARGETS}
    # T5-XXL beside CLIP-L: ComfyUI maps lora_te2_ (OneTrainer's) and lora_te3_ (kohya sd-scripts') T5 names for Flux;
    # lora_te3 is the one both ComfyUI and kohya's scripts read.
    lora_file_kohya_components = {"text_encoder_2": "lora_te3"}
    # OneTrainer (modules/util/convert/lora/convert_flux_lora.py): lora_transformer_ / lora_te1_ (CLIP-L) / lora_te2_
    # (T5); kohya sd-scripts (networks/lora_flux.py): lora_te1_ (CLIP-L), lora_te3_ (T5, read as Flux's own);
    # SimpleTuner's LyCORIS files: lycoris_<diffusers path> (ComfyUI's comfy/lora.py maps it for Flux)
    lora_foreign_prefixes = {"transformer": ("lora_transformer", "lycoris"), "text_encoder": ("lora_te1",),
                             "text_encoder_2": ("lora_te2",)}
    # Comfy-Org's Flux checkpoints (flux1-dev-fp8.safetensors) and ComfyUI's Save Checkpoint: comfy/supported_models.py
    # Flux (vae_key_prefix "vae.", text_encoder_key_prefix "text_encoders.", FluxClipModel's clip_l and t5xxl);
    # diffusers' from_single_file reads the same text-encoder prefixes.
    full_checkpoint = FullCheckpoint(text_encoders={"text_encoder": "text_encoders.clip_l.transformer.",
                                                    "text_encoder_2": "text_encoders.t5xxl.transformer."},
                                     vae="vae.")
    # ComfyUI's separate files: clip_l.safetensors, t5xxl_fp16 / _fp8_e4m3fn(_scaled).safetensors, ae.safetensors
    component_files = {"text_encoder": C.CLIP_TEXT, "text_encoder_2": C.T5_ENCODER, "vae": C.LDM_VAE}
    modelspec_implementation = "https://github.com/black-forest-labs/flux"  # kohya's IMPL_FLUX

    # Flux.1 Fill [dev] (OneTrainer's FLUX_FILL_DEV_1): a Flux dev transformer with the masked image and the mask
    # beside the noisy latents, loaded as FluxFillPipeline
    inpaint_pipeline_class = "FluxFillPipeline"
    inpainting_in_channels = FLUX_FILL_IN_CHANNELS
    inpainting_input = "packed noisy latent 64 + masked-image latent 64 + mask 256"

    def modelspec_architecture_of(self, denoiser_config, prediction_type, inpainting):
        """kohya's ids (SwarmUI maps both onto its Flux.1 classes): dev has the guidance embedding, schnell none;
        Fill is SwarmUI's Flux.1-dev/inpaint class (kohya names none), lower-cased as Kontext's id is."""
        if inpainting:
            return "flux.1-dev/inpaint"
        return "flux-1-dev" if denoiser_config.get("guidance_embeds") else "flux-1-schnell"

    def inpainting_condition(self, masks, masked_latents):
        """FluxFillPipeline.prepare_mask_latents on the latent grid: the masked-image latents, then the pixel mask
        with each latent pixel's 8x8 block folded into 64 channels (row-major within the block). `predict` packs them
        with the noisy latents into one token per 2x2 patch; packing is channel-major, so packing the concatenation
        gives the pipeline's concatenation of the packed parts."""
        factor = masks.shape[-1] // masked_latents.shape[-1]  # the VAE's 8
        folded = torch.nn.functional.pixel_unshuffle(masks, factor)  # (B, 64, h, w), channel = row * 8 + column
        return torch.cat([masked_latents, folded.to(masked_latents)], dim=1)

    def sampling_arguments(self, pipeline, arguments):
        arguments = super().sampling_arguments(pipeline, arguments)
        if type(pipeline).__name__ == self.inpaint_pipeline_class:
            from ot_dist.models.inpainting import whole_image_repaint

            arguments = whole_image_repaint(arguments)
        return arguments

    sample_negative_prompt = False  # FluxPipeline samples with the distilled guidance, without a negative pass

    def __init__(self, guidance_scale: float = 1.0):
        # The distilled guidance dev's transformer is shown in training (OneTrainer and SimpleTuner train at 1.0).
        self.guidance_scale = guidance_scale

    def configure(self, model_config) -> "Flux":
        scale = model_config.guidance_scale
        family = self if scale is None or scale == self.guidance_scale else type(self)(scale)
        return with_t5_tokens(family, model_config)

    def encode_text(self, text_encoders, tokens):
        clip, t5 = text_encoders["text_encoder"], text_encoders["text_encoder_2"]
        pooled = clip(to_device(tokens["text_encoder"], clip.device), output_hidden_states=False).pooler_output
        hidden = self.text_states("text_encoder_2", t5(to_device(tokens["text_encoder_2"], t5.device),
                                                       output_hidden_states=False))
        return {"hidden": hidden, "pooled": pooled}

    def transformer_inputs(self, denoiser, conditioning, noisy):
        guidance = None
        if denoiser.config.guidance_embeds:  # dev; schnell has no guidance embedding
            guidance = torch.full((noisy.shape[0],), self.guidance_scale, device=noisy.device, dtype=torch.float32)
        return {"pooled_projections": conditioning["pooled"], "guidance": guidance}

    def build_tiny(self, seed: int = 0, variant: str = "dev", in_channels: int | None = None, **_):
        """`in_channels`: FLUX_FILL_IN_CHANNELS for a Fill transformer (it still predicts the 64 latent channels)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel

        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer, tiny_t5_encoder, \
            tiny_t5_tokenizer

        torch.manual_seed(seed)
        clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=in_channels or 64, out_channels=64 if in_channels else None, num_layers=2,
            num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN,
            pooled_projection_dim=TEXT_HIDDEN, guidance_embeds=variant == "dev", axes_dims_rope=(4, 6, 6))
        return self.pipeline_cls()(
            transformer=transformer,
            vae=tiny_flow_vae(shift_factor=0.1159, scaling_factor=0.3611),
            text_encoder=CLIPTextModel(clip_text_config(len(clip_tokenizer), "quick_gelu")),
            text_encoder_2=tiny_t5_encoder(len(t5_tokenizer)),
            tokenizer=clip_tokenizer,
            tokenizer_2=t5_tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULERS[variant]),
        )


class Chroma(FlowTransformerFamily):
    name = "chroma"
    memory_reference = "Flux.1 dev"  # Chroma: Flux.1 schnell's blocks, no guidance / CLIP (8.9 B): an upper bound
    description = "Chroma (Flux-based MMDiT, T5 only with its attention mask, no guidance)"
    pipeline_class = "ChromaPipeline"
    transformer_file_layout = "ot_dist.models.families.flux_single_file:CHROMA"  # lodestones' keys
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {"text_encoder": T5_EMBEDDING_KEY}  # OneTrainer's ChromaEmbeddingSaver; ComfyUI's t5xxl copy
    embedding_key_copies = T5_EMBEDDING_COPIES
    # OneTrainer's ChromaEmbeddingSaver: t5 (the zero input rows), t5_out; the T5's last hidden state, read with the
    # tokenizer's mask as ot_dist's conditioning reads it (OneTrainer's T5 mask also lets the first padding token in,
    # which moves the start a little)
    output_embedding_keys = {"text_encoder": T5_EMBEDDING_KEY}
    output_states_masked = True

    def text_states(self, encoder, output):
        return output.last_hidden_state
    t5_tokenizer = "tokenizer"
    shard_units = {"transformer": TRANSFORMER_SHARD_UNITS, "text_encoder": T5_SHARD_UNITS}
    text_lora_targets = T5_LORA_TARGETS
    # ComfyUI's Chroma text encoder is T5-XXL alone: its LoRA modules are lora_te1_<T5 path> (comfy/lora.py)
    lora_file_kohya_components = {"text_encoder": "lora_te1"}
    # OneTrainer (modules/util/convert/lora/convert_chroma_lora.py): lora_transformer_ and lora_te_ (its T5)
    lora_foreign_prefixes = {"transformer": ("lora_transformer",), "text_encoder": ("lora_te",)}
    # ComfyUI's Chroma (comfy/supported_models.py) keeps the base prefixes: VAE first_stage_model., text encoder
    # cond_stage_model. with its PixArt-style T5 model named t5xxl. diffusers reads no Chroma text encoder from a file.
    full_checkpoint = FullCheckpoint(text_encoders={"text_encoder": "cond_stage_model.t5xxl.transformer."},
                                     vae="first_stage_model.")
    # ComfyUI's separate files: t5xxl (its fp8 casts too) and Flux's ae.safetensors
    component_files = {"text_encoder": C.T5_ENCODER, "vae": C.LDM_VAE}
    modelspec_architecture = "chroma"  # kohya's ARCH_FLUX_1_CHROMA, SwarmUI's id
    modelspec_implementation = "https://huggingface.co/lodestones/Chroma"  # kohya's IMPL_CHROMA

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        encoded = tokenizer(captions, padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        t5 = text_encoders["text_encoder"]
        token_mask = to_device(tokens["text_encoder_mask"], t5.device)
        hidden = t5(to_device(tokens["text_encoder"], t5.device), attention_mask=token_mask, output_hidden_states=False)[0]
        # The transformer sees the caption and its first padding token (ChromaPipeline's convention).
        lengths = token_mask.sum(dim=1)
        positions = torch.arange(token_mask.shape[1], device=token_mask.device)[None]
        return {"hidden": hidden, "mask": (positions <= lengths[:, None]).long()}

    def transformer_inputs(self, denoiser, conditioning, noisy):
        mask = conditioning["mask"]
        image_tokens = (noisy.shape[-2] // 2) * (noisy.shape[-1] // 2)
        # Extended over the image tokens, which always attend (ChromaPipeline._prepare_attention_mask).
        full = torch.cat([mask.to(noisy.dtype), torch.ones(mask.shape[0], image_tokens, device=mask.device,
                                                             dtype=noisy.dtype)], dim=1)
        return {"attention_mask": full}

    def build_tiny(self, seed: int = 0, **_):
        from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

        from ot_dist.models.tiny import TEXT_HIDDEN, tiny_t5_encoder, tiny_t5_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_t5_tokenizer()
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6),
            approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=1)
        return ChromaPipeline(
            transformer=transformer,
            vae=tiny_flow_vae(shift_factor=0.1159, scaling_factor=0.3611),
            text_encoder=tiny_t5_encoder(len(tokenizer)),
            tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULERS["dev"]),
        )


def reference_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """The position ids of a reference image's packed tokens: (1, row, column), FluxKontextPipeline's (its image_ids
    with the first coordinate 1, the same rows and columns from 0)."""
    ids = image_ids(h, w, device, dtype)
    ids[:, 0] = 1
    return ids


class FluxKontext(Flux):
    """Flux.1 Kontext [dev]: Flux dev's transformer (the same FluxTransformer2DModel config), trained and sampled with
    a reference image: its packed latents appended to the image tokens with position ids (1, row, column), the
    prediction read from the noisy latents' tokens alone (diffusers' FluxKontextPipeline and its DreamBooth LoRA
    script). Samples take the reference as every training sample does (concepts' reference_path, sampling prompts'
    reference_image). Its LoRA files are Flux LoRA files (ComfyUI runs Kontext on its Flux model class)."""

    name = "flux_kontext"
    memory_reference = "Flux.1 Kontext dev"  # Flux.1 dev's weights, twice its image tokens (ot_dist/memory/table.py)
    description = "Flux.1 Kontext dev (edit model: Flux dev with a reference image's tokens beside the noisy latents)"
    pipeline_class = "FluxKontextPipeline"
    inpaint_pipeline_class = None  # Kontext has no Fill variant
    inpainting_in_channels = None
    reference_images = True
    # FluxKontextPipeline's documented example and SimpleTuner's Kontext quickstart (its default call is 3.5)
    sample_guidance_scale = 2.5

    def modelspec_architecture_of(self, denoiser_config, prediction_type, inpainting):
        """SwarmUI's class id for Kontext (T2IModelClassSorter: Flux.1-dev/kontext); kohya defines none."""
        return "flux.1-dev/kontext"

    def image_tokens(self, noisy, conditioning):
        tokens, ids = super().image_tokens(noisy, conditioning)
        reference = conditioning.get("reference_latents")
        if reference is None:  # the trainer refuses such data before loading (ot_dist/train/references.py)
            raise ValueError("flux_kontext: a denoiser call without reference latents (conditioning "
                             "'reference_latents')")
        h, w = reference.shape[-2:]
        return (torch.cat([tokens, pack(reference.to(tokens))], dim=1),
                torch.cat([ids, reference_ids(h, w, ids.device, ids.dtype)], dim=0))

    def sampling_arguments(self, pipeline, arguments):
        """The prompt's reference image scaled to the sample's size (the geometry every training pair has), passed as
        FluxKontextPipeline's `image` without its own resizing: no snap to its preferred resolutions (_auto_resize),
        and max_area the sample's own (the pipeline scales width x height to max_area, 1024^2 by default)."""
        arguments = dict(arguments)
        references = arguments.pop("reference_images", [])  # one at most (max_reference_images, config checked)
        width, height = arguments["width"], arguments["height"]
        extra = {"max_area": width * height, "_auto_resize": False}
        if references:
            extra["image"] = sample_reference(references[0], width, height)
        return {**super().sampling_arguments(pipeline, arguments), **extra}


def sample_reference(path, width: int, height: int):
    """A sampling prompt's reference image, upright RGB, scaled to cover (width, height) and centre-cropped: what the
    shard build and the centre crop do to a training pair's reference."""
    from ot_dist.data.buckets import resize_to_cover
    from ot_dist.data.images import open_image

    image = resize_to_cover(open_image(path), (height, width))
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


# The published scheduler configs: dev shifts with the resolution, schnell does not shift.
FLUX_SCHEDULERS = {
    "dev": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                base_image_seq_len=256, max_image_seq_len=4096),
    "schnell": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
}


def tiny_flow_vae(shift_factor: float, scaling_factor: float):
    """A tiny AutoencoderKL with the 16 latent channels of the Flux / SD3 VAE and its scale and shift."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False)


FAMILIES = {"flux": Flux(), "chroma": Chroma(), "flux_kontext": FluxKontext()}
