"""HunyuanVideo (Tencent's 13 B text-to-video DiT) trained on still images as one-frame videos:
`HunyuanVideoTransformer3DModel` (20 dual-stream and 40 single-stream blocks over (1, 2, 2) patches of 3-D latents, a
token refiner in front of the text, guidance-distilled: the guidance value is an input) on the causal 3-D VAE's latents
(`AutoencoderKLHunyuanVideo`, 4x temporal: one image is one latent frame), conditioned on Llava-Llama-3's hidden states
and CLIP-L's pooled output; flow matching with the raw timestep (0..1000).

What follows HunyuanVideoPipeline (diffusers 0.42) and OneTrainer's HUNYUAN_VIDEO (no diffusers training script exists;
SimpleTuner's `hunyuanvideo` is HunyuanVideo 1.5, another model):
- Text: the caption put into the pipeline's prompt template (a system prompt describing videos, then the caption as the
  user turn), tokenized with the mask and padded to the template's tokens + 256 (`max_sequence_length`); the Llama
  model's hidden states three from the end (`hidden_states[-3]`: the pipeline's num_hidden_layers_to_skip=2,
  OneTrainer's default_layer -3; model.text_encoder_layer_skip moves further back, as OneTrainer's), the template's
  tokens cropped off the states and the mask (`crop_start`: the template prefix's token count, 95 with Llava-Llama-3's
  tokenizer, the pipeline's constant). The transformer gets the mask (its refiner and attention ignore the padding).
  CLIP-L: the caption padded to 77, its pooled output (no mask), as the pipeline's `_get_clip_prompt_embeds`.
  OneTrainer pads the caption to 77 Llama tokens; ot_dist keeps the pipeline's 256, which sampling uses too.
- Latents: the VAE takes and gives one-frame videos; ot_dist keeps the frame axis out (`encode_posterior`, as
  Qwen-Image's and Wan's) and scales by the VAE's scaling_factor (0.476986; no shift), the inverse of the pipeline's
  decode and OneTrainer's `latent_image * scaling_factor`.
- Objective: x_t = (1 - s) x + s n, target n - x, the transformer called with t = 1000 s (float32, as the pipeline
  passes the scheduler's timesteps) on the latents with their frame axis put back, and the distilled guidance value
  x 1000 (model.guidance_scale, null = 1.0: OneTrainer's transformer.guidance_scale default). s shifted by the
  scheduler config's `shift` (hunyuanvideo-community/HunyuanVideo ships FlowMatchEulerDiscreteScheduler, shift 7.0).
- Samples: one frame (`num_frames=1`), the pipeline's `.frames[0][0]`, its embedded guidance (6.0 as the pipeline's and
  OneTrainer's default; no negative prompt: the pipeline uses one only with true_cfg_scale, which ot_dist leaves at 1).

Not supported (refused, not silently done wrong): video clips as training data (images only, this family's data is
one-frame videos); the image-to-video transformers (`image_condition_type`: HunyuanVideo-I2V, SkyReels' 32-channel
input).

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`) that HunyuanVideoPipeline.load_lora_weights
reads, and beside it `lora_comfyui.safetensors` in the original module names with q / k / v fused
(`diffusion_model.double_blocks.0.img_attn_qkv...`), the only ones ComfyUI maps for HunyuanVideo (comfy/lora.py
model_lora_keys_unet: no diffusers rule for it); diffusers reads that one too (hunyuan_video_lora.py).

Single file: the transformer alone in Tencent's original layout (hunyuan_video_single_file.py: Comfy-Org's
`hunyuan_video_t2v_720p_bf16.safetensors`, what diffusers' from_single_file and ComfyUI read); the text encoders and
the VAE come from the `model.config` folder (ComfyUI loads them from files of their own).
"""

from __future__ import annotations

import torch

from ot_dist.errors import ConfigError
from ot_dist.models.families.base import Family
from ot_dist.models.families.qwen_image import QwenImage
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

