"""The memory table of docs/low-memory.md: bytes of weights, gradients and optimizer state for SD 1.5, SDXL, SD3.5
Large, Flux.1 dev, Stable Cascade's stage C (3.6 B and lite 1 B), Würstchen v2's prior (1 B), Qwen-Image (20 B),
Sana 1600M, Z-Image (6 B), HiDream-I1 (17 B), Lumina-Image 2.0, FLUX.2 dev (32 B), FLUX.2 klein 9B, Wan 2.1 T2V
14B, ERNIE-Image (8 B), Anima (2 B), Ideogram 4 (9.3 B, twice), Krea 2 (13 B) and HunyuanVideo (13 B) under the
low-memory options and, for the transformers and the priors, a full finetune under fsdp, from parameter counts
and dtypes.

The real architectures are built on the meta device (no weights, no downloads) from the key numbers
of their published configs, written out below. Activations are not counted: they depend on
resolution, batch size and gradient checkpointing.

    python -m ot_dist.memory.table
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ot_dist.memory.block_streaming import first_streamed
from ot_dist.models.families.anima import Anima
from ot_dist.models.families.ernie_image import ErnieImage
from ot_dist.models.families.flux import FLUX_LORA_TARGETS
from ot_dist.models.families.flux2 import Flux2, Flux2Klein
from ot_dist.models.families.hidream import HiDream
from ot_dist.models.families.ideogram4 import Ideogram4
from ot_dist.models.families.krea2 import Krea2
from ot_dist.models.families.hunyuan_video import HunyuanVideo
from ot_dist.models.families.lumina2 import Lumina2
from ot_dist.models.families.qwen_image import QwenImage
from ot_dist.models.families.sana import Sana
from ot_dist.models.families.sd import UNET_LORA_TARGETS as UNET_ATTENTION_TARGETS
from ot_dist.models.families.sd import UNET_SHARD_UNITS
from ot_dist.models.families.sd3 import SD3_LORA_TARGETS
from ot_dist.models.families.stable_cascade import CASCADE_ATTENTION, StableCascade, WuerstchenV2
from ot_dist.models.families.wan import Wan
from ot_dist.models.families.z_image import ZImage

GIB = 1024**3
LORA_RANK = 16
BNB_BLOCK, BNB_MIN_8BIT_SIZE = 256, 4096  # bitsandbytes' 8-bit state: blocks with one float32 absmax per state


# Key numbers of the published configs (runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-xl-base-1.0).
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768, attention_head_dim=8,
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20), use_linear_projection=True, cross_attention_dim=2048,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
OPENCLIP_BIGG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                     num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)


# black-forest-labs/FLUX.1-dev and stabilityai/stable-diffusion-3.5-large transformer configs, google/t5-v1_1-xxl's
# encoder (as both ship it), and their 16-channel VAE.
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
VAE_16 = dict(VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
# stabilityai/stable-cascade-prior's prior (stage C, 3.6 B) and prior_lite (1 B) configs; CLIP-G as the prior's text
# encoder (OpenCLIP bigG with its projection); the EfficientNetV2-S image encoder in place of a VAE.
CASCADE_BLOCKS = (("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),) * 2
STAGE_C = dict(in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64, patch_size=1, conditioning_dim=2048,
               block_out_channels=(2048, 2048), num_attention_heads=(32, 32), down_num_layers_per_block=(8, 24),
               up_num_layers_per_block=(24, 8), down_blocks_repeat_mappers=(1, 1), up_blocks_repeat_mappers=(1, 1),
               block_types_per_layer=CASCADE_BLOCKS, clip_text_in_channels=1280, clip_text_pooled_in_channels=1280,
               clip_image_in_channels=768, clip_seq=4, kernel_size=3, dropout=(0.1, 0.1), self_attn=True,
               timestep_conditioning_type=("sca", "crp"), switch_level=(False,))
STAGE_C_LITE = dict(STAGE_C, conditioning_dim=1536, block_out_channels=(1536, 1536), num_attention_heads=(24, 24),
                    down_num_layers_per_block=(4, 12), up_num_layers_per_block=(12, 4))
# warp-ai/wuerstchen-prior: the prior as diffusers' scripts/convert_wuerstchen.py builds it (WuerstchenPrior c_in 16,
# c 1536, c_cond 1280, c_r 64, depth 32, nhead 24; dropout 0.1, its default) and laion/CLIP-ViT-bigG-14-laion2B-39B-b160k's
# text model as a CLIPTextModel (no projection); the EfficientNetV2-S image encoder in place of a VAE.
WUERSTCHEN_V2_PRIOR = dict(c_in=16, c=1536, c_cond=1280, c_r=64, depth=32, nhead=24, dropout=0.1)
# Qwen/Qwen-Image: its transformer/config.json (diffusers' QwenImageTransformer2DModel defaults are the same), its
# text_encoder (Qwen/Qwen2.5-VL-7B-Instruct's config: the language model, untied lm_head, and the vision tower, which
# the pipeline loads though text-only training never runs it) and its VAE (AutoencoderKLQwenImage's defaults).
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
QWEN25_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, tie_word_embeddings=False),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    vocab_size=152064, tie_word_embeddings=False)
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                      temperal_downsample=[False, True, True])
# Efficient-Large-Model/Sana_1600M_1024px_diffusers: the transformer as diffusers' scripts/convert_sana_to_diffusers.py
# builds SanaMS_1600M_P1_D20 at 1024 px (70 heads x 32, 20 blocks, cross-attention 20 x 112, Gemma's 2304-wide
# caption, no interpolation_scale at 1024); its text_encoder is Gemma-2-2B-IT's decoder (Gemma2Model: no lm_head,
# the embedding tied to it in the CausalLM), whose numbers are transformers' Gemma2Config defaults (google/gemma-2-2b's,
# written out); its VAE mit-han-lab/dc-ae-f32c32-sana-1.0 (scripts/convert_dcae_to_diffusers.py's config, block types
# under AutoencoderDC's current names).
SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                  num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                  caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
                  norm_elementwise_affine=False, norm_eps=1e-6)
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=4096, max_position_embeddings=8192)
DC_AE_STAGES = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
DC_AE_F32C32 = dict(in_channels=3, latent_channels=32, attention_head_dim=32, encoder_block_types=DC_AE_STAGES,
                    decoder_block_types=DC_AE_STAGES, encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                    decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                    encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
                    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
                    decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), downsample_block_type="conv",
                    upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
                    scaling_factor=0.41407)
# black-forest-labs/FLUX.2-dev: its transformer (Flux2Transformer2DModel's defaults are its config: 8 double and 48
# single blocks, 48 heads x 128, the 3 x 5120-wide text input), its text_encoder (mistralai/Mistral-Small-3.1-24B-
# Instruct-2503's config: the language model, untied lm_head, and the Pixtral vision tower, which the pipeline loads
# though text-only training never runs it) and its VAE (AutoencoderKLFlux2's defaults). FLUX.2-klein-base-9B: 8 double
# and 24 single blocks, 32 heads, Qwen/Qwen3-8B's 3 x 4096-wide hidden layers, no guidance embedding, Qwen3-8B as its
# text encoder (untied lm_head), the same VAE.
FLUX2_DEV = dict(in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
                 joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True)
FLUX2_KLEIN_9B = dict(FLUX2_DEV, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                      guidance_embeds=False)
MISTRAL_SMALL_31 = dict(
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                     tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3),
    image_token_index=10, spatial_merge_size=2, multimodal_projector_bias=False, projector_hidden_act="gelu",
    tie_word_embeddings=False)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
# Alpha-VLLM/Lumina-Image-2.0: its transformer (Lumina2Transformer2DModel's defaults but the caption width, Gemma's
# 2304, which ComfyUI's model_detection.py reads from cap_embedder.1.weight beside the same 2304-wide, 24 / 8-head,
# 32-32-32 RoPE numbers), google/gemma-2-2b's decoder as the text encoder (GEMMA2_2B) and the Flux VAE (VAE_16).
LUMINA_IMAGE_2 = dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                      num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                      axes_lens=(300, 512, 512), cap_feat_dim=2304)
# Tongyi-MAI/Z-Image-Turbo: its transformer/config.json (diffusers' ZImageTransformer2DModel defaults, written out),
# its text_encoder Qwen/Qwen3-4B's decoder (Qwen3Model: no lm_head, the embedding tied to it in the CausalLM) and the
# Flux VAE (16 channels).
Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
               n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
               t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True)
# HiDream-ai/HiDream-I1-Full: its transformer as ComfyUI's model_detection.py and diffusers' config give it (16 dual-
# and 32 single-stream blocks, 20 heads x 128, 4 routed experts with 2 active, Llama layers 0-31 then 31 for the last 16
# blocks), CLIP-L and CLIP-G with their projections and the 248 positions of HiDream's CLIPs (the pipeline pads to
# 128 tokens, bounded by 218), T5-XXL's encoder, meta-llama/Llama-3.1-8B-Instruct (LlamaForCausalLM, untied lm_head)
# and the Flux VAE.
HIDREAM_I1 = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                  attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
                  num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128),
                  llama_layers=list(range(32)) + [31] * 16)
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
# Wan-AI/Wan2.1-T2V-14B-Diffusers: its transformer/config.json (5120 wide: 40 heads x 128, 40 blocks, FFN 13824, UMT5's
# 4096-wide states in), its text_encoder google/umt5-xxl's encoder (UMT5EncoderModel: 24 blocks, d_model 4096, d_ff 10240,
# 64 heads x 64, a relative-attention bias in every block, the 256384-token vocabulary) and its VAE (AutoencoderKLWan,
# Qwen-Image's numbers: base_dim 96, z_dim 16).
WAN21_T2V_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
                is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
# krea/Krea-2-Raw: Krea2Transformer2DModel's defaults, which its docstring gives as Krea 2's (48 heads x 128 = 6144
# wide, 12 key / value heads, 28 blocks, FFN 16384; the 12 x 2560-wide text taps fused by 2 + 2 blocks 20 heads wide),
# written out; its text_encoder Qwen/Qwen3-VL-4B-Instruct's Qwen3VLModel (the language model without lm_head, the vision
# tower, which the pipeline loads though text-only training never runs it) and Qwen-Image's VAE.
KREA2 = dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
             intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560, num_text_layers=12,
             text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=6912,
             num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48))
QWEN3_VL_4B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000,
                                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
    vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[5, 11, 17]),
    tie_word_embeddings=True)
# baidu/ERNIE-Image: its 8 B transformer (ComfyUI's ErnieImageModel defaults, comfy/ldm/ernie/model.py @ 7b30bf37:
# 36 blocks 4096 wide, 32 heads, the 12288-wide gated MLP, Ministral-3's 3072-wide states in), its text_encoder
# Mistral3Model of Ministral-3 3B (ComfyUI's Ministral3_3BConfig: 26 layers, 3072 wide, 8 KV heads, the tied
# embedding once; the model card's 3.4 B language model and 0.4 B Pixtral vision tower, FLUX.2's tower config, which
# the pipeline loads though text-only training never runs it) and FLUX.2's VAE.
ERNIE_IMAGE = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
                   out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48))
MINISTRAL3_3B = dict(
    text_config=dict(model_type="ministral3", vocab_size=131072, hidden_size=3072, intermediate_size=9216,
                     num_hidden_layers=26, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=262144, rms_norm_eps=1e-5, tie_word_embeddings=True),
    vision_config=MISTRAL_SMALL_31["vision_config"], image_token_index=10, spatial_merge_size=2,
    multimodal_projector_bias=False, projector_hidden_act="gelu")
# circlestone-labs/Anima: the transformer as diffusers' convert_anima_to_diffusers.py builds it (Cosmos-Predict2 2B's
# config: 16 heads x 128, 28 blocks, 1024-wide text, RoPE scale (1, 4, 4), the padding-mask channel), its LLM adapter
# (AnimaTextConditioner's defaults: 6 blocks 1024 wide over T5's 32128 ids), Qwen/Qwen3-0.6B-Base's decoder as the
# text encoder and the Qwen-Image VAE.
ANIMA_2B = dict(in_channels=16, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=28,
                mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
                rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True)
# Ideogram 4 (ideogram-ai/ideogram-v4 as diffusers ships it): two transformers of Ideogram4Transformer2DModel's default
# config (its docstring's: 34 blocks of 18 heads x 256, SwiGLU 12288, 53248-wide text features in), the conditional one
# trained and the unconditional one frozen; the text encoder Qwen/Qwen3-VL-8B-Instruct's Qwen3VLModel (no lm_head: the
# language model and its vision tower, which text-only training never runs) and AutoencoderKLFlux2's defaults.
IDEOGRAM4 = dict(in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18,
                 intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000,
                 mrope_section=(24, 20, 20))
QWEN3_VL_8B = dict(
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24]),
    tie_word_embeddings=False)
# Components beside the denoiser that ot_dist keeps on the device whatever the setup offloads: the frozen denoisers only
# sampling runs (Family.sampling_modules: Ideogram 4's unconditional transformer)
RESIDENT_COMPONENTS = ("unconditional_transformer",)
# model -> (denoiser component, its LoRA targets (the family's default preset), the family's sharding units)
DENOISERS = {
    "SD 1.5": ("unet", UNET_ATTENTION_TARGETS, UNET_SHARD_UNITS),
    "SDXL": ("unet", UNET_ATTENTION_TARGETS, UNET_SHARD_UNITS),
    "SD3.5 Large": ("transformer", SD3_LORA_TARGETS, ("transformer_blocks",)),
    "Flux.1 dev": ("transformer", FLUX_LORA_TARGETS, ("transformer_blocks", "single_transformer_blocks")),
    "Stable Cascade C": ("prior", CASCADE_ATTENTION, StableCascade.shard_units["prior"]),
    "Stable Cascade C lite": ("prior", CASCADE_ATTENTION, StableCascade.shard_units["prior"]),
    "Würstchen v2": ("prior", WuerstchenV2.denoiser_lora_presets["default"], WuerstchenV2.shard_units["prior"]),
    "Qwen-Image": ("transformer", QwenImage.denoiser_lora_presets["default"], QwenImage.shard_units["transformer"]),
    "Sana 1600M": ("transformer", Sana.denoiser_lora_presets["default"], Sana.shard_units["transformer"]),
    "FLUX.2 dev": ("transformer", Flux2.denoiser_lora_presets["default"], Flux2.shard_units["transformer"]),
    "FLUX.2 klein 9B": ("transformer", Flux2Klein.denoiser_lora_presets["default"],
                        Flux2Klein.shard_units["transformer"]),
    "Lumina-Image 2.0": ("transformer", Lumina2.denoiser_lora_presets["default"], Lumina2.shard_units["transformer"]),
    "Z-Image": ("transformer", ZImage.denoiser_lora_presets["default"], ZImage.shard_units["transformer"]),
    "HiDream-I1": ("transformer", HiDream.denoiser_lora_presets["default"], HiDream.shard_units["transformer"]),
}
DENOISERS["Wan 2.1 T2V 14B"] = ("transformer", Wan.denoiser_lora_presets["default"], Wan.shard_units["transformer"])
DENOISERS["Krea 2"] = ("transformer", Krea2.denoiser_lora_presets["default"], Krea2.shard_units["transformer"])
DENOISERS["ERNIE-Image"] = ("transformer", ErnieImage.denoiser_lora_presets["default"],
                            ErnieImage.shard_units["transformer"])
DENOISERS["Anima"] = ("transformer", Anima.denoiser_lora_presets["default"], Anima.shard_units["transformer"])
DENOISERS["Ideogram 4"] = ("transformer", Ideogram4.denoiser_lora_presets["default"],
                           Ideogram4.shard_units["transformer"])
# hunyuanvideo-community/HunyuanVideo: its transformer/config.json (diffusers' defaults: 24 heads x 128, 20 dual- and 40
# single-stream blocks, 2 refiner blocks, Llama's 4096-wide states and CLIP-L's 768 pooled in, the guidance embedder),
# its text_encoder (xtuner/llava-llama-3-8b-v1_1's language model as a LlamaModel: no lm_head, the 128320-token
# vocabulary with LLaVA's added tokens), CLIP-L's text model and its VAE (AutoencoderKLHunyuanVideo's defaults).
HUNYUAN_VIDEO = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=(16, 56, 56))
LLAVA_LLAMA3_8B = dict(vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0)
DENOISERS["HunyuanVideo"] = ("transformer", HunyuanVideo.denoiser_lora_presets["default"],
                             HunyuanVideo.shard_units["transformer"])
# Flux.1 Kontext dev: Flux.1 dev's published transformer config, encoders and VAE (its own row for its activations:
# the reference image's tokens double the image sequence; ot_dist/starter/choose.py)
DENOISERS["Flux.1 Kontext dev"] = DENOISERS["Flux.1 dev"]
SAME_WEIGHTS_AS = {"Flux.1 Kontext dev": "Flux.1 dev"}  # rows the printed table leaves out: another row's figures
# Qwen-Image-Edit: Qwen/Qwen-Image's transformer, Qwen2.5-VL-7B (its vision tower now runs, frozen) and VAE (its own row
# for its activations: the reference's latent tokens and its vision tokens join the sequences; ot_dist/starter/choose.py)
DENOISERS["Qwen-Image-Edit"] = DENOISERS["Qwen-Image"]
SAME_WEIGHTS_AS["Qwen-Image-Edit"] = "Qwen-Image"


def build_components(model: str) -> dict[str, torch.nn.Module]:
    from diffusers import (AutoencoderDC, AutoencoderKL, AutoencoderKLQwenImage, FluxTransformer2DModel,
                           QwenImageTransformer2DModel, SanaTransformer2DModel, SD3Transformer2DModel,
                           StableCascadeUNet, UNet2DConditionModel)
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, Gemma2Config, Gemma2Model,
                              Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, T5Config, T5EncoderModel)

    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior

    from ot_dist.models.efficientnet import EfficientNetEncoder, EffnetConfig

    with torch.device("meta"):
        if model.startswith("FLUX.2"):
            return flux2_components(model)
        if model == "ERNIE-Image":
            from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel
            from transformers import Mistral3Config, Mistral3Model

            return {"transformer": ErnieImageTransformer2DModel(**ERNIE_IMAGE),
                    "text_encoder": Mistral3Model(Mistral3Config(**MINISTRAL3_3B)), "vae": AutoencoderKLFlux2()}
        if model == "HunyuanVideo":
            from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel
            from transformers import LlamaConfig, LlamaModel

            return {"transformer": HunyuanVideoTransformer3DModel(**HUNYUAN_VIDEO),
                    "text_encoder": LlamaModel(LlamaConfig(**LLAVA_LLAMA3_8B)),
                    "text_encoder_2": CLIPTextModel(CLIPTextConfig(**CLIP_L)), "vae": AutoencoderKLHunyuanVideo()}
        if model == "Wan 2.1 T2V 14B":
            from diffusers import AutoencoderKLWan, WanTransformer3DModel
            from transformers import UMT5Config, UMT5EncoderModel

            return {"transformer": WanTransformer3DModel(**WAN21_T2V_14B),
                    "text_encoder": UMT5EncoderModel(UMT5Config(**UMT5_XXL)),
                    "vae": AutoencoderKLWan(**QWEN_IMAGE_VAE)}
        if model == "Anima":
            from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
            from transformers import Qwen3Config, Qwen3Model

            return {"transformer": CosmosTransformer3DModel(**ANIMA_2B),
                    "text_encoder": Qwen3Model(Qwen3Config(**QWEN3_06B)), "text_conditioner": AnimaTextConditioner(),
                    "vae": AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)}
        if model == "Ideogram 4":
            from diffusers import AutoencoderKLFlux2, Ideogram4Transformer2DModel
            from transformers import Qwen3VLConfig, Qwen3VLModel

            return {"transformer": Ideogram4Transformer2DModel(**IDEOGRAM4),
                    "unconditional_transformer": Ideogram4Transformer2DModel(**IDEOGRAM4),
                    "text_encoder": Qwen3VLModel(Qwen3VLConfig(**QWEN3_VL_8B)), "vae": AutoencoderKLFlux2()}
        if model == "Krea 2":
            from diffusers import Krea2Transformer2DModel
            from transformers import Qwen3VLConfig, Qwen3VLModel

            return {"transformer": Krea2Transformer2DModel(**KREA2), "text_encoder": Qwen3VLModel(Qwen3VLConfig(**QWEN3_VL_4B)),
                    "vae": AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)}
        if model == "Lumina-Image 2.0":
            from diffusers import Lumina2Transformer2DModel

            return {"transformer": Lumina2Transformer2DModel(**LUMINA_IMAGE_2),
                    "text_encoder": Gemma2Model(Gemma2Config(**GEMMA2_2B)), "vae": AutoencoderKL(**VAE_16)}
        if model == "Z-Image":
            from diffusers import ZImageTransformer2DModel
            from transformers import Qwen3Config, Qwen3Model

            return {"transformer": ZImageTransformer2DModel(**Z_IMAGE), "text_encoder": Qwen3Model(Qwen3Config(**QWEN3_4B)),
                    "vae": AutoencoderKL(**VAE_16)}
        if model == "HiDream-I1":
            from diffusers import HiDreamImageTransformer2DModel
            from transformers import LlamaConfig, LlamaForCausalLM

            long_clip = {"max_position_embeddings": 248}
            return {"transformer": HiDreamImageTransformer2DModel(**HIDREAM_I1),
                    "text_encoder": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L | long_clip)),
                    "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**OPENCLIP_BIGG | long_clip)),
                    "text_encoder_3": T5EncoderModel(T5Config(**T5_XXL)),
                    "text_encoder_4": LlamaForCausalLM(LlamaConfig(**LLAMA31_8B)), "vae": AutoencoderKL(**VAE_16)}
        if model == "Sana 1600M":
            return {"transformer": SanaTransformer2DModel(**SANA_1600M),
                    "text_encoder": Gemma2Model(Gemma2Config(**GEMMA2_2B)), "vae": AutoencoderDC(**DC_AE_F32C32)}
        if model in ("Qwen-Image", "Qwen-Image-Edit"):
            return {"transformer": QwenImageTransformer2DModel(**QWEN_IMAGE),
                    "text_encoder": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B)),
                    "vae": AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)}
        if model == "Würstchen v2":
            return {"prior": WuerstchenPrior(**WUERSTCHEN_V2_PRIOR),
                    "text_encoder": CLIPTextModel(CLIPTextConfig(**OPENCLIP_BIGG)),
                    "effnet": EfficientNetEncoder(EffnetConfig(affine=WuerstchenV2.effnet_affine))}
        if model.startswith("Stable Cascade C"):
            return {"prior": StableCascadeUNet(**(STAGE_C_LITE if model.endswith("lite") else STAGE_C)),
                    "text_encoder": CLIPTextModelWithProjection(CLIPTextConfig(**OPENCLIP_BIGG)),
                    "effnet": EfficientNetEncoder()}
        if model in ("Flux.1 dev", "Flux.1 Kontext dev"):
            return {"transformer": FluxTransformer2DModel(**FLUX_DEV),
                    "text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP_L)),
                    "text_encoder_2": T5EncoderModel(T5Config(**T5_XXL)), "vae": AutoencoderKL(**VAE_16)}
        if model == "SD3.5 Large":
            return {"transformer": SD3Transformer2DModel(**SD35_LARGE),
                    "text_encoder": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L)),
                    "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**OPENCLIP_BIGG)),
                    "text_encoder_3": T5EncoderModel(T5Config(**T5_XXL)), "vae": AutoencoderKL(**VAE_16)}
        if model == "SD 1.5":
            return {"unet": UNet2DConditionModel(**SD15_UNET), "text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP_L)),
                    "vae": AutoencoderKL(**VAE)}
        return {"unet": UNet2DConditionModel(**SDXL_UNET), "text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP_L)),
                "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**OPENCLIP_BIGG)),
                "vae": AutoencoderKL(**VAE)}


def flux2_components(model: str) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    if model == "FLUX.2 dev":
        transformer = Flux2Transformer2DModel(**FLUX2_DEV)
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(**MISTRAL_SMALL_31))
    else:
        transformer = Flux2Transformer2DModel(**FLUX2_KLEIN_9B)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B))
    return {"transformer": transformer, "text_encoder": text_encoder, "vae": AutoencoderKLFlux2()}


def lora_shapes(unet: torch.nn.Module, rank: int = LORA_RANK, targets=UNET_ATTENTION_TARGETS) -> list[tuple[int, ...]]:
    """Shapes of peft's lora_A / lora_B for the default UNet targets (peft matches module-name suffixes)."""
    shapes = []
    for name, module in unet.named_modules():
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if isinstance(module, torch.nn.Linear):
            shapes += [(rank, module.in_features), (module.out_features, rank)]
        elif isinstance(module, torch.nn.Conv2d):
            shapes += [(rank, module.in_channels, *module.kernel_size), (module.out_channels, rank, 1, 1)]
    return shapes


