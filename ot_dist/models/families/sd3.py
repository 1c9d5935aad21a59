"""Stable Diffusion 3 / 3.5 (medium, large): an MMDiT over 16-channel latents in 2x2 patches, conditioned on
CLIP-L and CLIP-G (penultimate hidden states side by side, zero-padded to the T5 width, then the T5 tokens after
them; the two pooled vectors concatenated), trained with flow matching at a fixed shift (3.0 from the scheduler
config) and the raw timestep (0..1000) as input. SD3.5 adds qk RMS norms and, for medium, dual attention layers:
both come from the transformer's own config."""

from __future__ import annotations

import torch

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import T5_EMBEDDING_COPIES, T5_EMBEDDING_KEY, T5_LORA_TARGETS, Family
from ot_dist.models.families.full_checkpoint import FullCheckpoint
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# The diffusers SD3 LoRA script's default targets: attention of both streams.
SD3_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
SD3_LORA_WITH_MLP = SD3_LORA_TARGETS + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
CLIP_SHARD_UNITS = ("encoder.layers",)  # CLIPTextModel (transformers 5: no text_model level) and WithProjection
T5_MAX_TOKENS = 256  # StableDiffusion3Pipeline's default


class SD3(Family):
    name = "sd3"
    memory_reference = "SD3.5 Large"  # the largest of the family; SD3 / SD3.5 Medium need less
    description = "Stable Diffusion 3 / 3.5 (MMDiT, CLIP-L + CLIP-G + T5, flow matching with shift 3)"
    pipeline_class = "StableDiffusion3Pipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizers = ("tokenizer", "tokenizer_2", "tokenizer_3")
    # OneTrainer's StableDiffusion3EmbeddingSaver: clip_l, clip_g, t5 (ComfyUI reads the T5's copy t5xxl)
    embedding_keys = {"text_encoder": "clip_l", "text_encoder_2": "clip_g", "text_encoder_3": T5_EMBEDDING_KEY}
    embedding_key_copies = T5_EMBEDDING_COPIES
    embedding_keys_optional = frozenset({"text_encoder_3"})  # A1111-style clip_l / clip_g files start the T5's
    # OneTrainer's StableDiffusion3ModelEmbedding: an output embedding is one of all three encoders (encode_text
    # applies each one's vectors to the states it reads); StableDiffusion3EmbeddingSaver writes clip_l / clip_g / t5
    # (the zero input rows) and clip_l_out / clip_g_out / t5_out.
    output_embedding_keys = {"text_encoder": "clip_l", "text_encoder_2": "clip_g", "text_encoder_3": T5_EMBEDDING_KEY}

    def text_states(self, encoder, output):
        if encoder == "text_encoder_3":
            return output.last_hidden_state  # the T5's, without its mask (StableDiffusion3Pipeline, OneTrainer)
        return output.hidden_states[-2]  # the CLIPs' penultimate layer, no final norm (OneTrainer: -2, no norm)

    denoiser_lora_presets = {"default": SD3_LORA_TARGETS, "attention": SD3_LORA_TARGETS,
                             "attention_mlp": SD3_LORA_WITH_MLP}
    shard_units = {"transformer": ("transformer_blocks",), "text_encoder": CLIP_SHARD_UNITS,
                   "text_encoder_2": CLIP_SHARD_UNITS, "text_encoder_3": ("encoder.block",)}
    pixel_multiple = 16  # VAE x8, 2x2 patches
    text_lora_targets_by_encoder = {"text_encoder_3": T5_LORA_TARGETS}
    # T5-XXL after CLIP-L and CLIP-G: ComfyUI (comfy/lora.py) and kohya's sd-scripts name its LoRA modules lora_te3_
    lora_file_kohya_components = {"text_encoder_3": "lora_te3"}
    # OneTrainer (modules/util/convert/lora/convert_sd3_lora.py) and kohya sd-scripts (networks/lora_sd3.py) both
    # name CLIP-L lora_te1_, CLIP-G lora_te2_; the transformer OneTrainer's lora_transformer_<diffusers path with _>,
    # kohya's lora_unet_<MMDiT path with _> (joint_blocks_0_x_block_attn_qkv), ComfyUI's diffusion_model.<MMDiT path>
    lora_foreign_prefixes = {"transformer": ("lora_transformer",), "text_encoder": ("lora_te1",),
                             "text_encoder_2": ("lora_te2",)}
    lora_original_prefixes = (("lora_unet", "_"), ("diffusion_model", "."))
    # ComfyUI maps transformer.<path> through utils.mmdit_to_diffusers: whole weights, q / k / v as row blocks of qkv
    lora_oft_diffusers_layout = True

    def lora_oft_reordered_modules(self, denoiser):
        # swap_scale_shift there: the final layer's and the last block's context modulation (shift | scale)
        return ["norm_out.linear", f"transformer_blocks.{len(denoiser.transformer_blocks) - 1}.norm1_context.linear"]

    samplers = ("flow_euler",)
    modelspec_implementation = "https://github.com/Stability-AI/generative-models"  # kohya's, for SD3 checkpoints

    def modelspec_architecture_of(self, denoiser_config, prediction_type, inpainting):
        """The spec lists `stable-diffusion-v3-medium` (ComfyUI and OneTrainer write it for SD3); SD 3.5 follows that
        pattern as SwarmUI names it (`stable-diffusion-v3.5-large` / `-medium`). The variant is kohya's test on the
        weights (library/sd3_utils.py): qk norms = 3.5, dual-attention layers besides = 3.5 medium. kohya writes
        `stable-diffusion-3-medium` / `-3-5-large` instead, which neither the spec nor SwarmUI knows."""
        if not denoiser_config.get("qk_norm"):
            return "stable-diffusion-v3-medium"
        return "stable-diffusion-v3.5-medium" if denoiser_config.get("dual_attention_layers") else \
            "stable-diffusion-v3.5-large"

    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=2)

    def objective_kind(self) -> str:
        return "flow"

    t5_tokens: int | None = None  # model.t5_max_tokens; None: T5_MAX_TOKENS

    def configure(self, model_config) -> "SD3":
        from ot_dist.models.families.flux import with_t5_tokens

        return with_t5_tokens(super().configure(model_config), model_config)

    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        if tokenizer_name == "tokenizer_3":
            return min(self.t5_tokens or T5_MAX_TOKENS, tokenizer.model_max_length)
        return tokenizer.model_max_length

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer_3", pipeline.tokenizer_3)}

    def encode_text(self, text_encoders, tokens):
        clip_hidden, pooled = [], []
        for name in ("text_encoder", "text_encoder_2"):
            encoder = text_encoders[name]
            out = encoder(to_device(tokens[name], encoder.device), output_hidden_states=True)
            clip_hidden.append(self.text_states(name, out))
            pooled.append(out[0])  # the projected pooled output (text_embeds)
        t5 = text_encoders["text_encoder_3"]
        t5_hidden = self.text_states("text_encoder_3", t5(to_device(tokens["text_encoder_3"], t5.device)))
        clip = torch.cat(clip_hidden, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5_hidden.shape[-1] - clip.shape[-1]))
        return {"hidden": torch.cat([clip, t5_hidden.to(clip.dtype)], dim=-2), "pooled": torch.cat(pooled, dim=-1)}

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        # The timestep stays float32, as StableDiffusion3Pipeline and diffusers' SD3 training scripts pass it: its
        # sinusoidal embedding is computed in float32, and bfloat16 would round t near 1000 to a multiple of 4.
        return denoiser(hidden_states=noisy, timestep=timesteps.float(),
                        encoder_hidden_states=conditioning["hidden"], pooled_projections=conditioning["pooled"],
                        return_dict=False)[0]

    def denoiser_original_rules(self, config) -> list:
        from ot_dist.models.families.sd3_single_file import sd3_rules

        return sd3_rules(config)

    def load_single_file(self, path, config_folder, model_config):
        from ot_dist.models.families.sd3_single_file import sd3_from_original, validate_sd3_file
        from ot_dist.models.families.transformer_single_file import load_transformer_file

        return load_transformer_file(path, config_folder, self, sd3_from_original, validate_sd3_file, model_config)

    # Stability's all-in-one files (sd3_medium_incl_clips_t5xxlfp16) and ComfyUI's SD3 checkpoints: comfy/
    # supported_models.py SD3 (text_encoder_key_prefix "text_encoders.", its SD3ClipModel's clip_l / clip_g / t5xxl),
    # diffusers' from_single_file (single_file_utils: text_encoders.clip_l / clip_g / t5xxl .transformer.).
    full_checkpoint = FullCheckpoint(text_encoders={"text_encoder": "text_encoders.clip_l.transformer.",
                                                    "text_encoder_2": "text_encoders.clip_g.transformer.",
                                                    "text_encoder_3": "text_encoders.t5xxl.transformer."},
                                     vae="first_stage_model.")
    # ComfyUI's separate files: clip_l, clip_g, t5xxl (fp16 / fp8 / fp8 scaled) and an LDM-layout VAE file
    component_files = {"text_encoder": C.CLIP_TEXT, "text_encoder_2": C.CLIP_TEXT_PROJECTED,
                       "text_encoder_3": C.T5_ENCODER,
                       "vae": C.LDM_VAE}

    def export_single_file(self, components, states, path, dtype, with_text_encoders=False, metadata=None):
        """Stability's layout: the transformer under model.diffusion_model. and the VAE under first_stage_model.
        (what StableDiffusion3Pipeline.from_single_file and ComfyUI read); with the three text encoders when a run
        trained any (the text encoders otherwise ship separately, as with Stability's sd3.5_large.safetensors)."""
        from ot_dist.models.families.sd3_single_file import sd3_to_original
        from ot_dist.models.families.transformer_single_file import write_transformer_file

        state = sd3_to_original(states["transformer"], dict(components["transformer"].config))
        layout = self.full_checkpoint
        state |= layout.component_keys(components, states) if with_text_encoders else \
            FullCheckpoint(vae=layout.vae).component_keys(components, states)
        write_transformer_file(state, path, dtype, metadata)

    def build_tiny(self, seed: int = 0, variant: str = "sd3", **_):
        """variant: sd3 (SD3 medium's layout), sd35 (3.5: qk RMS norm and a dual-attention layer)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection

        from ot_dist.models.families.flux import tiny_flow_vae
        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer, tiny_t5_encoder, \
            tiny_t5_tokenizer

        torch.manual_seed(seed)
        clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        t5_width = 2 * TEXT_HIDDEN  # at least CLIP-L + CLIP-G side by side, as 4096 >= 768 + 1280
        sd35 = variant == "sd35"
        transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=t5_width, caption_projection_dim=32, pooled_projection_dim=2 * TEXT_HIDDEN,
            out_channels=16, pos_embed_max_size=32, qk_norm="rms_norm" if sd35 else None,
            dual_attention_layers=(0,) if sd35 else ())
        return StableDiffusion3Pipeline(
            transformer=transformer,
            vae=tiny_flow_vae(shift_factor=0.0609, scaling_factor=1.5305),
            text_encoder=CLIPTextModelWithProjection(clip_text_config(len(clip_tokenizer), "quick_gelu")),
            text_encoder_2=CLIPTextModelWithProjection(clip_text_config(len(clip_tokenizer), "gelu")),
            text_encoder_3=tiny_t5_encoder(len(t5_tokenizer), d_model=t5_width),
            tokenizer=clip_tokenizer,
            tokenizer_2=clip_tokenizer,
            tokenizer_3=t5_tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        )


FAMILIES = {"sd3": SD3()}
