"""PixArt-α and PixArt-Σ: a DiT (`PixArtTransformer2DModel`, 2x2 patches, adaLN-single) over 4-channel VAE
latents, conditioned on T5's last hidden states with their attention mask. Two families, one module: they share
the architecture and differ in what the model folder and the pipeline expect.

- `pixart_alpha`: PixArtAlphaPipeline, T5 context of 120 tokens, the SD VAE (scale 0.18215). The 1024 models
  (transformer `sample_size` 128) take the image's resolution and aspect ratio as micro-conditioning
  (`added_cond_kwargs`); the transformer's own `use_additional_conditions` says whether it does.
- `pixart_sigma`: PixArtSigmaPipeline, 300 tokens, the SDXL VAE (scale 0.13025), no micro-conditioning.

The transformer outputs 8 channels: epsilon, then the learned variance values. Training is DDPM epsilon on the
model's scheduler config (linear betas) with the MSE on the first half, plus, as OneTrainer, the variational-bound
loss on the second half at `loss.vb_loss_strength` (default 1.0; ot_dist/models/learned_variance.py).

LoRA: diffusers 0.42 gives this transformer no `add_adapter` and its pipelines no LoRA loader; ot_dist's LoRA
method injects peft adapters directly (ot_dist/methods/lora.py) and writes the diffusers layout
(`transformer.<module>.lora_A/B.weight`, the scale inside the up matrices): the keys ComfyUI's PixArt branch of
`model_lora_keys_unet` maps. Loading it back into a diffusers pipeline: see docs/families.md.
"""

from __future__ import annotations

import torch

from ot_dist.config.sampling import DDPM_SAMPLERS
from ot_dist.models.families.base import T5_EMBEDDING_COPIES, T5_EMBEDDING_KEY, T5_LORA_TARGETS, Family
from ot_dist.models.objectives import DDPM
from ot_dist.train.transfer import to_device

# Attention of the self- (attn1) and cross-attention (attn2) layers: what PixArt LoRA trainers target by default.
PIXART_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
PIXART_LORA_WITH_MLP = PIXART_LORA_TARGETS + ("ff.net.0.proj", "ff.net.2")
T5_SHARD_UNITS = ("encoder.block",)
VAE_FACTOR = 8  # PixArt's VAEs (SD's, SDXL's) downsample 8x
VB_LOSS_DEFAULT = 1.0  # OneTrainer's vb_loss_strength default


