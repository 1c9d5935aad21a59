"""Z-Image (Tongyi-MAI's Z-Image / Z-Image-Turbo): a single-stream DiT (`ZImageTransformer2DModel`: a noise refiner
over the image tokens, a context refiner over the caption tokens, then 30 joint blocks over [image, caption]) on the
Flux VAE's 16-channel latents in 2x2 patches, conditioned on Qwen3-4B's penultimate hidden states.

What follows ZImagePipeline and diffusers' train_dreambooth_lora_z_image.py (diffusers 0.42):
- Text: each caption becomes a user turn of the tokenizer's chat template with the generation prompt (Qwen3's
  template with enable_thinking=True: `<|im_start|>user\\n{caption}<|im_end|>\\n<|im_start|>assistant\\n`, what
  ComfyUI's ZImageTokenizer writes too), padded to 512 tokens; the text encoder runs with the mask and the hidden
  states of its second-to-last layer are kept, each caption cut to its own tokens (the pipeline's list of
  variable-length tensors). ot_dist keeps them padded to a fixed length with the mask (the text cache holds equal
  shapes) and cuts each caption to its length in `predict`, from the batch's host copy of the mask (no device read
  per step, as Qwen-Image). The lengths matter: the transformer pads each caption itself with its learned
  `cap_pad_token` to a multiple of 32 and masks only what lies beyond that.
- Latents: (x - shift_factor) x scaling_factor of the Flux VAE; the transformer patchifies 2x2 itself.
- Objective, with the flow reversed as in Lumina 2: x_t = (1 - s) x + s n with s drawn through the scheduler
  config's fixed shift (3.0 for Z-Image-Turbo), the transformer sees t = 1 - s (`(1000 - timesteps) / 1000`) and its
  output is negated before it is compared with the target n - x: the model itself predicts x - n.
- Sampling: the pipeline's guidance is `pos + g (pos - neg)`, applied when g > 0. A sample prompt's guidance_scale
  is read as everywhere else in ot_dist (classifier-free guidance `neg + s (pos - neg)`, OneTrainer's cfg_scale) and
  passed as g = s - 1; s <= 1 samples unguided (Z-Image-Turbo's distilled guidance samples with the pipeline's 0).

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`), which ZImagePipeline.load_lora_weights
reads and ComfyUI maps for Z-Image (comfy/lora.py: `transformer.<diffusers module>` through
comfy.utils.z_image_to_diffusers, to_q / to_k / to_v as slices of its fused qkv). The text encoder's modules carry
ComfyUI's names (`text_encoders.qwen3_4b.transformer.model.<module>`, its only names for Qwen3-4B); diffusers' Z-Image
loader reads no text-encoder LoRA.

Single files: ComfyUI's diffusion-model file (z_image_turbo_bf16.safetensors), the transformer in the original layout
(q / k / v fused, a few names changed: z_image_single_file.py), which diffusers' from_single_file reads too;
`model.config` names the diffusers folder that supplies the rest. Qwen3-4B and the VAE ship as separate files in
ComfyUI's layouts, which ot_dist reads (`model.component_files`, component_files.py) but does not write: a trained text
encoder is exported in the diffusers folder only.
"""

from __future__ import annotations

import torch

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import Family
from ot_dist.models.families.qwen_image import caption_lengths
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# ZImagePipeline's and the training script's max_sequence_length (OneTrainer's PROMPT_MAX_LENGTH)
MAX_TOKENS = 512
# What Qwen3's chat template writes for one user message with add_generation_prompt and enable_thinking=True (its
# `<think>` block is added only when thinking is off); ComfyUI's ZImageTokenizer.llama_template is the same text.
CHAT_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# A chat template for the tiny tokenizer that renders that turn as Qwen3's does (user turns, the generation prompt,
# the empty think block when thinking is off); real Z-Image tokenizers bring Qwen3's own.
TINY_CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                      "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                      "{%- if enable_thinking is defined and enable_thinking is false %}"
                      "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
# The hidden layer the pipeline reads: hidden_states[-2], the second-to-last decoder layer's output (no final norm)
HIDDEN_LAYER = -2
# train_dreambooth_lora_z_image.py's default --lora_layers; the MLP adds the SwiGLU's three projections
Z_IMAGE_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
Z_IMAGE_ATTENTION_MLP_TARGETS = Z_IMAGE_LORA_TARGETS + ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
QWEN3_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# ComfyUI's LoRA names of the text encoder's modules: "text_encoders." + its ZImageTEModel's state-dict path
# (comfy/text_encoders/z_image.py: the Qwen3-4B model named qwen3_4b, llama.py's Llama2_ under `transformer.model`)
COMFY_QWEN3_PREFIX = "text_encoders.qwen3_4b.transformer.model."
# Tongyi-MAI/Z-Image-Turbo's scheduler config
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
TINY_TEXT_WIDTH = 32


