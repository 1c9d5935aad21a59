"""Lumina 2 (Lumina-Image-2.0, and its finetunes such as Neta Lumina): a single-stream DiT
(`Lumina2Transformer2DModel`: context and noise refiner blocks, then joint blocks over caption + image tokens,
2x2 patches) over the Flux VAE's 16-channel latents, conditioned on Gemma 2's penultimate hidden states with their
attention mask.

What follows Lumina2Pipeline, diffusers' train_dreambooth_lora_lumina2.py and SimpleTuner's lumina2 model:
- the caption is prefixed with the pipeline's system prompt, `<system prompt> <Prompt Start> <caption>`, tokenized
  right-padded to 256 tokens with Gemma's <bos>, and encoded with the mask; the conditioning is the hidden states
  entering Gemma's last layer (`hidden_states[-2]`). The negative prompt of a sample has no prefix (the pipeline's
  encode_prompt prefixes the prompt only).
- Lumina's time runs the other way: x_t = (1 - t) n + t x, t = 0 pure noise, and the model predicts x - n. That is
  the usual flow of the other families with t = 1 - s: the noise level s is drawn and x_t = (1 - s) x + s n formed
  as for SD3, the transformer is called with 1 - s in [0, 1] and its output negated, so that the loss compares n - x
  with n - x (the same squared error as the script's x - n against the model's output).
- the shift: the model's scheduler config (`shift`, 6.0 for Lumina-Image-2.0, what ComfyUI samples with) applied to
  the noise level s, as SimpleTuner does. diffusers' script takes the scheduler's shifted sigma as Lumina's t (the
  image's weight), which shifts its draws towards the image instead; with a symmetric draw (its default uniform one,
  logit-normal with mean 0) that is `loss.timestep_shift: 1 / shift`.

Single files: the original NextDiT layout that ComfyUI's diffusion-model files (Comfy-Org's
`lumina_2_model_bf16.safetensors`, Neta Lumina's) and Alpha-VLLM's checkpoint use (lumina2_single_file.py), the
transformer alone: ComfyUI loads Gemma and the VAE from their own files, so a trained Gemma goes to the diffusers
folder only.

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`) that Lumina2Pipeline.load_lora_weights
reads and diffusers' script and SimpleTuner write. ComfyUI maps a Lumina 2 LoRA by the original model's keys only
(comfy/lora.py model_lora_keys_unet has no Lumina 2 rule, only its generic `diffusion_model.<key>` /
`lora_unet_<key with _>`, whose q / k / v are one fused `attention.qkv`), so the same adapters are also written in
those names, `lora_comfyui.safetensors` (lumina2_lora.py); files in those names (kohya sd-scripts' Lumina LoRAs,
ComfyUI's) are read by `ot-dist lora merge` and `lora.init_from`.
"""

from __future__ import annotations

import torch

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import Family
from ot_dist.models.families.gemma import (GEMMA_EMBEDDING_KEY, GEMMA_LORA_TARGETS, GEMMA_SHARD_UNITS, TINY_GEMMA_WIDTH, tiny_gemma,
                                          tiny_gemma_tokenizer)
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# train_dreambooth_lora_lumina2.py's default --lora_layers (every block's attention: the refiners' and the joint ones)
LUMINA2_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# the SwiGLU feed-forward (w1 / w2 / w3 of the original model)
LUMINA2_LORA_WITH_MLP = LUMINA2_LORA_TARGETS + ("feed_forward.linear_1", "feed_forward.linear_2",
                                                "feed_forward.linear_3")
MAX_SEQUENCE_LENGTH = 256  # Lumina2Pipeline's, the training script's and SimpleTuner's default
# Lumina2Pipeline.system_prompt, what Lumina-Image-2.0 was trained with
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")
PROMPT_START = " <Prompt Start> "


