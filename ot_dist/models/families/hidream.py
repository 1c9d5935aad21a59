"""HiDream-I1: a sparse DiT (`HiDreamImageTransformer2DModel`: 16 dual-stream and 32 single-stream blocks whose image
feed-forwards are mixtures of experts, 4 routed experts with 2 active per token beside a shared one) over the Flux
VAE's 16 channels in 2x2 patches, conditioned on four text encoders; flow matching with the output negated.

What follows HiDreamImagePipeline.encode_prompt and diffusers' train_dreambooth_lora_hidream.py:
- Text: CLIP-L and CLIP-G give their projected pooled outputs, concatenated (the timestep embedding's addend); T5
  gives its last hidden states (the tokens with their attention mask into T5, nothing masked afterwards); Llama-3.1
  gives the hidden states after every layer (`hidden_states[1:]`), which the transformer's `llama_layers` pick one by
  one per block. Every tokenizer pads to max_sequence_length (128, bounded by the T5 tokenizer's model_max_length; CLIP
  by 218), Llama with its end-of-turn token as padding, as the pipeline sets it. The Llama stack is kept batch-first
  (B, layers, tokens, width) in the conditioning (the text cache's unit) and handed over as the pipeline's
  (layers, B, tokens, width). A caption's cache entry is large: 32 layers x 128 x 4096 (32 MiB in bfloat16).
- Objective: x_t = (1 - s) x + s n, target n - x, the transformer called with the raw timestep (0..1000), its
  prediction negated (the model predicts x - n). The shift is the model's scheduler config (`flow_shift` of a
  flow-sigma UniPC / DPM config, else `shift`); diffusers' script loads that config into a
  FlowMatchEulerDiscreteScheduler with shift=3.0 whatever it says: `loss.timestep_shift: 3` reproduces it.
- The experts: in eval mode (as ot_dist keeps every model) and under the script's `force_inference_output=True`, the
  MoE runs `moe_infer`, which is `torch.no_grad()`: the routed experts and the gate get no gradient, and the
  gradient reaching everything before a MoE skips the routed experts' path (only the shared expert's). ot_dist runs
  the MoE's differentiable branch whenever autograd records (a forward pre-hook, `differentiable_experts`), as
  OneTrainer trains in train mode: the prediction is the same (within float rounding), the gradients are whole, and a
  full finetune trains the experts and the gate. The transformer's own output stays the pipeline's layout (its
  top-level mode is untouched). No load-balancing loss: diffusers computes the gate's auxiliary loss in train mode
  and drops it, OneTrainer adds none; SimpleTuner's optional one (hidream_load_balancing_loss_weight) is not here.
- Latents: the transformer patchifies itself; a non-square latent is padded to `max_seq` image tokens (4096, 1024 px
  square's count) as the pipeline does at inference, so training sees what sampling sees (OneTrainer trains non-square
  buckets unpadded). A non-square bucket over 1 MP, which that padding cannot hold, trains unpadded, as OneTrainer
  trains every bucket, and a sample of such a size is drawn the same way (the pipeline's own call fails there).
- Sampling: HiDreamImagePipeline rescales every request to the area of its default size (1024 x 1024); samples keep
  the requested size (the training buckets') by setting the pipeline's default size to that area.

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`), which HiDreamImagePipeline.load_lora_weights
reads (the transformer only) and ComfyUI maps for HiDream (comfy/lora.py: `transformer.<module>` for each of its
model's keys, whose names are diffusers').

Single files: ComfyUI's diffusion-model file (`hidream_i1_full_fp16.safetensors`, its fp8 cast), whose keys are
diffusers' (hidream_single_file.py); `model.config` names the diffusers folder that supplies the rest. ComfyUI loads
the four text encoders from files of their own: a trained text encoder is exported in the diffusers folder only.
"""

from __future__ import annotations

import math

import torch

