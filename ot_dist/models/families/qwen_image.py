"""Qwen-Image: an MMDiT (`QwenImageTransformer2DModel`, 60 dual-stream blocks) over 16-channel latents packed 2x2
into 64-channel tokens, conditioned on Qwen2.5-VL's last hidden states, trained with flow matching and the
resolution-dependent shift of its scheduler config.

- Text: each caption goes into Qwen-Image's chat template; the template's first 34 tokens (the system prompt and
  the user turn's header, 34 with the real tokenizer) are dropped from the last hidden states, the rest (caption and
  the assistant turn's header) is the text stream, with its attention mask (QwenImagePipeline._get_qwen_prompt_embeds).
  Captions are padded to a fixed length so the text cache holds equal shapes; each step trims the batch to its
  longest caption (OneTrainer's QwenModel.encode_text does the same), which leaves the prediction unchanged: padding
  is masked out of attention and the text positions of RoPE count from the first token. The lengths come from the
  batch's host copy of the mask (tokens or text cache), so the step reads nothing back from the device (issue 21).
- Latents: the VAE (`AutoencoderKLQwenImage`, Wan's causal 3-D VAE) takes and gives one-frame videos
  (B, C, 1, H, W); ot_dist keeps the frame axis out (`encode_posterior`), normalises with the per-channel
  latents_mean / latents_std and no scale, and packs as Flux does.
- Objective: x_t = (1 - s) x + s n, target n - x, the transformer sees t / 1000 and `img_shapes` (1, h/2, w/2) per
  sample (diffusers' train_dreambooth_lora_qwen_image.py); s is drawn with the scheduler config's dynamic shift
  (mu from the number of image tokens, as the pipeline's calculate_shift; OneTrainer's calculate_timestep_shift).
- Sampling: QwenImagePipeline's classifier-free guidance is `true_cfg_scale` with a negative prompt; a sample
  prompt's guidance_scale becomes it, with the blank negative prompt the model card uses when none is given.

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`), which QwenImagePipeline.load_lora_weights
reads and ComfyUI maps for Qwen-Image (comfy/lora.py: `transformer.<diffusers module>`). The text encoder's modules
carry ComfyUI's names, the only ones it maps for Qwen2.5-VL (model_lora_keys_clip: `text_encoders.<key of its text
encoder>`; comfy/text_encoders/qwen_image.py keeps the language model as `qwen25_7b.transformer.model.`), with an
`.alpha` tensor each; diffusers' Qwen-Image loader reads no text encoder LoRA.

Single files: ComfyUI's diffusion-model file (`qwen_image_bf16.safetensors`, its plain fp8 cast too), whose keys are
diffusers' (qwen_image_single_file.py); `model.config` names the diffusers folder that supplies the rest. The text
encoder and the VAE ship as separate files in ComfyUI's layouts, which ot_dist reads (`model.component_files`,
component_files.py) but does not write: a trained text encoder is exported in the diffusers folder only.
"""

from __future__ import annotations

import torch

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import Family
from ot_dist.models.families.flux import pack, unpack
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42); OneTrainer's
# DEFAULT_PROMPT_TEMPLATE / _CROP_START are the same.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_TOKENS_DROPPED = 34
# Caption tokens after the dropped ones: OneTrainer's PROMPT_MAX_LENGTH, QwenImagePipeline's max_sequence_length default.
MAX_TOKENS = 512
# diffusers' train_dreambooth_lora_qwen_image.py default; "attention" adds the text stream's projections.
QWEN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
QWEN_ATTENTION_TARGETS = QWEN_LORA_TARGETS + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
QWEN_ATTENTION_MLP_TARGETS = QWEN_ATTENTION_TARGETS + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                                       "txt_mlp.net.2")
# The language model's attention only: the MLP names (gate_proj, up_proj, down_proj) are also the vision tower's,
# which text-only training never runs (its adapters would get no gradient).
QWEN_TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# ComfyUI's LoRA name of the language model's modules: "text_encoders." + its QwenImageTEModel's state-dict path
COMFY_QWEN_TEXT_PREFIX = "text_encoders.qwen25_7b.transformer.model."
# The published Qwen/Qwen-Image scheduler config (SimpleTuner writes it out: helpers/models/qwen_image/model.py).
QWEN_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                      time_shift_type="exponential")


