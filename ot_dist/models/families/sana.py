"""Sana: a linear-attention DiT (`SanaTransformer2DModel`, 1x1 patches) over the 32x-downsampling DC-AE's latents
(`AutoencoderDC`: a deterministic encoder, `.latent`, scaled by 0.41407), cross-attending to Gemma2's last hidden
states with their attention mask; flow matching with the raw timestep (0..1000), as SD3.

What follows SanaPipeline and diffusers' train_dreambooth_lora_sana.py:
- the prompt is lowercased and stripped (the pipeline's `_text_preprocessing` without clean_caption), tokenized
  right-padded to 300 tokens with Gemma's <bos> and encoded with the mask; `select_index` ([0] + the last 299) keeps
  every token at that length. No "complex human instruction" prefix: the training script's default, and sampling
  passes `complex_human_instruction=None` so that samples see the text as training did (the pipeline's own
  default prepends it).
- noisy = (1 - s) x + s n, target n - x, the transformer called with t = 1000 s (times the config's
  `timestep_scale`, 1 except for Sana Sprint, as the pipeline does).
- the shift: the model's scheduler config. Sana's folders ship DPMSolverMultistepScheduler with `use_flow_sigmas`
  and `flow_shift` (3.0 at 1024 px, what NVlabs trained and samples with); a FlowMatchEulerDiscreteScheduler's
  `shift` is read as SD3's. diffusers' training script loads that DPM config into FlowMatchEulerDiscreteScheduler,
  which knows no `flow_shift`, and so trains unshifted, as does OneTrainer's default timestep_shift 1.0:
  `loss.timestep_shift: 1` reproduces them (`ot-dist import onetrainer` carries OneTrainer's value).

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`) that SanaPipeline.load_lora_weights
reads; ComfyUI has no Sana model type (no LoRA key rules for it). No single-file layout.
"""

from __future__ import annotations

import torch

from ot_dist.models.families.base import Family
from ot_dist.models.families.gemma import (GEMMA_EMBEDDING_KEY, GEMMA_LORA_TARGETS, GEMMA_SHARD_UNITS, TINY_GEMMA_WIDTH, tiny_gemma,
                                          tiny_gemma_tokenizer)
from ot_dist.models.families.sd import skipped_layer
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# train_dreambooth_lora_sana.py's default --lora_layers (self- and cross-attention q / k / v)
SANA_LORA_TARGETS = ("to_q", "to_k", "to_v")
SANA_LORA_ATTENTION = SANA_LORA_TARGETS + ("to_out.0",)
# the Mix-FFN's pointwise convolutions (GLUMBConv; its depthwise conv_depth is left alone)
SANA_LORA_WITH_MLP = SANA_LORA_ATTENTION + ("ff.conv_inverted", "ff.conv_point")
MAX_SEQUENCE_LENGTH = 300  # SanaPipeline's and the training script's