def optimizer_state_bytes(shapes: list[tuple[int, ...]], optimizer: str) -> int:
    """Optimizer state of parameters of these shapes, as the implementations allocate it."""
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        if optimizer == "ADAMW":  # torch: exp_avg + exp_avg_sq in the parameter's dtype (float32)
            total += 8 * n
        elif optimizer == "ADAMW_8BIT":  # bitsandbytes: two uint8 states + an absmax per block each
            total += 8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 8 * math.ceil(n / BNB_BLOCK)
        elif optimizer == "ADAFACTOR":  # transformers, beta1 None: factored second moment (rows + columns)
            total += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])) if len(shape) >= 2 else 4 * n
        else:
            raise ValueError(optimizer)
    return total


@dataclass
class Setup:
    label: str
    trained: str  # "lora" or "full" (the UNet)
    frozen: str  # bytes per frozen parameter: "float32" | "bfloat16" | "float8" | "nf4" (Linear weights)
    offload: bool  # text encoders + VAE in CPU memory (or unused: cached latents and text)
    trained_dtype: str = "float32"  # trained weights and gradients
    optimizer: str = "ADAMW"
    fused_back_pass: bool = False  # gradients applied as they arrive: none held for the whole model
    # the share of the denoiser's block bytes kept in CPU memory and copied in ahead of use (`<denoiser>.
    # offload_fraction`, memory/block_streaming.py, with gradient checkpointing): a LoRA's frozen blocks, or a full
    # finetune's trained ones (their optimizer state stays on the device)
    streamed: float = 0.0


