"""Anima (circlestone-labs): Cosmos-Predict2's 2 B DiT (`CosmosTransformer3DModel`, one frame) on the Qwen-Image VAE's
16-channel latents, conditioned through an LLM adapter (`AnimaTextConditioner`) that cross-attends from learned T5
token embeddings to Qwen3-0.6B's last hidden states.

What follows diffusers' modular pipeline (AnimaAutoBlocks, diffusers 0.42) and OneTrainer's Anima setup
(modules/model/AnimaModel.py, modules/modelSetup/BaseAnimaSetup.py):
- Text: the caption is tokenized twice, by the Qwen tokenizer (no chat template) and by a T5 tokenizer, each up to
  512 tokens. Qwen3 runs with the mask; its last hidden state, zero at the padding, is the adapter's source; the T5
  ids are its queries (with their mask). The adapter's output, zero past the T5 tokens and padded to its
  min_sequence_length (512), is the transformer's `encoder_hidden_states`, passed without a mask. ot_dist pads both
  tokenizations to the maximum length (as OneTrainer does; the pipeline pads to the longest): padded tokens are masked
  wherever they could reach a real one, so the output is the same. The text cache stores the adapter's output.
- Latents: (x - mean) / std per channel of the Qwen-Image VAE, images as one-frame clips.
- Objective: plain flow matching, x_t = (1 - s) x + s n with s drawn through the scheduler config's fixed shift (3.0,
  as diffusers' convert_anima_to_diffusers.py writes it); the transformer sees t = s (timesteps / 1000) and predicts
  n - x directly (the pipeline's Euler step takes its output as the velocity); its padding mask is zeros.
- Sampling: diffusers' AnimaAutoBlocks (ClassifierFreeGuidance neg + s (pos - neg), what ot_dist's guidance_scale
  means) through anima_pipeline.AnimaPipeline, a DiffusionPipeline face over the same components.

The adapter is a part of its own (`text_conditioner`, paired with the T5 tokenizer): frozen by default like the text
encoder (OneTrainer never trains either), trainable with `text_conditioner.train` (full or LoRA; diffusers'
AnimaLoraLoaderMixin loads `text_conditioner.` LoRA modules).

Single file: circlestone-labs' `anima-*.safetensors`, the transformer and the adapter under Cosmos' `net.` in the
original names (anima_single_file.py), read as `model.path` with `model.config` naming a folder for Qwen3, the VAE and
the tokenizers, and written beside a full finetune's folder.
"""

from __future__ import annotations

import torch

from ot_dist.memory.float8 import compute_dtype
from ot_dist.models.families.base import Family
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# OneTrainer's PROMPT_MAX_LENGTH and the pipeline's max_sequence_length default, for both tokenizers
MAX_TOKENS = 512
# OneTrainer's layer presets (BaseAnimaSetup.LAYER_PRESETS) as module suffixes: "attn-only" and "attn-mlp" (its
# LoRA training preset's filter: attn1, attn2, ff). There is no diffusers training script for Anima.
ANIMA_ATTENTION_TARGETS = tuple(f"{attn}.{m}" for attn in ("attn1", "attn2")
                                for m in ("to_q", "to_k", "to_v", "to_out.0"))
ANIMA_ATTENTION_MLP_TARGETS = ANIMA_ATTENTION_TARGETS + ("ff.net.0.proj", "ff.net.2")
QWEN3_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The adapter's attention projections and MLP
CONDITIONER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.0", "mlp.2")
# The scheduler diffusers' convert_anima_to_diffusers.py saves: FlowMatchEulerDiscreteScheduler(shift=3.0)
ANIMA_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# The class a published Anima folder names (circlestone-labs/Anima-Base-v1.0-Diffusers: modular_model_index.json)
MODULAR_PIPELINE = "AnimaModularPipeline"
TINY_TEXT_WIDTH = 32
TINY_TOKENS = 32


