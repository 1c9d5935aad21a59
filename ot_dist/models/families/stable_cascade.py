"""Stable Cascade (Würstchen v3) and Würstchen v2: training the prior, stage C, as OneTrainer does. Two families,
one module: both denoise EfficientNetV2-S latents with Würstchen's continuous cosine schedule; `wuerstchen_v2`
(below the Stable Cascade class) differs in its prior (`WuerstchenPrior`), text input and latent scaling.

- Components: the diffusers `StableCascadePriorPipeline` folder (prior, CLIP-G `CLIPTextModelWithProjection`,
  tokenizer, `DDPMWuerstchenScheduler`), plus Stability's `effnet_encoder.safetensors` (EfficientNetV2-S + mapper,
  ot_dist/models/efficientnet.py) put into that folder: it turns images into stage C's 16-channel latents (a 1024 px
  side -> 24) and is cached like VAE latents (data.cache_latents). The latents are used as they come (OneTrainer
  scales only Würstchen v2's).
- Text: CLIP-G's last hidden states (`clip_text`) and projected pooled output (`clip_text_pooled`, one token); the
  image conditioning `clip_img` is zeros, as OneTrainer trains text-to-image.
- Objective: epsilon on the continuous cosine schedule, t in (0, 1] (ot_dist/models/objectives.py ContinuousCosine),
  OneTrainer's draw (i + 1) / 10000 + 0.001; loss.weight_fn (P2, MIN_SNR_GAMMA, ...) from alpha-bar(t).
- LoRA: diffusers 0.42 gives StableCascadeUNet no `add_adapter`; ot_dist's LoRA injects peft directly. The file is
  kohya-style under `lora_prior_unet_` with the original stage C module paths (the prefix ComfyUI maps onto stage C
  and OneTrainer writes); diffusers' `to_out.0` of the attention is the original `out_proj`. CLIP-G modules are
  `lora_prior_te_text_model_…` / `lora_prior_te_text_projection`, the names ComfyUI maps for Stable Cascade's CLIP-G.
- Sampling needs the frozen decoder stages (stage B and the Paella VQGAN) that a prior folder does not hold:
  `model.decoder` names their folder, loaded component by component and attached as `pipeline.decoder_stages`;
  samples come from diffusers' combined pipeline over the trained prior and them (ot_dist/models/families/
  cascade_decoder.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.models.families.base import Family
from ot_dist.models.families.full_checkpoint import FullCheckpoint
from ot_dist.models.objectives import ContinuousCosine
from ot_dist.train.transfer import to_device

# Attention projections (SDCascadeAttnBlock's self+cross attention) and the text-conditioning kv mapper:
# OneTrainer's "attn-only" filter for Stable Cascade is the attention; "attention_mlp" adds the blocks' channel MLP.
CASCADE_ATTENTION = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
CASCADE_ATTENTION_MLP = CASCADE_ATTENTION + ("kv_mapper.1", "channelwise.0", "channelwise.4")
CLIP_IMAGE_TOKENS = 1  # the pipeline's zero image embedding for text-to-image: one token
TINY_DECODER_FOLDER = "decoder_stages"  # where the demo's tiny models keep their decoder stages


class StableCascade(Family):
    name = "stable_cascade"
    description = "Stable Cascade stage C prior (StableCascadeUNet on EfficientNetV2-S latents, CLIP-G)"
    pipeline_class = "StableCascadePriorPipeline"
    denoiser = "prior"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    # Textual inversion on the prior's CLIP (CLIP-G; Würstchen v2's is CLIP-bigG's text model too): the file holds
    # {"clip_g": [vectors, 1280]}, the key ComfyUI's Stable Cascade tokenizer reads (comfy/sdxl_clip.py
    # StableCascadeClipGTokenizer: embedding_key "clip_g", embedding_size 1280) and OneTrainer's Würstchen / Stable
    # Cascade embedding saver writes.
    embedding_keys = {"text_encoder": "clip_g"}
    output_embedding_keys = {"text_encoder": "clip_g"}  # OneTrainer's WuerstchenEmbeddingSaver: clip_g, clip_g_out
    denoiser_lora_presets = {"default": CASCADE_ATTENTION, "attention": CASCADE_ATTENTION,
                             "attention_mlp": CASCADE_ATTENTION_MLP}

    def text_states(self, encoder, output):
        return output.hidden_states[-1]  # the last layer without the final norm (OneTrainer's Stable Cascade too)

    # down_blocks / up_blocks are lists of lists: each inner list (a level) holds the Res / Timestep / Attn blocks;
    # a unit is one block of a level (3.6 B: 192 units, the largest 1.4 %).
    shard_units = {"prior": ("down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"),
                   "text_encoder": ("encoder.layers",)}
    pixel_multiple = 128  # x 3/4 / 32: whole latents (a 128 px side -> 3)
    sample_pixel_multiple = 8  # the combined pipeline samples any side (docs/sampling.md: 64 px -> 84 px)
    sample_guidance_scale = 4.0  # OneTrainer's and StableCascadeCombinedPipeline's prior guidance
    bucket_step = 128
    latent_encoder = "effnet"
    samplers = ("wuerstchen",)  # the prior's DDPMWuerstchenScheduler; the decoder stages keep their own
    decoder_pipeline_class = "StableCascadeDecoderPipeline"
    combined_pipeline_class = "StableCascadeCombinedPipeline"
    # Stage B's steps and guidance (the sample prompt's steps / guidance_scale drive the prior): Stability's model
    # card decodes with 10 steps, guidance 0.
    decoder_steps, decoder_guidance_scale = 10, 0.0
    memory_reference = "Stable Cascade C"  # the 3.6 B prior; the lite prior (1 B): its own row
    # ComfyUI (comfy/lora.py model_lora_keys_clip) maps Stable Cascade's CLIP-G, loaded without a CLIP-L, by
    # `lora_prior_te_text_model_encoder_layers_<b>_<module>` and `lora_prior_te_text_projection` (the projection has no
    # `lora_te_` name there); OneTrainer writes the same `lora_prior_te` / `lora_prior_unet` prefixes.
    lora_file_prefixes = {"prior": "lora_prior_unet", "text_encoder": "lora_prior_te"}
    lora_file_roots = {"text_encoder": "text_model"}
    # diffusers' Attention of an SDCascadeAttnBlock is the original Attention2D's `attn` (nn.MultiheadAttention,
    # which ComfyUI splits into to_q / to_k / to_v and keeps `out_proj`); the other modules keep their names.
    lora_file_renames = {"prior": {"*.attention.to_q": "*.attention.attn.to_q",
                                   "*.attention.to_k": "*.attention.attn.to_k",
                                   "*.attention.to_v": "*.attention.attn.to_v",
                                   "*.attention.to_out.0": "*.attention.attn.out_proj"}}
    # ComfyUI's Stable_Cascade_C (comfy/supported_models.py): text_encoder_key_prefix "text_encoder.", its
    # StableCascadeClipModel names CLIP-G clip_g; the layout of a stage C checkpoint ComfyUI's Load Checkpoint reads.
    full_checkpoint = FullCheckpoint(text_encoders={"text_encoder": "text_encoder.clip_g.transformer."})
    time_scale = 1.0  # ContinuousCosine's scale (Würstchen v2: 1.08)
    # The spec's own id for stage C (`stable-cascade-v1-stage-a` / `b` / `c`; SwarmUI's class); the single file and the
    # kohya-layout LoRA name the modules of Stability's StableCascade code (its Attention2D's `attn.out_proj`).
    modelspec_architecture = "stable-cascade-v1-stage-c"
    modelspec_implementation = "https://github.com/Stability-AI/StableCascade"
    modelspec_kohya_lora_implementation = "https://github.com/Stability-AI/StableCascade"
    effnet_affine = False  # Stable Cascade's mapper BatchNorm has no weight / bias

    def objective(self, pipeline, model_config) -> ContinuousCosine:
        if model_config.prediction_type not in ("auto", "epsilon"):
            from ot_dist.errors import ConfigError

            raise ConfigError(f"model.prediction_type: {self.name} predicts epsilon only (DDPMWuerstchenScheduler)")
        return ContinuousCosine(scale=self.time_scale)

    def objective_kind(self) -> str:
        return "ddpm"

    def complete_pipeline(self, pipeline, path: Path, model_config):
        from ot_dist.errors import InputFileError
        from ot_dist.models.efficientnet import FILE_NAME, EffnetConfig, load_effnet

        file = path / FILE_NAME
        if not file.is_file():
            raise InputFileError(f"model.path: {path} has no {FILE_NAME}: put Stability's stage C image encoder "
                                 f"(stabilityai/stable-cascade, {FILE_NAME}) into the prior folder")
        pipeline.effnet = load_effnet(file, None if file.with_name("effnet_encoder.json").is_file()
                                      else EffnetConfig(affine=self.effnet_affine))
        if getattr(model_config, "decoder", None) is not None:
            decoder = Path(model_config.decoder)
            if not decoder.is_dir():
                raise InputFileError(f"model.decoder: {decoder.resolve()} is not a folder (expected a "
                                     f"{self.decoder_pipeline_class} diffusers folder)")
            pipeline.decoder_stages = self.load_decoder(decoder)
        return pipeline

    # -- sampling: the trained prior, then the frozen decoder stages (cascade_decoder.py) ---------------------
    def load_decoder(self, path: Path):
        from ot_dist.models.families.cascade_decoder import load_stable_cascade_decoder

        return load_stable_cascade_decoder(path)

    def sampling_modules(self, pipeline) -> list[torch.nn.Module]:
        from ot_dist.models.families.cascade_decoder import decoder_modules

        decoder = getattr(pipeline, "decoder_stages", None)
        return [] if decoder is None else decoder_modules(decoder)

    def sampling_pipeline(self, components: dict, loaded_pipeline):
        from ot_dist.models.families.cascade_decoder import combined_pipeline

        return combined_pipeline(self.combined_pipeline_class, components, loaded_pipeline.decoder_stages)

    def sampling_arguments(self, pipeline, arguments: dict) -> dict:
        """The prompt's steps and guidance drive the prior; the decoder stages run with the family's."""
        arguments = dict(arguments)
        arguments["prior_num_inference_steps"] = arguments.pop("num_inference_steps")
        arguments["prior_guidance_scale"] = arguments.pop("guidance_scale")
        return {**arguments, "num_inference_steps": self.decoder_steps,
                "decoder_guidance_scale": self.decoder_guidance_scale}

    # -- single files: Stability's stage_c.safetensors layout (ot_dist/models/families/cascade_single_file.py) --
    def load_single_file(self, path, config_folder, model_config):
        from ot_dist.models.families.cascade_single_file import cascade_from_original, validate_cascade_file
        from ot_dist.models.families.transformer_single_file import load_transformer_file

        pipeline = load_transformer_file(path, config_folder, self, cascade_from_original, validate_cascade_file)
        return self.complete_pipeline(pipeline, Path(config_folder), model_config)

    def export_single_file(self, components, states, path, dtype, with_text_encoders=False, metadata=None):
        """The prior alone, bare keys, as Stability ships stage_c.safetensors; when a run trained the text encoder, a
        checkpoint as ComfyUI's Load Checkpoint reads one: the prior under model.diffusion_model., CLIP-G beside it
        (no VAE: stage C's EfficientNet / previewer come from their own files, as with the bare stage C)."""
        from ot_dist.models.families.cascade_single_file import cascade_to_original
        from ot_dist.models.families.full_checkpoint import DENOISER_PREFIX
        from ot_dist.models.families.transformer_single_file import write_transformer_file

        state = cascade_to_original(states["prior"])
        if with_text_encoders:
            state = {DENOISER_PREFIX + k: v for k, v in state.items()}
            state |= self.full_checkpoint.component_keys(components, states)
        write_transformer_file(state, path, dtype, metadata)

    # -- latents ----------------------------------------------------------------------------------------
    def latent_shape(self, vae, pixel_height, pixel_width):
        return torch.Size((vae.config.c_latent, vae.latent_size(pixel_height), vae.latent_size(pixel_width)))

    def normalize_latents(self, vae, latents):
        return latents  # the mapper's BatchNorm already normalises them (OneTrainer: used as they are)

    # -- text -------------------------------------------------------------------------------------------
    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        encoded = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        # As the prior pipeline: the attention mask in, the last hidden states and the projected pooled output.
        out = encoder(to_device(tokens["text_encoder"], encoder.device),
                      attention_mask=to_device(tokens["text_encoder_mask"], encoder.device), output_hidden_states=True)
        return {"hidden": self.text_states("text_encoder", out), "pooled": out.text_embeds.unsqueeze(1)}

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        hidden = conditioning["hidden"]
        clip_img = torch.zeros(hidden.shape[0], CLIP_IMAGE_TOKENS, denoiser.config.clip_image_in_channels,
                               device=hidden.device, dtype=hidden.dtype)
        return denoiser(noisy, timestep_ratio=timesteps.to(noisy.dtype), clip_text_pooled=conditioning["pooled"],
                        clip_text=hidden, clip_img=clip_img, return_dict=False)[0]

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import DDPMWuerstchenScheduler, StableCascadePriorPipeline, StableCascadeUNet
        from transformers import CLIPTextModelWithProjection

        from ot_dist.models.efficientnet import EfficientNetEncoder, tiny_effnet_config
        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer()
        # The real block layout (two levels of Res / Timestep / Attn blocks, sca / crp time conditioning), narrow.
        prior = StableCascadeUNet(
            in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64, patch_size=1, conditioning_dim=32,
            block_out_channels=(32, 32), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1),
            up_num_layers_per_block=(1, 1), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
            block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),) * 2,
            clip_text_in_channels=TEXT_HIDDEN, clip_text_pooled_in_channels=TEXT_HIDDEN, clip_image_in_channels=16,
            clip_seq=4, kernel_size=3, dropout=(0.0, 0.0), self_attn=True, timestep_conditioning_type=("sca", "crp"),
            switch_level=(False,))
        pipeline = StableCascadePriorPipeline(
            tokenizer=tokenizer, text_encoder=CLIPTextModelWithProjection(clip_text_config(len(tokenizer), "gelu")),
            prior=prior, scheduler=DDPMWuerstchenScheduler())
        pipeline.effnet = EfficientNetEncoder(tiny_effnet_config())
        pipeline.decoder_stages = self.build_tiny_decoder(pipeline)
        return pipeline

    def build_tiny_decoder(self, prior_pipeline):
        """Tiny stage B + VQGAN; the decoder folder's text encoder is the prior's CLIP-G, as in Stability's folders."""
        from ot_dist.models.families.cascade_decoder import tiny_stable_cascade_decoder

        encoder = prior_pipeline.text_encoder
        return tiny_stable_cascade_decoder(prior_pipeline.tokenizer, encoder, encoder.config.projection_dim)

    def save_extras(self, pipeline, folder: Path) -> None:
        """The EfficientNet into the prior folder (what complete_pipeline reads): exports and merges of the prior
        hold it, so they train on and extract LoRAs like the base folder. The decoder stages are never written here:
        they are frozen and their own folder (model.decoder) serves every prior trained from them."""
        from ot_dist.models.efficientnet import save_effnet

        save_effnet(pipeline.effnet, folder)

    def save_demo_extras(self, pipeline, folder: Path) -> None:
        """The tiny decoder stages (built by build_tiny) into the demo folder's `decoder_stages/` subfolder, the
        folder the demo's model.decoder names."""
        from ot_dist.models.families.cascade_decoder import save_decoder

        if getattr(pipeline, "decoder_stages", None) is not None:
            save_decoder(pipeline.decoder_stages, folder / TINY_DECODER_FOLDER)