class ZImage(Family):
    name = "z_image"
    description = ("Z-Image / Z-Image-Turbo (single-stream DiT, Qwen3 penultimate hidden states after a chat "
                   "template + mask, reversed flow: t = 1 - sigma, output negated)")
    pipeline_class = "ZImagePipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # no UI loads Qwen3 embeddings
    denoiser_lora_presets = {"default": Z_IMAGE_LORA_TARGETS, "attention": Z_IMAGE_LORA_TARGETS,
                             "attention_mlp": Z_IMAGE_ATTENTION_MLP_TARGETS}
    text_lora_targets = QWEN3_LORA_TARGETS
    # The transformer's blocks (_no_split_modules: ZImageTransformerBlock) in its three lists; Qwen3's embedding
    # table is its own unit (151936 x 2560, 10 % of Qwen3-4B: in the root it would stay gathered through backward).
    shard_units = {"transformer": ("noise_refiner", "context_refiner", "layers"),
                   "text_encoder": ("embed_tokens", "layers")}
    pixel_multiple = 16  # VAE x8, then 2x2 patches (the pipeline refuses other sides)
    memory_reference = "Z-Image"  # Tongyi-MAI/Z-Image-Turbo: the 6.15 B transformer, Qwen3-4B (4.0 B), the Flux VAE
    # OneTrainer's sample default for Z-Image (SampleConfig.py), as classifier-free guidance neg + s (pos - neg)
    sample_guidance_scale = 4.0
    samplers = ("flow_euler",)
    lora_file_prefixes = None  # the diffusers layout: what ComfyUI maps for Z-Image
    # Other trainers' names, read by `ot-dist lora merge` and `lora.init_from`: kohya-style `lora_unet_<diffusers path
    # with "_">` (what diffusers' Z-Image converter reads: `lora_unet_layers_0_attention_to_q`), and ComfyUI's own LoRA
    # names, `diffusion_model.<its model's key>` (the original layout: a fused `attention.qkv` split by rows)
    lora_foreign_prefixes = {"transformer": ("lora_unet",)}
    lora_original_prefixes = (("diffusion_model", "."),)
    # transformers' Qwen3Model (Z-Image's text_encoder) is ComfyUI's Llama2_ under `qwen3_4b.transformer.model`
    # (same layer and projection names); a Qwen3ForCausalLM keeps it under `model.`
    lora_file_component_paths = {"text_encoder": {"layers.": COMFY_QWEN3_PREFIX + "layers.",
                                                  "model.layers.": COMFY_QWEN3_PREFIX + "layers."}}
    # ComfyUI's z_image_turbo_bf16.safetensors: the transformer alone in the original layout (z_image_single_file.py)
    single_file = True
    single_file_text_encoders = False  # ComfyUI loads Qwen3-4B from its own file, in a layout ot_dist does not write
    transformer_file_layout = "ot_dist.models.families.z_image_single_file:Z_IMAGE"  # ComfyUI's UNET loader reads Comfy-Org's file: the transformer alone with bare keys
    # ComfyUI's separate files: qwen_3_4b.safetensors and Flux's ae.safetensors (Z-Image's VAE is Flux's)
    component_files = {"text_encoder": C.QWEN3, "vae": C.LDM_VAE}
    # SwarmUI's class id (T2IModelClassSorter: "z-image", "z-image/lora"); OneTrainer writes "Z-Image"
    modelspec_architecture = "z-image"
    # the single file's keys are the original Z-Image code's (fused qkv, x_embedder, final_layer)
    modelspec_implementation = "https://github.com/Tongyi-MAI/Z-Image"

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        patch = pipeline.transformer.config.all_patch_size[0]
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=patch)

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_TOKENS, tokenizer.model_max_length)  # the tiny test tokenizer has fewer

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        turns = [tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=True)
                 for caption in captions]
        # right padding: each caption's tokens first, so a length cuts them out (Qwen's tokenizers pad right)
        encoded = tokenizer(turns, padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, padding_side="right", return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], encoder.device)
        out = encoder(input_ids=to_device(tokens["text_encoder"], encoder.device), attention_mask=mask.bool(),
                      output_hidden_states=True)
        hidden = out.hidden_states[HIDDEN_LAYER]
        # zeros at the padding, which the pipeline drops: the cache then holds nothing that depends on it
        return {"hidden": hidden * mask[..., None].to(hidden.dtype), "mask": mask.long()}

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer)}

    def sampling_arguments(self, pipeline, arguments):
        arguments = {**arguments, **self.pipeline_call_options(pipeline)}
        # classifier-free guidance neg + s (pos - neg) is the pipeline's pos + (s - 1)(pos - neg)
        arguments["guidance_scale"] = max(arguments.pop("guidance_scale") - 1.0, 0.0)
        return arguments

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        hidden = conditioning["hidden"]
        lengths = caption_lengths(batch, conditioning["mask"], dropped=0)
        captions = [hidden[i, :length] for i, length in enumerate(lengths)]
        images = list(noisy.unsqueeze(2).unbind(0))  # (C, 1, h, w) each: one frame
        # t = 1 - sigma in float32, as the script passes (1000 - timesteps) / 1000
        out = denoiser(images, (1000 - timesteps.float()) / 1000, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)  # the model predicts x - n; the objective's target is n - x

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        from ot_dist.models.families.flux import tiny_flow_vae
        from ot_dist.models.families.qwen_image import tiny_qwen2_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer(template=CHAT_TURN)
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TINY_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
            tie_word_embeddings=True)).eval()
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=TINY_TEXT_WIDTH, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])
        with torch.no_grad():  # the pad tokens start at zero; random ones make a wrong caption length show
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        return ZImagePipeline(
            transformer=transformer, vae=tiny_flow_vae(shift_factor=0.1159, scaling_factor=0.3611),
            text_encoder=text_encoder, tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER))


FAMILIES = {"z_image": ZImage()}