class PixArt(Family):
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    # OneTrainer's PixArtAlphaEmbeddingSaver (α and Σ): t5; ComfyUI's PixArt T5 tokenizer reads the copy t5xxl
    embedding_keys = {"text_encoder": T5_EMBEDDING_KEY}
    embedding_key_copies = T5_EMBEDDING_COPIES
    lowercases_prompts = "PixArt's pipelines lower-case the sample prompts (_text_preprocessing)"
    # OneTrainer's PixArtAlphaEmbeddingSaver: t5 (the zero input rows), t5_out; the T5's last hidden state, masked
    output_embedding_keys = {"text_encoder": T5_EMBEDDING_KEY}
    output_states_masked = True

    def text_states(self, encoder, output):
        return output.last_hidden_state
    denoiser_lora_presets = {"default": PIXART_LORA_TARGETS, "attention": PIXART_LORA_TARGETS,
                             "attention_mlp": PIXART_LORA_WITH_MLP}
    text_lora_targets = T5_LORA_TARGETS
    shard_units = {"transformer": ("transformer_blocks",), "text_encoder": T5_SHARD_UNITS}
    pixel_multiple = 16  # VAE x8, 2x2 patches
    # PixArt ships DPMSolverMultistepScheduler (dpmpp_2m) for sampling; the DDPM samplers all fit.
    samplers = ("dpmpp_2m", *(name for name in DDPM_SAMPLERS if name != "dpmpp_2m"))
    sample_guidance_scale = 4.5  # OneTrainer's and the PixArt pipelines' default
    lora_file_prefixes = None  # the diffusers layout: ComfyUI maps transformer.<diffusers module> for PixArt
    # ComfyUI's PixArt text encoder is T5-XXL alone: its LoRA modules are lora_te1_<T5 path> (comfy/lora.py)
    lora_file_kohya_components = {"text_encoder": "lora_te1"}
    # ComfyUI maps transformer.<path> through utils.pixart_to_diffusers: whole weights, q / k / v as row blocks of
    # attn.qkv and cross_attn.kv_linear, none reordered
    lora_oft_diffusers_layout = True
    max_sequence_length: int  # the pipeline's T5 context
    # PixArt's original checkpoint layout (blocks.N.attn.qkv, ...) is not written yet: the full method exports the
    # diffusers folder (what PixArtAlphaPipeline / PixArtSigmaPipeline.from_pretrained read).
    single_file = False
    # Its learned variance's VB loss divides by sqrt(alphas_cumprod), 0 at the last timestep of such a schedule, and
    # predicts epsilon; OneTrainer's PixArt setups ignore rescale_noise_scheduler_to_zero_terminal_snr.
    zero_terminal_snr_refusal = ("learns its variance with a VB loss that needs alphas_cumprod > 0 at every timestep "
                                 "(OneTrainer's PixArt training ignores the option too)")

    def objective(self, pipeline, model_config) -> DDPM:
        prediction_type = None if model_config.prediction_type == "auto" else model_config.prediction_type
        return DDPM(pipeline.scheduler.config, prediction_type)

    def objective_kind(self) -> str:
        return "ddpm"

    def sampling_overrides(self, objective: DDPM) -> dict:
        return {"prediction_type": objective.prediction_type}

    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(self.max_sequence_length, tokenizer.model_max_length)  # a tiny test T5 has 32

    def pipeline_call_options(self, pipeline) -> dict:
        # Samples at the requested size (no snapping to the pipeline's aspect-ratio bins: training uses the
        # bucket sizes as they are) and captions as training sees them (no clean_caption rewriting).
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer),
                "use_resolution_binning": False, "clean_caption": False}

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        encoded = tokenizer(captions, padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, add_special_tokens=True, return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        t5 = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], t5.device)
        hidden = t5(to_device(tokens["text_encoder"], t5.device), attention_mask=mask)[0]
        return {"hidden": hidden, "mask": mask.long()}

    def transformer_output(self, denoiser, noisy, timesteps, conditioning) -> torch.Tensor:
        """The transformer's full output (B, 2C, h, w): epsilon, then the variance values."""
        added = {"resolution": None, "aspect_ratio": None}
        if denoiser.use_additional_conditions:  # α-1024: the image's pixel size and aspect, as the pipeline passes
            b, height, width = noisy.shape[0], noisy.shape[-2] * VAE_FACTOR, noisy.shape[-1] * VAE_FACTOR
            # float32 whatever the latents' dtype (zero's bf16 / fp16 engine): the size embedding projects them in
            # float32 and casts its output to the transformer's dtype; bfloat16 would round an aspect of 4:3 to 1.336.
            added = {"resolution": torch.tensor([[height, width]], device=noisy.device, dtype=torch.float32).repeat(b, 1),
                     "aspect_ratio": torch.full((b, 1), height / width, device=noisy.device, dtype=torch.float32)}
        return denoiser(noisy, encoder_hidden_states=conditioning["hidden"],
                        encoder_attention_mask=conditioning["mask"], timestep=timesteps, added_cond_kwargs=added,
                        return_dict=False)[0]

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        out = self.transformer_output(denoiser, noisy, timesteps, conditioning)
        return out[:, : noisy.shape[1]] if out.shape[1] == 2 * noisy.shape[1] else out

    def training_prediction(self, denoiser, noisy, timesteps, conditioning, batch, latents, objective, options):
        out = self.transformer_output(denoiser, noisy, timesteps, conditioning)
        if out.shape[1] != 2 * noisy.shape[1]:  # a PixArt without the learned variance
            return out, None
        eps, variance = out.chunk(2, dim=1)
        strength = VB_LOSS_DEFAULT if options is None or options.vb_loss_strength is None else options.vb_loss_strength
        if strength == 0:
            return eps, None
        from ot_dist.models.learned_variance import VarianceSchedule, vb_loss

        schedule = VarianceSchedule(objective.scheduler.betas)
        return eps, vb_loss(schedule, latents, noisy, timesteps, eps, variance) * strength

    def build_tiny(self, seed: int = 0, variant: str | None = None, **_):
        """variant (α): 1024 (sample_size 128, micro-conditioning; the default) or 512 (sample_size 64, none)."""
        import diffusers
        from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel

        from ot_dist.models.tiny import TEXT_HIDDEN, tiny_t5_encoder, tiny_t5_tokenizer, tiny_vae

        torch.manual_seed(seed)
        tokenizer = tiny_t5_tokenizer()
        sample_size = 64 if variant == "512" else 128
        # Width 48 (2 heads x 24): the micro-conditioning embeds height, width and aspect in a third of it each.
        transformer = PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=8, num_layers=2,
            cross_attention_dim=48, sample_size=sample_size, patch_size=2, caption_channels=TEXT_HIDDEN,
            use_additional_conditions=self.micro_conditioning(sample_size))
        scheduler = DPMSolverMultistepScheduler(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                                                beta_schedule="linear", prediction_type="epsilon")
        return getattr(diffusers, self.pipeline_class)(
            tokenizer=tokenizer, text_encoder=tiny_t5_encoder(len(tokenizer)), vae=tiny_vae(self.vae_scale),
            transformer=transformer, scheduler=scheduler)

    def micro_conditioning(self, sample_size: int) -> bool:
        raise NotImplementedError

    vae_scale: float


class PixArtAlpha(PixArt):
    name = "pixart_alpha"
    description = "PixArt-α (DiT, T5 with its mask, 120 tokens; 1024 models: resolution / aspect micro-conditioning)"
    pipeline_class = "PixArtAlphaPipeline"
    max_sequence_length = 120
    vae_scale = 0.18215  # the SD VAE
    # kohya and ComfyUI write no PixArt ids: OneTrainer's (resources/sd_model_spec/pixart_alpha_1.0*.json)
    modelspec_architecture = "pixart-alpha"
    modelspec_implementation = "https://github.com/PixArt-alpha/PixArt-alpha"

    def micro_conditioning(self, sample_size):
        return sample_size == 128  # the α-1024 config (diffusers' rule when the config leaves it unset)


class PixArtSigma(PixArt):
    name = "pixart_sigma"
    description = "PixArt-Σ (DiT, T5 with its mask, 300 tokens, SDXL VAE)"
    pipeline_class = "PixArtSigmaPipeline"
    max_sequence_length = 300
    vae_scale = 0.13025  # the SDXL VAE
    modelspec_architecture = "pixart-sigma"  # OneTrainer's, as PixArt-α's (SwarmUI's class: pixart-ms-sigma-xl-2)
    modelspec_implementation = "https://github.com/PixArt-alpha/PixArt-sigma"

    def micro_conditioning(self, sample_size):
        return False  # the Σ configs set use_additional_conditions false


FAMILIES = {"pixart_alpha": PixArtAlpha(), "pixart_sigma": PixArtSigma()}
