"""Ideogram 4 (Ideogram4Pipeline, OneTrainer's IDEOGRAM_4): a single-stream DiT (`Ideogram4Transformer2DModel`) over
one packed sequence of caption tokens and 2x2-patchified 32-channel latents (AutoencoderKLFlux2's), conditioned on
13 hidden layers of Qwen3-VL-8B side by side. A second transformer of the same architecture, `unconditional_transformer`,
denoises the image tokens alone for the pipeline's classifier-free guidance; it is frozen and only sampling runs it.

What follows Ideogram4Pipeline and diffusers' train_dreambooth_lora_ideogram4.py (diffusers 0.42), as OneTrainer's
IdeogramModel / BaseIdeogramSetup do:
- Text: each caption becomes a user turn of the tokenizer's chat template with the generation prompt; the text
  encoder's language model runs over it and the outputs of its decoder layers QWEN3_VL_ACTIVATION_LAYERS (0, 3, ..,
  33, 35; no final norm) are interleaved per token, hidden size first (the pipeline's stack, permute, reshape:
  13 x 4096 = 53248 wide), zero at the padding. ot_dist keeps them right-padded to a fixed length with the mask (the
  text cache holds equal shapes).
- The packed sequence `[left padding][caption][image]`: the caption's features at its text positions (t = h = w = the
  token index), the image tokens at IMAGE_POSITION_OFFSET + (0, row, column); the padding is its own attention
  segment, so the prediction does not depend on how far a caption is padded: `predict` packs to the batch's longest
  caption (as OneTrainer), the pipeline to its max_sequence_length, with the same outputs.
- Latents: the VAE's batch-norm statistics over the 2x2 patches, in the pipeline's packing order (patch row, patch
  column, channel: channel fastest). That order is not FLUX.2's (channel first), so FLUX.2's normalisation of the same
  VAE class does not apply here; ot_dist keeps the VAE's (B, 32, h, w) layout and packs in `predict`.
- Objective: x_t = (1 - s) x + s n, the transformer sees t = 1 - s in [0, 1] and predicts x - n (negated here before
  the comparison with ot_dist's target n - x). The draw: logit-normal with the pipeline's resolution-aware mean
  mu = 0.5 ln(pixels / 512^2) (`_resolution_aware_mu`), written as the shift e^mu of a logit-normal draw (the same
  thing: sigmoid(z) shifted by e^mu is sigmoid(z + mu)); the script's std is 1.5 (loss.logit_normal_std), OneTrainer's
  default 1.0. loss.dynamic_timestep_shifting false / loss.timestep_shift replace that shift, as for Flux.
- Sampling: Ideogram4Pipeline with a constant guidance (`guidance_scale`; its default schedule 7 / 3 is per step),
  `neg + g (pos - neg)` where neg is the unconditional transformer's: no negative prompt.

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`), which Ideogram4Pipeline.load_lora_weights
reads, and beside it `lora_comfyui.safetensors` in the original names (fused qkv, attention.o) that ComfyUI's model
and SwarmUI's sorter have (ideogram4_lora.py), which diffusers' loader reads too. Only the conditional transformer trains (OneTrainer and the script alike); full finetuning exports the folder
with the unconditional transformer as loaded, and beside it the conditional transformer as one file in the original
layout (ideogram4_single_file.py), which `model.path` also reads with `model.config` naming the folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ot_dist.models.families.base import Family
from ot_dist.models.families.qwen_image import caption_lengths
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# Ideogram4Pipeline.__call__'s max_sequence_length (OneTrainer's PROMPT_MAX_LENGTH)
MAX_TOKENS = 2048
PATCH = 2  # Ideogram4Pipeline.patch_size: VAE latents in 2x2 patches, one token each
# _resolution_aware_mu's base: 512 x 512 pixels, 32 x 32 tokens of 16 x 16 pixels
BASE_IMAGE_TOKENS = (512 // 16) ** 2
# train_dreambooth_lora_ideogram4.py's default --lora_layers (attention and the SwiGLU), OneTrainer's "attn-mlp"
IDEOGRAM4_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                          "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
IDEOGRAM4_ATTENTION_TARGETS = IDEOGRAM4_LORA_TARGETS[:4]
# Qwen3-VL's language-model attention and MLP (its vision tower never runs for text)
QWEN3_VL_TEXT_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# What Qwen3-VL's chat template writes for one user turn of text with add_generation_prompt (no default system turn)
CHAT_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# A chat template for the tiny tokenizer rendering that turn from the pipeline's content list ({"type": "text"} items)
TINY_CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
                      "{%- if message.content is string %}{{- message.content }}{%- else %}"
                      "{%- for item in message.content %}{%- if item.type == 'text' %}{{- item.text }}{%- endif %}"
                      "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
                      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# The scheduler config: no shift of its own (the pipeline hands it the resolution-aware sigmas, which a `shift` in the
# config would move again)
IDEOGRAM4_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
TINY_TEXT_WIDTH = 16


@dataclass(frozen=True)
class ResolutionAwareShift:
    """Ideogram4Pipeline's `_resolution_aware_mu` in image tokens: mu = 0.5 ln(tokens / base tokens), base 512^2
    pixels (the shift e^mu grows with the square root of the pixel count)."""

    base_image_tokens: int = BASE_IMAGE_TOKENS

    def mu(self, image_tokens: int) -> float:
        return 0.5 * math.log(image_tokens / self.base_image_tokens)


class Ideogram4FlowMatching(FlowMatching):
    def __init__(self, num_timesteps: int = 1000):
        shift = ResolutionAwareShift()
        super().__init__(shift=1.0, dynamic=shift, num_timesteps=num_timesteps, patch_size=PATCH,
                         resolution_shift=shift)

    def describe(self) -> str:
        return ("flow matching (target noise - latents), resolution-aware shift e^mu, mu = 0.5 ln(pixels / 512^2)"
                if self.dynamic else f"flow matching (target noise - latents), shift {self.shift}")


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 x w/2, 4C): the pipeline's token layout (raster order; per token patch row, patch
    column, channel, channel fastest), the inverse of its decode's unpatchify."""
    b, c, h, w = latents.shape
    tokens = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 3, 5, 1)
    return tokens.reshape(b, (h // PATCH) * (w // PATCH), PATCH * PATCH * c)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack` for latents of h x w (Ideogram4Pipeline's decode: permute(0, 5, 1, 3, 2, 4))."""
    b, _, packed = tokens.shape
    c = packed // (PATCH * PATCH)
    latents = tokens.view(b, h // PATCH, w // PATCH, PATCH, PATCH, c).permute(0, 5, 1, 3, 2, 4)
    return latents.reshape(b, c, h, w)


def left_aligned(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(B, max(lengths), D): each caption's features (the first `length` rows of `hidden`) at the end of its rows,
    the `[left padding][caption]` part of the packed sequence."""
    width = max(lengths)
    out = hidden.new_zeros(hidden.shape[0], width, hidden.shape[-1])
    for i, length in enumerate(lengths):
        out[i, width - length:] = hidden[i, :length]
    return out


class Ideogram4(Family):
    name = "ideogram4"
    description = ("Ideogram 4 (single-stream DiT over [caption][2x2-patched latents], 13 Qwen3-VL hidden layers, "
                   "flow matching t = 1 - sigma with a resolution-aware shift; a frozen unconditional transformer "
                   "guides the samples)")
    pipeline_class = "Ideogram4Pipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # no UI loads Qwen3-VL embeddings
    denoiser_lora_presets = {"default": IDEOGRAM4_LORA_TARGETS, "attention": IDEOGRAM4_ATTENTION_TARGETS,
                             "attention_mlp": IDEOGRAM4_LORA_TARGETS}
    text_lora_targets = QWEN3_VL_TEXT_LORA_TARGETS
    # The transformer's blocks (_no_split_modules: Ideogram4TransformerBlock, about 2.8 % of it each); Qwen3-VL's
    # decoder layers and its embedding table (151936 x 4096, 7 % of the text encoder: in the root it would stay
    # gathered through backward); the vision tower never runs and stays in the root.
    shard_units = {"transformer": ("layers",),
                   "text_encoder": ("language_model.embed_tokens", "language_model.layers")}
    pixel_multiple = 16  # VAE x8, then 2x2 patches (the pipeline refuses other sides)
    # OneTrainer's sample default for Ideogram 4 (SampleConfig.py: cfg_scale 3.0), as neg + s (pos - neg)
    sample_guidance_scale = 3.0
    # The unconditional branch is the unconditional transformer on the image tokens alone: no text goes in
    sample_negative_prompt = False
    samplers = ("flow_euler",)
    lora_file_prefixes = None  # the diffusers layout, what Ideogram4Pipeline.load_lora_weights reads
    # The conditional transformer alone in the original layout (fused qkv, attention.o), as OneTrainer's
    # ORIGINAL_TRANSFORMER format writes it (ideogram4_single_file.py); Qwen3-VL never goes in the file
    single_file = True
    single_file_text_encoders = False
    transformer_file_layout = "ot_dist.models.families.ideogram4_single_file:IDEOGRAM4"
    # SwarmUI's class id (T2IModelClassSorter: "ideogram-4", "ideogram-4/lora"); OneTrainer writes "Ideogram"
    modelspec_architecture = "ideogram-4"
    memory_reference = "Ideogram 4"

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        return Ideogram4FlowMatching(pipeline.scheduler.config.get("num_train_timesteps", 1000))

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_TOKENS, tokenizer.model_max_length)  # the tiny test tokenizer has fewer

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        # Ideogram4Pipeline.encode_prompt: one user turn of text per caption, the generation prompt, no special
        # tokens added by the tokenizer itself
        turns = [tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": caption}]}],
                                               add_generation_prompt=True, tokenize=False)
                 for caption in captions]
        # right padding: each caption's tokens first (the causal encoder never sees the padding), cut by a length
        encoded = tokenizer(turns, padding="max_length", max_length=self.max_tokens("tokenizer", tokenizer),
                            truncation=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        from diffusers import Ideogram4Pipeline

        encoder = text_encoders["text_encoder"]
        full = tokens["text_encoder"].shape[1]
        # The encoder is causal and the captions are right-padded: it runs over the batch's longest caption only (the
        # padding up to 2048 tokens would cost up to 10x the compute for zeros), read from the host copy of the mask
        # (a device copy is not read: that would stall the host)
        host_mask = tokens["text_encoder_mask"]
        width = max(max(map(sum, host_mask.tolist())), 1) if host_mask.device.type == "cpu" else full
        ids = to_device(tokens["text_encoder"][:, :width], encoder.device)
        mask = to_device(host_mask, encoder.device)
        # the caption's tokens at positions 0 .. n - 1 on all three MRoPE axes, as the pipeline places them
        positions = torch.arange(width, device=ids.device).expand(ids.shape[0], -1)
        layers = Ideogram4Pipeline._get_text_encoder_hidden_states(encoder, ids, mask[:, :width], positions)
        hidden = torch.stack(layers, dim=0).permute(1, 2, 3, 0).reshape(ids.shape[0], width, -1)
        hidden = torch.nn.functional.pad(hidden * mask[:, :width, None].to(hidden.dtype), (0, 0, 0, full - width))
        return {"hidden": hidden, "mask": mask.long()}  # the fixed length: the text cache holds equal shapes

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer)}

    def sampling_arguments(self, pipeline, arguments):
        arguments = {**arguments, **self.pipeline_call_options(pipeline)}
        arguments.pop("negative_prompt", None)  # refused with the config (sample_negative_prompt)
        # a constant guidance: the pipeline's default per-step schedule is set unless told otherwise
        return {**arguments, "guidance_schedule": None}

    # The unconditional transformer (9.3 B parameters, as large as the trained one) may wait in CPU memory between
    # samples: the pipeline makes its latents where the trained transformer is (OneTrainer offloads it whole too).
    sampling_modules_offloadable = True

    def sampling_modules(self, pipeline) -> list[torch.nn.Module]:
        """The unconditional transformer: frozen, run by sampling only (stored like the VAE)."""
        unconditional = getattr(pipeline, "unconditional_transformer", None)
        return [] if unconditional is None else [unconditional]

    # -- LoRA files -----------------------------------------------------------------------------------
    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's LoRA in the original names (fused qkv, attention.o) that
        ComfyUI's Ideogram 4 model has and SwarmUI recognises (ideogram4_lora.py); nothing for an adapter other than
        plain LoRA or a run without a transformer LoRA."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.ideogram4_lora import original_lora_state

        if "transformer" not in states:
            return []
        tensors = original_lora_state(states["transformer"], adapter_configs["transformer"])
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name, layout="original",
                                    scale="inside the up matrices, alpha = each module's rank",
                                    rank=adapter_configs["transformer"]["r"])

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        from diffusers import Ideogram4Pipeline

        b, _, h, w = noisy.shape
        lengths = caption_lengths(batch, conditioning["mask"], dropped=0)
        text = left_aligned(conditioning["hidden"], lengths)
        width = text.shape[1]
        image = pack(noisy)
        # the layout is built on the host from host lengths and copied without blocking (the pipeline's own helper
        # would copy from pageable memory, which waits for the device's queue)
        position_ids, segment_ids, indicator = (to_device(ids, noisy.device) for ids in Ideogram4Pipeline._prepare_ids(
            lengths, h // PATCH, w // PATCH, width, torch.device("cpu")))
        features = torch.cat([text, text.new_zeros(b, image.shape[1], text.shape[-1])], dim=1)
        tokens = torch.cat([image.new_zeros(b, width, image.shape[-1]), image], dim=1)
        out = denoiser(hidden_states=tokens, timestep=(1000 - timesteps.float()) / 1000,  # t = 1 - sigma
                       encoder_hidden_states=features, position_ids=position_ids, segment_ids=segment_ids,
                       indicator=indicator, return_dict=False)[0]
        return -unpack(out[:, width:], h, w)  # the model predicts x - n; the objective's target is n - x

    # -- latents ----------------------------------------------------------------------------------------
    def normalize_latents(self, vae, latents):
        """(x - running_mean) / sqrt(running_var + eps) of the VAE's batch norm over the packed tokens (the
        pipeline's decode inverted, the script's normalisation), returned in the VAE's (B, 32, h, w) layout."""
        bn = vae.bn
        mean = bn.running_mean.view(1, 1, -1).to(latents)
        std = torch.sqrt(bn.running_var.view(1, 1, -1) + vae.config.batch_norm_eps).to(latents)
        return unpack((pack(latents) - mean) / std, *latents.shape[-2:])

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

        from ot_dist.models.families.flux2 import tiny_flux2_vae
        from ot_dist.models.families.qwen_image import tiny_qwen2_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_qwen2_tokenizer(template=CHAT_TURN)
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
        text_encoder = tiny_qwen3_vl(len(tokenizer), tokenizer.pad_token_id)
        return Ideogram4Pipeline(
            transformer=tiny_transformer(), unconditional_transformer=tiny_transformer(), vae=tiny_flux2_vae(),
            text_encoder=text_encoder, tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**IDEOGRAM4_SCHEDULER))


def tiny_qwen3_vl(vocab_size: int, pad_token_id: int | None, width: int = TINY_TEXT_WIDTH):
    """A tiny Qwen3VLModel (the class Ideogram 4's text_encoder is) with as many decoder layers as the pipeline reads
    (its deepest tap is layer 35 of Qwen3-VL-8B's 36) and interleaved MRoPE over head_dim 8 (sections 2 / 1 / 1), a
    one-block vision tower that text never runs."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=width, intermediate_size=32,
                         num_hidden_layers=max(QWEN3_VL_ACTIVATION_LAYERS) + 1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=4096, pad_token_id=pad_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width,
                           deepstack_visual_indexes=[0], num_position_embeddings=16))
    return Qwen3VLModel(config).eval()


def tiny_transformer():
    from diffusers import Ideogram4Transformer2DModel
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS

    # head_dim 8 with MRoPE sections 2 / 1 / 1 (its 4 frequencies); 128 = 32 VAE channels x 2 x 2
    return Ideogram4Transformer2DModel(
        in_channels=128, num_layers=2, attention_head_dim=8, num_attention_heads=4, intermediate_size=64,
        adaln_dim=16, llm_features_dim=TINY_TEXT_WIDTH * len(QWEN3_VL_ACTIVATION_LAYERS), rope_theta=5_000_000,
        mrope_section=(2, 1, 1))


FAMILIES = {"ideogram4": Ideogram4()}
