"""The family contract: everything the rest of ot_dist may know about a model family.

A family module (sd.py, sdxl.py, sd3.py, flux.py, ...) subclasses `Family`, fills in the class attributes and
overrides the few methods whose behaviour differs, then registers the instance(s) in registry.py. The trainer,
methods, strategies, caches, sampling, checkpoints and exports talk only to this interface and to
`LoadedModel` (ot_dist/models/loading.py); none of them names a family.

The conditioning dict returned by `encode_text` is the unit of text caching: the text cache stores exactly its
tensors (one per caption line, batch dimension dropped), the reader returns them as `text_<key>` in the batch,
and `predict` receives them back as the same dict. Its tensors are batch-first.
"""

from __future__ import annotations

import copy

from pathlib import Path

import torch

from ot_dist.errors import ConfigError
from ot_dist.models.latent_posterior import encode_posterior
from ot_dist.models.objectives import Objective


# The embedding_keys value replaced by the trained token (embedding.token) in the exported file.
EMBEDDING_TOKEN_KEY = "{token}"
# model.<option>s that belong to one family (its `model_options`): the others refuse them when set
FAMILY_MODEL_OPTIONS = ("wan_expert",)
# A T5 encoder's LoRA targets: attention (T5Attention q / k / v / o) and the gated MLP (wi_0, wi_1, wo), the modules
# kohya's sd-scripts adapt in a T5 (networks/lora_flux.py, lora_sd3.py: T5Attention, T5DenseGatedActDense).
T5_LORA_TARGETS = ("q", "k", "v", "o", "wi_0", "wi_1", "wo")
# A T5's key in an embedding file: OneTrainer's (modules/modelSaver/*/*EmbeddingSaver.py: SD3, Flux, Chroma, PixArt,
# HiDream), and its copy for ComfyUI, whose T5-XXL tokenizers read `t5xxl` (comfy/text_encoders/sd3_clip.py, flux.py,
# pixart_t5.py: SDTokenizer's embedding_key; comfy/sd1_clip.py load_embed picks that key out of the file).
T5_EMBEDDING_KEY = "t5"
T5_EMBEDDING_COPIES = {T5_EMBEDDING_KEY: ("t5xxl",)}