MAX_SEQUENCE_LENGTH = 256  # HunyuanVideoPipeline's max_sequence_length default: caption tokens after the template
CLIP_MAX_TOKENS = 77  # the pipeline's _get_clip_prompt_embeds length
HIDDEN_LAYER = -3  # hidden_states[-(num_hidden_layers_to_skip + 1)], the pipeline's skip of 2 (OneTrainer's -3)
# The pipeline's own `prompt_template` (and OneTrainer's HunyuanVideoModel DEFAULT_PROMPT_TEMPLATE): the caption is `{}`
CAPTION_SLOT = "{}"
# the transformer's attention (double blocks: image q / k / v / out; single blocks: q / k / v; the refiner's too),
# the usual diffusers default (finetrainers' HunyuanVideo LoRA)
HUNYUAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# ...and the text stream's attention in the double blocks (SimpleTuner's HunyuanVideo 1.5 default)
HUNYUAN_ATTENTION_TARGETS = HUNYUAN_LORA_TARGETS + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# ...and the feed-forwards: double blocks' ff / ff_context (net.0.proj in, net.2 out), single blocks' proj_mlp /
# proj_out (their fused MLP input and output), as OneTrainer's "blocks" filter adapts every linear of the blocks
HUNYUAN_ATTENTION_MLP_TARGETS = HUNYUAN_ATTENTION_TARGETS + ("net.0.proj", "net.2", "proj_mlp", "proj_out")
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompt_template():
    """The pipeline's template text (diffusers' DEFAULT_PROMPT_TEMPLATE["template"])."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return DEFAULT_PROMPT_TEMPLATE["template"]


def crop_start(tokenizer) -> int:
    """The template's tokens before the caption (with the begin-of-text token): what the pipeline crops off. 95 for
    Llava-Llama-3's tokenizer (the pipeline's DEFAULT_PROMPT_TEMPLATE["crop_start"]); counted here so that any
    tokenizer (the tiny test one) crops exactly the template."""
    return len(tokenizer(prompt_template().split(CAPTION_SLOT)[0]).input_ids)


class HunyuanVideo(Family):
    name = "hunyuan_video"
    description = ("HunyuanVideo text-to-video DiT trained on images as one-frame videos (Llava-Llama-3 hidden states "
                   "after the pipeline's prompt template + CLIP-L pooled, flow matching with the raw t and the "
                   "distilled guidance input)")
    pipeline_class = "HunyuanVideoPipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder", "text_encoder_2")
    tokenizers = ("tokenizer", "tokenizer_2")
    embedding_keys = {}  # no embedding (textual inversion) support yet
    denoiser_lora_presets = {"default": HUNYUAN_LORA_TARGETS, "attention": HUNYUAN_ATTENTION_TARGETS,
                             "attention_mlp": HUNYUAN_ATTENTION_MLP_TARGETS}
    text_lora_targets_by_encoder = {"text_encoder": LLAMA_LORA_TARGETS}
    # HunyuanVideoTransformer3DModel._no_split_modules: the dual- and single-stream blocks (and the refiner, 2 % of it,
    # left in the root); Llama's `layers` (LlamaModel: no `model.` level) and its embedding table (128 k x 4096, 7 %
    # of it, a unit of its own as HiDream's Llama); CLIP-L's encoder layers (`encoder.layers`: transformers 5's
    # CLIPTextModel has no `text_model.` level, so the longer suffix would find no unit)
    shard_units = {"transformer": ("transformer_blocks", "single_transformer_blocks"),
                   "text_encoder": ("embed_tokens", "layers"), "text_encoder_2": ("encoder.layers",)}
    layer_skip_encoders = ("text_encoder",)  # model.text_encoder_layer_skip: Llama's layer further from the end
    pixel_multiple = 16  # the VAE x8, then the transformer's 2x2 patches
    native_resolution = 960  # the long side of HunyuanVideo's 540p buckets (960 x 544); 720p is 1280 x 720
    memory_reference = "HunyuanVideo"  # the 12.8 B transformer, Llava-Llama-3-8B's LlamaModel (7.5 B), CLIP-L, its VAE
    samplers = ("flow_euler",)
    sample_guidance_scale = 6.0  # the pipeline's guidance_scale default and OneTrainer's HunyuanVideo sample default
    sample_negative_prompt = False  # guidance is distilled: the pipeline's negative pass needs true_cfg_scale > 1
    lora_file_prefixes = None  # the diffusers layout
    # Tencent's original transformer keys (hunyuan_video_single_file.py); never a text encoder in the file
    single_file = True
    single_file_text_encoders = False
    transformer_file_layout = "ot_dist.models.families.hunyuan_video_single_file:HUNYUAN_VIDEO"
    video_model = True  # a video clip in a concept is refused (images only, as one-frame videos)
    modelspec_architecture = "hunyuan-video"  # OneTrainer's (resources/sd_model_spec/hunyuan_video.json)

    def __init__(self, guidance_scale: float = 1.0):
        # The distilled guidance the transformer is shown in training: OneTrainer's transformer.guidance_scale, 1.0
        self.guidance_scale = guidance_scale

    def configure(self, model_config) -> "HunyuanVideo":
        family = super().configure(model_config)
        scale = model_config.guidance_scale
        if scale is None or scale == family.guidance_scale:
            return family
        import copy

        family = copy.copy(family)
        family.guidance_scale = scale
        return family

    # -- loading --------------------------------------------------------------------------------------
    def complete_pipeline(self, pipeline, path, model_config):
        refuse_image_to_video(pipeline.transformer)
        return pipeline

    def load_single_file(self, path, config_folder, model_config):
        # the transformer's config comes from model.config: an image-to-video folder is refused as a folder is
        return self.complete_pipeline(super().load_single_file(path, config_folder, model_config), path, model_config)

    # -- objective ------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config,
                                                  patch_size=pipeline.transformer.config.patch_size, dynamic=False)

    def objective_kind(self) -> str:
        return "flow"

    def sampling_overrides(self, objective: FlowMatching) -> dict:
        return {"shift": objective.shift}

    # -- text -----------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        """Caption tokens after the template: the pipeline's 256, within the tokenizer's length (the tiny one's)."""
        if tokenizer_name == "tokenizer_2":
            return CLIP_MAX_TOKENS
        return min(MAX_SEQUENCE_LENGTH, tokenizer.model_max_length - crop_start(tokenizer))

    def tokenize(self, tokenizers, captions):
        llama, clip = tokenizers["tokenizer"], tokenizers["tokenizer_2"]
        crop = crop_start(llama)
        template = prompt_template()
        encoded = llama([template.format(c) for c in captions], padding="max_length", truncation=True,
                        max_length=self.max_tokens("tokenizer", llama) + crop, return_attention_mask=True,
                        return_tensors="pt")
        clip_ids = clip(captions, padding="max_length", max_length=CLIP_MAX_TOKENS, truncation=True,
                        return_tensors="pt").input_ids
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask,
                "text_encoder_crop": torch.full((len(captions),), crop), "text_encoder_2": clip_ids}

    def encode_text(self, text_encoders, tokens):
        llama, clip = text_encoders["text_encoder"], text_encoders["text_encoder_2"]
        mask = to_device(tokens["text_encoder_mask"], llama.device)
        output = llama(input_ids=to_device(tokens["text_encoder"], llama.device), attention_mask=mask,
                       output_hidden_states=True)
        crop = int(tokens["text_encoder_crop"][0])
        hidden = output.hidden_states[HIDDEN_LAYER - self.layer_skip.get("text_encoder", 0)][:, crop:]
        pooled = clip(to_device(tokens["text_encoder_2"], clip.device), output_hidden_states=False).pooler_output
        return {"hidden": hidden, "mask": mask[:, crop:], "pooled": pooled}

    def pipeline_call_options(self, pipeline) -> dict:
        """The pipeline's template with this tokenizer's crop (the constant 95 fits Llava-Llama-3's only) and the
        caption length training uses."""
        tokenizer = pipeline.tokenizer
        return {"max_sequence_length": self.max_tokens("tokenizer", tokenizer),
                "prompt_template": {"template": prompt_template(), "crop_start": crop_start(tokenizer)}}

    def sampling_arguments(self, pipeline, arguments):
        return {**arguments, **self.pipeline_call_options(pipeline), "num_frames": 1}

    def sampled_image(self, output):
        return output.frames[0][0]  # one video of one frame

    # -- latents --------------------------------------------------------------------------------------
    def latent_shape(self, vae, pixel_height, pixel_width):
        factor = vae.config.spatial_compression_ratio
        return torch.Size((vae.config.latent_channels, pixel_height // factor, pixel_width // factor))

    encode_posterior = QwenImage.encode_posterior  # a VAE of videos: images in as one-frame clips

    # -- the denoiser call ----------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        guidance = None
        if denoiser.config.guidance_embeds:  # the distilled guidance, x 1000 as the pipeline passes it
            guidance = torch.full((noisy.shape[0],), self.guidance_scale * 1000.0, device=noisy.device,
                                  dtype=torch.float32)
        # float32 timesteps, as the pipeline passes the scheduler's (bfloat16 would round t near 1000)
        out = denoiser(hidden_states=noisy.unsqueeze(2), timestep=timesteps.float(),
                       encoder_hidden_states=conditioning["hidden"], encoder_attention_mask=conditioning["mask"],
                       pooled_projections=conditioning["pooled"], guidance=guidance, return_dict=False)[0]
        return out[:, :, 0]

    # -- LoRA files -----------------------------------------------------------------------------------
    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's LoRA in the original names ComfyUI maps for HunyuanVideo,
        q / k / v (and the single blocks' MLP input) fused (hunyuan_video_lora.py); nothing for an adapter other than
        plain LoRA, one on a module without an original name there, or a run without a transformer LoRA."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.hunyuan_video_lora import comfyui_lora_state

        if "transformer" not in states:
            return []
        tensors = comfyui_lora_state(states["transformer"], adapter_configs["transformer"], model.part("transformer"))
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name,
                                    scale="inside the up matrices, no alpha tensors")

    # Other trainers' files in the original names (ot-dist lora merge, lora.init_from): diffusion-pipe's and
    # OneTrainer's ComfyUI files (`diffusion_model.` / `transformer.`), musubi-tuner's (`lora_unet_`), fused modules
    # split by rows
    lora_original_prefixes = (("diffusion_model", "."), ("transformer", "."), ("lora_unet", "_"))

    def denoiser_original_rules(self, config) -> list:
        from ot_dist.models.families.hunyuan_video_lora import original_rules

        return original_rules(config)

    # -- demo and tests -------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                               HunyuanVideoTransformer3DModel)
        from transformers import CLIPTextModel, LlamaConfig, LlamaModel

        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer

        torch.manual_seed(seed)
        llama_tokenizer = tiny_llava_llama_tokenizer()
        llama = LlamaModel(LlamaConfig(
            vocab_size=len(llama_tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
            bos_token_id=llama_tokenizer.bos_token_id, eos_token_id=llama_tokenizer.eos_token_id)).eval()
        clip_tokenizer = tiny_clip_tokenizer()
        clip = CLIPTextModel(clip_text_config(len(clip_tokenizer), "quick_gelu")).eval()
        # HunyuanVideo's layout (diffusers' own test sizes): 16 latent channels, x8 spatial, 4x temporal
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=16,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, act_fn="silu", norm_num_groups=4,
            scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4,
            mid_block_add_attention=True)
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=10, num_layers=2,
            num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=TEXT_HIDDEN, pooled_projection_dim=TEXT_HIDDEN, rope_axes_dim=(2, 4, 4))
        # what hunyuanvideo-community/HunyuanVideo ships
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0)
        return HunyuanVideoPipeline(text_encoder=llama, tokenizer=llama_tokenizer, transformer=transformer, vae=vae,
                                    scheduler=scheduler, text_encoder_2=clip, tokenizer_2=clip_tokenizer)