class Anima(Family):
    name = "anima"
    description = ("Anima (Cosmos-Predict2 DiT, Qwen3-0.6B last hidden states through an LLM adapter queried by T5 "
                   "tokens, Qwen-Image VAE, flow matching with shift 3)")
    pipeline_class = "AnimaPipeline"  # ot_dist's DiffusionPipeline face (anima_pipeline.py) over diffusers' blocks
    denoiser = "transformer"
    text_encoders = ("text_encoder", "text_conditioner")
    tokenizers = ("tokenizer", "t5_tokenizer")
    embedding_keys = {}  # no UI loads Qwen3 embeddings
    denoiser_lora_presets = {"default": ANIMA_ATTENTION_MLP_TARGETS, "attention": ANIMA_ATTENTION_TARGETS,
                             "attention_mlp": ANIMA_ATTENTION_MLP_TARGETS}
    text_lora_targets = QWEN3_LORA_TARGETS
    text_lora_targets_by_encoder = {"text_conditioner": CONDITIONER_LORA_TARGETS}
    # CosmosTransformerBlock (_no_split_modules: 3.5 % of the transformer each), AnimaTextConditionerBlock (its
    # _no_split_modules); the embedding tables their own units (Qwen3's 151936 x 1024: a quarter of Qwen3-0.6B; the
    # adapter's 32128 x 1024, as much of the adapter): in the root they would stay gathered through backward
    shard_units = {"transformer": ("transformer_blocks",), "text_encoder": ("embed_tokens", "layers"),
                   "text_conditioner": ("embed", "blocks")}
    pixel_multiple = 16  # VAE x8, then the transformer's 2x2 patches (the pipeline refuses other sides)
    memory_reference = "Anima"  # the 1.96 B transformer, Qwen3-0.6B (0.6 B), the adapter (0.13 B), the Qwen-Image VAE
    # OneTrainer's sample defaults for Anima (SampleConfig.py): cfg 4.0, as neg + s (pos - neg)
    sample_guidance_scale = 4.0
    samplers = ("flow_euler",)
    lora_file_prefixes = None  # the diffusers layout, which AnimaLoraLoaderMixin.load_lora_weights reads
    # Other trainers' names of the transformer's modules, read by `ot-dist lora merge` and `lora.init_from`: the
    # original DiT's paths (anima_lora.original_rules) as ComfyUI and OneTrainer's COMFY format write them
    # (`diffusion_model.blocks.0.self_attn.q_proj`) and as kohya's and OneTrainer's KOHYA format do
    # (`lora_unet_blocks_0_self_attn_q_proj`)
    lora_original_prefixes = (("diffusion_model", "."), ("lora_unet", "_"))
    # circlestone-labs' anima-*.safetensors: the DiT and its LLM adapter under `net.` (anima_single_file.py); Qwen3
    # never goes in the file (ComfyUI reads it from its own)
    single_file = True
    single_file_text_encoders = False
    # OneTrainer's ModelSpec architecture for Anima (resources/sd_model_spec/anima.json: "Anima", "Anima/lora")
    modelspec_architecture = "Anima"

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        patch = pipeline.transformer.config.patch_size[-1]
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=patch)

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_TOKENS, tokenizer.model_max_length)  # the tiny test tokenizers have fewer

    def tokenize(self, tokenizers, captions):
        tokens = {}
        for encoder, name in zip(self.text_encoders, self.tokenizers):
            tokenizer = tokenizers[name]
            encoded = tokenizer(captions, padding="max_length", max_length=self.max_tokens(name, tokenizer),
                                truncation=True, padding_side="right", return_tensors="pt")
            tokens[encoder], tokens[f"{encoder}_mask"] = encoded.input_ids, encoded.attention_mask
        return tokens

    def encode_text(self, text_encoders, tokens):
        encoder, conditioner = text_encoders["text_encoder"], text_encoders["text_conditioner"]
        mask = to_device(tokens["text_encoder_mask"], encoder.device)
        hidden = encoder(input_ids=to_device(tokens["text_encoder"], encoder.device), attention_mask=mask
                         ).last_hidden_state
        hidden = hidden * mask[..., None].to(hidden.dtype)  # zero at the padding, as the pipeline's text step
        device = conditioner.device
        # in the adapter's compute dtype (its weights', or float8 storage's compute dtype), as the pipeline passes it
        out = conditioner(source_hidden_states=to_device(hidden, device).to(compute_dtype(conditioner)),
                          target_input_ids=to_device(tokens["text_conditioner"], device),
                          target_attention_mask=to_device(tokens["text_conditioner_mask"], device),
                          source_attention_mask=to_device(mask, device))
        return {"hidden": out}

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer)}

    # -- latents ----------------------------------------------------------------------------------------
    def latent_shape(self, vae, pixel_height, pixel_width):
        factor = 2 ** len(vae.config.temperal_downsample)
        return torch.Size((vae.config.z_dim, pixel_height // factor, pixel_width // factor))

    def encode_posterior(self, vae, pixels):
        posterior = vae.encode(pixels.unsqueeze(2)).latent_dist  # one frame
        return posterior.mean[:, :, 0], posterior.std[:, :, 0]

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        from ot_dist.models.families.anima_pipeline import ensure_padding_mask_resize

        ensure_padding_mask_resize()
        b, _, h, w = noisy.shape
        # no padded pixels: zeros, at the latent grid the transformer resizes the pipeline's pixel-sized mask to
        padding = noisy.new_zeros(1, 1, h, w)
        out = denoiser(hidden_states=noisy.unsqueeze(2), timestep=timesteps.float() / 1000,
                       encoder_hidden_states=conditioning["hidden"], padding_mask=padding, return_dict=False)[0]
        return out[:, :, 0]

    # -- single files -----------------------------------------------------------------------------------
    def load_single_file(self, path, config_folder, model_config):
        from ot_dist.models.families.anima_single_file import load_anima_file

        return load_anima_file(path, config_folder, self)

    def export_single_file(self, components, states, path, dtype, with_text_encoders=False, metadata=None):
        """The transformer and the adapter in the original file's keys; a trained Qwen3 is in the folder only."""
        from ot_dist.models.families.anima_single_file import to_original
        from ot_dist.models.families.transformer_single_file import write_transformer_file

        state = to_original(states["transformer"], states["text_conditioner"], dict(components["transformer"].config),
                            dict(components["text_conditioner"].config))
        write_transformer_file(state, path, dtype, metadata)

    # -- sampling -------------------------------------------------------------------------------------
    def sampling_pipeline(self, components, loaded_pipeline):
        from ot_dist.models.families.anima_pipeline import COMPONENTS

        return self.pipeline_cls()(**{name: components[name] for name in COMPONENTS})

    # -- LoRA files -------------------------------------------------------------------------------------
    def denoiser_original_rules(self, config) -> list:
        from ot_dist.models.families.anima_lora import original_rules

        return original_rules(config)

    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's and the adapter's LoRA in the original model's names, which
        ComfyUI and diffusers' Anima loader both read (anima_lora.py); nothing for an adapter other than plain LoRA or
        a run that trained neither."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.anima_lora import comfyui_lora_state

        parts = [part for part in ("transformer", "text_conditioner") if part in states]
        tensors = comfyui_lora_state(states, adapter_configs) if parts else None
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name,
                                    scale="inside the up matrices, no alpha",
                                    rank=adapter_configs[parts[0]]["r"] if parts else None)

    # -- folders ----------------------------------------------------------------------------------------
    def load_folder(self, path, index):
        """ot_dist's own folders (model_index.json naming AnimaPipeline), and the published ones, which diffusers'
        AnimaModularPipeline saved (modular_model_index.json only): read by diffusers' ModularPipeline."""
        if index.get("_class_name") == MODULAR_PIPELINE:
            from diffusers import ModularPipeline

            from ot_dist.models.families.anima_pipeline import COMPONENTS

            modular = ModularPipeline.from_pretrained(str(path), local_files_only=True)
            modular.load_components(names=list(COMPONENTS), dtype=torch.float32, use_safetensors=True)
            return self.pipeline_cls()(**{name: getattr(modular, name) for name in COMPONENTS})
        from ot_dist.models.load_dtype import pipeline_from_pretrained  # the files' dtype where training reads so

        return pipeline_from_pretrained(self.pipeline_cls(), path, index, {}, use_safetensors=True,
                                        local_files_only=True)

    def pipeline_classes(self):
        return (self.pipeline_class, MODULAR_PIPELINE)

    def save_extras(self, pipeline, folder):
        from ot_dist.models.families.anima_pipeline import write_modular_index

        write_modular_index(pipeline, folder)

    def pipeline_cls(self):
        from ot_dist.models.families.anima_pipeline import AnimaPipeline

        return AnimaPipeline

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import (AnimaTextConditioner, AutoencoderKLQwenImage, CosmosTransformer3DModel,
                               FlowMatchEulerDiscreteScheduler)
        from transformers import Qwen3Config, Qwen3Model

        from ot_dist.models.families.anima_pipeline import AnimaPipeline
        from ot_dist.models.families.qwen_image import tiny_qwen2_tokenizer
        from ot_dist.models.tiny import tiny_t5_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer(max_length=TINY_TOKENS, template="{}")
        t5_tokenizer = tiny_t5_tokenizer(max_length=TINY_TOKENS)
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TINY_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
            tie_word_embeddings=False)).eval()
        # the published adapter: 6 blocks, 16 heads, width 1024 = Qwen3-0.6B's and the DiT's text width
        text_conditioner = AnimaTextConditioner(
            source_dim=TINY_TEXT_WIDTH, target_dim=TINY_TEXT_WIDTH, model_dim=TINY_TEXT_WIDTH, num_layers=2,
            num_attention_heads=2, mlp_ratio=2.0, target_vocab_size=len(t5_tokenizer), min_sequence_length=TINY_TOKENS)
        # Cosmos-Predict2 2B's layout (convert_cosmos_to_diffusers.py): RoPE scale (1, 4, 4), the padding mask
        # concatenated, no learnable position embedding; tiny widths
        transformer = CosmosTransformer3DModel(
            in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=24, num_layers=2,
            mlp_ratio=2.0, text_embed_dim=TINY_TEXT_WIDTH, adaln_lora_dim=8, max_size=(128, 240, 240),
            patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)
        vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        return AnimaPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             t5_tokenizer=t5_tokenizer, text_conditioner=text_conditioner,
                             scheduler=FlowMatchEulerDiscreteScheduler(**ANIMA_SCHEDULER))


FAMILIES = {"anima": Anima()}
