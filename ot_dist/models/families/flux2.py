"""FLUX.2: an MMDiT over 32-channel VAE latents that the transformer sees 2x2-patchified (128 channels, one token
per patch), normalised by the VAE's own batch-norm statistics, trained with flow matching (t / 1000 in, target
noise - latents) and a resolution-dependent shift.

- `flux2` (FLUX.2 [dev], Flux2Pipeline): Mistral-Small-3.1 (Mistral3ForConditionalGeneration) reads the caption in
  its chat template after Black Forest Labs' system message; the hidden states of layers 10, 20 and 30 are
  concatenated per token (3 x 5120 = 15360 wide), every one of the 512 padded tokens goes to the transformer (no
  mask). Its guidance is distilled: the transformer takes the guidance value as an input (`model.guidance_scale`).
- `flux2_klein` (FLUX.2 [klein] 4B / 9B, Flux2KleinPipeline): Qwen3 (Qwen3ForCausalLM) after Qwen3's chat template
  with the thinking turned off, layers 9, 18 and 27; no guidance embedding, real classifier-free guidance when
  sampling. The [klein] base models are the ones to train; the step-distilled ones sample without guidance.

The latent layout ot_dist keeps (what the latent cache stores, the noise is drawn in, masks are scaled to) is the
VAE's own (B, 32, h, w); `normalize_latents` applies the per-channel statistics of the patchified layout without
changing it, and `predict` patchifies and packs (Flux.1's 2x2 packing: channel, patch row, patch column), then
unpacks the prediction back.

Single files: Black Forest Labs' transformer keys (flux2_single_file.py). LoRA files: the diffusers layout, which
diffusers' Flux2 loader reads and ComfyUI in part (its Flux2 is its Flux, whose diffusers key map names the blocks'
projections, not the shared modulations, the time / guidance embedders or a text encoder), and beside it
`lora_comfyui.safetensors` in the names ComfyUI maps for every module (flux2_lora.py).
"""

from __future__ import annotations

import torch

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import Family
from ot_dist.models.families.flux import TRANSFORMER_SHARD_UNITS, pack, sample_reference, unpack
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.references import reference_latents
from ot_dist.train.transfer import to_device

# Flux2Pipeline / Flux2KleinPipeline defaults: the text encoder's hidden states they concatenate (index 0 is the
# embedding output) and the caption length, system message and template tokens included.
MISTRAL_LAYERS = (10, 20, 30)
QWEN3_LAYERS = (9, 18, 27)
MAX_TOKENS = 512
# diffusers' train_dreambooth_lora_flux2.py / _klein.py default: both streams' image attention in the double blocks,
# the single blocks' fused qkv + MLP input and their output projection. The single block's `attn.to_out` is named
# by its path, as the scripts do (the suffix alone would also name the double blocks' to_out ModuleList); 48 covers
# every published model ([dev] 48 single blocks, [klein] 9B 24, 4B 20).
FLUX2_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj",
                      *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)))
# Every projection of the double blocks' two streams, the single blocks as above
FLUX2_ATTENTION_MLP_TARGETS = FLUX2_LORA_TARGETS + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                                                    "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                                                    "ff_context.linear_out")
# The language model's attention: Mistral3's Pixtral vision tower (which text-only training never runs) names its
# projections attention.q_proj ..., so the self_attn. level keeps them out.
TEXT_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# SimpleTuner's FLUX.2 scheduler config (helpers/models/flux2/model.py), the one published with the models: dynamic
# shifting, so the scheduler's training sigmas are unshifted (what diffusers' scripts draw); OneTrainer shifts per
# resolution with these base / max values (Flux2Model.calculate_timestep_shift).
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                       max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2): Flux2Pipeline._patchify_latents' channel order (channel, row, column)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.view(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def batch_norm_normalize(vae, latents: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - running_mean) / sqrt(running_var + eps) of an AutoencoderKLFlux2's batch norm over the patchified latents,
    returned in the VAE's (B, 32, h, w) layout (FLUX.2's and ERNIE-Image's normalisation)."""
    view = (1, -1, 1, 1)
    mean = vae.bn.running_mean.view(view).to(latents)
    std = torch.sqrt(vae.bn.running_var.view(view) + eps).to(latents)
    return unpatchify((patchify(latents) - mean) / std)