# nf4 (memory/nf4.py): a 4-bit code per weight, an 8-bit absmax per block of 64, a float32 scale per 256 absmaxes
# (bitsandbytes' double quantization; a layer's 1.1 KB of code tables aside). Only Linear weights: the other frozen
# parameters of an nf4 part stay in the compute dtype, bfloat16 here (NF4_OTHERS).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_OTHERS = "bfloat16"
BYTES = {"float32": 4, "bfloat16": 2, "float8": 1, "nf4": NF4_BYTES}
SETUPS = [
    Setup("LoRA r16, frozen float32", "lora", "float32", False),
    Setup("LoRA r16, frozen bfloat16", "lora", "bfloat16", False),
    Setup("LoRA r16, frozen float8", "lora", "float8", False),
    Setup("LoRA r16, frozen float8, text encoders + VAE offloaded", "lora", "float8", True),
    # streaming costs time (12 % for half of Flux.1 dev's blocks on an H200, docs/performance.md), not accuracy:
    # tried before nf4's coarser weights
    Setup("LoRA r16, frozen float8, text encoders + VAE offloaded, half the blocks streamed", "lora", "float8", True,
          streamed=0.5),
    Setup("LoRA r16, frozen nf4 (Linear weights), text encoders + VAE offloaded", "lora", "nf4", True),
    Setup("LoRA r16, frozen nf4 (Linear weights), text encoders + VAE offloaded, 80 % of the blocks streamed", "lora",
          "nf4", True, streamed=0.8),
    Setup("full denoiser, AdamW, frozen bfloat16", "full", "bfloat16", False),
    Setup("full denoiser, 8-bit AdamW, frozen bfloat16", "full", "bfloat16", False, optimizer="ADAMW_8BIT"),
    Setup("full denoiser, Adafactor, frozen bfloat16", "full", "bfloat16", False, optimizer="ADAFACTOR"),
    Setup("full denoiser, bfloat16 weights, Adafactor, fused back pass, frozen float8 + offloaded", "full", "float8",
          True, trained_dtype="bfloat16", optimizer="ADAFACTOR", fused_back_pass=True),
    # the trained weights stream too, stepped in backward (memory/trained_streaming.py; OneTrainer's FINE_TUNE presets)
    Setup("full denoiser, bfloat16 weights, Adafactor, fused back pass, frozen float8 + offloaded, half the blocks "
          "streamed", "full", "float8", True, trained_dtype="bfloat16", optimizer="ADAFACTOR", fused_back_pass=True,
          streamed=0.5),
    Setup("full denoiser, bfloat16 weights, Adafactor, fused back pass, frozen float8 + offloaded, 80 % of the blocks "
          "streamed", "full", "float8", True, trained_dtype="bfloat16", optimizer="ADAFACTOR", fused_back_pass=True,
          streamed=0.8),
]


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def component_rows(sizes: dict[str, ModelSizes]) -> list[str]:
    rows = ["| model | component | parameters | float32 GiB | bfloat16 GiB | float8 GiB | nf4 GiB |",
            "|---|---|--:|--:|--:|--:|--:|"]
    for model, measured in sizes.items():
        for name, n in measured.counts.items():
            nf4 = frozen_bytes("nf4", n, measured.linear[name])
            rows.append(f"| {model} | {name} | {n:,} | {gib(4 * n)} | {gib(2 * n)} | {gib(n)} | {gib(nf4)} |")
    return rows


