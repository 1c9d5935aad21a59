"""Stable Diffusion 1.x and 2.x: a UNet over 4-channel latents (x8 VAE), one CLIP text encoder's last
hidden state as cross-attention context, epsilon (1.x) or v-prediction (2.x) on a DDPM schedule. Their
9-channel inpainting UNets train too (noisy latent + mask + masked-image latent)."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from ot_dist.config.sampling import DDPM_SAMPLERS
from ot_dist.models.families.base import EMBEDDING_TOKEN_KEY, Family
from ot_dist.models.objectives import DDPM
from ot_dist.train.transfer import to_device

UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")
# One FSDP unit per resnet, per transformer block of the attentions, per down/upsampler: on SDXL the largest is
# ~2 % of the UNet (a whole up_blocks[0] was 47 %); the attentions' proj_in / proj_out, the embeddings and
# conv_in / conv_out stay with the root (~1.3 %).
UNET_SHARD_UNITS = ("resnets", "transformer_blocks", "downsamplers", "upsamplers")
CLIP_SHARD_UNITS = ("encoder.layers",)  # CLIPTextModel (transformers 5: no text_model level) and WithProjection
ZERO_TERMINAL_SNR_GUIDANCE_RESCALE = 0.7  # OneTrainer's cfg_rescale with the option on, the paper's choice
STABILITY_GENERATIVE_MODELS = "https://github.com/Stability-AI/generative-models"


class UNetFamily(Family):
    """What SD 1.x, 2.x and SDXL share: the UNet, the DDPM objective, the original single-file layout."""

    denoiser = "unet"
    convolutional_denoiser = True
    inpainting_in_channels = 9
    inpainting_input = "noisy latent 4 + mask 1 + masked-image latent 4"
    denoiser_lora_presets = {"default": UNET_LORA_TARGETS, "attention": ("to_q", "to_k", "to_v", "to_out.0")}
    shard_units = {"unet": UNET_SHARD_UNITS, "text_encoder": CLIP_SHARD_UNITS, "text_encoder_2": CLIP_SHARD_UNITS}
    pixel_multiple = 8
    sample_guidance_scale = 7.5  # OneTrainer's for SD 1.x, 2.x and SDXL (StableDiffusionPipeline's too)
    lora_file_prefixes = {"unet": "lora_unet", "text_encoder": "lora_te"}
    lora_file_roots = {"text_encoder": "text_model", "text_encoder_2": "text_model"}
    # kohya sd-scripts' SDXL LoRAs (and some SD 1.x / 2.x ones) name UNet modules by their original LDM / SGM paths
    # (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`), ComfyUI's own by `diffusion_model.` + the path;
    # ComfyUI, A1111 / Forge and diffusers read them, and so do `ot-dist lora merge` and `lora.init_from`
    # (ot_dist/lora_tools/foreign.py, through `denoiser_original_rules`).
    lora_original_prefixes = (("lora_unet", "_"), ("diffusion_model", "."))
    # kohya sd-scripts' IMPL_STABILITY_AI: what it writes for SD checkpoints, embeddings and SDXL LoRAs (ComfyUI
    # writes "sgm", the same codebase's short name)
    modelspec_implementation = STABILITY_GENERATIVE_MODELS
    # The architecture id's suffix per prediction type (SD 2.x: the spec's `v2-512` / `v2-768-v`, as kohya picks them
    # by --v_parameterization); a 9-channel inpainting UNet is the spec's `<base>-inpainting` instead.
    modelspec_prediction_suffixes: dict[str, str] = {}

    def modelspec_architecture_of(self, denoiser_config, prediction_type, inpainting):
        if inpainting:
            return f"{self.modelspec_architecture}-inpainting"
        return self.modelspec_architecture + self.modelspec_prediction_suffixes.get(prediction_type, "")

    def denoiser_original_rules(self, config) -> list:
        """original (LDM) weight <- diffusers weight for every UNet weight, as the single-file export names them."""
        from diffusers import UNet2DConditionModel

        from ot_dist.models.families.sd_single_file import _unet_key_mapper
        from ot_dist.models.families.single_file_keys import Rule

        try:
            to_original = _unet_key_mapper(config)
        except ValueError:  # per-level layers_per_block: no original layout
            return []
        with torch.device("meta"):  # the weight names of a UNet of this config, nothing allocated
            names = UNet2DConditionModel.from_config(config).state_dict().keys()
        return [Rule(to_original(name), (name,)) for name in names if name.endswith(".weight")]

    def objective(self, pipeline, model_config) -> DDPM:
        return DDPM(pipeline.scheduler.config, model_config.training_prediction_type())

    def objective_kind(self) -> str:
        return "ddpm"

    zero_terminal_snr_refusal = None

    def complete_pipeline(self, pipeline, path: Path, model_config):
        return self.with_training_schedule(pipeline, model_config)

    def with_training_schedule(self, pipeline, model_config):
        """The pipeline with its scheduler saying what training does: what the UNet predicts (model.prediction_type)
        and on which schedule (model.zero_terminal_snr). The objective, the samples and the exports (the diffusers
        folder's scheduler config, the single file's v_pred / ztsnr markers) all take it from there."""
        from ot_dist.models.families.sd_single_file import with_prediction_type, with_zero_terminal_snr

        pipeline = with_prediction_type(pipeline, model_config.training_prediction_type())
        return with_zero_terminal_snr(pipeline) if model_config.zero_terminal_snr else pipeline

    samplers = DDPM_SAMPLERS
    sample_guidance_rescale = True  # StableDiffusionPipeline and the SDXL pipelines take guidance_rescale

    def sampling_overrides(self, objective: DDPM) -> dict:
        return {"prediction_type": objective.prediction_type}

    def sampling_arguments(self, pipeline, arguments: dict) -> dict:
        arguments = super().sampling_arguments(pipeline, arguments)
        # On a zero-terminal-SNR schedule the paper (section 3.4) and OneTrainer's samples rescale the guided
        # prediction by 0.7 (diffusers' guidance_rescale; SD's inpainting pipeline has none), against over-exposure.
        if pipeline.scheduler.config.get("rescale_betas_zero_snr") and "guidance_rescale" in inspect.signature(
                pipeline.__call__).parameters:
            arguments.setdefault("guidance_rescale", ZERO_TERMINAL_SNR_GUIDANCE_RESCALE)
        if type(pipeline).__name__ == self.inpaint_pipeline_class:
            from ot_dist.models.inpainting import whole_image_repaint

            arguments = whole_image_repaint(arguments)
        return arguments

    def predict(self, denoiser, noisy, timesteps, conditioning, batch):
        return denoiser(noisy, timesteps, **self.unet_inputs(conditioning, batch), return_dict=False)[0]

    def unet_inputs(self, conditioning: dict, batch: dict) -> dict:
        return {"encoder_hidden_states": conditioning["hidden"]}

    def load_single_file(self, path: Path, config_folder, model_config):
        from ot_dist.models.families.sd_single_file import load_single_file
        from ot_dist.models.load_dtype import as_float32_load, load_dtype_of

        dtype = load_dtype_of([Path(path)])  # the file's own width where it holds every value (models/load_dtype.py)
        pipeline = load_single_file(path, self.name, config_folder, torch_dtype=dtype)
        for module in pipeline.components.values():
            if isinstance(module, torch.nn.Module):
                as_float32_load(module, dtype, config_follows_load=False)
        return self.with_training_schedule(pipeline, model_config)

    def export_single_file(self, components, states, path, dtype, with_text_encoders=False, metadata=None):
        """The checkpoint layout, which always holds the text encoders (trained or not)."""
        from ot_dist.models.families.sd_single_file import export_single_file

        export_single_file(components, self.name, path, dtype=dtype, states=states, metadata=metadata)


def skipped_layer(hidden_states: tuple, default: int, skip: int, encoder: str) -> torch.Tensor:
    """hidden_states[default - skip], or an error naming the config key when the encoder has too few layers."""
    layers = len(hidden_states) - 1  # hidden_states[0] is the embeddings
    if skip > layers + 1 + default:
        from ot_dist.errors import ConfigError

        raise ConfigError(f"model.{encoder}_layer_skip: {skip} skips past the first layer of {encoder} "
                          f"({layers} layers)")
    return hidden_states[default - skip]


class SD(UNetFamily):
    bucket_step = 8  # OneTrainer's StableDiffusionBaseDataLoader quantizes buckets to 8 px
    pipeline_class = "StableDiffusionPipeline"
    inpaint_pipeline_class = "StableDiffusionInpaintPipeline"
    text_encoders = ("text_encoder",)
    tokenizers = ("tokenizer",)
    embedding_keys = {"text_encoder": EMBEDDING_TOKEN_KEY}

    memory_reference = "SD 1.5"  # SD 2.x: a UNet of the same size (865 M), a larger text encoder (354 M)

    def __init__(self, name: str, description: str, hidden_act: str, prediction_type: str, native_resolution: int,
                 lora_base_model_version: str, modelspec_architecture: str,
                 modelspec_prediction_suffixes: dict[str, str] | None = None, depth_models: bool = False):
        self.name, self.description, self.native_resolution = name, description, native_resolution
        # SD 2.0 depth (stabilityai/stable-diffusion-2-depth, OneTrainer's STABLE_DIFFUSION_20_DEPTH): a 5-channel UNet
        # whose last input channel is the image's depth map (ot_dist/models/depth.py)
        self.depth_pipeline_class = "StableDiffusionDepth2ImgPipeline" if depth_models else None
        self.lora_base_model_version = lora_base_model_version
        self.modelspec_architecture = modelspec_architecture
        self.modelspec_prediction_suffixes = modelspec_prediction_suffixes or {}
        self.tiny_hidden_act, self.tiny_prediction_type = hidden_act, prediction_type

    layer_skip_encoders = ("text_encoder",)
    output_embedding_keys = {"text_encoder": "emp_params"}  # OneTrainer's StableDiffusionEmbeddingSaver

    def text_states(self, encoder, output):
        return output.last_hidden_state  # (no layer skip: output_embedding_conflict)

    def output_embedding_conflict(self, model_config):
        if model_config.text_encoder_layer_skip:
            # the skipped layer goes through the final layer norm after the encoder returns it (encode_text), so
            # vectors put into it would be normalised; OneTrainer puts them after the norm
            return ("model.text_encoder_layer_skip", "an output embedding's vectors replace the encoder's output "
                    "after its final layer norm, which a layer skip applies afterwards; set it to 0")
        return None

    def encode_text(self, text_encoders, tokens):
        encoder = text_encoders["text_encoder"]
        skip = self.layer_skip.get("text_encoder", 0)
        if not skip:
            return {"hidden": encoder(to_device(tokens["text_encoder"], encoder.device))[0]}
        # OneTrainer's encode_clip (default_layer -1, add_layer_norm) and diffusers' clip_skip: an earlier layer's
        # hidden states through the final layer norm.
        hidden = encoder(to_device(tokens["text_encoder"], encoder.device), output_hidden_states=True).hidden_states
        norm = getattr(encoder, "text_model", encoder).final_layer_norm  # transformers 5 dropped .text_model
        return {"hidden": norm(skipped_layer(hidden, -1, skip, "text_encoder"))}

    def pipeline_call_options(self, pipeline):
        skip = self.layer_skip.get("text_encoder", 0)
        if not skip:
            return {}
        encoder = pipeline.text_encoder
        if not hasattr(encoder, "text_model"):
            # diffusers 0.42's clip_skip reads text_encoder.text_model.final_layer_norm, which transformers 5's
            # CLIPTextModel no longer has (its layer norm is its own): point the name at the model itself, outside
            # the module tree (no submodule registered, state dict unchanged).
            object.__setattr__(encoder, "text_model", encoder)
        return {"clip_skip": skip}

    def load_folder(self, path, index):
        """SD 2.0 depth's published folder names its processor DPTFeatureExtractor, an alias of DPTImageProcessor that
        transformers 5 no longer has (diffusers 0.42 remaps CLIPFeatureExtractor only): read component by component."""
        if index.get("_class_name") != self.depth_pipeline_class or \
                (index.get("feature_extractor") or [None, None])[1] != "DPTFeatureExtractor":
            return None
        from ot_dist.models.depth import load_renamed_processor_folder

        return load_renamed_processor_folder(path, index, self.depth_pipeline_class)

    def is_depth_conditioned(self, denoiser) -> bool:
        from ot_dist.models.depth import DEPTH_IN_CHANNELS

        return self.depth_pipeline_class is not None and denoiser.config.in_channels == DEPTH_IN_CHANNELS

    def depth_condition(self, pipeline, pixels, latent_size):
        """StableDiffusionDepth2ImgPipeline.prepare_depth_map of the batch's images: one channel in [-1, 1]."""
        from ot_dist.models.depth import depth_map

        return depth_map(pipeline.depth_estimator, pipeline.feature_extractor, pixels, latent_size)

    def sampling_modules(self, pipeline):
        estimator = getattr(pipeline, "depth_estimator", None)  # a depth model's: training runs it every step
        return [] if estimator is None else [estimator]

    def samples_refusal(self, loaded_pipeline):
        if type(loaded_pipeline).__name__ == self.depth_pipeline_class:
            return ("a depth-conditioned model (SD 2.0 depth) samples from an image's depth map "
                    "(StableDiffusionDepth2ImgPipeline is image-to-image), which sample prompts do not give yet; "
                    "remove sampling.prompts")
        return super().samples_refusal(loaded_pipeline)

    def modelspec_architecture_of(self, denoiser_config, prediction_type, inpainting):
        from ot_dist.models.depth import DEPTH_IN_CHANNELS

        if self.depth_pipeline_class and denoiser_config.get("in_channels") == DEPTH_IN_CHANNELS:
            return f"{self.modelspec_architecture}-depth"  # the spec's stable-diffusion-v2-depth
        return super().modelspec_architecture_of(denoiser_config, prediction_type, inpainting)

    def build_tiny(self, seed: int = 0, prediction_type: str | None = None, in_channels: int = 4,
                   depth: bool = False, **_):
        """`depth`: SD 2.0 depth's pipeline (a 5-channel UNet, epsilon as the published model, a tiny random DPT)."""
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel

        from ot_dist.models.tiny import TEXT_HIDDEN, clip_text_config, tiny_clip_tokenizer, tiny_ddim, tiny_vae

        torch.manual_seed(seed)
        tokenizer = tiny_clip_tokenizer()
        sd2 = self.tiny_hidden_act == "gelu"
        if depth:
            from ot_dist.models.depth import DEPTH_IN_CHANNELS

            in_channels, prediction_type = DEPTH_IN_CHANNELS, prediction_type or "epsilon"
        unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=in_channels,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            block_out_channels=(32, 32, 64, 64),
            layers_per_block=1,
            norm_num_groups=8,
            cross_attention_dim=TEXT_HIDDEN,
            # SD 1.x gives a head count here; SD 2.x a per-level head dim with linear projections.
            attention_head_dim=(2, 2, 4, 4) if sd2 else 4,
            use_linear_projection=sd2,
        )
        components = dict(vae=tiny_vae(0.18215),
                          text_encoder=CLIPTextModel(clip_text_config(len(tokenizer), self.tiny_hidden_act)),
                          tokenizer=tokenizer, unet=unet,
                          scheduler=tiny_ddim(prediction_type or self.tiny_prediction_type))
        if depth:
            from diffusers import StableDiffusionDepth2ImgPipeline

            from ot_dist.models.depth import tiny_depth_estimator

            estimator, processor = tiny_depth_estimator(seed)
            return StableDiffusionDepth2ImgPipeline(**components, depth_estimator=estimator,
                                                    feature_extractor=processor)
        return StableDiffusionPipeline(**components, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)


FAMILIES = {
    "sd1": SD("sd1", "Stable Diffusion 1.x (epsilon)", hidden_act="quick_gelu", prediction_type="epsilon",
              native_resolution=512, lora_base_model_version="sd_v1", modelspec_architecture="stable-diffusion-v1"),
    "sd2": SD("sd2", "Stable Diffusion 2.x (epsilon or v-prediction)", hidden_act="gelu",
              prediction_type="v_prediction", native_resolution=768, lora_base_model_version="sd_v2",
              modelspec_architecture="stable-diffusion-v2",
              modelspec_prediction_suffixes={"epsilon": "-512", "v_prediction": "-768-v"}, depth_models=True),
}