from ot_dist.models.families import component_files as C
from ot_dist.models.families.base import T5_EMBEDDING_COPIES, T5_EMBEDDING_KEY, T5_LORA_TARGETS, Family
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# train_dreambooth_lora_hidream.py's default --lora_layers: the image stream's attention (`to_out` is a plain Linear)
HIDREAM_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out")
HIDREAM_ATTENTION_TARGETS = HIDREAM_LORA_TARGETS + ("to_q_t", "to_k_t", "to_v_t", "to_out_t")
# the SwiGLU feed-forwards: the shared and routed experts of the MoE and the text stream's ff_t (OneTrainer's
# attn-mlp preset: attn1 and ff_i)
HIDREAM_ATTENTION_MLP_TARGETS = HIDREAM_ATTENTION_TARGETS + ("w1", "w2", "w3")
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CLIP_SHARD_UNITS = ("encoder.layers",)  # CLIPTextModel (transformers 5: no text_model level) and WithProjection
MAX_SEQUENCE_LENGTH = 128  # HiDreamImagePipeline's and the training script's default
CLIP_MAX_TOKENS = 218  # the pipeline's bound for the (248-position) CLIP encoders
# ComfyUI's LoRA names of Llama-3.1's modules: "text_encoders." + its HiDreamTEModel's state-dict path
COMFY_LLAMA_PREFIX = "text_encoders.llama.transformer.model."