# Flux2Pipeline._prepare_image_ids: the i-th reference image's tokens sit at time coordinate 10 + 10 i
REFERENCE_TIME_SCALE = 10


def reference_ids(rows: int, columns: int, index: int, device) -> torch.Tensor:
    """(rows * columns, 4): the position ids of the `index`-th reference image's packed tokens, (10 + 10 index, row,
    column, 0) in raster order, rows and columns from 0 (Flux2Pipeline._prepare_image_ids)."""
    time = torch.full((1,), REFERENCE_TIME_SCALE * (1 + index), dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return torch.cartesian_prod(time, torch.arange(rows, device=device), torch.arange(columns, device=device), zero)


def position_ids(rows: int, columns: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids (rows * columns, 4), text ids (tokens, 4)): the (time, row, column, layer) coordinates the pipeline
    gives its tokens, image tokens in raster order at time 0, text tokens along the layer axis."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    image = torch.cartesian_prod(zero, torch.arange(rows, device=device), torch.arange(columns, device=device), zero)
    text = torch.cartesian_prod(zero, zero, zero, torch.arange(tokens, device=device))
    return image, text


class Flux2Family(Family):
    """What FLUX.2 [dev] and [klein] share: the transformer, its latents and objective, the stacked text layers."""

    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # no UI loads Mistral-3 / Qwen3 embeddings
    denoiser_lora_presets = {"default": FLUX2_LORA_TARGETS, "attention_mlp": FLUX2_ATTENTION_MLP_TARGETS}
    text_lora_targets = TEXT_LORA_TARGETS
    pixel_multiple = 16  # VAE x8, then 2x2 patches
    samplers = ("flow_euler",)
    # OneTrainer's sample default for FLUX.2 (SampleConfig: cfg_scale 4.0); the pipelines' own default too
    sample_guidance_scale = 4.0
    # Black Forest Labs' transformer file (flux2-dev.safetensors; ComfyUI's diffusion-model files have its keys): the
    # transformer alone; ComfyUI loads Mistral-3 / Qwen3 and the VAE from files of their own
    single_file = True
    single_file_text_encoders = False
    transformer_file_layout = "ot_dist.models.families.flux2_single_file:FLUX2"  # Black Forest Labs' file: the transformer alone with bare keys
    modelspec_implementation = "https://github.com/black-forest-labs/flux2"  # the single file's key names
    # kohya-style lora_unet_<BFL path with _> and ComfyUI's diffusion_model.<BFL path>, read by lora merge / init_from
    lora_original_prefixes = (("lora_unet", "_"), ("diffusion_model", "."))
    layers: tuple[int, ...] = ()
    # Both pipelines take `image=` (reference images) and diffusers has an img2img script for each: a run with a
    # reference_path on its concepts trains image editing, one without trains text-to-image.
    reference_images_optional = True
    # Flux2Pipeline / Flux2KleinPipeline take a list of references (each at time id 10 + 10 i) and set no cap; Black
    # Forest Labs gives FLUX.2 up to 10 reference images
    max_reference_images = 10

    def objective(self, pipeline, model_config) -> FlowMatching:
        return FlowMatching.from_scheduler_config(pipeline.scheduler.config, patch_size=2)

    def objective_kind(self) -> str:
        return "flow"

    # -- text -------------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        # a processor ([dev]'s PixtralProcessor) keeps the limit on its tokenizer; a tiny test tokenizer has fewer
        return min(MAX_TOKENS, getattr(tokenizer, "tokenizer", tokenizer).model_max_length)

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer),
                "text_encoder_out_layers": self.layers}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        out = encoder(input_ids=to_device(tokens["text_encoder"], encoder.device),
                      attention_mask=to_device(tokens["text_encoder_mask"], encoder.device),
                      output_hidden_states=True, use_cache=False,
                      logits_to_keep=1)  # the language-model head's output is not used: one position, not 512
        # per token, the chosen layers side by side (the pipeline's stack, permute and reshape); the mask only
        # shapes the text encoder's attention: the transformer sees every token, padding included
        return {"hidden": torch.cat([out.hidden_states[k] for k in self.layers], dim=-1)}

    # -- latents ----------------------------------------------------------------------------------------
    def normalize_latents(self, vae, latents):
        """The pipelines' and the training scripts' normalisation, with the VAE config's eps."""
        return batch_norm_normalize(vae, latents, vae.config.batch_norm_eps)

    # -- the denoiser call ------------------------------------------------------------------------------
    def guidance(self, denoiser, batch_size: int, device) -> torch.Tensor | None:
        return None

    def image_tokens(self, noisy: torch.Tensor, conditioning: dict, image_ids: torch.Tensor):
        """(the image stream's tokens, their position ids): the packed noisy latents, then, where the conditioning
        has them (an edit run: ot_dist/train/references.py), each reference's packed latents with their own ids (the
        i-th at time 10 + 10 i), as
        Flux2Pipeline / Flux2KleinPipeline append them (Flux.1 Kontext's hook, FLUX.2's ids). The prediction is read
        from the first tokens, the noisy latents' own."""
        tokens = pack(noisy)
        references = reference_latents(conditioning)
        if not references:
            return tokens, image_ids
        ids = [reference_ids(r.shape[-2] // 2, r.shape[-1] // 2, i, image_ids.device) for i, r in enumerate(references)]
        return (torch.cat([tokens, *(pack(r.to(tokens)) for r in references)], dim=1),
                torch.cat([image_ids, *ids], dim=0))

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        b, _, h, w = noisy.shape
        hidden = conditioning["hidden"]
        image_ids, text_ids = position_ids(h // 2, w // 2, hidden.shape[1], noisy.device)
        tokens, image_ids = self.image_tokens(noisy, conditioning, image_ids)
        tokens = denoiser(
            hidden_states=tokens,
            # float32, as the training scripts pass it (the transformer casts it to its own dtype)
            timestep=timesteps.float() / 1000,
            guidance=self.guidance(denoiser, b, noisy.device),
            encoder_hidden_states=hidden,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
        return unpack(tokens[:, :(h // 2) * (w // 2)], h, w)

    # -- LoRA files -----------------------------------------------------------------------------------
    def comfy_text_prefixes(self, text_encoder) -> tuple[str, str]:
        """(transformers' path of the text encoder's language-model layers, ComfyUI's name for it)."""
        raise NotImplementedError

    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's LoRA in Black Forest Labs' names, which ComfyUI maps for every
        FLUX.2 module (its diffusers-name map lacks the shared modulations and the time / guidance embedders), a
        trained text encoder's beside it in ComfyUI's names for it (flux2_lora.py); nothing for an adapter other than
        plain LoRA or a run without a transformer LoRA."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.flux2_lora import comfyui_lora_state, comfyui_text_lora_state

        if "transformer" not in states:
            return []
        tensors = comfyui_lora_state(states["transformer"], adapter_configs["transformer"],
                                     dict(model.part("transformer").config))
        if "text_encoder" in states and tensors is not None:  # a trained text encoder: ComfyUI's names, same file
            own, comfy = self.comfy_text_prefixes(model.part("text_encoder"))
            text = comfyui_text_lora_state(states["text_encoder"], adapter_configs["text_encoder"], own, comfy)
            tensors = None if text is None else {**tensors, **text}
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name, layout="comfyui",
                                    scale="inside the up matrices, alpha = each module's rank",
                                    rank=adapter_configs["transformer"]["r"])

    # -- demo and tests ---------------------------------------------------------------------------------
    def tiny_transformer(self, guidance: bool):
        from diffusers import Flux2Transformer2DModel

        from ot_dist.models.tiny import TEXT_HIDDEN

        return Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN * len(self.layers), timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance)


class Flux2(Flux2Family):
    name = "flux2"
    description = ("FLUX.2 [dev] (MMDiT over patchified 32-channel latents, Mistral-3 hidden layers 10 / 20 / 30, "
                   "distilled guidance, flow matching with a resolution-dependent shift)")
    pipeline_class = "Flux2Pipeline"
    # Mistral3ForConditionalGeneration: model.language_model.layers (the vision tower never runs: left whole)
    shard_units = {"transformer": TRANSFORMER_SHARD_UNITS, "text_encoder": ("language_model.layers",)}
    layers = MISTRAL_LAYERS
    memory_reference = "FLUX.2 dev"  # black-forest-labs/FLUX.2-dev: the 32 B transformer, Mistral-Small-3.1 (24 B)
    sample_negative_prompt = False  # Flux2Pipeline samples with the distilled guidance, without a negative pass
    modelspec_architecture = "flux-2-dev"  # OneTrainer writes "Flux.2"

    def __init__(self, guidance_scale: float = 1.0):
        # The distilled guidance the transformer is shown in training: 1.0 as ot_dist's Flux.1 dev (OneTrainer's
        # transformer.guidance_scale default); diffusers' script shows 3.5 (its --guidance_scale).
        self.guidance_scale = guidance_scale

    def configure(self, model_config) -> "Flux2":
        scale = model_config.guidance_scale
        return self if scale is None or scale == self.guidance_scale else Flux2(scale)

    def comfy_text_prefixes(self, text_encoder):
        # Mistral3ForConditionalGeneration's language model; ComfyUI's Flux2TEModel "mistral3_24b"
        from ot_dist.models.families.flux2_lora import COMFY_MISTRAL_PREFIX

        return "model.language_model.", COMFY_MISTRAL_PREFIX

    def guidance(self, denoiser, batch_size, device):
        if not denoiser.config.guidance_embeds:
            return None
        return torch.full((batch_size,), self.guidance_scale, device=device, dtype=torch.float32)

    def tokenize(self, tokenizers, captions):
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        tokenizer = tokenizers["tokenizer"]
        encoded = tokenizer.apply_chat_template(
            format_input(list(captions), SYSTEM_MESSAGE), add_generation_prompt=False, tokenize=True,
            return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
            max_length=self.max_tokens("tokenizer", tokenizer))
        return {"text_encoder": encoded["input_ids"], "text_encoder_mask": encoded["attention_mask"]}

    def sampling_arguments(self, pipeline, arguments):
        # guidance_scale is the distilled guidance input here; there is no negative prompt
        return {**with_reference(arguments), **self.pipeline_call_options(pipeline)}

    def build_tiny(self, seed: int = 0, **_):
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        from ot_dist.models.tiny import TEXT_HIDDEN

        torch.manual_seed(seed)
        tokenizer = tiny_mistral_tokenizer()
        # Mistral-Small-3.1's layout (grouped KV heads, a Pixtral vision tower the text path never runs), tiny, with
        # one layer more than the deepest one read, as the real 40 layers have
        config = Mistral3Config(
            text_config=dict(model_type="mistral", hidden_size=TEXT_HIDDEN, intermediate_size=64,
                             num_hidden_layers=max(self.layers) + 1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=256,
                             pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=32, patch_size=16, head_dim=8),
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
        return Flux2Pipeline(
            transformer=self.tiny_transformer(guidance=True), vae=tiny_flux2_vae(),
            text_encoder=Mistral3ForConditionalGeneration(config).eval(), tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER))


class Flux2Klein(Flux2Family):
    name = "flux2_klein"
    description = ("FLUX.2 [klein] 4B / 9B (FLUX.2's transformer without guidance embedding, Qwen3 hidden layers 9 / "
                   "18 / 27, classifier-free guidance)")
    pipeline_class = "Flux2KleinPipeline"
    shard_units = {"transformer": TRANSFORMER_SHARD_UNITS, "text_encoder": ("model.layers",)}  # Qwen3ForCausalLM
    # ComfyUI's qwen_3_4b / qwen_3_8b files (Qwen3 under model., no lm_head: 4B's is tied, 8B's a zero one); its
    # flux2-vae.safetensors layout is not read yet
    component_files = {"text_encoder": C.QWEN3}
    layers = QWEN3_LAYERS
    memory_reference = "FLUX.2 klein 9B"  # the larger [klein] (9.1 B + Qwen3-8B); 4B's needs are below it
    modelspec_architecture = "flux-2-klein"

    def comfy_text_prefixes(self, text_encoder):
        # Qwen3ForCausalLM's model; ComfyUI's klein_te names it by its size (qwen3_4b / qwen3_8b)
        from ot_dist.models.families.flux2_lora import comfy_qwen3_prefix

        return "model.", comfy_qwen3_prefix(text_encoder.config.hidden_size)

    def tokenize(self, tokenizers, captions):
        tokenizer = tokenizers["tokenizer"]
        # Flux2KleinPipeline._get_qwen3_prompt_embeds: Qwen3's template, one caption at a time, no thinking
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False)
                 for caption in captions]
        encoded = tokenizer(texts, padding="max_length", truncation=True,
                            max_length=self.max_tokens("tokenizer", tokenizer), return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def sampling_arguments(self, pipeline, arguments):
        """The pipeline guides against the empty caption; a sample prompt's negative prompt goes in as its
        embeddings (the pipeline takes no negative text)."""
        arguments = {**with_reference(arguments), **self.pipeline_call_options(pipeline)}
        negative = arguments.pop("negative_prompt", None)
        if negative:
            arguments["negative_prompt_embeds"] = pipeline.encode_prompt(
                negative, device=pipeline._execution_device, max_sequence_length=arguments["max_sequence_length"],
                text_encoder_out_layers=self.layers)[0]
        return arguments

    def build_tiny(self, seed: int = 0, **_):
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from ot_dist.models.tiny import TEXT_HIDDEN

        torch.manual_seed(seed)
        tokenizer = tiny_qwen3_tokenizer()
        config = Qwen3Config(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=max(self.layers) + 1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=len(tokenizer),
                             max_position_embeddings=256, tie_word_embeddings=True,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return Flux2KleinPipeline(
            transformer=self.tiny_transformer(guidance=False), vae=tiny_flux2_vae(),
            text_encoder=Qwen3ForCausalLM(config).eval(), tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER))


def with_reference(arguments: dict) -> dict:
    """A sample prompt's reference images as the pipelines' `image`: each scaled to cover the sample's size and
    centre-cropped, the geometry every training pair has (Flux.1 Kontext's sample_reference); several as the list
    `image=[...]` in order (ids 10, 20, ...), one as itself (the pipelines make it a list of one). The pipelines take
    them as given up to 1024 x 1024 pixels (larger, they scale them down to that area, as the img2img scripts')."""
    arguments = dict(arguments)
    references = [sample_reference(path, arguments["width"], arguments["height"])
                  for path in arguments.pop("reference_images", [])]
    if references:
        arguments["image"] = references if len(references) > 1 else references[0]
    return arguments


def tiny_flux2_vae():
    """A tiny AutoencoderKLFlux2 (32 latent channels, 2x2 patches for its batch norm) whose batch-norm statistics are
    not the identity, so that the normalisation shows in every comparison."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=32,
                             norm_num_groups=8, sample_size=64)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean) * 0.3)
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) + 0.5)
    return vae.eval()


# The rendering of Mistral-Small-3.1's chat template for text: <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}{% else %}"
    "{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")
# Qwen3's chat template for a user turn and the generation prompt, with the empty thinking block that
# enable_thinking=False adds
QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SPLIT_WORDS = ("yellow", "black")  # out of the BPE's training text: they split into pieces (captions differ in length)


def _byte_level_bpe(texts: list[str], specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=specials[0]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials,
        show_progress=False))
    return bpe


def tiny_mistral_tokenizer(max_length: int = 64):
    """A byte-level BPE tokenizer built offline with Mistral's control tokens and a chat template rendering its
    system / user turns: Flux2Pipeline calls `apply_chat_template` on it as on the real PixtralProcessor (whose image
    processor needs torchvision). `max_length` (model_max_length) bounds the caption tokens, system message included."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PreTrainedTokenizerFast

    from ot_dist.models.tiny import DEMO_WORDS

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                "[IMG_BREAK]", "[IMG_END]"]
    words = " ".join(w for w in DEMO_WORDS if w not in SPLIT_WORDS)
    return PreTrainedTokenizerFast(tokenizer_object=_byte_level_bpe([SYSTEM_MESSAGE, words], specials),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                                   model_max_length=max_length, chat_template=MISTRAL_TEMPLATE)


def tiny_qwen3_tokenizer(max_length: int = 32):
    """Qwen-Image's offline Qwen2 tokenizer with Qwen3's chat template and its <think> / </think> tokens."""
    from ot_dist.models.families.qwen_image import tiny_qwen2_tokenizer

    tokenizer = tiny_qwen2_tokenizer(max_length)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


FAMILIES = {"flux2": Flux2(), "flux2_klein": Flux2Klein()}