def trained_rows(sizes: dict[str, ModelSizes]) -> list[str]:
    rows = ["| model | trained | parameters | weights + grads float32 GiB | weights + grads bfloat16 GiB | AdamW state GiB "
            "| 8-bit AdamW state GiB | Adafactor state GiB |", "|---|---|--:|--:|--:|--:|--:|--:|"]
    for model, measured in sizes.items():
        for trained, shapes in measured.trained.items():
            n = sum(math.prod(s) for s in shapes)
            states = [gib(optimizer_state_bytes(shapes, o)) for o in ("ADAMW", "ADAMW_8BIT", "ADAFACTOR")]
            rows.append(f"| {model} | {trained} | {n:,} | {gib(8 * n)} | {gib(4 * n)} | {' | '.join(states)} |")
    return rows


def denoiser_of(components: dict) -> str:
    return next(name for name in ("unet", "transformer", "prior") if name in components)


def trained_shapes(components: dict, targets=None) -> dict[str, list[tuple[int, ...]]]:
    denoiser = components[denoiser_of(components)]
    targets = targets or (UNET_ATTENTION_TARGETS if denoiser_of(components) == "unet" else FLUX_LORA_TARGETS)
    return {"lora": lora_shapes(denoiser, targets=targets), "full": [tuple(p.shape) for p in denoiser.parameters()]}