class HiDream(Family):
    name = "hidream"
    description = ("HiDream-I1 (sparse MoE DiT, CLIP-L + CLIP-G pooled, T5 and Llama-3.1 layers, flow matching with "
                   "the output negated)")
    pipeline_class = "HiDreamImagePipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    tokenizers = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")
    # OneTrainer's HiDreamEmbeddingSaver: clip_l, clip_g, t5, llama; ComfyUI's HiDream tokenizers read clip_l, clip_g,
    # t5xxl (the T5's copy) and llama (comfy/text_encoders/hidream.py, hunyuan_video.py LLAMA3Tokenizer)
    embedding_keys = {"text_encoder": "clip_l", "text_encoder_2": "clip_g", "text_encoder_3": T5_EMBEDDING_KEY,
                      "text_encoder_4": "llama"}
    embedding_key_copies = T5_EMBEDDING_COPIES
    embedding_keys_optional = frozenset({"text_encoder_3", "text_encoder_4"})  # CLIP-only files start those two
    denoiser_lora_presets = {"default": HIDREAM_LORA_TARGETS, "attention": HIDREAM_ATTENTION_TARGETS,
                             "attention_mlp": HIDREAM_ATTENTION_MLP_TARGETS}
    text_lora_targets_by_encoder = {"text_encoder_3": T5_LORA_TARGETS, "text_encoder_4": LLAMA_LORA_TARGETS}
    # Llama-3.1-8B's embedding table and its untied lm_head (128 k x 4096, 6.5 % of it each, one tensor) are units of
    # their own, as Sana's Gemma's table: in the root, which FSDP2 keeps gathered for the whole step, only the norm
    shard_units = {"transformer": ("double_stream_blocks", "single_stream_blocks"),
                   "text_encoder": CLIP_SHARD_UNITS, "text_encoder_2": CLIP_SHARD_UNITS,
                   "text_encoder_3": ("encoder.block",),
                   "text_encoder_4": ("model.embed_tokens", "model.layers", "lm_head")}
    pixel_multiple = 16  # VAE x8, 2x2 patches
    memory_reference = "HiDream-I1"  # HiDream-I1-Full: the 17 B transformer, CLIP-L, CLIP-G, T5-XXL, Llama-3.1-8B
    samplers = ("flow_euler",)
    sample_guidance_scale = 5.0  # OneTrainer's SampleConfig HiDream default (the model card's for Full)
    lora_file_prefixes = None  # the diffusers layout: what diffusers and ComfyUI read for HiDream
    # Trained text encoders under the names ComfyUI maps for HiDream (comfy/lora.py model_lora_keys_clip on its
    # HiDreamTEModel: clip_l, clip_g, t5xxl, llama): CLIP-L / CLIP-G keep diffusers' `text_encoder.` /
    # `text_encoder_2.text_model.` names, which it maps; T5 is `lora_te3_<path>` (its T5 index behind two CLIPs), and
    # Llama `text_encoders.llama.transformer.model.<path>` (hunyuan_video.LLAMAModel: llama.py's Llama2_ under
    # `transformer.model`, transformers' layer names). diffusers' HiDream loader reads the transformer only.
    lora_file_kohya_components = {"text_encoder_3": "lora_te3"}
    lora_file_component_paths = {"text_encoder_4": {"model.layers.": COMFY_LLAMA_PREFIX + "layers."}}
    # ComfyUI's hidream_i1_*.safetensors: the transformer alone, bare diffusers keys (hidream_single_file.py)
    single_file = True
    single_file_text_encoders = False  # ComfyUI loads the four text encoders from files of their own
    transformer_file_layout = "ot_dist.models.families.hidream_single_file:HIDREAM"  # ComfyUI's diffusion-model loader reads Comfy-Org's file: the transformer alone with bare keys
    # ...which model.component_files reads: clip_l_hidream / clip_g_hidream (their projections: HiDream pools both
    # projected), t5xxl, llama_3.1_8b_instruct (fp8_scaled too; ComfyUI's has no lm_head) and Flux's ae.safetensors
    component_files = {"text_encoder": C.CLIP_TEXT_PROJECTED, "text_encoder_2": C.CLIP_TEXT_PROJECTED,
                       "text_encoder_3": C.T5_ENCODER,
                       "text_encoder_4": C.decoder_lm("Llama 3.1 text encoder (ComfyUI's llama_3.1_8b_instruct)"),
                       "vae": C.LDM_VAE}
    modelspec_architecture = "hidream-i1"  # OneTrainer's (resources/sd_model_spec/hi_dream_full.json)

    # -- loading ------------------------------------------------------------------------------------------
    def load_folder(self, path, index):
        """None (from_pretrained loads it) once the folder holds its Llama; HiDream-ai's repositories ship none (the
        pipeline takes it as an argument), so a folder without one is refused with the step that completes it."""
        if all(isinstance(index.get(name), list) and index[name][0] and (path / name).is_dir()
               for name in ("text_encoder_4", "tokenizer_4")):
            return None
        from ot_dist.errors import InputFileError

        raise InputFileError(
            f"model.path: {path} has no Llama (text_encoder_4 / tokenizer_4), which HiDream-ai's folders leave out; "
            "save a complete one first: HiDreamImagePipeline.from_pretrained(FOLDER, "
            "tokenizer_4=AutoTokenizer.from_pretrained(LLAMA), text_encoder_4=LlamaForCausalLM.from_pretrained(LLAMA))"
            ".save_pretrained(COMPLETE) with LLAMA = meta-llama/Llama-3.1-8B-Instruct (docs/families.md, HiDream-I1)")

    # -- objective ----------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        config = pipeline.scheduler.config
        shift = config.get("flow_shift") if config.get("use_flow_sigmas") else None  # a UniPC / DPM flow config
        return FlowMatching.from_scheduler_config(config, patch_size=2, shift=shift, dynamic=False)

    def objective_kind(self) -> str:
        return "flow"

    def sampling_overrides(self, objective: FlowMatching) -> dict:
        # the fixed shift training used (a flow-sigma config names it flow_shift, which the Euler sampler ignores)
        return {"shift": objective.shift, "use_dynamic_shifting": False}

    # -- text -------------------------------------------------------------------------------------------
    def sequence_length(self, tokenizers: dict) -> int:
        """The pipeline call's max_sequence_length: 128, or fewer where the T5 tokenizer holds fewer (a tiny one)."""
        return min(MAX_SEQUENCE_LENGTH, tokenizers["tokenizer_3"].model_max_length)

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.sequence_length({"tokenizer_3": pipeline.tokenizer_3})}

    def tokenize(self, tokenizers, captions):
        length = self.sequence_length(tokenizers)
        tokens = {}
        for encoder, name in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
            tokens[encoder] = tokenizers[name](captions, padding="max_length", max_length=min(length, CLIP_MAX_TOKENS),
                                               truncation=True, return_tensors="pt").input_ids
        llama = tokenizers["tokenizer_4"]
        if llama.pad_token != llama.eos_token:
            llama.pad_token = llama.eos_token  # as HiDreamImagePipeline.__init__ sets it
        for encoder, tokenizer in (("text_encoder_3", tokenizers["tokenizer_3"]), ("text_encoder_4", llama)):
            encoded = tokenizer(captions, padding="max_length", max_length=min(length, tokenizer.model_max_length),
                                truncation=True, add_special_tokens=True, return_tensors="pt")
            tokens[encoder], tokens[f"{encoder}_mask"] = encoded.input_ids, encoded.attention_mask
        return tokens

    def encode_text(self, text_encoders, tokens):
        pooled = []
        for name in ("text_encoder", "text_encoder_2"):
            encoder = text_encoders[name]
            pooled.append(encoder(to_device(tokens[name], encoder.device))[0])  # the projected pooled output
        t5 = text_encoders["text_encoder_3"]
        t5_hidden = t5(to_device(tokens["text_encoder_3"], t5.device),
                       attention_mask=to_device(tokens["text_encoder_3_mask"], t5.device))[0]
        llama = text_encoders["text_encoder_4"]
        # logits_to_keep=1: the language-model head (128 k wide) on one position, not on every token
        out = llama(to_device(tokens["text_encoder_4"], llama.device),
                    attention_mask=to_device(tokens["text_encoder_4_mask"], llama.device), output_hidden_states=True,
                    use_cache=False, logits_to_keep=1)
        return {"pooled": torch.cat(pooled, dim=-1), "t5": t5_hidden,
                "llama": torch.stack(out.hidden_states[1:], dim=1)}

    # -- the denoiser call ------------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        differentiable_experts(denoiser)
        llama = conditioning["llama"].transpose(0, 1)  # (layers, B, tokens, width), as the transformer indexes it
        out = denoiser(**image_inputs(denoiser, noisy), timesteps=timesteps.float(),
                       encoder_hidden_states_t5=conditioning["t5"], encoder_hidden_states_llama3=llama,
                       pooled_embeds=conditioning["pooled"], return_dict=False)[0]
        if denoiser.training and not denoiser.config.force_inference_output:
            out = unpatchify_training_output(out, *noisy.shape[-2:], denoiser.config.patch_size)
        return -out  # the model predicts x - n; the target is n - x

    # -- sampling ---------------------------------------------------------------------------------------
    def sampling_arguments(self, pipeline, arguments):
        arguments = {**arguments, **self.pipeline_call_options(pipeline)}
        unpadded_large_images(pipeline.transformer)  # a non-square sample over 1 MP, as training sees it
        pipeline.default_sample_size = area_keeping_sample_size(arguments["width"], arguments["height"],
                                                                pipeline.vae_scale_factor)
        return arguments

    # -- demo and tests ---------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, **_):
        from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
        from transformers import CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM

        from ot_dist.models.families.flux import tiny_flow_vae
        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer, tiny_t5_encoder, \
            tiny_t5_tokenizer

        torch.manual_seed(seed)
        clip_tokenizer, t5_tokenizer, llama_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer(), \
            tiny_llama_tokenizer()
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(llama_tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
            bos_token_id=llama_tokenizer.bos_token_id, eos_token_id=llama_tokenizer.eos_token_id))
        # HiDream-I1's layout (2x2 patches, RoPE over (t, h, w) head slices, 4 routed experts with 2 active, a Llama
        # layer per block, the last one repeated for the later blocks as the real 48-entry list does), tiny; its
        # max_resolution of 16 x 16 latents pads non-square images to 64 tokens
        transformer = HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, caption_channels=[TEXT_HIDDEN, TEXT_HIDDEN], text_emb_dim=2 * TEXT_HIDDEN,
            num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16),
            llama_layers=[0, 1, 1, 1])
        return HiDreamImagePipeline(
            transformer=transformer,
            vae=tiny_flow_vae(shift_factor=0.1159, scaling_factor=0.3611),  # the Flux VAE's
            text_encoder=CLIPTextModelWithProjection(clip_text_config(len(clip_tokenizer), "quick_gelu")),
            text_encoder_2=CLIPTextModelWithProjection(clip_text_config(len(clip_tokenizer), "gelu")),
            text_encoder_3=tiny_t5_encoder(len(t5_tokenizer)),
            text_encoder_4=llama,
            tokenizer=clip_tokenizer, tokenizer_2=clip_tokenizer, tokenizer_3=t5_tokenizer,
            tokenizer_4=llama_tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        )