class Lumina2(Family):
    name = "lumina2"
    description = ("Lumina 2 (single-stream DiT over 16-channel latents, Gemma2's penultimate layer with a system "
                   "prompt and mask, reversed flow matching)")
    pipeline_class = "Lumina2Pipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    # OneTrainer trains no Lumina 2; its Gemma key as Sana's (OneTrainer's SanaEmbeddingSaver)
    embedding_keys = {"text_encoder": GEMMA_EMBEDDING_KEY}
    denoiser_lora_presets = {"default": LUMINA2_LORA_TARGETS, "attention": LUMINA2_LORA_TARGETS,
                             "attention_mlp": LUMINA2_LORA_WITH_MLP}
    text_lora_targets = GEMMA_LORA_TARGETS
    # Lumina2Transformer2DModel's _no_split_modules (Lumina2TransformerBlock) are these three lists' items
    shard_units = {"transformer": ("context_refiner", "noise_refiner", "layers"), "text_encoder": GEMMA_SHARD_UNITS}
    pixel_multiple = 16  # VAE x8, 2x2 patches (Lumina2Pipeline refuses other sides)
    memory_reference = "Lumina-Image 2.0"  # the 2.6 B transformer, Gemma-2-2B (2.6 B), the Flux VAE
    samplers = ("flow_euler",)
    sample_guidance_scale = 4.0  # Lumina2Pipeline's default
    lora_file_prefixes = None  # the diffusers layout
    # kohya sd-scripts' lora_unet_<original path with _> (networks/lora_lumina.py) and ComfyUI's
    # diffusion_model.<original path>, read through denoiser_original_rules (the fused qkv split by rows)
    lora_original_prefixes = (("lora_unet", "_"), ("diffusion_model", "."))
    single_file = True
    single_file_text_encoders = False  # ComfyUI loads Gemma 2 from its own file, in a layout ot_dist does not write
    # ComfyUI's separate files: gemma_2_2b_fp16.safetensors (Gemma 2 under model., its spiece_model beside) and Flux's
    # ae.safetensors (Lumina 2's VAE is Flux's)
    component_files = {"text_encoder": C.decoder_lm("Gemma 2 text encoder (ComfyUI's gemma_2_2b)"), "vae": C.LDM_VAE}
    modelspec_architecture = "lumina-2"  # kohya sd-scripts' ARCH_LUMINA_2 and IMPL_LUMINA (library/sai_model_spec.py)
    modelspec_implementation = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"
    # the module names of lora_comfyui.safetensors (extra_lora_files): the original model's, as kohya's IMPL_LUMINA
    modelspec_kohya_lora_implementation = modelspec_implementation

    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config,
                                                  patch_size=pipeline.transformer.config.patch_size)

    def objective_kind(self) -> str:
        return "flow"

    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_SEQUENCE_LENGTH, tokenizer.model_max_length)

    def pipeline_call_options(self, pipeline) -> dict:
        # the text as training sees it: the same length, the same system prompt
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer), "system_prompt": SYSTEM_PROMPT}

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        text = [SYSTEM_PROMPT + PROMPT_START + caption for caption in captions]  # Lumina2Pipeline.encode_prompt
        encoded = tokenizer(text, padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, padding_side="right", return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        gemma = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], gemma.device)
        out = gemma(to_device(tokens["text_encoder"], gemma.device), attention_mask=mask, use_cache=False,
                    output_hidden_states=True)
        return {"hidden": out.hidden_states[-2], "mask": mask.long()}

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        # Lumina's t = 1 - s (float32, as the pipeline passes it), and its prediction x - n negated to n - x
        t = 1 - timesteps.float() / 1000
        out = denoiser(hidden_states=noisy, timestep=t, encoder_hidden_states=conditioning["hidden"],
                       encoder_attention_mask=conditioning["mask"], return_dict=False)[0]
        return -out

    def denoiser_original_rules(self, config) -> list:
        from ot_dist.models.families.lumina2_single_file import lumina2_rules

        return lumina2_rules(config)

    def load_single_file(self, path, config_folder, model_config):
        from ot_dist.models.families.lumina2_single_file import lumina2_from_original, validate_lumina2_file
        from ot_dist.models.families.transformer_single_file import load_transformer_file

        return load_transformer_file(path, config_folder, self, lumina2_from_original, validate_lumina2_file,
                                     model_config)

    def export_single_file(self, components, states, path, dtype, with_text_encoders=False, metadata=None):
        """The transformer alone with bare original keys, as ComfyUI's diffusion-model loader reads Comfy-Org's file.
        A trained Gemma is not in it (`single_file_text_encoders`): the full method puts it in the diffusers folder."""
        from ot_dist.models.families.lumina2_single_file import lumina2_to_original
        from ot_dist.models.families.transformer_single_file import write_transformer_file

        state = lumina2_to_original(states["transformer"], dict(components["transformer"].config))
        write_transformer_file(state, path, dtype, metadata)

    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's LoRA in the names ComfyUI reads for Lumina 2, a trained Gemma's
        beside it in ComfyUI's names for that (lumina2_lora.py); nothing for an adapter other than plain LoRA or a run
        without a transformer LoRA."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.lumina2_lora import comfyui_lora_state, comfyui_text_lora_state

        if "transformer" not in states:
            return []
        tensors = comfyui_lora_state(states["transformer"], adapter_configs["transformer"], model.part("transformer"))
        if "text_encoder" in states and tensors is not None:  # a trained Gemma: ComfyUI's names for it, same file
            text = comfyui_text_lora_state(states["text_encoder"], adapter_configs["text_encoder"])
            tensors = None if text is None else {**tensors, **text}
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name, layout="comfyui",
                                    scale="inside the up matrices, alpha = each module's rank",
                                    rank=adapter_configs["transformer"]["r"])

    def build_tiny(self, seed: int = 0, **_):
        from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

        from ot_dist.models.families.flux import tiny_flow_vae

        torch.manual_seed(seed)
        # the system prompt alone is ~170 of the tiny tokenizer's letter-level tokens: the pipeline's 256 fit it
        tokenizer = tiny_gemma_tokenizer(max_length=MAX_SEQUENCE_LENGTH)
        text_encoder = tiny_gemma(len(tokenizer))
        transformer = Lumina2Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
            cap_feat_dim=TINY_GEMMA_WIDTH)
        return Lumina2Pipeline(
            transformer=transformer, vae=tiny_flow_vae(shift_factor=0.1159, scaling_factor=0.3611),
            text_encoder=text_encoder, tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0))


FAMILIES = {"lumina2": Lumina2()}