def tiny_llava_llama_tokenizer(caption_tokens: int = 24):
    """The tiny Llama-3 tokenizer (hidream.py's) with the template's header tokens as special tokens, as Llama-3's
    vocabulary has them, its BPE trained on the template too (so the template is some 60 tokens, not 500 bytes), right
    padding with <|end_of_text|>; model_max_length leaves `caption_tokens` after the template."""
    from ot_dist.models.families.hidream import tiny_llama_tokenizer

    template = prompt_template()
    tokenizer = tiny_llama_tokenizer(corpus=(template.replace(CAPTION_SLOT, ""),))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eot_id|>"]})
    tokenizer.pad_token = "<|end_of_text|>"
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = crop_start(tokenizer) + caption_tokens
    return tokenizer


def refuse_image_to_video(transformer) -> None:
    """HunyuanVideo-I2V (`image_condition_type`) and SkyReels' image-to-video transformer (32 input channels) need an
    image beside the text: ot_dist trains the text-to-video model."""
    config = transformer.config
    if config.image_condition_type is not None or config.in_channels != config.out_channels:
        raise ConfigError("model.path: a HunyuanVideo image-to-video transformer (image conditioning) is not "
                          "supported: ot_dist trains the text-to-video model")


FAMILIES = {"hunyuan_video": HunyuanVideo()}