def differentiable_experts(denoiser: torch.nn.Module) -> None:
    """Give each MoE feed-forward of `denoiser` (once) a forward pre-hook that runs its differentiable branch while
    autograd records and `moe_infer` (no_grad) otherwise; its gate is left alone (in eval mode it computes no
    auxiliary loss). The hook travels with the module through deep copies and FSDP wrapping."""
    if getattr(denoiser, "_ot_dist_differentiable_experts", False):
        return
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    for module in denoiser.modules():
        if isinstance(module, MOEFeedForwardSwiGLU):
            module.register_forward_pre_hook(_route_by_grad_mode)
    denoiser._ot_dist_differentiable_experts = True


def _route_by_grad_mode(module, args):
    # The branch MOEFeedForwardSwiGLU.forward takes is `self.training and not self._force_inference_output`; its
    # own mode and that flag affect nothing else (the experts are plain Linears, the gate has its own mode).
    module.training = torch.is_grad_enabled()
    module._force_inference_output = False


def image_inputs(denoiser, noisy: torch.Tensor) -> dict:
    """The transformer's image arguments: the latents, which it patchifies itself (a non-square one padded to max_seq
    tokens, as the pipeline samples), or, for a non-square latent with more tokens than max_seq (a bucket over 1 MP,
    which the padding cannot hold and the pipeline never samples), its tokens unpadded with their mask, sizes and
    (0, row, column) ids: the input OneTrainer trains every bucket with."""
    b, c, h, w = noisy.shape
    p = denoiser.config.patch_size
    rows, cols = h // p, w // p
    if h == w or rows * cols <= denoiser.max_seq:
        return {"hidden_states": noisy}
    tokens = noisy.reshape(b, c, rows, p, cols, p).permute(0, 2, 4, 3, 5, 1).reshape(b, rows * cols, p * p * c)
    ids = torch.zeros(rows, cols, 3, device=noisy.device, dtype=noisy.dtype)
    ids[..., 1] += torch.arange(rows, device=noisy.device, dtype=noisy.dtype)[:, None]
    ids[..., 2] += torch.arange(cols, device=noisy.device, dtype=noisy.dtype)[None, :]
    return {"hidden_states": tokens, "hidden_states_masks": noisy.new_ones(b, rows * cols),
            "img_sizes": torch.tensor([[rows, cols]] * b, device=noisy.device),
            "img_ids": ids.reshape(1, rows * cols, 3).expand(b, -1, -1)}


