"""Wan 2.1 / 2.2 trained on still images as one-frame videos, or on video clips (data.video_frames, ot_dist/data/video.py):
`WanTransformer3DModel` (a DiT over (1, 2, 2) patches
of 3-D latents) on the causal 3-D VAE's latents (`AutoencoderKLWan`, 4x temporal: a clip of 4k + 1 frames gives
k + 1 latent frames, so one image is one latent frame), cross-attending to UMT5-XXL's last hidden states; flow
matching with the raw timestep (0..1000).

What follows WanPipeline (diffusers 0.42) and SimpleTuner's helpers/models/wan (no diffusers training script exists):
- Text: the prompt cleaned as the pipeline's `prompt_clean` (ftfy when installed, HTML unescape, whitespace), padded
  to 512 tokens (`max_sequence_length`, min the tokenizer's length) with the mask; UMT5 runs with the mask and the
  hidden states past each caption's length are zeroed, as the pipeline re-stacks them. The transformer gets no mask:
  it attends to the zero rows as the pipeline's call does.
- Latents: the VAE takes and gives one-frame videos (B, C, 1, H, W); ot_dist keeps the frame axis out of images'
  latents (`encode_posterior`, Qwen-Image's, whose VAE is Wan's) and in clips' ((B, 3, 4n + 1, H, W) pixels give
  (B, C, n + 1, h, w) latents), and normalises with the per-channel latents_mean / latents_std
  (Family.normalize_latents).
- Objective: x_t = (1 - s) x + s n, target n - x, the transformer called with t = 1000 s (float32, the unit of the
  scheduler's timesteps the pipeline passes) on the latents with their frame axis put back (a clip's: as they are,
  one s and one noise draw per clip). s is shifted by the
  scheduler config's `flow_shift` (Wan's diffusers folders ship UniPCMultistepScheduler with use_flow_sigmas and
  flow_shift 3.0 (480p) / 5.0 (720p); SimpleTuner trains with flow_schedule_shift, 3.0 / 5.0 per model).
- Samples: one frame (`num_frames=1`), the pipeline's `.frames[0][0]`; WanPipeline's guidance_scale (default 5.0).

Wan 2.2 A14B (two experts: `transformer` for high noise, `transformer_2` for low noise, switched by WanPipeline at
t >= boundary_ratio * 1000 (0.875 for T2V)): one expert trains per run, `model.wan_expert` (required for such a folder,
refused for any other). Only that expert is loaded, in the `transformer` slot (the denoiser), `transformer_2` None: the
other 14 B is never read. Its training times stay on its side of the boundary: the usual draw conditioned on the side
(redrawn until it lands there), musubi-tuner's recommended one-expert setting (`--min_timestep 875` or
`--max_timestep 875` with `--preserve_distribution_shape`; SimpleTuner does not restrict). Samples are refused (the
pipeline needs both experts: the other 14 B only for samples would double the memory); a full finetune's export is
the A14B folder again, the trained expert in its own slot and the other copied from the base folder.

Not supported (refused, not silently done wrong): video clips without data.video_frames, or in a micro
batch with images (a clip's latents are cached whole with data.cache_latents); Wan 2.2 TI2V-5B's per-token timesteps (`expand_timesteps`): refused; image-to-video models (an image encoder).

LoRA files: the diffusers layout (`transformer.<module>.lora_A/B.weight`) that WanPipeline.load_lora_weights reads,
and beside it `lora_comfyui.safetensors` in the original module names (`diffusion_model.blocks.0.self_attn.q...`), the
only ones ComfyUI maps for Wan (comfy/lora.py model_lora_keys_unet has no diffusers rule for WAN21); diffusers reads
that one too (wan_lora.py). No single-file layout.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from ot_dist.errors import ConfigError
from ot_dist.models.families.base import Family
from ot_dist.models.families.qwen_image import QwenImage
from ot_dist.models.objectives import FlowMatching
from ot_dist.train.transfer import to_device

# model.wan_expert -> the A14B folder's subfolder holding it (WanPipeline: `transformer` at t >= the boundary)
EXPERT_FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}
MAX_SEQUENCE_LENGTH = 512  # WanPipeline's max_sequence_length default (Wan's text_len)
# SimpleTuner's DEFAULT_LORA_TARGET for Wan (self- and cross-attention), also diffusers' usual attention default
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# the feed-forward (diffusers' FeedForward: net.0.proj in, net.2 out) as musubi-tuner's / kohya's Wan LoRAs adapt it
WAN_LORA_WITH_FFN = WAN_LORA_TARGETS + ("ffn.net.0.proj", "ffn.net.2")
WAN_TEXT_LORA_TARGETS = ("q", "k", "v", "o", "wi_0", "wi_1", "wo")  # UMT5's attention and gated MLP (T5's names)


class Wan(Family):
    name = "wan"
    description = ("Wan 2.1 / 2.2 single-transformer text-to-video models trained on images as one-frame videos or "
                   "on video clips (data.video_frames) "
                   "(UMT5 with zeroed padding, per-channel latent mean / std, flow matching with the raw t)")
    pipeline_class = "WanPipeline"
    denoiser = "transformer"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {}  # T5-family encoders take no embeddings in ot_dist
    denoiser_lora_presets = {"default": WAN_LORA_TARGETS, "attention_mlp": WAN_LORA_WITH_FFN}
    text_lora_targets = WAN_TEXT_LORA_TARGETS
    # WanTransformer3DModel._no_split_modules = ["WanTransformerBlock"]: `blocks`; UMT5's `encoder.block`
    shard_units = {"transformer": ("blocks",), "text_encoder": ("encoder.block",)}
    pixel_multiple = 16  # the Wan 2.1 VAE x8, then the transformer's 2x2 patches
    native_resolution = 832  # the long side of Wan 2.1's 480p buckets (832 x 480)
    memory_reference = "Wan 2.1 T2V 14B"  # the 14.3 B transformer, UMT5-XXL's encoder (5.7 B), the Wan VAE
    samplers = ("flow_euler",)
    sample_guidance_scale = 5.0  # WanPipeline's default (OneTrainer has no Wan)
    lora_file_prefixes = None  # the diffusers layout
    single_file = False
    video_model = True  # video clips train with data.video_frames (else a clip in a concept is refused)
    temporal_compression = 4  # AutoencoderKLWan's scale_factor_temporal: 4n + 1 frames -> n + 1 latent frames
    # SwarmUI's class ids (T2IModelClassSorter: wan-2_1-text2video-1_3b / -14b); modelspec_architecture_of picks one
    modelspec_architecture = "wan-2_1-text2video-14b"

    def modelspec_architecture_of(self, denoiser_config, prediction_type, inpainting):
        """Wan 2.1 T2V 1.3B (width 1536) or 14B (width 5120), the two sizes SwarmUI tells apart."""
        width = denoiser_config.get("num_attention_heads", 40) * denoiser_config.get("attention_head_dim", 128)
        return "wan-2_1-text2video-14b" if width >= 5120 else "wan-2_1-text2video-1_3b"

    model_options = ("wan_expert",)
    expert: str | None = None  # model.wan_expert: the Wan 2.2 A14B expert this run trains

    def configure(self, model_config) -> "Wan":
        family = super().configure(model_config)
        expert = getattr(model_config, "wan_expert", None)
        if expert == family.expert:
            return family
        family = copy.copy(family)
        family.expert = expert
        family.samples_refused = (
            "a Wan 2.2 A14B run trains one expert and WanPipeline samples with both (the other 14 B loaded only for "
            "samples would double the memory): remove sampling.prompts, and sample the LoRA with both experts in "
            "ComfyUI or diffusers (docs/families.md, Wan)") if expert else None
        return family

    # -- loading --------------------------------------------------------------------------------------
    def load_folder(self, path, index):
        if not has_two_experts(index):
            if self.expert is not None:
                raise ConfigError(f"model.wan_expert: {self.expert} is for a Wan 2.2 A14B folder (two experts, "
                                  "transformer_2 and boundary_ratio); model.path has one transformer: remove it")
            refuse_unsupported_index(index)
            return None
        if self.expert is None:
            raise ConfigError("model.wan_expert: model.path is a Wan 2.2 A14B folder (two experts): set "
                              "model.wan_expert to high_noise (transformer) or low_noise (transformer_2), the expert "
                              "this run trains")
        refuse_unsupported_index({**index, "transformer_2": None, "boundary_ratio": None})
        return None  # from_pretrained with folder_components' expert (or the caller's given one)

    def folder_components(self, path, given=frozenset()):
        """For one A14B expert (load_folder refused any other folder with model.wan_expert): that expert read into
        the `transformer` slot (the denoiser), `transformer_2` None, so the other expert is never loaded; nothing
        read when the caller gives the transformer (a full export's trained one)."""
        if self.expert is None:
            return {}
        if "transformer" in given:
            return {"transformer_2": None}
        return {"transformer": load_expert(Path(path), self.expert), "transformer_2": None}

    def complete_pipeline(self, pipeline, path, model_config):
        if self.expert is None:
            refuse_unsupported_variant(pipeline)
        return pipeline

    def save_extras(self, pipeline, folder):
        """A full export of one A14B expert: the A14B folder again, the trained expert in its slot, the other expert's
        files copied from the base folder, model_index.json listing both and the boundary."""
        if self.expert is None or getattr(pipeline, "transformer_2", None) is not None:
            return
        base, folder = Path(pipeline.config["_name_or_path"]), Path(folder)
        other = next(name for name in EXPERT_FOLDERS.values() if name != EXPERT_FOLDERS[self.expert])
        if other == "transformer":  # the trained one is the low-noise expert: its files belong in transformer_2
            (folder / "transformer").rename(folder / "transformer_2")
        shutil.copytree(base / other, folder / other)
        index = json.loads((folder / "model_index.json").read_text())
        base_index = json.loads((base / "model_index.json").read_text())
        index.update(transformer=base_index["transformer"], transformer_2=base_index["transformer_2"],
                     boundary_ratio=base_index["boundary_ratio"])
        (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    # -- objective ------------------------------------------------------------------------------------
    def objective(self, pipeline, model_config) -> FlowMatching:
        config = pipeline.scheduler.config
        shift = config.get("flow_shift") if config.get("use_flow_sigmas") else None  # UniPC / DPM flow config
        patch = pipeline.transformer.config.patch_size[-1]
        if self.expert is None:
            return FlowMatching.from_scheduler_config(config, patch_size=patch, shift=shift, dynamic=False)
        objective = ExpertFlowMatching.from_scheduler_config(config, patch_size=patch, shift=shift, dynamic=False)
        objective.boundary = pipeline.config["boundary_ratio"] * objective.num_timesteps
        objective.high_noise = self.expert == "high_noise"
        return objective

    def objective_kind(self) -> str:
        return "flow"

    def sampling_overrides(self, objective: FlowMatching) -> dict:
        # flow_euler's FlowMatchEulerDiscreteScheduler reads `shift`: the UniPC config's flow_shift
        return {"shift": objective.shift}

    # -- text -----------------------------------------------------------------------------------------
    def max_tokens(self, tokenizer_name, tokenizer) -> int:
        return min(MAX_SEQUENCE_LENGTH, tokenizer.model_max_length)  # the tiny test tokenizer has 32

    def tokenize(self, tokenizers, captions):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokenizer = tokenizers["tokenizer"]
        encoded = tokenizer([prompt_clean(c) for c in captions], padding="max_length",
                            max_length=self.max_tokens("tokenizer", tokenizer), truncation=True,
                            add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        return {"text_encoder": encoded.input_ids, "text_encoder_mask": encoded.attention_mask}

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        mask = to_device(tokens["text_encoder_mask"], encoder.device)
        hidden = encoder(to_device(tokens["text_encoder"], encoder.device), mask).last_hidden_state
        # zeros past each caption, as the pipeline's re-stacking leaves them (the transformer sees them unmasked)
        return {"hidden": hidden * mask[..., None].to(hidden.dtype)}

    def pipeline_call_options(self, pipeline) -> dict:
        return {"max_sequence_length": self.max_tokens("tokenizer", pipeline.tokenizer)}

    def sampling_arguments(self, pipeline, arguments):
        return {**arguments, **self.pipeline_call_options(pipeline), "num_frames": 1}

    def sampled_image(self, output):
        return output.frames[0][0]  # one video of one frame

    # -- latents --------------------------------------------------------------------------------------
    def latent_shape(self, vae, pixel_height, pixel_width):
        factor = vae.config.scale_factor_spatial
        return torch.Size((vae.config.z_dim, pixel_height // factor, pixel_width // factor))

    def clip_latent_shape(self, vae, frames, pixel_height, pixel_width):
        factor = vae.config.scale_factor_spatial
        return torch.Size((vae.config.z_dim, 1 + (frames - 1) // vae.config.scale_factor_temporal,
                           pixel_height // factor, pixel_width // factor))

    def encode_posterior(self, vae, pixels):
        """Images (B, 3, H, W) in as one-frame clips, their posterior without the frame axis (QwenImage's, whose VAE is
        Wan's); clips (B, 3, F, H, W) as they are, (B, C, F', h, w) out."""
        if pixels.dim() == 4:
            return QwenImage.encode_posterior(self, vae, pixels)
        posterior = vae.encode(pixels).latent_dist
        return posterior.mean, posterior.std

    # -- the denoiser call ----------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        # float32 timesteps, as the pipeline passes the scheduler's (bfloat16 would round t near 1000)
        # images (B, C, h, w) as one-frame clips; clips' latents (B, C, F', h, w) as they are
        image = noisy.dim() == 4
        out = denoiser(hidden_states=noisy.unsqueeze(2) if image else noisy, timestep=timesteps.float(),
                       encoder_hidden_states=conditioning["hidden"], return_dict=False)[0]
        return out[:, :, 0] if image else out

    # -- LoRA files -----------------------------------------------------------------------------------
    def extra_lora_files(self, model, states, adapter_configs, target, dtype, modelspec):
        """`lora_comfyui.safetensors`: the transformer's LoRA in the original names ComfyUI maps for Wan (wan_lora.py),
        which WanPipeline.load_lora_weights reads too; nothing for an adapter other than plain LoRA or a run without a
        transformer LoRA."""
        from ot_dist.methods.lora_layouts import write_companion_lora
        from ot_dist.models.families.wan_lora import comfyui_lora_state

        if "transformer" not in states:
            return []
        tensors = comfyui_lora_state(states["transformer"], adapter_configs["transformer"])
        return write_companion_lora(target, tensors, dtype, modelspec, family=self.name,
                                    scale="inside the up matrices, no alpha tensors")

    # -- demo and tests -------------------------------------------------------------------------------
    def build_tiny(self, seed: int = 0, a14b: bool = False, **_):
        """`a14b`: Wan 2.2 A14B's layout, two experts (transformer_2 a second random transformer) and boundary_ratio
        0.875 (T2V's)."""
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        from ot_dist.models.tiny import TEXT_HIDDEN, tiny_t5_tokenizer

        torch.manual_seed(seed)
        tokenizer = tiny_t5_tokenizer()
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=TEXT_HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, relative_attention_max_distance=16,
            is_encoder_decoder=False, use_cache=False)).eval()
        # Wan 2.1's VAE layout (diffusers' own test sizes): 16 latent channels, x8 spatial, 4x temporal
        vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        def tiny_transformer():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=TEXT_HIDDEN, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)

        transformer = tiny_transformer()
        experts = {"transformer_2": tiny_transformer(), "boundary_ratio": 0.875} if a14b else {}
        # what Wan-AI/Wan2.1-T2V-1.3B-Diffusers ships (480p: flow_shift 3.0)
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            num_train_timesteps=1000, flow_shift=3.0)
        return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                           scheduler=scheduler, **experts)


class ExpertFlowMatching(FlowMatching):
    """Wan 2.2 A14B's flow matching for one expert: the family's draw conditioned on the expert's side of the boundary
    (WanPipeline: the high-noise `transformer` at t >= boundary, the low-noise one below), so the distribution keeps
    its shape within the side (musubi-tuner's --preserve_distribution_shape)."""

    boundary: float = 875.0  # boundary_ratio * num_timesteps, in the timestep unit the transformer sees
    high_noise: bool = True
    max_draws = 10_000

    def on_side(self, t: torch.Tensor) -> bool:
        return bool((t >= self.boundary).all()) if self.high_noise else bool((t < self.boundary).all())

    def draw(self, g, options, latent_shape):
        for _ in range(self.max_draws):
            t = super().draw(g, options, latent_shape)
            if self.on_side(t):
                return t
        side = "at or above" if self.high_noise else "below"
        raise ConfigError(f"model.wan_expert: {self.max_draws} timestep draws never landed {side} the experts' "
                          f"boundary ({self.boundary:g}); loss.min_timestep / max_timestep / timestep_shift leave "
                          "this expert's side (almost) empty")

    def describe(self) -> str:
        side = f"t >= {self.boundary:g}" if self.high_noise else f"t < {self.boundary:g}"
        return f"{super().describe()}, the {'high' if self.high_noise else 'low'}-noise expert's side ({side})"


def has_two_experts(index: dict) -> bool:
    """A Wan 2.2 A14B folder (model_index.json, or a pipeline config): transformer_2 listed or boundary_ratio set."""
    second = index.get("transformer_2")
    return (second is not None and list(second)[:1] != [None]) or index.get("boundary_ratio") is not None


def load_expert(path: Path, expert: str):
    """The A14B folder's `expert` transformer alone (its own subfolder)."""
    from diffusers import WanTransformer3DModel

    from ot_dist.models.load_dtype import component_from_pretrained

    return component_from_pretrained(WanTransformer3DModel, path / EXPERT_FOLDERS[expert], use_safetensors=True,
                                     local_files_only=True)


def refuse_unsupported_index(index: dict) -> None:
    """Wan folders this family would train wrongly, told by their model_index.json (or a loaded pipeline's config):
    two experts (Wan 2.2 A14B: transformer_2 and boundary_ratio), per-token timesteps (TI2V-5B: expand_timesteps)."""
    if has_two_experts(index):
        raise ConfigError("model.path: a Wan 2.2 A14B folder (two experts, transformer_2 and boundary_ratio) trains "
                          "one expert per run: set model.wan_expert (high_noise or low_noise)")
    if index.get("expand_timesteps"):
        raise ConfigError("model.path: Wan 2.2 TI2V-5B (expand_timesteps: per-token timesteps) is not supported yet")


def refuse_unsupported_variant(pipeline) -> None:
    """refuse_unsupported_index on a loaded pipeline, and an image-to-video transformer (extra input channels, an
    image embedding)."""
    refuse_unsupported_index({**pipeline.config, "transformer_2": [getattr(pipeline, "transformer_2", None)]})
    transformer = pipeline.transformer
    if transformer.config.in_channels != transformer.config.out_channels or transformer.config.image_dim:
        raise ConfigError("model.path: a Wan image-to-video transformer (image conditioning) is not supported: "
                          "ot_dist trains the text-to-video models")


FAMILIES = {"wan": Wan()}
