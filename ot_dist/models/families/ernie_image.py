"""ERNIE-Image (Baidu's ERNIE-Image / ERNIE-Image-Turbo, OneTrainer's model type ERNIE): a single-stream DiT
(`ErnieImageTransformer2DModel`: one list of blocks over [image tokens, caption tokens], one shared AdaLN
modulation) on FLUX.2's VAE (`AutoencoderKLFlux2`: 32 channels, seen 2x2-patchified as 128 channels, one token per
patch), conditioned on the penultimate hidden states of a Mistral-3 (`Mistral3Model`, Ministral-3 3B's text layers).

What follows ErnieImagePipeline (diffusers 0.42) and OneTrainer's BaseErnieSetup / ErnieModel (there is no diffusers
training script for it):
- Text: the caption tokenized plainly (no chat template, the tokenizer's special tokens), the text encoder's
  hidden_states[-2] kept per caption token. The pipeline encodes one caption at a time without padding; ot_dist,
  as OneTrainer, pads to 512 tokens (right) with the mask, which leaves a causal encoder's caption tokens as they are,
  and zeros the padding. The transformer takes the padded states with each caption's length (`text_lens`): it masks
  the rest out of the attention and starts the image tokens' first position coordinate at that length.
- Latents: FLUX.2's, patchified, then normalised by the VAE's batch-norm statistics with eps 1e-5, the value the
  pipeline un-normalises with before decoding (its comment: the trained value, which the Hub's VAE config does not
  hold yet; OneTrainer and SimpleTuner read the config's `batch_norm_eps`). ot_dist keeps the VAE's own (B, 32, h, w)
  layout, as for FLUX.2, and patchifies in `predict`.
- Objective: flow matching, x_t = (1 - s) x + s n, the transformer at t = 1000 s, target n - x (OneTrainer's
  `flow = latent_noise - scaled_latent_image`), s through the scheduler config's fixed shift (the pipeline sets its
  sigmas explicitly, which a dynamically shifting scheduler refuses; ComfyUI samples ERNIE-Image at shift 3).
- Sampling: ErnieImagePipeline's classifier-free guidance is ot_dist's (neg + s (pos - neg), negative "" by
  default); its prompt enhancer (`pe`, a separate Ministral-3 that rewrites prompts) is turned off, as a sample shows
  what the trained model does with the prompt given.

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`), which ErnieImagePipeline.load_lora_weights
reads, OneTrainer writes (its ERNIE LoRA saver keeps the module names as they are) and ComfyUI maps for ERNIE-Image
(comfy/lora.py: `transformer.<k>` for each weight key k of its model, whose names are diffusers'). A trained text
encoder's LoRA carries ComfyUI's names for Ministral-3 (`text_encoders.ministral3_3b.transformer.model.<module>`),
which ot_dist reads back; the pipeline's loader takes the transformer only.

Single files: the transformer alone with its own keys (ernie_image_single_file.py), as ComfyUI's diffusion-model file
and diffusers' from_single_file have it; `model.config` names the diffusers folder that supplies the rest. Ministral-3
and the VAE stay in the folder: a trained text encoder is exported in the diffusers folder only.
"""

from __future__ import annotations

import torch

from ot_dist.models.families.base import Family
from ot_dist.models.families.flux2 import batch_norm_normalize, patchify, unpatchify
from ot_dist.models.families.qwen_image import caption_lengths
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# OneTrainer's PROMPT_MAX_LENGTH; the pipeline truncates at the tokenizer's model_max_length
MAX_TOKENS = 512
HIDDEN_LAYER = -2  # "second to last hidden state (matches training)": the pipeline's and OneTrainer's
# The eps ErnieImagePipeline un-normalises the latents with before decoding (not vae.config.batch_norm_eps)
BATCH_NORM_EPS = 1e-5
# The transformer block's projections: SimpleTuner's default LoRA targets (attention) and OneTrainer's attn-mlp
# preset (its ERNIE presets' layer_filter "self_attention,mlp": attention and the gated MLP)
ERNIE_LORA_TARGETS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0")
ERNIE_ATTENTION_MLP_TARGETS = ERNIE_LORA_TARGETS + ("mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")
# Mistral3Model's language model; `self_attn.` keeps the Pixtral vision tower's attention.*_proj out
MINISTRAL_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
COMFY_MINISTRAL_PREFIX = "text_encoders.ministral3_3b.transformer.model."
TINY_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