def unpadded_large_images(transformer: torch.nn.Module) -> None:
    """Give `transformer` (once) a forward pre-hook that hands a latent image argument to it as `image_inputs` does:
    the pipeline's call at a non-square size over 1 MP, which the transformer's own padding cannot hold."""
    if getattr(transformer, "_ot_dist_unpadded_large_images", False):
        return

    def hook(module, args, kwargs):
        latents = kwargs.get("hidden_states")
        if args or latents is None or latents.dim() != 4 or kwargs.get("hidden_states_masks") is not None:
            return None
        return args, {**kwargs, **image_inputs(module, latents)}

    transformer.register_forward_pre_hook(hook, with_kwargs=True)
    transformer._ot_dist_unpadded_large_images = True


def unpatchify_training_output(out: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """The transformer's train-mode output (B, C, tokens, p*p; tokens padded to max_seq for a non-square latent) as
    latents (B, C, h, w): what its eval-mode unpatchify gives."""
    b, c = out.shape[:2]
    rows, cols = height // patch, width // patch
    out = out[:, :, :rows * cols].reshape(b, c, rows, cols, patch, patch)
    return out.permute(0, 1, 2, 4, 3, 5).reshape(b, c, height, width)


def area_keeping_sample_size(width: int, height: int, vae_scale_factor: int) -> float:
    """The pipeline's default_sample_size that makes its area rescaling keep width x height: the side whose square is
    the requested area (rounded up, so that the pipeline's scale is never below 1 and its floor keeps the size)."""
    side = math.sqrt(width * height) / vae_scale_factor
    while (side * vae_scale_factor) ** 2 < width * height:
        side = math.nextafter(side, math.inf)
    return side


def tiny_llama_tokenizer(max_length: int = 32, corpus: tuple[str, ...] = ()):
    """A Llama-3-style tokenizer built offline: byte-level BPE (GPT-2's pre-tokenizer) trained on the demo words, so
    each is one token as with the real vocabulary, <|begin_of_text|> put in front by a template processor as Llama-3's
    tokenizer.json does, <|eot_id|> its end token (Llama-3.1-Instruct's, which the pipeline pads with). `max_length`
    becomes model_max_length; `corpus`: more text the BPE learns (a prompt template, so it is words, not bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ot_dist.models.tiny import DEMO_WORDS

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=specials, show_progress=False)
    words = " ".join(DEMO_WORDS)
    backend.train_from_iterator([" " + words, words.title(), *corpus], trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", backend.token_to_id("<|begin_of_text|>"))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   model_max_length=max_length)


FAMILIES = {"hidream": HiDream()}