@dataclass(frozen=True)
class ModelSizes:
    """What the byte figures of the setups read of a model: each component's parameter count and the shapes each
    kind of training trains. Measured once per model: walking a real-size model's modules and parameters costs
    about 0.1 s, and every setup (and every `ot-dist init` candidate) reads the same figures."""

    counts: dict[str, int]
    denoiser: str
    trained: dict[str, list[tuple[int, ...]]]
    linear: dict[str, int]  # of counts, the elements of nn.Linear weights (what nf4 stores in 4 bits)
    # the denoiser's blocks (its sharding units, which block streaming streams), in order: (parameters, Linear weights)
    blocks: tuple[tuple[int, int], ...] = ()


def model_sizes(components: dict, targets=None, units: tuple[str, ...] = ()) -> ModelSizes:
    """`units`: the denoiser's block patterns (DENOISERS' third entry), for the streamed setups."""
    blocks = sharding_units(components[denoiser_of(components)], units) if units else []
    return ModelSizes({name: sum(p.numel() for p in m.parameters()) for name, m in components.items()},
                      denoiser_of(components), trained_shapes(components, targets),
                      {name: linear_weight_count(m) for name, m in components.items()},
                      tuple((sum(p.numel() for p in b.parameters()), linear_weight_count(b)) for b in blocks))