class ErnieImage(Family):
    name = "ernie_image"
    description = ("ERNIE-Image / ERNIE-Image-Turbo (single-stream DiT over FLUX.2's patchified latents, "
                   "Mistral-3 penultimate hidden states with the caption lengths, flow matching)")
    pipeline_class = "ErnieImagePipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # no UI loads Mistral-3 embeddings
    denoiser_lora_presets = {"default": ERNIE_LORA_TARGETS, "attention": ERNIE_LORA_TARGETS,
                             "attention_mlp": ERNIE_ATTENTION_MLP_TARGETS}
    text_lora_targets = MINISTRAL_LORA_TARGETS
    # The transformer's blocks (its _repeated_blocks: ErnieImageSharedAdaLNBlock, one per item of `layers`); the text
    # encoder's decoder layers (the vision tower never runs: left whole in the root unit)
    shard_units = {"transformer": ("layers",), "text_encoder": ("language_model.layers",)}
    memory_reference = "ERNIE-Image"  # baidu/ERNIE-Image: the 8 B transformer, Ministral-3 3B (3.85 B), FLUX.2's VAE
    pixel_multiple = 16  # VAE x8, then 2x2 patches (the pipeline refuses other sides)
    # OneTrainer's sample default for ERNIE (SampleConfig: cfg_scale 4.0); the pipeline's own default too
    sample_guidance_scale = 4.0
    samplers = ("flow_euler",)
    lora_file_prefixes = None  # the diffusers layout
    single_file = True
    single_file_text_encoders = False  # ComfyUI loads Ministral-3 from its own file
    # the transformer alone with bare keys (ComfyUI's and from_single_file's names are diffusers')
    transformer_file_layout = "ot_dist.models.families.ernie_image_single_file:ERNIE_IMAGE"
    # kohya-style lora_unet_<path with _> (OneTrainer's KOHYA output) and ComfyUI's diffusion_model.<path>, read by
    # lora merge / init_from
    lora_original_prefixes = (("lora_unet", "_"), ("diffusion_model", "."))
    # ComfyUI's names for Ministral-3's modules: "text_encoders." + its ErnieTEModel's state-dict path (comfy/lora.py
    # model_lora_keys_clip; comfy/text_encoders/ernie.py: the model named ministral3_3b, llama.py's Llama2_ under
    # `transformer.model`, transformers' layer and projection names), its only names for the text encoder
    lora_file_component_paths = {"text_encoder": {"language_model.layers.": COMFY_MINISTRAL_PREFIX + "layers."}}
    modelspec_architecture = "ernie-image"  # diffusers' modular pipeline's model_name; OneTrainer writes "Ernie"

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=2)

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_TOKENS, tokenizer.model_max_length)  # the tiny test tokenizer has fewer

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        # right padding: each caption's tokens first, so a length cuts them out
        encoded = tokenizer(list(captions), padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, padding_side="right", add_special_tokens=True, return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], encoder.device)
        out = encoder(input_ids=to_device(tokens["text_encoder"], encoder.device), attention_mask=mask,
                      output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[HIDDEN_LAYER]
        # zeros at the padding, which the pipeline never computes: the cache then holds nothing that depends on it
        return {"hidden": hidden * mask[..., None].to(hidden.dtype), "mask": mask.long()}

    def sampling_arguments(self, pipeline, arguments):
        return {**arguments, "use_pe": False}

    # -- latents ----------------------------------------------------------------------------------------
    def normalize_latents(self, vae, latents):
        return batch_norm_normalize(vae, latents, BATCH_NORM_EPS)

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        hidden, mask = conditioning["hidden"], conditioning["mask"]
        # the batch's longest caption bounds the text tokens (the rest are masked anyway), read from the host mask
        longest = max(caption_lengths(batch, mask, dropped=0))
        out = denoiser(
            hidden_states=patchify(noisy),
            timestep=timesteps.float(),  # 1000 s, as the pipeline's scheduler timesteps
            text_bth=hidden[:, :longest],
            text_lens=mask.sum(1),
            return_dict=False,
        )[0]
        return unpatchify(out)

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler
        from transformers import Mistral3Config, Mistral3Model

        from ot_dist.models.families.flux2 import tiny_flux2_vae
        from ot_dist.models.tiny import TEXT_HIDDEN

        torch.manual_seed(seed)
        tokenizer = tiny_ministral_tokenizer()
        # Ministral-3's layout (grouped KV heads, YaRN rope, a Pixtral vision tower the text path never runs), tiny
        config = Mistral3Config(
            text_config=dict(model_type="ministral3", hidden_size=TEXT_HIDDEN, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             vocab_size=len(tokenizer), max_position_embeddings=256,
                             # Ministral-3's YaRN, its context x16 over the original, scaled to the tiny one
                             rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=16.0,
                                                  original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                                  mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1),
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=32, patch_size=16, head_dim=8),
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
        transformer = ErnieImageTransformer2DModel(
            hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64, in_channels=128,
            out_channels=128, patch_size=1, text_in_dim=TEXT_HIDDEN, rope_theta=256, rope_axes_dim=(4, 6, 6))
        with torch.no_grad():
            # zero-initialised in diffusers (gates shut, output zero): a trained model's open gates and output
            # layer, so that the blocks' LoRA moves the prediction and the time path shows
            transformer.adaLN_modulation[-1].weight.normal_(std=0.2)
            transformer.adaLN_modulation[-1].bias.normal_(std=0.2)
            transformer.final_linear.weight.normal_(std=0.2)
            transformer.final_linear.bias.normal_(std=0.02)
        return ErnieImagePipeline(
            transformer=transformer, vae=tiny_flux2_vae(), text_encoder=Mistral3Model(config).eval(),
            tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER))


def tiny_ministral_tokenizer(max_length: int = 32):
    """FLUX.2's offline Mistral tokenizer with Mistral's BOS added to every caption, as the real tokenizer's post
    processor does (so an empty caption is one token, as the pipeline makes it)."""
    from tokenizers import processors

    from ot_dist.models.families.flux2 import tiny_mistral_tokenizer

    tokenizer = tiny_mistral_tokenizer(max_length)
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tokenizer


FAMILIES = {"ernie_image": ErnieImage()}