class Family:
    # -- identity and components ------------------------------------------------------------------------
    name: str  # model.family in the config
    description: str  # one line for the config reference
    pipeline_class: str  # the diffusers pipeline that loads / saves / samples the whole model
    inpaint_pipeline_class: str | None = None  # the pipeline of the family's inpainting denoisers, if any
    denoiser: str = "unet"  # the diffusers component name of the denoiser: "unet" or "transformer"
    # Mostly convolutions (a UNet): performance.channels_last auto stores it NHWC on CUDA.
    convolutional_denoiser: bool = False
    text_encoders: tuple[str, ...] = ()  # diffusers component names, in the order encode_text uses them
    tokenizers: tuple[str, ...] = ()  # one per text encoder
    # Text encoders that can take new token vectors (method embedding), with the key each one gets in the
    # embedding file (the layout A1111 / ComfyUI / diffusers read). EMBEDDING_TOKEN_KEY names the key after the
    # trained token: a file of one tensor under the token's name is what `pipe.load_textual_inversion(file)`
    # registers without `token=`. A T5 is listed under OneTrainer's key `t5` (its *EmbeddingSaver), a Gemma under
    # `gemma`, a Llama under `llama`; their tokens get rows after the tokenizer's vocabulary, not the matrix's (a T5's
    # matrix has 28 rows more than its tokenizer has tokens), as OneTrainer's AdditionalEmbeddingWrapper places them.
    embedding_keys: dict[str, str] = {}
    # Further keys under which the file repeats an encoder's vectors, for programs that read another name (file key ->
    # the copies): ComfyUI's T5-XXL tokenizers read `t5xxl` (T5_EMBEDDING_COPIES). `init_from` reads the key or,
    # where the file lacks it, a copy.
    embedding_key_copies: dict[str, tuple[str, ...]] = {}
    # Encoders of embedding_keys whose vectors an `init_from` file may lack (a file of a program that trains the
    # CLIP vectors only: A1111's SDXL layout, ot_dist's SD3 / Flux files before it trained the T5's): those start from
    # init_text. An encoder that is the family's only one is never optional.
    embedding_keys_optional: frozenset[str] = frozenset()
    # Why an embedding's token must be lower case (where the family's training or its sampling pipeline lower-cases
    # the prompt, an upper-case token is never found), or None.
    lowercases_prompts: str | None = None
    # Text encoders whose hidden states an output embedding replaces at its tokens (OneTrainer's is_output_embedding,
    # ot_dist/methods/output_vectors.py), with OneTrainer's file key: its zero input rows under `<key>`, its vectors
    # under `<key>_out`. Empty: the family takes no output embeddings (`text_states` is then never called).
    output_embedding_keys: dict[str, str] = {}
    # Whether the conditioning reads those encoders with the tokenizer's attention mask (PixArt's and Chroma's T5): an
    # output embedding's start (OneTrainer's: the encoder's output of its initial text) is read so too.
    output_states_masked: bool = False

    def text_states(self, encoder: str, output) -> torch.Tensor:
        """The hidden states of `encoder`'s output (a transformers ModelOutput with hidden_states) that the
        conditioning reads: where an output embedding's vectors end up, and what OneTrainer starts them from."""
        raise NotImplementedError

    def output_embedding_conflict(self, model_config) -> tuple[str, str] | None:
        """(config key, why) when the model section rules output embeddings out (SD's layer skip), else None."""
        return None

    # -- LoRA -------------------------------------------------------------------------------------------
    # Module-name suffixes peft adapts, per preset; "default" is what the family's diffusers training script
    # targets. "all_linear" and "all_layers" are derived from the module (every nn.Linear; and every nn.Conv2d) and
    # need no entry.
    denoiser_lora_presets: dict[str, tuple[str, ...]] = {}
    text_lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    # Per text encoder whose modules differ from text_lora_targets' (a T5 beside CLIPs): its own default targets.
    text_lora_targets_by_encoder: dict[str, tuple[str, ...]] = {}

    def text_lora_default_targets(self, encoder: str) -> tuple[str, ...]:
        """The modules a LoRA adapts in `encoder` when lora.text_encoder_targets is unset."""
        return self.text_lora_targets_by_encoder.get(encoder, self.text_lora_targets)

    # -- sharding ---------------------------------------------------------------------------------------
    # Per component, the sub-modules a sharding strategy wraps one by one (a name or a dotted suffix; a
    # ModuleList gives its items). Each unit should be a few % of the component, never half of it.
    shard_units: dict[str, tuple[str, ...]] = {}

    # -- latents ----------------------------------------------------------------------------------------
    # The pipeline attribute that turns pixels into latents: a diffusers VAE, or an encoder with the same `encode`
    # answer (`.latent_dist.mean` / `.std`) that `complete_pipeline` attaches (Stable Cascade's EfficientNet).
    latent_encoder: str = "vae"
    # Edit models (Flux.1 Kontext) see a reference image beside the noisy latents: every sample must have one (a
    # concept's reference_path); a family without them refuses samples that have one (ot_dist/train/references.py).
    reference_images: bool = False
    # An edit model whose pipeline cannot sample without a reference image (QwenImageEditPipeline): a sample prompt
    # without reference_image is refused before training (Kontext's pipeline samples from the prompt alone).
    sample_reference_required: bool = False
    # data.<option>: why this family refuses it (Qwen-Image-Edit's text encoder reads the reference image's pixels,
    # so a text cache of captions cannot serve it); checked before the model loads.
    cache_refusals: dict[str, str] = {}
    # The text encoder reads the reference images' pixels (Qwen-Image-Edit's vision tower): with data.cache_latents
    # the reader gives them beside the cached latents, cropped and augmented as the cache's version.
    text_reads_references: bool = False
    # A video model (Wan, HunyuanVideo): a clip in a concept it does not train on is refused, not left out
    # (concepts.py check_video_clips), since it was surely meant as training data.
    video_model: bool = False
    # A video model that trains on clips (data.video_frames, ot_dist/data/video.py): its VAE's k frames per latent frame
    # after the first (a clip of k n + 1 frames gives n + 1). None: images only, as one-frame videos.
    temporal_compression: int | None = None
    # Edit models that train text-to-image too (FLUX.2 [dev] / [klein]): with references where every sample has one,
    # without them where none has (a mix is refused: ot_dist/train/references.py); sample prompts may give one.
    reference_images_optional: bool = False
    # How many reference images one sample may give the denoiser (a family that takes them): Kontext and
    # Qwen-Image-Edit read one; FLUX.2 and Qwen-Image-Edit-2509 read a list (ot_dist/train/references.py refuses more).
    max_reference_images: int = 1
    # Why this configured family cannot sample (a reason, refused before training when sampling.prompts has any),
    # None where it can: Wan 2.2 A14B's one-expert runs (WanPipeline needs both experts).
    samples_refused: str | None = None
    # The model.<option>s only this family reads (FAMILY_MODEL_OPTIONS); any other family refuses them when set.
    model_options: tuple[str, ...] = ()

    @property
    def takes_reference_images(self) -> bool:
        """Whether the denoiser can see a reference image (training pairs, a sample prompt's reference_image)."""
        return self.reference_images or self.reference_images_optional

    def complete_pipeline(self, pipeline, path: Path, model_config):
        """The loaded pipeline with what its folder's model_index.json does not list (a family's extra encoder)."""
        return pipeline

    def load_folder(self, path: Path, index: dict):
        """The pipeline of a diffusers folder (model_index.json's content in `index`) for a family whose pipeline
        from_pretrained cannot reload it (a component class diffusers does not export); None = from_pretrained."""
        return None

    def folder_components(self, path: Path, given: frozenset[str] = frozenset()) -> dict:
        """Components read here and handed to the pipeline's from_pretrained (folders and single files' config
        folders alike), for a component from_pretrained cannot read in this environment (Qwen-Image-Edit's
        processor, whose video part needs torchvision; Wan 2.2 A14B's one expert); {} for most families. `given`:
        the components the caller passes itself (not to be read here)."""
        return {}

    def save_extras(self, pipeline, folder: Path) -> None:
        """Write into a saved pipeline folder what `complete_pipeline` reads back (nothing for most families): every
        diffusers folder ot_dist writes (the full export, its EMA copy, `ot-dist lora merge`, the demo's models)
        gets these files, so ot_dist loads it again as `model.path`."""

    def save_demo_extras(self, pipeline, folder: Path) -> None:
        """Write what the demo's tiny model folder holds beyond the model itself (Stable Cascade's tiny decoder
        stages, which `model.decoder` names); never part of an export."""

    # Image sides must be multiples of this many pixels: VAE downsampling x the denoiser's own patching (a UNet
    # pads odd sizes itself). data.bucket_step must be a multiple of it.
    pixel_multiple: int = 8
    # Sample image sides (sampling.prompts[].width / height) must be multiples of this: SD3's pipeline refuses other
    # sides, PixArt's fails mid-sampling, Flux's and Chroma's resize them with a warning. The training grid for
    # every family but Stable Cascade, whose combined pipeline takes any side.
    sample_pixel_multiple: int | None = None  # None: pixel_multiple
    # The classifier-free guidance scale of a sample prompt that sets none: OneTrainer's sample default for the
    # family (modules/util/config/SampleConfig.py: 7.0 for SD3; for Flux.1 dev its distilled guidance, 3.5).
    sample_guidance_scale: float = 7.0
    # Whether the sampling pipeline uses a sample prompt's negative_prompt (classifier-free guidance); FluxPipeline
    # ignores it at its default true_cfg_scale of 1 (Flux.1 dev's guidance is distilled, schnell has none).
    sample_negative_prompt: bool = True
    # The default data.bucket_step: bucket sides are multiples of it (OneTrainer's aspect_bucketing_quantization for
    # the family: 64 for SDXL, SD3, Flux, Chroma; 8 for SD 1.x / 2.x).
    bucket_step: int = 64

    # -- starting configs (`ot-dist init`) --------------------------------------------------------------
    # The side the family's base models were trained at (the resolution a new config starts with), and the
    # model of ot_dist/memory/table.py whose byte counts stand for this family's (None: no starting presets).
    native_resolution: int = 1024
    # SDPA kernels that `performance.attention_backend: auto` leaves out on CUDA for this denoiser, because they
    # computed it wrongly on a GPU we measured (see the family's value); an explicit backend is still honoured.
    attention_kernels_avoided: tuple[str, ...] = ()
    memory_reference: str | None = None

    # -- text -----------------------------------------------------------------------------------------
    # The text encoders whose output layer model.<encoder>_layer_skip moves back (OneTrainer's
    # text_encoder_layer_skip, A1111's "clip skip"); `layer_skip` holds the configured skips (configure).
    layer_skip_encoders: tuple[str, ...] = ()
    layer_skip: dict[str, int] = {}

    def configure(self, model_config) -> "Family":
        """The family with the config's model-section settings applied (a copy when they differ; instances are
        shared): the text encoders' layer skips here, a family's own settings in its override. A family-specific
        model option set for another family is refused."""
        for option in FAMILY_MODEL_OPTIONS:
            if getattr(model_config, option, None) is not None and option not in self.model_options:
                raise ConfigError(f"model.{option}: model.family {self.name} has no such setting; remove it")
        return self.with_layer_skip(model_config)

    def with_layer_skip(self, model_config) -> "Family":
        skips = {name: getattr(model_config, f"{name}_layer_skip", 0) for name in self.layer_skip_encoders}
        skips = {name: skip for name, skip in skips.items() if skip}
        if skips == self.layer_skip:
            return self
        family = copy.copy(self)
        family.layer_skip = skips
        return family

    # -- objective --------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> Objective:
        """The training objective for a loaded pipeline and the config's model section."""
        raise NotImplementedError

    def objective_kind(self) -> str:
        """"ddpm" or "flow", known without loading anything: config validation refuses options that do not apply."""
        raise NotImplementedError

    # Why model.zero_terminal_snr does not apply to the family (None: its DDPM betas are rescaled, as diffusers'
    # rescale_betas_zero_snr does; the family's loaders apply it), checked when the config is validated.
    zero_terminal_snr_refusal: str | None = "has no discrete DDPM beta schedule to rescale"

    # -- sampling ---------------------------------------------------------------------------------------
    samplers: tuple[str, ...] = ("flow_euler",)  # sampling.sampler values that fit the objective; the first is auto
    # Whether the sampling pipeline's call takes guidance_rescale (sampling.prompts[].guidance_rescale): diffusers'
    # SD and SDXL pipelines do; SD3's, Flux's, Chroma's, PixArt's and Stable Cascade's do not.
    sample_guidance_rescale: bool = False

    def sampling_overrides(self, objective: Objective) -> dict:
        """Scheduler config entries that make sampling match training (e.g. the prediction type)."""
        return {}

    def pipeline_call_options(self, pipeline) -> dict:
        """Extra keyword arguments of the pipeline call that make sampling see the text as training does
        (e.g. the T5 sequence length, SD's clip_skip)."""
        return {}

    # The diffusers pipeline class of frozen decoder stages that sampling needs beside the trained model (Stable
    # Cascade's stage B + VQGAN); `model.decoder` names their folder, `load_decoder` reads it. None = the loaded
    # pipeline samples by itself.
    decoder_pipeline_class: str | None = None

    def load_decoder(self, path: Path):
        """The decoder stages of the folder `model.decoder` names (a pipeline object holding their modules); the
        family's `complete_pipeline` attaches them to the loaded pipeline."""
        raise NotImplementedError

    def sampling_modules(self, pipeline) -> list[torch.nn.Module]:
        """Frozen modules beyond the VAE and the text encoders (Stable Cascade's decoder stages, which only sampling
        uses; SD 2.0 depth's depth estimator): stored like the VAE, kept on the device unless
        `sampling_modules_offloadable`."""
        return []

    # Whether offload_frozen_components may keep the sampling modules in CPU memory like the text encoders and VAE:
    # only where a module the pipeline computes on stays on the device, which is the device the pipeline makes its
    # latents on (diffusers' `DiffusionPipeline.device` prefers an accelerator component). Not Stable Cascade's
    # decoder stages: their own pipeline holds nothing else.
    sampling_modules_offloadable: bool = False

    def samples_refusal(self, loaded_pipeline) -> str | None:
        """Why this loaded model cannot sample (`samples_refused`, or a variant's reason known once it is loaded)."""
        return self.samples_refused

    def sampling_pipeline(self, components: dict, loaded_pipeline):
        """The pipeline that samples, from `components` (the loaded pipeline's, the gathered copies of the trained
        modules, a fresh scheduler) and the loaded pipeline's own options (e.g. SDXL's
        force_zeros_for_empty_prompt); samples show what the model learnt: no safety checker, no watermark."""
        import inspect

        pipeline_cls = self.sampling_pipeline_cls(loaded_pipeline)
        accepted = inspect.signature(pipeline_cls.__init__).parameters
        options = {k: v for k, v in loaded_pipeline.config.items() if k in accepted and k not in components}
        options.update(requires_safety_checker=False, add_watermarker=False)
        if "safety_checker" in components:
            components = {**components, "safety_checker": None}
        return pipeline_cls(**{k: v for k, v in {**components, **options}.items() if k in accepted})

    def sampling_pipeline_cls(self, loaded_pipeline):
        """The pipeline class that samples: the family's text-to-image one, or its inpainting one for an inpainting
        model (loaded as one: a 9-channel UNet cannot sample through the text-to-image pipeline)."""
        if type(loaded_pipeline).__name__ == self.inpaint_pipeline_class:
            return type(loaded_pipeline)
        return self.pipeline_cls()

    def sampling_arguments(self, pipeline, arguments: dict) -> dict:
        """The keyword arguments of the sampling pipeline's call, from the generic ones (prompt, negative_prompt,
        width, height, num_inference_steps, guidance_scale, generator, output_type)."""
        return {**arguments, **self.pipeline_call_options(pipeline)}

    def sampled_image(self, output):
        """The image of the sampling pipeline's output (a video pipeline's first frame of its first video)."""
        return output.images[0]

    # -- text -------------------------------------------------------------------------------------------
    def tokenize(self, tokenizers: dict, captions: list[str]) -> dict[str, torch.Tensor]:
        """Token ids (and attention masks, `<encoder>_mask`) per text encoder."""
        tokens = {}
        for encoder_name, tokenizer_name in zip(self.text_encoders, self.tokenizers):
            tokenizer = tokenizers[tokenizer_name]
            tokens[encoder_name] = tokenizer(
                captions, padding="max_length", max_length=self.max_tokens(tokenizer_name, tokenizer),
                truncation=True, return_tensors="pt",
            ).input_ids
        return tokens

    def tokenize_batch(self, model, captions: list[str], batch: dict) -> dict[str, torch.Tensor]:
        """`tokenize` for a training batch (the loaded `model`, the batch's other tensors at hand): a family whose
        text encoder reads the reference image too (Qwen-Image-Edit's processor) overrides it."""
        return self.tokenize(model.tokenizers, captions)

    def max_tokens(self, tokenizer_name: str, tokenizer) -> int:
        return tokenizer.model_max_length

    def encode_text(self, text_encoders: dict, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The conditioning dict the denoiser needs, from `tokenize`'s output."""
        raise NotImplementedError

    # -- latents ----------------------------------------------------------------------------------------
    def latent_shape(self, vae, pixel_height: int, pixel_width: int) -> torch.Size:
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        return torch.Size((vae.config.latent_channels, pixel_height // factor, pixel_width // factor))

    def clip_latent_shape(self, vae, frames: int, pixel_height: int, pixel_width: int) -> torch.Size:
        """A video model's latent shape (C, F', h, w) of a clip of `frames` frames; other families train no clips
        (check_clip_settings refuses data.video_frames for them)."""
        raise NotImplementedError(f"{self.name} trains no video clips")

    def encode_posterior(self, vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the VAE posterior of images (B, 3, H, W), each (B, C, h, w): what the latent cache stores and
        the loss samples from. A VAE of videos (Qwen-Image's) takes the images as one-frame clips here; a deterministic
        encoder (Sana's DC-AE) gives std zero."""
        return encode_posterior(vae, pixels)

    def normalize_latents(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """A VAE sample -> the denoiser's latent space: (x - shift) x scale, or a per-channel mean / std."""
        config = vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is not None and std is not None:
            view = (1, -1) + (1,) * (latents.dim() - 2)
            latents = (latents - torch.tensor(mean).view(view).to(latents)) / torch.tensor(std).view(view).to(latents)
            return latents * getattr(config, "scaling_factor", 1.0)  # Qwen-Image's VAE has mean / std only
        shift = getattr(config, "shift_factor", None) or 0.0
        return (latents - shift) * config.scaling_factor

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy: torch.Tensor, timesteps: torch.Tensor, conditioning: dict[str, torch.Tensor],
                batch: dict) -> torch.Tensor:
        """The denoiser's prediction for `noisy` latents (B, C, h, w) at `timesteps` (the objective's units),
        in the same latent layout as `noisy` (a family that packs latents unpacks the prediction)."""
        raise NotImplementedError

    def training_prediction(self, denoiser, noisy: torch.Tensor, timesteps: torch.Tensor,
                            conditioning: dict[str, torch.Tensor], batch: dict, latents: torch.Tensor,
                            objective: Objective, options) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the prediction compared with the objective's target, an elementwise extra loss term or None) for one
        training step; `latents` are the clean latents, `options` the loss section. A denoiser whose output holds
        more than the prediction (PixArt's learned variance) computes the term for the rest here; the default is
        `predict` and no extra term."""
        return self.predict(denoiser, noisy, timesteps, conditioning, batch), None

    # -- variants ---------------------------------------------------------------------------------------
    # The denoiser's input channels when it is an inpainting model (inpaint_pipeline_class), and what they hold, in
    # the words config errors use; None: the family has no inpainting models.
    inpainting_in_channels: int | None = None
    inpainting_input: str = ""

    def is_inpainting(self, denoiser) -> bool:
        """A denoiser whose input is noisy latent + the repaint mask + the masked image's latent (SD's 9-channel UNets,
        Flux.1 Fill's 384-channel transformer)."""
        return self.inpainting_in_channels is not None and denoiser.config.in_channels == self.inpainting_in_channels

    # The pipeline of the family's depth-conditioned denoisers (SD 2.0 depth), if any: their input is noisy latent +
    # a depth map of the image that the pipeline's depth_estimator computes (ot_dist/models/depth.py).
    depth_pipeline_class: str | None = None

    def is_depth_conditioned(self, denoiser) -> bool:
        return False

    def depth_condition(self, pipeline, pixels: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
        """(B, k, h, w): what a depth-conditioned denoiser sees beside the noisy latents, from the batch's pixels."""
        raise NotImplementedError

    def inpainting_condition(self, masks: torch.Tensor, masked_latents: torch.Tensor) -> torch.Tensor:
        """What an inpainting denoiser sees beside the noisy latents, on the latent grid and concatenated after them
        along the channels: from the binary repaint masks (B, 1, H, W) at pixel size and the masked image's latents
        (B, C, h, w). The default is SD's inpainting pipelines': the mask scaled to latent size by nearest
        interpolation, then the masked-image latent (B, 1 + C, h, w)."""
        mask = torch.nn.functional.interpolate(masks, size=tuple(masked_latents.shape[-2:]))  # nearest
        return torch.cat([mask.to(masked_latents), masked_latents], dim=1)

    # -- single files -----------------------------------------------------------------------------------
    # Whether the family has a single-file layout (load_single_file / export_single_file); without one the full
    # method exports the diffusers folder only.
    single_file: bool = True
    # Whether that file can hold trained text encoders (as a full checkpoint); False: the file is the denoiser alone
    # and a trained text encoder is exported in the diffusers folder only (Qwen-Image: ComfyUI reads its text encoder
    # from a separate file).
    single_file_text_encoders: bool = True
    # A transformer family whose single file is one key map (single_file_keys.py `TransformerFileLayout`) names it
    # as "module:ATTRIBUTE" (imported when a file is read or written, not with the family); the defaults below then
    # load, export and describe that file, and the family writes none of them.
    transformer_file_layout: str = ""

    def file_layout(self):
        """The declared `TransformerFileLayout` (None: the family has its own single-file code, or none)."""
        if not self.transformer_file_layout:
            return None
        import importlib

        module, attribute = self.transformer_file_layout.split(":")
        return getattr(importlib.import_module(module), attribute)

    def load_single_file(self, path: Path, config_folder: str | None, model_config):
        """A pipeline from one .safetensors file in the family's original layout."""
        layout = self.file_layout()
        if layout is None:
            raise NotImplementedError(f"model.path: {self.name} models load from a diffusers folder only")
        from ot_dist.models.families.transformer_single_file import load_transformer_file

        return load_transformer_file(path, config_folder, self, layout.from_original, layout.validate, model_config)

    def export_single_file(self, components: dict[str, torch.nn.Module], states: dict[str, dict],
                           path: Path, dtype: torch.dtype, with_text_encoders: bool = False,
                           metadata: dict[str, str] | None = None) -> None:
        """Write the trained model as one file in the family's original layout (what from_single_file reads), with
        `metadata` (its ModelSpec header) in the file's header beside the layout's own keys.
        `with_text_encoders` (a run that trained a text encoder, a merge that changed one): the file must carry the
        text encoders, as a full checkpoint where the family's own file is the denoiser alone (`full_checkpoint`).
        With a declared layout: the denoiser alone with bare keys (a trained text encoder of a family without
        `single_file_text_encoders` goes to the diffusers folder only)."""
        layout = self.file_layout()
        if layout is None or (with_text_encoders and self.single_file_text_encoders):
            raise NotImplementedError
        from ot_dist.models.families.transformer_single_file import write_transformer_file

        state = layout.to_original(states[self.denoiser], dict(components[self.denoiser].config))
        write_transformer_file(state, path, dtype, metadata)

    # The components a separate file may replace (`model.component_files`: ComfyUI's clip_l / t5xxl / ae files and
    # the like), each with the layout its file has (ot_dist/models/families/component_files.py); the model.config
    # folder then needs only their configs. Empty: the family takes every component from its folder or single file.
    component_files: dict = {}

    # Where a full checkpoint (ComfyUI's Load Checkpoint: denoiser, VAE, text encoders in one file) holds each
    # component, for the families whose own single file is the denoiser (ot_dist/models/families/full_checkpoint.py).
    full_checkpoint = None

    # -- LoRA files -------------------------------------------------------------------------------------
    # The kohya-style prefix of each component's modules in a LoRA file (ComfyUI, A1111 / Forge, kohya read
    # these); None = the family writes the diffusers layout only. See ot_dist/methods/lora_layouts.py.
    lora_file_prefixes: dict[str, str] | None = None
    # kohya's `ss_base_model_version` for the family's kohya-layout files ("sd_v1", "sd_v2", "sdxl_base_v1-0"; with
    # `ss_v2`): A1111 sorts LoRAs by it (extensions-builtin/Lora/network.py `detect_version`) and takes a file whose
    # metadata names no version for SD 1.x, which its Lora page hides while an SDXL or SD 2.x checkpoint is loaded.
    lora_base_model_version: str | None = None
    # Per component, a module level the file's names carry that the loaded module may lack (transformers 5's
    # CLIPTextModel has no `text_model.`); inserted only where the module has no child of that name.
    lora_file_roots: dict[str, str] = {}
    # Per component, {module path: the path the file names instead} for modules whose kohya name is not their
    # diffusers path (Stable Cascade's `*.attention.to_q` -> `*.attention.attn.to_q`).
    lora_file_renames: dict[str, dict[str, str]] = {}

    def lora_file_module_renames(self, component: str, module: torch.nn.Module) -> dict[str, str]:
        """`lora_file_renames` for one loaded component; a family whose kohya names depend on the component's
        config (SDXL's original UNet paths) computes them here."""
        return dict(self.lora_file_renames.get(component, {}))
    # Per component, in a diffusers-layout file: a kohya-style name prefix under which that component's modules are
    # written instead of `<component>.<path>` (`<prefix>_<path with "_">.lora_A.weight` / `.lora_B.weight` and an
    # `.alpha` tensor). ComfyUI maps T5-XXL LoRA modules only by such names (comfy/lora.py model_lora_keys_clip:
    # `lora_te{N}_<T5 path>`, N counting the CLIP encoders the model has), never as `text_encoder_2.<path>`.
    lora_file_kohya_components: dict[str, str] = {}
    # Per component, in a diffusers-layout file: {module path prefix: the name prefix written instead} (dotted names,
    # peft's suffixes and an `.alpha` tensor); paths under no listed prefix keep `<component>.<path>`. For text encoders
    # that ComfyUI maps only by its own state-dict keys (comfy/lora.py model_lora_keys_clip: `text_encoders.<key>`).
    lora_file_component_paths: dict[str, dict[str, str]] = {}
    # Other trainers' names, read by `ot-dist lora merge` and `lora.init_from` (ot_dist/lora_tools/foreign.py):
    # per component, prefixes naming its modules by their diffusers path with "_" for "." (OneTrainer's
    # `lora_transformer_`, `lora_te2_` for Flux's T5); the component's `lora_file_roots` level applies.
    lora_foreign_prefixes: dict[str, tuple[str, ...]] = {}
    # (prefix, separator) pairs naming the denoiser's modules by their original single-file paths (kohya sd-scripts'
    # `lora_unet_double_blocks_0_img_attn_qkv`, ComfyUI's `diffusion_model.double_blocks.0.img_attn.qkv`); the
    # paths and how fused modules split come from `denoiser_original_rules`.
    lora_original_prefixes: tuple[tuple[str, str], ...] = ()

    # `lora.variant: oft` in the diffusers layout (ot_dist/methods/oft_file.py): True where ComfyUI maps every
    # `transformer.<path>` of the family onto a whole weight in the same row order or onto a block of a fused weight's
    # output rows (comfy/lora.py model_lora_keys_unet with utils.flux_to_diffusers / mmdit_to_diffusers /
    # pixart_to_diffusers: q, k, v slices of qkv), so that the rotation it applies to those rows is the trained one.
    # False: not read there as trained, or not checked (oft is refused in that layout).
    lora_oft_diffusers_layout: bool = False

    def lora_oft_reordered_modules(self, denoiser: torch.nn.Module) -> list[str]:
        """The denoiser's module paths ComfyUI maps onto a weight whose rows it orders otherwise (swap_scale_shift:
        shift | scale there, scale | shift in diffusers). Its OFT rule rotates the blocks of its own rows and swaps
        the change afterwards, which is not the trained rotation, so oft leaves these modules out."""
        return []

    def extra_lora_files(self, model, states: dict[str, dict], adapter_configs: dict[str, dict], target: Path,
                         dtype: torch.dtype, modelspec: dict[str, str]) -> list[Path]:
        """Files written beside the LoRA file `target` (`lora<suffix>.safetensors`): the same adapters in the names of
        a program that reads neither layout, where no one file serves it and diffusers (Lumina 2: ComfyUI's fused
        q|k|v names). `states` / `adapter_configs`: per trained part, peft's state dict and adapter config;
        `modelspec`: the header of a file in the original module names. None for most families."""
        return []

    def denoiser_original_rules(self, config) -> list:
        """The single-file key rules (ot_dist/models/families/single_file_keys.py `Rule`) of a denoiser with this
        config: original key <- diffusers key(s). Empty for families without an original layout."""
        layout = self.file_layout()
        return [] if layout is None else layout.rules(config)

    # -- ModelSpec identity ------------------------------------------------------------------------------
    # What the `modelspec.*` header of every file ot_dist writes says about the base model (Stability AI's model
    # metadata spec, which kohya sd-scripts, ComfyUI and OneTrainer write and SwarmUI / model browsers read; see
    # ot_dist/checkpoint/modelspec.py). `modelspec_architecture`: the base model's architecture id (kohya's or the
    # spec's string; a file kind adds `/lora` or `/textual-inversion`). `modelspec_implementation`: the codebase whose
    # names the family's original single-file keys follow. `modelspec_kohya_lora_implementation`: the codebase whose
    # module paths the family's kohya-layout LoRA names carry (diffusers' for SD 1.x / 2.x, as kohya says).
    modelspec_architecture: str = ""
    modelspec_implementation: str = "diffusers"
    modelspec_kohya_lora_implementation: str = "diffusers"

    def modelspec_architecture_of(self, denoiser_config, prediction_type: str | None, inpainting: bool) -> str:
        """The architecture id of a loaded model: a family whose variants differ in what inference must do (SD 2.x
        v / epsilon, SD 3 / 3.5, Flux dev / schnell) tells them apart by the denoiser's config here."""
        return self.modelspec_architecture

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **options):
        """A randomly initialised pipeline of the real architecture, small enough to train on a CPU in
        tests and the demo, with offline tokenizers."""
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------------------
    def pipeline_cls(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def pipeline_classes(self) -> tuple[str, ...]:
        """Pipeline classes a diffusers folder of this family may name in its model_index.json."""
        return tuple(c for c in (self.pipeline_class, self.inpaint_pipeline_class, self.depth_pipeline_class) if c)
