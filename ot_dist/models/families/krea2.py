"""Krea 2 (krea/Krea-2-Raw and its few-step distilled Turbo): a single-stream MMDiT (`Krea2Transformer2DModel`) over
Qwen-Image's VAE latents in 2x2 patches, conditioned on a stack of Qwen3-VL-4B hidden states that a small text-fusion
transformer inside the denoiser collapses per token.

What follows Krea2Pipeline and diffusers' train_dreambooth_lora_krea2.py (diffusers 0.42), and OneTrainer's KREA_2
(modules/model/Krea2Model.py, modules/modelSetup/BaseKrea2Setup.py):
- Text: each caption goes into Qwen-Image's chat template, padded to a fixed length *before* the assistant suffix
  (`[system prefix | caption | padding | suffix]`); the text encoder (`Qwen3VLModel`) runs with the mask and with
  positions that count only real tokens (the suffix follows the caption's last token), and the hidden states of
  every third layer from 2 (`hidden_states[2], [5], ..., [35]`: 12 taps for Qwen3-VL-4B's 36 layers) are stacked
  per token as (L, 12, 2560); the 34 system-prefix tokens are dropped. ot_dist moves each caption's real tokens to
  the front (zeros and mask 0 after them), as OneTrainer prunes them: the transformer places every text token at
  rotary position 0 and masks padded ones as keys, so where the real tokens sit in the text stream changes nothing
  but the length; each step then trims the batch to its longest caption (from the batch's host copy of the mask, as
  Qwen-Image) instead of running the pipeline's 512 tokens.
- Latents: Qwen-Image's VAE (one-frame videos), per-channel latents_mean / latents_std; packed 2x2 into 64 channels.
- Objective: x_t = (1 - s) x + s n, target n - x, the transformer sees t / 1000 and position ids (text at the
  origin, image tokens at their (0, row, column)); s is drawn with the scheduler config's resolution-dependent shift
  (base 0.5 / max 1.15 over 256..6400 image tokens), as OneTrainer draws it. diffusers' script draws from the
  unshifted sigmas of that config.
- Sampling: the pipeline's guidance is `cond + g (cond - uncond)`, on when g > 0; a sample prompt's guidance_scale s
  (classifier-free guidance, OneTrainer's cfg_scale) is passed as g = s - 1.

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`), which Krea2Pipeline.load_lora_weights
reads, and beside it `lora_comfyui.safetensors` in the original module names (`diffusion_model.blocks.<n>.attn.wq`,
krea2_lora.py), the layout of Krea 2 LoRAs outside diffusers, which diffusers' Krea 2 loader reads too. The text
encoder is Qwen3-VL's: OneTrainer and diffusers train the transformer only, and diffusers' Krea 2 loader reads no
text-encoder LoRA.

Single files: krea/Krea-2-Raw's `raw.safetensors`, the transformer in the original krea-ai/krea-2 layout
(krea2_single_file.py), which diffusers' from_single_file reads too; `model.config` names the diffusers folder that
supplies the rest. A full export writes it beside the folder.
"""

from __future__ import annotations

import torch

from ot_dist.errors import ConfigError
from ot_dist.models.families.base import Family
from ot_dist.models.families.flux import pack, unpack
from ot_dist.models.families.qwen_image import PROMPT_TEMPLATE, QwenImage, caption_lengths
from ot_dist.models.families.z_image import QWEN3_LORA_TARGETS
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# Krea2Pipeline.prompt_template_encode_prefix / _suffix (OneTrainer's PROMPT_TEMPLATE_PREFIX / _SUFFIX): Qwen-Image's
# chat template cut where the caption ends, so the padding can go between the two.
PROMPT_PREFIX, PROMPT_SUFFIX = PROMPT_TEMPLATE.split("{}")
TEMPLATE_TOKENS_DROPPED = 34  # prompt_template_encode_start_idx: the system prefix and the user header
SUFFIX_TOKENS = 5  # prompt_template_encode_num_suffix_tokens: <|im_end|> \n <|im_start|> assistant \n
MAX_TOKENS = 512  # the pipeline's max_sequence_length: caption + suffix after the dropped prefix
# Krea2Pipeline's default text_encoder_select_layers: every third hidden state from 2 of Qwen3-VL-4B's 37 (the
# embeddings, then 36 layers); ot_dist derives the taps from the encoder's depth by the same rule.
FIRST_TAP, TAP_STRIDE = 2, 3
# train_dreambooth_lora_krea2.py's default target_modules (the Krea 2 authors' recommended LoRA): every linear layer
# of the attention and the MLP's up / down, plus the embedders and the output projection
KREA2_LORA_TARGETS = ("img_in", "final_layer.linear", "to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.up", "ff.down",
                      "text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2", "time_embed.linear_1",
                      "time_embed.linear_2", "time_mod_proj")