def linear_weight_count(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def frozen_bytes(storage: str, count: int, linear: int) -> float:
    """Bytes of `count` frozen parameters, `linear` of them nn.Linear weights, stored as `storage` (a weight_dtype)."""
    if storage == "nf4":
        return linear * NF4_BYTES + (count - linear) * BYTES[NF4_OTHERS]
    return count * BYTES[storage]


# Streamed blocks on the device at once, with gradient checkpointing: the one computing, the next one copied in ahead,
# and one whose copies autograd still holds (tests/test_block_streaming.py counts at most 3 live)
STREAMED_IN_FLIGHT = 3


def streamed_bytes(setup: Setup, sizes: ModelSizes) -> tuple[float, float]:
    """(bytes of the streamed blocks, bytes of the largest), chosen as training chooses them
    (memory/block_streaming.first_streamed)."""
    if setup.trained == "full":
        sizes_of = [count * BYTES[setup.trained_dtype] for count, _ in sizes.blocks]
    else:
        sizes_of = [frozen_bytes(setup.frozen, count, linear) for count, linear in sizes.blocks]
    streamed = sizes_of[first_streamed(sizes_of, setup.streamed):]
    return (sum(streamed), max(streamed)) if streamed else (0.0, 0.0)


def setup_bytes(setup: Setup, sizes: ModelSizes) -> float:
    """Device bytes: frozen weights + trained weights + gradients + optimizer state. A streamed setup keeps its
    streamed blocks in CPU memory and up to STREAMED_IN_FLIGHT of them on the device."""
    counts, denoiser = sizes.counts, sizes.denoiser
    shapes = sizes.trained[setup.trained]
    trained = sum(math.prod(s) for s in shapes)
    frozen_parts = [n for n in counts if n != denoiser and (not setup.offload or n in RESIDENT_COMPONENTS)]
    frozen_parts += [denoiser] if setup.trained == "lora" else []
    frozen = sum(frozen_bytes(setup.frozen, counts[n], sizes.linear[n]) for n in frozen_parts)
    streamed = 0.0  # the bytes streaming takes off the device (frozen ones for a LoRA, trained ones in a finetune)
    if setup.streamed:
        if not sizes.blocks:
            raise ValueError(f"'{setup.label}' needs the denoiser's blocks (model_sizes(..., units=...))")
        away, largest = streamed_bytes(setup, sizes)
        streamed = away - STREAMED_IN_FLIGHT * largest
    grads = 0 if setup.fused_back_pass else trained * BYTES[setup.trained_dtype]
    return (frozen + trained * BYTES[setup.trained_dtype] - streamed + grads
            + optimizer_state_bytes(shapes, setup.optimizer))


def setup_rows(sizes: dict[str, ModelSizes]) -> list[str]:
    names = list(sizes)
    rows = ["| setup | " + " | ".join(f"{m} GiB" for m in names) + " |", "|---|" + "--:|" * len(names)]
    for setup in SETUPS:
        rows.append(f"| {setup.label} | " + " | ".join(gib(setup_bytes(setup, sizes[m])) for m in names) + " |")
    return rows


def sharding_units(module: torch.nn.Module, patterns: tuple[str, ...]) -> list[torch.nn.Module]:
    from ot_dist.parallel.fsdp import wrap_units

    return wrap_units(module, patterns)


def fsdp_rank_bytes(components: dict, model: str, ranks: int) -> dict[str, float]:
    """A full finetune of the denoiser under fsdp (full_shard, bf16 compute, float32 masters, AdamW), text and
    latents cached (no encoder or VAE on the GPUs): per-rank bytes of the sharded state (weights + grads + 2 Adam
    moments, 16 bytes a parameter, split evenly) and the peak of the bf16 all-gathers (the largest unit, twice:
    the one computing and the one prefetched)."""
    name, _, patterns = DENOISERS[model]
    denoiser = components[name]
    total = sum(p.numel() for p in denoiser.parameters())
    units = [sum(p.numel() for p in unit.parameters()) for unit in sharding_units(denoiser, patterns)]
    root = total - sum(units)  # what the root's own fully_shard call gathers (embedders, final layer)
    largest = max(units + [root])
    return {"parameters": total, "sharded_state": 16 * total / ranks, "gather_peak": 2 * 2 * largest,
            "largest_unit_fraction": largest / total}


def fsdp_rows(models: dict, ranks=(8, 64)) -> list[str]:
    rows = ["| model | ranks | sharded weights + grads + AdamW GiB/rank | bf16 all-gather peak GiB | total GiB/rank "
            "| largest unit / model |", "|---|--:|--:|--:|--:|--:|"]
    for model, components in models.items():
        if denoiser_of(components) == "unet":
            continue
        for n in ranks:
            b = fsdp_rank_bytes(components, model, n)
            rows.append(f"| {model} | {n} | {gib(b['sharded_state'])} | {gib(b['gather_peak'])} | "
                        f"{gib(b['sharded_state'] + b['gather_peak'])} | {100 * b['largest_unit_fraction']:.2f} % |")
    return rows


def main() -> None:
    models = {model: build_components(model) for model in DENOISERS if model not in SAME_WEIGHTS_AS}
    sizes = {model: model_sizes(components, DENOISERS[model][1], DENOISERS[model][2])
             for model, components in models.items()}
    for rows in (component_rows(sizes), trained_rows(sizes), setup_rows(sizes), fsdp_rows(models)):
        print("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