class QwenImage(Family):
    name = "qwen_image"
    description = ("Qwen-Image (MMDiT, Qwen2.5-VL hidden states after a chat template + mask, flow matching with a "
                   "resolution-dependent shift)")
    pipeline_class = "QwenImagePipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # no UI loads Qwen2.5-VL embeddings
    denoiser_lora_presets = {"default": QWEN_LORA_TARGETS, "attention": QWEN_ATTENTION_TARGETS,
                             "attention_mlp": QWEN_ATTENTION_MLP_TARGETS}
    text_lora_targets = QWEN_TEXT_LORA_TARGETS
    # Qwen2_5_VLForConditionalGeneration: model.language_model.layers (the vision tower never runs: left whole)
    shard_units = {"transformer": ("transformer_blocks",), "text_encoder": ("language_model.layers",)}
    pixel_multiple = 16  # VAE x8, then 2x2 packing
    memory_reference = "Qwen-Image"  # Qwen/Qwen-Image: the 20 B transformer, Qwen2.5-VL-7B (8.3 B), its VAE
    # OneTrainer's sample default for Qwen (modules/util/config/SampleConfig.py); it becomes true_cfg_scale
    sample_guidance_scale = 3.5
    samplers = ("flow_euler",)
    lora_file_prefixes = None  # the diffusers layout: what ComfyUI maps for Qwen-Image
    # transformers' Qwen2_5_VLForConditionalGeneration.model.language_model is ComfyUI's Llama2_ under its text
    # encoder's `qwen25_7b.transformer.model` (same layer and projection names)
    lora_file_component_paths = {"text_encoder": {"model.language_model.": COMFY_QWEN_TEXT_PREFIX}}
    # ComfyUI's qwen_image_*.safetensors: the transformer alone, bare keys (as Comfy-Org ship it)
    single_file = True
    single_file_text_encoders = False  # ComfyUI loads Qwen2.5-VL from its own file, in a layout ot_dist does not write
    transformer_file_layout = "ot_dist.models.families.qwen_image_single_file:QWEN_IMAGE"  # ComfyUI's UNET loader reads Comfy-Org's file: the transformer alone with bare keys
    # ComfyUI's qwen_2.5_vl_7b(_fp8_scaled).safetensors and qwen_image_vae.safetensors (Wan 2.1's VAE layout)
    component_files = {"text_encoder": C.QWEN25_VL, "vae": C.WAN_VAE}
    # SwarmUI's class id (T2IModelClassSorter: "qwen-image"); OneTrainer writes "Qwen-Image"
    modelspec_architecture = "qwen-image"

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=2)

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_TOKENS, tokenizer.model_max_length)  # a tiny test tokenizer has fewer

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        encoded = tokenizer([PROMPT_TEMPLATE.format(c) for c in captions], padding="max_length",
                            max_length=self.max_tokens("tokenizer", tokenizer) + TEMPLATE_TOKENS_DROPPED,
                            truncation=True, padding_side="right", return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], encoder.device)
        out = encoder(input_ids=to_device(tokens["text_encoder"], encoder.device), attention_mask=mask,
                      output_hidden_states=True)
        hidden, mask = out.hidden_states[-1][:, TEMPLATE_TOKENS_DROPPED:], mask[:, TEMPLATE_TOKENS_DROPPED:]
        # zeros at the padding, as the pipeline's re-stacking leaves them
        return {"hidden": hidden * mask[..., None].to(hidden.dtype), "mask": mask.long()}

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer)}

    def sampling_arguments(self, pipeline, arguments):
        arguments = {**arguments, **self.pipeline_call_options(pipeline)}
        scale = arguments.pop("guidance_scale")
        arguments["true_cfg_scale"] = scale
        if scale > 1:  # the pipeline guides only with a negative prompt; Qwen-Image's model card passes " "
            arguments.setdefault("negative_prompt", " ")
        return arguments

    # -- latents ----------------------------------------------------------------------------------------
    def latent_shape(self, vae, pixel_height, pixel_width):
        factor = 2 ** len(vae.config.temperal_downsample)
        return torch.Size((vae.config.z_dim, pixel_height // factor, pixel_width // factor))

    def encode_posterior(self, vae, pixels):
        posterior = vae.encode(pixels.unsqueeze(2)).latent_dist  # one frame
        return posterior.mean[:, :, 0], posterior.std[:, :, 0]

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        b, _, h, w = noisy.shape
        hidden, mask = conditioning["hidden"], conditioning["mask"]
        lengths = caption_lengths(batch, mask)
        longest = max(lengths)
        hidden, mask = hidden[:, :longest], mask[:, :longest]
        tokens = denoiser(
            hidden_states=pack(noisy),
            encoder_hidden_states=hidden,
            # no mask when nothing is padded, as the pipeline passes (SDPA then keeps its fastest kernels)
            encoder_hidden_states_mask=None if min(lengths) == longest else mask,
            # float32, as diffusers' training script passes it (the transformer casts it to its own dtype)
            timestep=timesteps.float() / 1000,
            img_shapes=[(1, h // 2, w // 2)] * b,
            return_dict=False,
        )[0]
        return unpack(tokens, h, w)

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                               QwenImageTransformer2DModel)
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from ot_dist.models.tiny import TEXT_HIDDEN

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer()
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        # Qwen2.5-VL's layout (M-RoPE sections, grouped KV heads, a vision tower the text path never runs), tiny
        config = Qwen2_5_VLConfig(
            text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=256,
                             bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_HIDDEN),
            vocab_size=len(tokenizer))
        return QwenImagePipeline(
            transformer=transformer, vae=vae, text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
            tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER))


def caption_lengths(batch: dict, mask: torch.Tensor, dropped: int = TEMPLATE_TOKENS_DROPPED) -> list[int]:
    """Each caption's token count (after the `dropped` template tokens), read from the batch's host copy of the mask:
    the text cache's `text_mask` or the tokenizer's `text_encoder_mask`, on the CPU as the loader made them. Reading
    the device copy (`mask`) would stall the host every micro step on a GPU (issue 21); it is read only when the
    batch has neither (a direct call, as the tests make)."""
    if "text_mask" in batch:
        rows = batch["text_mask"].tolist()
    elif "token_ids" in batch:
        rows = [row[dropped:] for row in batch["token_ids"]["text_encoder_mask"].tolist()]
    else:
        rows = mask.tolist()
    return [sum(row) for row in rows]  # B rows of at most 512 ints: summed in Python, the loader's tensor read once


SPLIT_WORDS = ("yellow", "black")


def tiny_qwen2_tokenizer(max_length: int = 32, template: str = PROMPT_TEMPLATE):
    """A Qwen2Tokenizer built offline: byte-level BPE (Qwen2's pre-tokenizer) trained on the chat template and the
    demo words, so each of them is one token (SPLIT_WORDS excepted) as with the real vocabulary, and the template's system prompt and user
    header tokenize to TEMPLATE_TOKENS_DROPPED tokens, as the real tokenizer's do; <|im_start|> / <|im_end|> are
    special tokens. `max_length` becomes model_max_length (the caption tokens the family keeps); `template` is the
    prompt template whose words the vocabulary learns (Z-Image's chat turn for its Qwen3 tokenizer)."""
    import json

    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from ot_dist.models.tiny import DEMO_WORDS

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=specials, show_progress=False)
    scratch = Qwen2Tokenizer()
    # Two demo colours stay out of the training text: they split into pieces, as rarer words do with the real
    # vocabulary, so the demo captions differ in length and a batch's padding (and its mask) matters.
    words = " ".join(w for w in DEMO_WORDS if w not in SPLIT_WORDS)
    scratch.backend_tokenizer.train_from_iterator([template.format(words), words], trainer=trainer)
    model = json.loads(scratch.backend_tokenizer.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                               model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tokenizer


FAMILIES = {"qwen_image": QwenImage()}