# what the script's comment suggests for long runs (its --lora_layers "to_q,to_k,to_v,to_out.0,to_gate")
KREA2_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "to_gate")
KREA2_ATTENTION_MLP_TARGETS = KREA2_ATTENTION_TARGETS + ("ff.gate", "ff.up", "ff.down")
# The scheduler config Krea2Pipeline's docstring asks for (the resolution-aware exponential shift)
KREA2_SCHEDULER = dict(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                       base_image_seq_len=256, max_image_seq_len=6400)


def text_taps(num_hidden_layers: int) -> tuple[int, ...]:
    """The indices into a text encoder's hidden_states (0: the embeddings) whose states Krea 2 stacks: (2, 5, ..., 35)
    for Qwen3-VL-4B's 36 layers."""
    return tuple(range(FIRST_TAP, num_hidden_layers + 1, TAP_STRIDE))


class Krea2(Family):
    name = "krea2"
    description = ("Krea 2 (single-stream MMDiT, a stack of 12 Qwen3-VL hidden layers per token after a chat "
                   "template + mask, flow matching with a resolution-dependent shift)")
    pipeline_class = "Krea2Pipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # no UI loads Qwen3-VL embeddings
    denoiser_lora_presets = {"default": KREA2_LORA_TARGETS, "attention": KREA2_ATTENTION_TARGETS,
                             "attention_mlp": KREA2_ATTENTION_MLP_TARGETS}
    # Qwen3-VL's language model (q / k / v / o and the SwiGLU; its vision tower names its own layers qkv, proj,
    # linear_fc1 / 2, so none of its modules is adapted)
    text_lora_targets = QWEN3_LORA_TARGETS
    # _no_split_modules: Krea2TransformerBlock, Krea2TextFusionBlock (Krea2FinalLayer is one small linear); Qwen3-VL's
    # embedding table is its own unit (151936 x 2560, 9 % of the language model), its vision tower stays in the root
    shard_units = {"transformer": ("transformer_blocks", "text_fusion.layerwise_blocks", "text_fusion.refiner_blocks"),
                   "text_encoder": ("language_model.embed_tokens", "language_model.layers")}
    pixel_multiple = 16  # VAE x8, then 2x2 patches
    memory_reference = "Krea 2"  # krea/Krea-2-Raw: the 12.8 B transformer, Qwen3-VL-4B, Qwen-Image's VAE
    # OneTrainer's sample default for KREA_2 (SampleConfig.py), as classifier-free guidance neg + s (pos - neg)
    sample_guidance_scale = 3.5
    samplers = ("flow_euler",)
    lora_file_prefixes = None  # the diffusers layout, which Krea2Pipeline.load_lora_weights reads
    # krea/Krea-2-Raw's raw.safetensors: the transformer alone in the original layout (krea2_single_file.py)
    single_file = True
    single_file_text_encoders = False  # the file holds no text encoder: a trained one is exported in the folder only
    # loaded with model.config, exported as the transformer alone with bare keys (base.py's defaults for a layout)
    transformer_file_layout = "ot_dist.models.families.krea2_single_file:KREA2"
    # ComfyUI's generic names over the original keys, as lora_comfyui.safetensors writes them (`lora.init_from`,
    # `ot-dist lora merge`)
    lora_original_prefixes = (("diffusion_model", "."),)
    # OneTrainer writes "Krea-2" / "Krea-2/lora" (resources/sd_model_spec/krea2.json); lower case, as the other
    # families' SwarmUI-style ids (z-image, qwen-image)
    modelspec_architecture = "krea-2"
    # the single file's keys are the original Krea 2 code's (diffusers' converter: "the original krea-ai/krea-2 names")
    modelspec_implementation = "https://github.com/krea-ai/krea-2"

    # Qwen-Image's VAE: one-frame videos in, the frame axis kept out
    latent_shape = QwenImage.latent_shape
    encode_posterior = QwenImage.encode_posterior

    # -- loading ------------------------------------------------------------------------------------------
    def complete_pipeline(self, pipeline, path, model_config):
        """A folder whose pipeline taps other layers than Krea 2's rule gives is refused: encode_text knows only the
        text encoder, and conditioning from other layers would train a different model."""
        taps = text_taps(pipeline.text_encoder.config.text_config.num_hidden_layers)
        named = tuple(pipeline.config.text_encoder_select_layers)
        if named != taps:
            raise ConfigError(f"model.path: {path} taps text_encoder_select_layers {named}; ot_dist reads Krea 2's "
                              f"{taps} (every third hidden state from {FIRST_TAP}) for this text encoder")
        return pipeline

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=pipeline.patch_size)

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_TOKENS, tokenizer.model_max_length)  # a tiny test tokenizer has fewer

    def tokenize(self, tokenizers, captions):
        """Krea2Pipeline.get_text_hidden_states' layout: prefix + caption padded to a fixed length, then the suffix."""
        tokenizer = tokenizers["tokenizer"]
        length = self.max_tokens("tokenizer", tokenizer) + TEMPLATE_TOKENS_DROPPED - SUFFIX_TOKENS
        text = tokenizer([PROMPT_PREFIX + caption for caption in captions], truncation=True, padding="max_length",
                         max_length=length, return_tensors="pt")
        suffix = tokenizer([PROMPT_SUFFIX] * len(captions), return_tensors="pt")
        return {"text_encoder": torch.cat([text.input_ids, suffix.input_ids], dim=1),
                "text_encoder_mask": torch.cat([text.attention_mask, suffix.attention_mask], dim=1)}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], encoder.device).bool()
        # positions count real tokens only (the suffix follows the caption), the same on Qwen3-VL's 3 M-RoPE axes
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = encoder(input_ids=to_device(tokens["text_encoder"], encoder.device), attention_mask=mask,
                      position_ids=positions, output_hidden_states=True)
        taps = text_taps(encoder.config.text_config.num_hidden_layers)
        hidden = torch.stack([out.hidden_states[i] for i in taps], dim=2)[:, TEMPLATE_TOKENS_DROPPED:]
        mask = mask[:, TEMPLATE_TOKENS_DROPPED:]
        # each caption's real tokens first, in their order (a stable sort of "is padding"), zeros after them
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        hidden = hidden.gather(1, order[:, :, None, None].expand_as(hidden))
        mask = mask.gather(1, order)
        return {"hidden": hidden * mask[:, :, None, None].to(hidden.dtype), "mask": mask.long()}

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer)}

    def sampling_arguments(self, pipeline, arguments):
        arguments = {**arguments, **self.pipeline_call_options(pipeline)}
        # classifier-free guidance neg + s (pos - neg) is the pipeline's pos + (s - 1)(pos - neg)
        arguments["guidance_scale"] = max(arguments.pop("guidance_scale") - 1.0, 0.0)
        return arguments

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        from diffusers import Krea2Pipeline

        b, _, h, w = noisy.shape
        hidden, mask = conditioning["hidden"], conditioning["mask"]
        lengths = caption_lengths(batch, mask, dropped=TEMPLATE_TOKENS_DROPPED)
        longest = max(lengths)
        hidden, mask = hidden[:, :longest], mask[:, :longest]
        tokens = denoiser(
            hidden_states=pack(noisy),
            encoder_hidden_states=hidden,
            timestep=timesteps.float() / 1000,  # float32, as the script passes timesteps / 1000
            position_ids=Krea2Pipeline.prepare_position_ids(longest, h // 2, w // 2, noisy.device),
            # no mask when nothing is padded, as OneTrainer passes (SDPA then keeps its fastest kernels)
            encoder_attention_mask=None if min(lengths) == longest else mask.bool(),
            return_dict=False,
        )[0]
        return unpack(tokens, h, w)

    # -- LoRA files -------------------------------------------------------------------------------------
    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's LoRA in the original module names under `diffusion_model.`
        (krea2_lora.py), what ComfyUI's generic rule maps and diffusers' Krea 2 loader reads too; nothing for an
        adapter other than plain LoRA or a run without a transformer LoRA."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.krea2_lora import comfyui_lora_state

        if "transformer" not in states:
            return []
        tensors = comfyui_lora_state(states["transformer"], adapter_configs["transformer"])
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name,
                                    scale="inside the up matrices, no alpha tensors")

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline,
                               Krea2Transformer2DModel)
        from transformers import Qwen3VLConfig, Qwen3VLModel

        from ot_dist.models.families.qwen_image import tiny_qwen2_tokenizer
        from ot_dist.models.tiny import TEXT_HIDDEN

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer()
        layers = 6  # taps (2, 5): the last layer runs but is not read, as Qwen3-VL-4B's 36th
        taps = text_taps(layers)
        config = Qwen3VLConfig(
            text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=len(tokenizer),
                             max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                              "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                               deepstack_visual_indexes=[0]),
            vocab_size=len(tokenizer))
        text_encoder = Qwen3VLModel(config).eval()
        transformer = Krea2Transformer2DModel(
            in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=TEXT_HIDDEN, num_text_layers=len(taps),
            text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=64,
            num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
        with torch.no_grad():
            for name, parameter in transformer.named_parameters():
                if "norm" in name:  # zero-centred scales start at zero; random ones test more
                    parameter.normal_(std=0.1)
                elif "scale_shift_table" in name:  # open gates: the text moves the 8-bit samples more
                    parameter.normal_()
        vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        return Krea2Pipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER),
                             text_encoder_select_layers=taps)


FAMILIES = {"krea2": Krea2()}