class WuerstchenV2(StableCascade):
    """Würstchen v2's prior (`WuerstchenPrior`: one level of Res / Timestep / Attn blocks) conditioned on CLIP's last
    hidden states (`c`), the time as `r`. Its latents are the EfficientNet's (affine mapper norm) as (x + 1) / 42
    (OneTrainer; the pipeline undoes it with latent_mean 42, latent_std 1), its time t x 1.08 + 0.001. diffusers 0.42
    keeps WuerstchenPrior under `deprecated` and a saved pipeline folder does not reload by itself
    ("`diffusers` has no class `WuerstchenPrior`", even with the prior passed in): `load_folder` loads the
    components one by one and builds the pipeline."""

    name = "wuerstchen_v2"
    description = "Würstchen v2 prior (WuerstchenPrior on EfficientNetV2-S latents, CLIP last hidden states)"
    pipeline_class = "WuerstchenPriorPipeline"
    denoiser_lora_presets = {"default": CASCADE_ATTENTION, "attention": CASCADE_ATTENTION,
                             "attention_mlp": CASCADE_ATTENTION_MLP}
    shard_units = {"prior": ("blocks",), "text_encoder": ("encoder.layers",)}

    def text_states(self, encoder, output):
        return output.last_hidden_state  # after the final norm (OneTrainer's Würstchen v2 too)
    single_file = False  # no original single-file layout of Würstchen v2's prior in ot_dist
    # no kohya / ComfyUI / spec id: OneTrainer's (resources/sd_model_spec/wuerstchen_2.0*.json), diffusers' names
    modelspec_architecture = "wuerstchen-v2-prior"
    modelspec_implementation = "diffusers"
    lora_file_prefixes = None  # no UI reads Würstchen v2 LoRAs by kohya names: the diffusers layout
    lora_file_renames = {}
    memory_reference = "Würstchen v2"  # the 1 B prior (warp-ai/wuerstchen-prior)
    decoder_pipeline_class = "WuerstchenDecoderPipeline"
    combined_pipeline_class = "WuerstchenCombinedPipeline"
    decoder_steps, decoder_guidance_scale = 12, 0.0  # WuerstchenCombinedPipeline's defaults
    time_scale = 1.08
    effnet_affine = True
    latent_mean, latent_std = 42.0, 1.0

    def load_folder(self, path: Path, index: dict):
        from diffusers import DDPMWuerstchenScheduler, WuerstchenPriorPipeline
        from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior
        from transformers import CLIPTextModel, CLIPTokenizer

        from ot_dist.models.load_dtype import component_from_pretrained  # the files' dtype where the trainer reads so

        settings = {k: index[k] for k in ("latent_mean", "latent_std", "resolution_multiple") if k in index}
        return WuerstchenPriorPipeline(
            tokenizer=CLIPTokenizer.from_pretrained(path / "tokenizer"),
            text_encoder=component_from_pretrained(CLIPTextModel, path / "text_encoder"),
            prior=component_from_pretrained(WuerstchenPrior, path / "prior"),
            scheduler=DDPMWuerstchenScheduler.from_pretrained(path / "scheduler"), **settings)

    def normalize_latents(self, vae, latents):
        return (latents + self.latent_std) / self.latent_mean  # the pipeline's output x 42 - 1, inverted

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        out = encoder(to_device(tokens["text_encoder"], encoder.device),
                      attention_mask=to_device(tokens["text_encoder_mask"], encoder.device))
        return {"hidden": self.text_states("text_encoder", out)}  # as WuerstchenPriorPipeline.encode_prompt

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        return denoiser(noisy, r=timesteps.to(noisy.dtype), c=conditioning["hidden"])

    def build_tiny(self, seed: int = 0, **_):
        from diffusers import DDPMWuerstchenScheduler, WuerstchenPriorPipeline
        from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior
        from transformers import CLIPTextModel

        from ot_dist.models.efficientnet import EfficientNetEncoder, tiny_effnet_config
        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer()
        prior = WuerstchenPrior(c_in=16, c=32, c_cond=TEXT_HIDDEN, c_r=64, depth=2, nhead=2, dropout=0.0)
        # The prior predicts (x - a) / (|1 - b| + 1e-5) from its output conv's (a, b): at diffusers' random init some
        # b lie near 1 and the prediction (and the loss) explodes. A trained prior keeps b away from 1; the tiny
        # one starts with a small output conv, so a, b start near 0 and still depend on every input.
        with torch.no_grad():
            prior.out[1].weight.mul_(0.01)
            prior.out[1].bias.mul_(0.01)
        pipeline = WuerstchenPriorPipeline(
            tokenizer=tokenizer, text_encoder=CLIPTextModel(clip_text_config(len(tokenizer), "gelu")), prior=prior,
            scheduler=DDPMWuerstchenScheduler())
        config = tiny_effnet_config()
        pipeline.effnet = EfficientNetEncoder(type(config)(**{**config.__dict__, "affine": True}))
        pipeline.decoder_stages = self.build_tiny_decoder(pipeline)
        return pipeline

    def load_decoder(self, path: Path):
        from ot_dist.models.families.cascade_decoder import load_wuerstchen_decoder

        return load_wuerstchen_decoder(path)

    def build_tiny_decoder(self, prior_pipeline):
        """Tiny WuerstchenDiffNeXt + VQGAN with a CLIP text encoder of their own (Würstchen v2's decoder reads
        another CLIP than its prior)."""
        from transformers import CLIPTextModel

        from ot_dist.models.families.cascade_decoder import tiny_wuerstchen_decoder
        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config

        tokenizer = prior_pipeline.tokenizer
        encoder = CLIPTextModel(clip_text_config(len(tokenizer), "gelu"))
        return tiny_wuerstchen_decoder(tokenizer, encoder, TEXT_HIDDEN)


FAMILIES = {"stable_cascade": StableCascade(), "wuerstchen_v2": WuerstchenV2()}