class Sana(Family):
    name = "sana"
    description = "Sana (linear DiT over 32x DC-AE latents, Gemma2 with its mask, flow matching with the raw t)"
    pipeline_class = "SanaPipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {"text_encoder": GEMMA_EMBEDDING_KEY}  # OneTrainer's SanaEmbeddingSaver
    # OneTrainer's SanaEmbeddingSaver: gemma (the zero input rows), gemma_out; SanaModel.encode_text applies the
    # vectors to the Gemma's read state (encode_gemma: the last, after the final norm). The start needs no mask: a
    # causal decoder's states before the (right) padding do not see it.
    output_embedding_keys = {"text_encoder": GEMMA_EMBEDDING_KEY}

    def text_states(self, encoder, output):
        return output.last_hidden_state  # (no layer skip: output_embedding_conflict)

    def output_embedding_conflict(self, model_config):
        if model_config.text_encoder_layer_skip:
            # the skipped layer goes through Gemma's final norm after the encoder returns it (encode_text), so vectors
            # put into it would be normalised; OneTrainer puts them after the norm
            return ("model.text_encoder_layer_skip", "an output embedding's vectors replace the encoder's output "
                    "after its final norm, which a layer skip applies afterwards; set it to 0")
        return None

    lowercases_prompts = "Sana's training and SanaPipeline lower-case every caption (_text_preprocessing)"
    denoiser_lora_presets = {"default": SANA_LORA_TARGETS, "attention": SANA_LORA_ATTENTION,
                             "attention_mlp": SANA_LORA_WITH_MLP}
    text_lora_targets = GEMMA_LORA_TARGETS
    # model.text_encoder_layer_skip: an earlier layer's hidden states through Gemma's final norm (OneTrainer's
    # encode_gemma); samples then get the prompts' conditioning from encode_text (SanaPipeline has no layer skip)
    layer_skip_encoders = ("text_encoder",)
    # Gemma's embedding table is its own unit (ot_dist/models/families/gemma.py says why)
    shard_units = {"transformer": ("transformer_blocks",), "text_encoder": GEMMA_SHARD_UNITS}
    pixel_multiple = 32  # DC-AE x32, 1x1 patches
    memory_reference = "Sana 1600M"  # Sana_1600M_1024px: the 1.6 B transformer, Gemma-2-2B-IT (2.6 B), DC-AE f32c32
    samplers = ("flow_euler",)
    # OneTrainer's sample default (SampleConfig.py's Sana branch), also SanaPipeline's own
    sample_guidance_scale = 4.5
    lora_file_prefixes = None  # the diffusers layout
    single_file = False
    modelspec_architecture = "sana"  # OneTrainer's (resources/sd_model_spec/sana.json)
    modelspec_implementation = "https://github.com/NVlabs/Sana"

    def objective(self, pipeline, model_config) -> FlowMatching:
        config = pipeline.scheduler.config
        shift = config.get("flow_shift") if config.get("use_flow_sigmas") else None  # a DPM-solver flow config
        return FlowMatching.from_scheduler_config(config, patch_size=pipeline.transformer.config.patch_size,
                                                  shift=shift, dynamic=False)

    def objective_kind(self) -> str:
        return "flow"

    def sampling_overrides(self, objective: FlowMatching) -> dict:
        # flow_euler's FlowMatchEulerDiscreteScheduler reads `shift`: the DPM config's flow_shift, not its default 1
        return {"shift": objective.shift}

    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_SEQUENCE_LENGTH, tokenizer.model_max_length)  # the tiny test tokenizer has 32

    def pipeline_call_options(self, pipeline) -> dict:
        # The text as training sees it (no instruction prefix, no caption cleaning), at the requested size (no
        # snapping to the pipeline's aspect-ratio bins: training uses the bucket sizes as they are).
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer),
                "complex_human_instruction": None, "clean_caption": False, "use_resolution_binning": False}

    def sampling_arguments(self, pipeline, arguments):
        arguments = {**arguments, **self.pipeline_call_options(pipeline)}
        if not self.layer_skip:
            return arguments
        encoders, tokenizers = {"text_encoder": pipeline.text_encoder}, {"tokenizer": pipeline.tokenizer}
        with torch.no_grad():
            prompt, negative = (self.encode_text(encoders, self.tokenize(tokenizers, [text])) for text in (
                arguments.pop("prompt"), arguments.pop("negative_prompt", "")))  # the pipeline's default: ""
        return {**arguments, "prompt_embeds": prompt["hidden"], "prompt_attention_mask": prompt["mask"],
                "negative_prompt": None, "negative_prompt_embeds": negative["hidden"],
                "negative_prompt_attention_mask": negative["mask"]}

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        text = [caption.lower().strip() for caption in captions]  # SanaPipeline._text_preprocessing
        encoded = tokenizer(text, padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, add_special_tokens=True, padding_side="right", return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        gemma = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], gemma.device)
        skip = self.layer_skip.get("text_encoder", 0)
        out = gemma(to_device(tokens["text_encoder"], gemma.device), attention_mask=mask, use_cache=False,
                    output_hidden_states=bool(skip))
        hidden = gemma.norm(skipped_layer(out.hidden_states, -1, skip, "text_encoder")) if skip else out[0]
        return {"hidden": hidden, "mask": mask.long()}

    def latent_shape(self, vae, pixel_height, pixel_width):
        factor = 2 ** (len(vae.config.encoder_block_out_channels) - 1)  # AutoencoderDC: x2 per stage after the first
        return torch.Size((vae.config.latent_channels, pixel_height // factor, pixel_width // factor))

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        # float32 timestep, as the pipeline passes it (bfloat16 would round t near 1000 to a multiple of 4)
        timestep = timesteps.float() * denoiser.config.timestep_scale
        return denoiser(noisy, encoder_hidden_states=conditioning["hidden"],
                        encoder_attention_mask=conditioning["mask"], timestep=timestep, return_dict=False)[0]

    def build_tiny(self, seed: int = 0, **_):
        from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

        torch.manual_seed(seed)
        tokenizer = tiny_gemma_tokenizer()
        text_encoder = tiny_gemma(len(tokenizer))
        # Sana 1.0's DC-AE layout (3 ResBlock stages, 3 EfficientViT stages, x32), narrow; 8 latent channels
        stages = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
        vae = AutoencoderDC(
            in_channels=3, latent_channels=8, attention_head_dim=8, encoder_block_types=stages,
            decoder_block_types=stages, encoder_block_out_channels=(8, 8, 8, 16, 16, 16),
            decoder_block_out_channels=(8, 8, 8, 16, 16, 16), encoder_layers_per_block=(1,) * 6,
            decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 3 + ((5,),) * 3,
            decoder_qkv_multiscales=((),) * 3 + ((5,),) * 3, downsample_block_type="conv",
            upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
            scaling_factor=0.41407)
        transformer = SanaTransformer2DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
            caption_channels=TINY_GEMMA_WIDTH, sample_size=32, patch_size=1)
        # what Sana's diffusers folders ship (scripts/convert_sana_to_diffusers.py, flow-dpm_solver)
        scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
        return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                            scheduler=scheduler)


FAMILIES = {"sana": Sana()}
