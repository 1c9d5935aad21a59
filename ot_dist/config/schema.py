"""The typed training config. Every field carries its help text; the reference in
configs/REFERENCE.md is generated from this file (`ot-dist config reference`).

Names follow OneTrainer's where one exists, so its users feel at home.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from ot_dist.config.checkpoint import CheckpointConfig
from ot_dist.config.embeddings import (AUTO_VECTORS, OUTPUT_EMBEDDING_DESCRIPTION, AdditionalEmbeddingConfig,
                                       VectorCount, check_additional_embeddings, check_output_embedding,
                                       check_token_case, lower_case_for_several_vectors, safetensors_only)
from ot_dist.config.performance import CHANNELS_LAST_STRATEGIES, PerformanceConfig
from ot_dist.config.loss import LossConfig, MaskedTrainingConfig
from ot_dist.config.metadata import MetadataConfig
from ot_dist.config.optim import OptimizerConfig, SchedulerConfig, check_optimizer_setup
from ot_dist.config.sampling import SamplingConfig
from ot_dist.config.section import Section
from ot_dist.extras import missing_extra
from ot_dist.models.families.registry import FAMILY_NAMES, get_family
from ot_dist.optim.registry import FUSED_BACK_PASS, SPECS

Dtype = Literal["float32", "bfloat16", "float16"]
# How frozen weights are stored: a dtype, or a quantized format upcast to train_dtype where used (memory/float8.py).
StorageDtype = Literal["float32", "bfloat16", "float16", "float8", "nf4", "int8"]
# single and ddp only: sharding would split the stored weights from their scales
QUANTIZED_STORAGE = ("float8", "nf4", "int8")
# A path as a shell reads it: YAML keeps `~` literal and Python's file calls do not expand it, so without this the
# early checks (which expand it) passed and the run then read and wrote a folder named `~` in the working folder.
UserPath = Annotated[str, AfterValidator(os.path.expanduser)]
# The config sections of the parts a family may train (which ones a family has: its `denoiser` and `text_encoders`).
PART_FIELDS = ("unet", "transformer", "prior", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4",
               "text_conditioner")


class ModelConfig(Section):
    family: Literal[FAMILY_NAMES] = Field(  # type: ignore[valid-type]
        description="Model family: sd1 (Stable Diffusion 1.x), sd2 (2.x, epsilon or v-prediction), sdxl, sd3 (SD3 / "
        "3.5), flux (Flux.1 dev / schnell), chroma, pixart_alpha, pixart_sigma (PixArt-α / Σ), stable_cascade (its stage C "
        "prior), wuerstchen_v2 (its prior), qwen_image (Qwen-Image), sana, z_image (Z-Image / Z-Image-Turbo), hidream "
        "(HiDream-I1), flux_kontext (Flux.1 Kontext dev, an edit model: concepts need reference_path), lumina2 "
        "(Lumina 2), flux2 (FLUX.2 [dev]), flux2_klein (FLUX.2 [klein] 4B / 9B; both edit models when the concepts "
        "give reference_path, text-to-image without), wan (Wan 2.1 text-to-video, trained on images as one-frame "
        "videos or on video clips), qwen_image_edit (Qwen-Image-Edit, an edit model), qwen_image_edit_plus (Qwen-Image-Edit-2509 / 2511, "
        "one reference per sample), ernie_image (ERNIE-Image / ERNIE-Image-Turbo), anima (Anima: "
        "Cosmos-Predict2's DiT, Qwen3 through its LLM adapter, the text_conditioner part), ideogram4 (Ideogram 4), krea2 (Krea 2), hunyuan_video (HunyuanVideo text-to-video, trained on images as one-frame videos); each is one "
        "module under ot_dist/models/families/ (docs/families.md)."
    )
    path: UserPath = Field(
        description="The base model: a diffusers-format folder, or a single-file .safetensors checkpoint in the "
        "family's original layout (A1111 / ComfyUI for SD 1.x / 2.x / SDXL; Stability's for SD3, Black Forest Labs' for "
        "Flux and FLUX.2, lodestones' for Chroma, krea-ai's raw.safetensors for Krea 2: the transformer (and SD3's VAE), the rest comes from model.config or "
        "model.component_files)."
    )
    config: UserPath | None = Field(
        default=None,
        description="For a single-file checkpoint: a diffusers-format folder (or hub id when online) whose "
        "component configs describe the architecture. Needed offline.",
    )
    component_files: dict[str, UserPath] = Field(
        default_factory=dict,
        description="Components read from their own files instead of the model.config folder (or model.path's): "
        "component name -> .safetensors file in ComfyUI's layout, as ComfyUI / Forge / SwarmUI users hold them. flux: "
        "text_encoder (clip_l), text_encoder_2 (t5xxl_fp16, t5xxl_fp8_e4m3fn and its _scaled file), vae (ae); chroma: "
        "text_encoder (t5xxl), vae (ae); sd3: text_encoder (clip_l), text_encoder_2 (clip_g), text_encoder_3 (t5xxl), "
        "vae (an LDM-layout VAE file); qwen_image: text_encoder (qwen_2.5_vl_7b, its fp8_scaled file too), vae "
        "(qwen_image_vae); z_image: text_encoder (qwen_3_4b), vae (Flux's ae); flux_kontext: Flux's; lumina2: text_encoder "
        "(gemma_2_2b), vae (ae); hidream: text_encoder (clip_l), text_encoder_2 (clip_g), text_encoder_3 (t5xxl), "
        "text_encoder_4 (llama_3.1_8b_instruct), vae (ae); flux2_klein: text_encoder (qwen_3_4b / qwen_3_8b). The folder then needs only the configs and tokenizers (`hf "
        "download REPO --include '*.json' '*.txt' '*.model' 'tokenizer*'`). Each file is checked against the "
        "component the folder's config describes before anything is loaded; float8 weights (ComfyUI's scaled ones "
        "with their scales) are upcast to float32 as every weight is (docs/families.md).",
    )
    decoder: str | None = Field(
        default=None,
        description="Stable Cascade / Würstchen v2: the diffusers folder of the frozen decoder stages that turn the "
        "prior's image embeddings into images (stabilityai/stable-cascade: StableCascadeDecoderPipeline, stage B "
        "`decoder/` + Paella `vqgan/`; warp-ai/wuerstchen: WuerstchenDecoderPipeline). Needed for sampling.prompts; "
        "loaded component by component, stored like the VAE. Other families have no decoder stages.",
    )
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        default="auto",
        description="What a DDPM denoiser (UNet families) predicts. auto = what the model's scheduler config says. "
        "Flow-matching families always predict noise - latents.",
    )
    zero_terminal_snr: bool = Field(
        default=False,
        description="Train on the noise schedule rescaled to zero terminal SNR (Lin et al. 2023, 'Common Diffusion "
        "Noise Schedules and Sample Steps are Flawed'; diffusers' rescale_betas_zero_snr, OneTrainer's "
        "rescale_noise_scheduler_to_zero_terminal_snr): sqrt(alphas_cumprod) shifted so that the last timestep is "
        "pure noise and scaled so that the first keeps its value, which lets the model learn very dark and bright "
        "images. As OneTrainer and the paper, it trains v-prediction (prediction_type auto becomes v_prediction; "
        "epsilon is refused: at SNR 0 the input is the noise itself). The exports carry it (the diffusers folder's "
        "scheduler config, with timestep_spacing trailing; the single file's `ztsnr` and `v_pred` markers) and the "
        "samples use it (from the last timestep, guidance rescaled by 0.7 as OneTrainer). false = the schedule the "
        "model's scheduler config describes. UNet families (SD 1.x / 2.x / SDXL).",
    )
    guidance_scale: float | None = Field(
        default=None, ge=0,
        description="Flux.1 dev, FLUX.2 [dev], HunyuanVideo: the distilled guidance value its transformer is shown "
        "while training; null = 1.0, as OneTrainer trains them (SimpleTuner Flux.1; diffusers' scripts 3.5). Models "
        "without a guidance embedding (schnell, Chroma, FLUX.2 [klein], UNets) ignore it.",
    )
    t5_max_tokens: int | None = Field(
        default=None, ge=1,
        description="SD3 / Flux / Chroma: the T5 caption length, padded and truncated to it (the transformer sees every "
        "padding token of Flux and SD3); null = the family's pipeline default (Flux / Chroma 512, SD3 256). The peers "
        "differ: OneTrainer's Flux and the diffusers SD3 scripts use 77, kohya's schnell 256. Families without T5 "
        "ignore it.",
    )
    text_encoder_layer_skip: int = Field(
        default=0, ge=0,
        description="Clip skip (OneTrainer's text_encoder_layer_skip): take the first text encoder's hidden states "
        "this many layers earlier (SD 1.x / 2.x: through the final layer norm, as diffusers' clip_skip; SDXL: before "
        "its penultimate layer; Sana: Gemma's, through its final norm). 0 = the family's usual layer. Applies to "
        "training, the text cache and samples.",
    )
    text_encoder_2_layer_skip: int = Field(
        default=0, ge=0, description="Clip skip of SDXL's second text encoder (OneTrainer's text_encoder_2_layer_skip)."
    )
    wan_expert: Literal["high_noise", "low_noise"] | None = Field(
        default=None,
        description="wan, a Wan 2.2 A14B folder (two experts): the one this run trains, required there and refused for "
        "any other model. high_noise = `transformer` (WanPipeline uses it at t >= boundary_ratio * 1000, 875 for T2V), "
        "low_noise = `transformer_2` (below). Only that expert is loaded; the training times are the usual draw kept "
        "on its side of the boundary (redrawn until there, as musubi-tuner's --min/--max_timestep 875 with "
        "--preserve_distribution_shape). Samples are refused (the pipeline needs both experts). The low-noise LoRA "
        "loads in diffusers with load_lora_weights(..., load_into_transformer_2=True); in ComfyUI on the low-noise "
        "model's file (docs/families.md, Wan).",
    )
    inpainting: bool | None = Field(
        default=None,
        description="Inpainting finetune (a 9-channel UNet: noisy latent + mask + masked-image latent; Flux.1 Fill: a "
        "384-channel transformer, the same in FluxFillPipeline's layout). null = detected from the denoiser config "
        "(in_channels 9 / 384); true / false = require that kind of model. The mask is the "
        "image's `-masklabel.png` (white = repaint) or, without one, a random rectangle, brush strokes or the whole "
        "image, drawn per sample and epoch. Needs the images (not data.cache_latents).",
    )

    @model_validator(mode="after")
    def _zero_terminal_snr_predicts_v(self) -> "ModelConfig":
        if self.zero_terminal_snr and self.prediction_type == "epsilon":
            raise ValueError("model.prediction_type: epsilon cannot be trained with model.zero_terminal_snr: at the "
                             "last timestep (SNR 0) the noisy input is the noise itself, so an epsilon prediction says "
                             "nothing of the image; use v_prediction (or auto, which zero_terminal_snr makes "
                             "v_prediction, as OneTrainer does)")
        return self

    def training_prediction_type(self) -> str | None:
        """What the denoiser is trained to predict where the config decides it (None: the scheduler config's):
        prediction_type, or v_prediction on a schedule rescaled to zero terminal SNR."""
        if self.prediction_type != "auto":
            return self.prediction_type
        return "v_prediction" if self.zero_terminal_snr else None


class PartConfig(Section):
    """One trainable part of the model (the denoiser, `unet` or `transformer`, or a text encoder)."""

    train: bool | None = Field(
        default=None,
        description="Train this part. Default: the denoiser trains (full, lora), text encoders do not; "
        "with method embedding nothing but the embedding trains.",
    )
    learning_rate: float | None = Field(
        default=None, gt=0, description="Learning rate of this part; unset = the top-level learning_rate."
    )
    stop_training_after: int | None = Field(
        default=None, ge=0, description="Stop training this part after this many epochs or steps (unit below)."
    )
    stop_training_after_unit: Literal["epoch", "step"] = Field(
        default="epoch", description="Unit of stop_training_after."
    )
    weight_dtype: StorageDtype | None = Field(
        default=None,
        description="Storage of this part's frozen weights (a frozen text encoder, a LoRA's base), as OneTrainer's "
        "per-part weight dtype; unset = the top-level weight_dtype. Trained weights follow trained_weight_dtype.",
    )
    offload_fraction: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="The denoiser only (OneTrainer's layer offloading): this fraction of the bytes of its blocks' "
        "frozen weights (a LoRA's base) stays in CPU memory, and each of those blocks is copied to the device for its "
        "forward and again for its recomputation in backward (the blocks at the end; the others stay on the device). "
        "In a full finetune the blocks' trained weights stream too (this fraction of all their bytes), each updated "
        "on the device inside backward: needs optimizer.fused_back_pass (strategies single and ddp), and the optimizer "
        "state stays on the device. Needs gradient_checkpointing; strategies single and ddp (fsdp: fsdp.cpu_offload). "
        "Frozen text encoders and the VAE: offload_frozen_components.",
    )

    def stopped(self, epoch: int, step: int) -> bool:
        """Whether this part no longer trains in `epoch` (0-based) once `step` optimizer steps are done: the
        trainer's rule, shared with `ot-dist schedule` and the logged learning rates (0 once stopped)."""
        if self.stop_training_after is None:
            return False
        return (epoch if self.stop_training_after_unit == "epoch" else step) >= self.stop_training_after


class LoraConfig(Section):
    rank: int = Field(default=16, ge=1, description="LoRA rank.")
    alpha: float = Field(default=1.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA dropout while training: lora drops the rank "
                           "features (the down projection's output), as OneTrainer's dropout_probability and kohya's "
                           "network_dropout; dora drops the adapted layer's input (peft's, OneTrainer's DoRA).")
    rank_dropout: float = Field(default=0.0, ge=0, lt=1, description="kohya's rank_dropout (variant lora): while "
                                "training, each sample keeps each rank feature with probability 1 - p and the kept "
                                "ones are scaled by 1 / (1 - p); one mask per sample, over all its tokens / pixels.")
    module_dropout: float = Field(default=0.0, ge=0, lt=1, description="kohya's module_dropout (variant lora): while "
                                  "training, each adapted layer leaves its adapter out of a forward with probability "
                                  "p (drawn per layer and forward).")
    variant: Literal["lora", "dora", "loha", "lokr", "oft"] = Field(
        default="lora",
        description="The adapter, trained through peft: lora (up @ down); dora (LoRA with a trained magnitude per "
        "output row, peft's use_dora, as OneTrainer's lora_decompose with lora_decompose_output_axis; written with "
        "a dora_scale per module); loha (Hadamard product of two low-rank products, peft's LoHa, OneTrainer's "
        "peft_type LOHA: hada_w1_a / hada_w1_b / hada_w2_a / hada_w2_b); lokr (Kronecker product, peft's LoKr: "
        "lokr_w1 / lokr_w2 or their _a / _b factors). rank and alpha mean the same for each (scale alpha / rank); "
        "oft (orthogonal finetuning, OneTrainer's OFT_2 as ComfyUI and LyCORIS' diag-oft read it: blocks of each "
        "layer's output rows rotated, oft_blocks per module; lora.oft_block_size and lora.oft_constraint, not rank "
        "or alpha; ot_dist's own module; written in the kohya layout, and for flux, flux_kontext, chroma, sd3 and pixart "
        "in the diffusers layout's names ComfyUI maps, other families refused). "
        "Every strategy trains each. See docs/lora.md for which loader applies which variant exactly (A1111 does "
        "not apply dora as trained).",
    )
    oft_block_size: int = Field(default=32, ge=1, description="variant oft: the size of each rotated block of a "
                                "layer's output rows (OneTrainer's oft_block_size); a layer whose output size it does "
                                "not divide gets the nearest divisor, as in OneTrainer.")
    oft_constraint: float = Field(default=0.0, ge=0, description="variant oft: COFT's constraint, the largest norm "
                                  "of each layer's skew-symmetric generator (over all its blocks); 0 = none. Written as "
                                  "the modules' .alpha, which ComfyUI applies as that norm.")
    preset: str = Field(
        default="default",
        description="The denoiser modules to adapt: default (the family's diffusers training script's list), "
        "attention (attention projections only), all_linear (every Linear layer), all_layers (every Linear and "
        "Conv2d layer but grouped convolutions: OneTrainer's full layer filter), or another preset the family "
        "names. unet_targets / transformer_targets override it.",
    )
    unet_targets: list[str] | None = Field(
        default=None, description="UNet module names to adapt; unset = lora.preset."
    )
    transformer_targets: list[str] | None = Field(
        default=None, description="Transformer module names to adapt (transformer families); unset = lora.preset."
    )
    prior_targets: list[str] | None = Field(
        default=None, description="Stable Cascade / Würstchen v2 prior (stage C) module names to adapt; unset = lora.preset."
    )
    layer_filter: list[str] | None = Field(
        default=None, min_length=1,
        description="OneTrainer's layer filter, on the denoiser: adapt every Linear and Conv2d layer whose module "
        "path in the denoiser (the diffusers path, e.g. down_blocks.1.attentions.0.proj_in) contains one of these "
        "patterns (with layer_filter_regex: in which one of these regular expressions is found, Python's re.search); "
        "an empty pattern selects every such layer. Replaces lora.preset; each pattern must select a layer. "
        "OneTrainer's comma-separated layer_filter is this list.",
    )
    layer_filter_regex: bool = Field(
        default=False, description="Read lora.layer_filter's patterns as regular expressions (OneTrainer's "
        "layer_filter_regex) instead of substrings.",
    )
    text_encoder_targets: list[str] | None = Field(
        default=None, description="Text encoder module names to adapt, in every trained text encoder; unset = each "
        "encoder's default list (CLIP: q_proj, k_proj, v_proj, out_proj, fc1, fc2; T5: q, k, v, o, wi_0, wi_1, wo)."
    )
    file_layout: Literal["auto", "kohya", "diffusers"] = Field(
        default="auto",
        description="Key layout of lora.safetensors. kohya: lora_unet_* / lora_te_* (SDXL: lora_te1_* / lora_te2_*) "
        "modules (UNet modules by their diffusers paths) with lora_down / lora_up and an .alpha tensor each, "
        "for ComfyUI, A1111 / Forge, kohya and diffusers' load_lora_weights. diffusers: peft's keys "
        "(unet.*.lora_A / lora_B) with rank and alpha only in the file's metadata, read by diffusers' "
        "load_lora_weights. auto: kohya for the families "
        "that have kohya names (sd1, sd2, sdxl), diffusers for the others (sd3, flux, chroma, pixart_alpha, pixart_sigma, "
        "whose T5-XXL modules are named as ComfyUI reads them: lora_te3_* / lora_te1_* with .alpha tensors; "
        "PixArt's pipelines have no load_lora_weights: ot_dist.lora_tools.peft_load.load_peft_lora loads the file).",
    )
    init_from: UserPath | None = Field(
        default=None,
        description="A LoRA .safetensors file to start from instead of zero (continue a LoRA, ot_dist's or another "
        "trainer's: kohya or diffusers layout). Its rank must equal lora.rank; its alpha is honoured (the starting "
        "change equals the file's); the targeted modules it lacks start at zero change, modules it has that are "
        "not targeted are an error.",
    )


class EmbeddingConfig(Section):
    token: str = Field(
        default="<ot-embedding>",
        min_length=1,
        description="The placeholder token. Captions that contain it (in any case, as CLIP tokenizers read it) train it "
        "in place; captions without it get it prepended. Lower case when vectors > 1.",
    )
    vectors: VectorCount = Field(default=1, description="Number of embedding vectors (tokens) it expands to, or "
                                 f"{AUTO_VECTORS}. With init_from the file sets it (a different number here is an "
                                 "error).")
    init_text: str = Field(
        default="*", min_length=1, description="Text whose token embeddings initialise the vectors (unless init_from)."
    )
    init_from: UserPath | None = Field(
        default=None,
        description="An embedding .safetensors to continue: the vectors start from it instead of init_text. Layouts: "
        "ot_dist's / ComfyUI's / A1111-Forge SDXL (clip_l, clip_g), OneTrainer's (emp_params for SD 1.x/2.x; "
        "clip_l / clip_g / t5 / gemma / llama; ComfyUI's t5xxl where t5 is missing; a CLIP-only file starts SD3's, "
        "Flux's and HiDream's T5 / Llama vectors from init_text), A1111 (string_to_param.*), diffusers ({token: "
        "tensor}). .pt / .bin (pickle) files are refused.",
    )
    learning_rate: float | None = Field(
        default=None, gt=0, description="Learning rate of the embedding vectors; unset = the top-level learning_rate."
    )
    output_embedding: bool = Field(default=False, description=OUTPUT_EMBEDDING_DESCRIPTION)

    @field_validator("init_from")
    @classmethod
    def _safetensors_only(cls, value: str | None) -> str | None:
        return safetensors_only(value, "embedding.init_from")

    @model_validator(mode="after")
    def _lower_case_for_several_vectors(self) -> "EmbeddingConfig":
        lower_case_for_several_vectors(self.token, self.vectors, "embedding.token")
        return self


class ConceptConfig(Section):
    """One concept (OneTrainer's term): a folder of images with captions, optional masks and, for edit models, a
    folder of reference images paired by file name."""

    path: UserPath = Field(description="Folder of images (.png .jpg .jpeg .webp .bmp); `a-masklabel.png` beside `a.png` is "
                      "its mask (white = train on this region).")
    name: str | None = Field(default=None, description="Name in reports and sample keys; unset = the folder name.")
    type: Literal["standard", "validation", "prior_preservation", "prior_prediction"] = Field(
        default="standard",
        description="standard: trained. validation: never trained; its loss at fixed noise and timesteps (the same "
        "every time) is computed on all ranks at `validation`'s interval and logged as validation/loss/<concept name> "
        "(OneTrainer's VALIDATION). prior_preservation: regularisation images (the class images of DreamBooth), "
        "trained with this concept's loss_weight as DreamBooth's prior_loss_weight. prior_prediction (OneTrainer's "
        "PRIOR_PREDICTION, method lora): its samples are trained towards the model's own prediction without the LoRA "
        "(same noisy input, timestep and caption) instead of the image's target, so the LoRA learns to leave what "
        "they show as the base model draws it; a run with such a concept costs one more denoiser forward per micro "
        "batch (no gradients). For the masked-out area of masked training see "
        "masked_training.prior_preservation_weight.",
    )
    include_subdirectories: bool = Field(default=False, description="Also read images in sub-folders.")
    reference_path: UserPath | list[UserPath] | None = Field(
        default=None, description="Folder of reference (conditioning) images for an edit model (flux_kontext, "
        "qwen_image_edit, qwen_image_edit_plus; flux2 / flux2_klein, which then need it on every concept): the "
        "partner of `<path>/sub/a.png` is the image `sub/a.<any extension>` under this folder (the ai-toolkit / "
        "musubi `control` folder, SimpleTuner's conditioning dataset paired by file name). Every image needs its "
        "partner (a missing one is named before any shard is written). Several references per sample (flux2, "
        "flux2_klein: up to 10; qwen_image_edit_plus: up to 3): numbered partners `sub/a_0.png`, `sub/a_1.png`, ... "
        "in order (musubi's layout for several control images), or a list of folders, each giving one partner by "
        "file name, in list order (ai-toolkit's control_path list, SimpleTuner's several conditioning datasets); as "
        "many for every image of the run. Each reference takes the image's geometry: "
        "scaled to the image's size, then the same bucket, crop and flip / rotation / colour jitter (diffusers' "
        "Kontext script and SimpleTuner's reference_strict). A family without reference images refuses it.",
    )
    caption_source: Literal["txt", "filename", "text"] = Field(
        default="txt",
        description="txt: a same-name caption file (one caption per line; a line is drawn per epoch); filename: the "
        "image file name without extension; text: caption_text for every image (one caption per line, as in a file).",
    )
    caption_extension: str = Field(default=".txt", min_length=1, description="Extension of the caption files "
                                   "(caption_source txt); `txt` is read as `.txt`.")
    caption_text: str | None = Field(default=None, description="The caption of every image (caption_source text); "
                                     "several lines are several captions, a line drawn per image and epoch.")
    caption_prefix: str = Field(default="", description="Text put before every caption of this concept, and a space "
                                "unless it ends with one (kohya's caption_prefix: `sks` + `a dog` is `sks a dog`).")
    caption_suffix: str = Field(default="", description="Text put after every caption of this concept, after a space "
                                "unless it starts with one (kohya's caption_suffix: `a dog` + `sks` is `a dog sks`); "
                                "like the prefix, stored with the caption, so shuffling and dropout see it.")
    balancing: float = Field(
        default=1.0, gt=0, description="repeats: times each image is seen per epoch (fractions pick a random part; "
        "floor(images x repeats) samples per epoch, as OneTrainer); samples: images drawn from this concept per epoch "
        "(the whole part).",
    )
    balancing_strategy: Literal["repeats", "samples"] = Field(default="repeats", description="How balancing counts.")
    loss_weight: float = Field(
        default=1.0, ge=0, description="This concept's samples count this many times in the loss (OneTrainer's "
        "per-concept loss_weight).",
    )
    flip_probability: float = Field(
        default=0.0, ge=0, le=1, description="Mirror the image (and its mask) left-right with this probability per "
        "sample and epoch (OneTrainer's random flip is 0.5).",
    )
    rotation_degrees: float = Field(
        default=0.0, ge=0, le=180, description="Rotate by an angle drawn in [-d, d] per sample and epoch; the corners "
        "that leave the image are masked out of the loss.",
    )
    brightness: float = Field(default=0.0, ge=0, description="Brightness jitter: a factor drawn in [1-s, 1+s], "
                              "below 0 taken as 0 (black), as OneTrainer's random_brightness_max_strength.")
    contrast: float = Field(default=0.0, ge=0, description="Contrast jitter: a factor drawn in [1-s, 1+s], below 0 "
                            "taken as 0 (the mean grey), as OneTrainer's random_contrast_max_strength.")
    saturation: float = Field(default=0.0, ge=0, description="Saturation jitter: a factor drawn in [1-s, 1+s], below 0 "
                              "taken as 0 (greyscale), as OneTrainer's random_saturation_max_strength.")
    hue: float = Field(default=0.0, ge=0, le=0.5, description="Hue jitter: a turn of the colour circle in [-s, s].")
    image_variations: int = Field(
        default=1, ge=1, description="With data.cache_latents and this concept's augmentation: the latent cache holds "
        "this many augmented versions of each image (OneTrainer's image_variations), N times the cache's size; pass "
        "p over the concept's images (epoch p with balancing 1) trains with version p mod N, and version v is the "
        "augmentation the images get uncached in epoch v (drawn per seed and sample: a rerun, a resume or another "
        "number of processes reads the same cache). 1: augmentation cannot go with cached latents (refused). A concept "
        "that does not augment caches one version. docs/data.md#cached-variations",
    )
    text_variations: int = Field(
        default=1, ge=1, description="With data.cache_text and this concept's caption options (tag shuffling, tag or "
        "caption dropout, caps): the text cache holds this many varied versions of each caption line (OneTrainer's "
        "text_variations), N times the cache's size; pass p over the concept's images trains with version p mod N, "
        "version v being the captions uncached epoch v reads. 1: varying captions cannot go with cached text "
        "(refused). docs/data.md#cached-variations",
    )
    tag_shuffling: bool = Field(
        default=False, description="Shuffle the caption's tags (split at tag_delimiter) every epoch, keeping the first "
        "keep_tags_count in place (OneTrainer's enable_tag_shuffling).",
    )
    tag_delimiter: str = Field(default=",", min_length=1, description="What separates tags in a caption.")
    keep_tags_count: int = Field(
        default=1, ge=0, description="Tags at the start that shuffling and tag dropout leave alone (OneTrainer's "
        "keep_tags_count; e.g. the trigger word).",
    )
    tag_dropout_probability: float = Field(
        default=0.0, ge=0, le=1, description="Tag dropout's probability, drawn per sample and epoch; what it drops is "
        "tag_dropout_mode's.",
    )
    tag_dropout_mode: Literal["random", "random_weighted", "full"] = Field(
        default="random", description="random: each tag after the kept ones is left out with tag_dropout_probability "
        "(OneTrainer's RANDOM, kohya's caption_tag_dropout_rate); random_weighted: the i-th of the n droppable tags "
        "(from 1) with tag_dropout_probability x i / n, so the last tags go most often (OneTrainer's RANDOM WEIGHTED); "
        "full: all of them together, only the kept tags stay (OneTrainer's FULL, its default). OneTrainer's spellings "
        "(`RANDOM WEIGHTED`) are accepted.",
    )
    tag_dropout_special_tags_mode: Literal["none", "whitelist", "blacklist"] = Field(
        default="none", description="OneTrainer's special tags for tag dropout: whitelist: the special tags are never "
        "dropped; blacklist: only the special tags can be (the others always stay). OneTrainer's upper-case spellings "
        "are accepted.",
    )
    tag_dropout_special_tags: str | list[str] = Field(
        default="", description="The special tags: a list, a string split at tag_delimiter, or the path of a .txt "
        "file (one tag a line) or a .csv file (its first column). Matched before any case change.",
    )
    tag_dropout_special_tags_regex: bool = Field(
        default=False, description="A special tag holding a regex character (`.^$*+?{}[]|()\\`) is a pattern that "
        "must match a whole tag; any special tag also matches a tag written in parentheses, `(red hair)` "
        "(OneTrainer's tag_dropout_special_tags_regex).",
    )
    caps_randomize_probability: float = Field(
        default=0.0, ge=0, le=1, description="Each tag (the kept ones too) gets one of caps_randomize_mode's "
        "capitalisations with this probability per sample and epoch, after tag dropout and before shuffling "
        "(OneTrainer's caps_randomize_enable / caps_randomize_probability). As in OneTrainer, the tags are then "
        "joined by the bare tag_delimiter (`a,B`) unless tag_shuffling re-joins them.",
    )
    caps_randomize_mode: list[Literal["capslock", "title", "first", "random"]] = Field(
        default_factory=lambda: ["capslock", "title", "first", "random"], min_length=1,
        description="The capitalisations drawn from, each as likely (one listed twice twice as likely): capslock (ALL "
        "CAPS), title (Each Word Capitalised), first (First word capitalised, the rest lower case), random (each "
        "letter upper or lower case at random). OneTrainer's comma-separated string is accepted.",
    )
    lowercase_caption: bool = Field(
        default=False, description="Lower-case the caption, after tag dropout and before caps randomisation "
        "(OneTrainer's caps_randomize_lowercase, Force Lowercase, which applies with randomisation off too).",
    )
    keep_tags_separator: str = Field(
        default="", description="kohya's keep_tokens_separator (e.g. `|||`): in a caption holding it, the tags before "
        "it stay in place and are never dropped (keep_tags_count is not used for that caption), the tags after it are "
        "shuffled and dropped, and the tags after a second one stay at the end. The separator itself never reaches the "
        "text encoder (kohya leaves it in the caption when neither shuffling nor tag dropout is on).",
    )
    secondary_separator: str = Field(
        default="", description="kohya's secondary_separator (e.g. `;;;`): the parts it joins count as one tag for "
        "shuffling and dropout; afterwards it becomes the bare tag_delimiter (`a;;;b` is `a,b`).",
    )
    caption_dropout_probability: float = Field(
        default=0.0, ge=0, le=1, description="The whole caption is replaced by an empty one with this probability per "
        "sample and epoch, so the model also learns the unconditional prediction classifier-free guidance uses.",
    )
    caption_dropout_every_n_epochs: int = Field(
        default=0, ge=0, description="Every caption is empty in the n-th, 2n-th, ... epoch (counted from 1, as kohya's "
        "caption_dropout_every_n_epochs); 0: never. Validation losses are not affected.",
    )

    @field_validator("type", mode="before")
    @classmethod
    def _onetrainer_type(cls, value):
        """OneTrainer's spellings (STANDARD, VALIDATION, PRIOR_PREDICTION) are accepted."""
        return value.lower() if isinstance(value, str) else value

    @field_validator("caption_extension")
    @classmethod
    def _leading_dot(cls, value: str) -> str:
        """`txt` (the spelling of `ot-dist shard index --caption-ext`) names the same files as `.txt`."""
        return value if value.startswith(".") else "." + value

    # The three below are normalised here rather than where captions are read, so that the shard fingerprint (the
    # concepts' settings) changes for a set whose stored captions they change: it is rebuilt, not reused.
    @field_validator("caption_prefix")
    @classmethod
    def _prefix_and_a_space(cls, value: str) -> str:
        """kohya's caption_prefix is followed by a space: `sks` + `a dog` is `sks a dog`, never `sksa dog`."""
        return value + " " if value and not value[-1].isspace() else value

    @field_validator("caption_suffix")
    @classmethod
    def _a_space_and_suffix(cls, value: str) -> str:
        """kohya's caption_suffix comes after a space: `a dog` + `sks` is `a dog sks`, never `a dogsks`."""
        return " " + value if value and not value[0].isspace() else value

    @field_validator("caption_text")
    @classmethod
    def _caption_lines(cls, value: str | None) -> str | None:
        """Lines as in a caption file: a YAML block scalar (`caption_text: >`) ends with a newline, which is no
        empty caption to draw every other epoch."""
        return value if value is None else "\n".join(line.strip() for line in value.splitlines() if line.strip())

    @field_validator("tag_dropout_mode", "tag_dropout_special_tags_mode", mode="before")
    @classmethod
    def _onetrainer_mode(cls, value):
        return value.lower().replace(" ", "_") if isinstance(value, str) else value

    @field_validator("caps_randomize_mode", mode="before")
    @classmethod
    def _onetrainer_caps_modes(cls, value):
        """OneTrainer's field is one string, `capslock, title, first, random`."""
        return [m.strip() for m in value.split(",") if m.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _tag_options(self) -> "ConceptConfig":
        from ot_dist.data.captions import special_patterns, special_tags, special_tags_file_missing

        label, value = f"concept {self.path}", self.tag_dropout_special_tags
        if (missing := special_tags_file_missing(value)) is not None:
            raise ValueError(f"{label}: tag_dropout_special_tags: {value!r} names a special tags file "
                             f"({missing.suffix}) that does not exist; give the file's path, or the tags as a list")
        mode, tags = self.tag_dropout_special_tags_mode, special_tags(value, self.tag_delimiter)
        if mode != "none" and not tags:
            raise ValueError(f"{label}: tag_dropout_special_tags_mode: {mode} needs tag_dropout_special_tags")
        if mode == "none" and tags:
            raise ValueError(f"{label}: tag_dropout_special_tags: set, but tag_dropout_special_tags_mode is none "
                             "(whitelist: never dropped; blacklist: the only ones dropped)")
        try:
            special_patterns(tags, self.tag_dropout_special_tags_regex)
        except re.error as err:
            raise ValueError(f"{label}: tag_dropout_special_tags: {err.pattern!r} is no regular expression "
                             f"({err})") from None
        for name in ("keep_tags_separator", "secondary_separator"):
            separator = getattr(self, name)
            if separator and separator.strip() == self.tag_delimiter.strip():
                raise ValueError(f"{label}: {name}: {separator!r} is the tag_delimiter; it must mark something else")
        if self.keep_tags_separator and self.keep_tags_separator == self.secondary_separator:
            raise ValueError(f"{label}: secondary_separator: the same as keep_tags_separator")
        return self

    @model_validator(mode="after")
    def _caption_text(self) -> "ConceptConfig":
        if self.caption_source == "text" and not self.caption_text:
            raise ValueError(f"concept {self.path}: caption_source text needs caption_text")
        return self

    @model_validator(mode="after")
    def _reference_folders(self) -> "ConceptConfig":
        if isinstance(self.reference_path, list) and not self.reference_path:
            raise ValueError(f"concept {self.path}: reference_path: an empty list; give a folder (or several), or "
                             "leave it out")
        return self


class DataConfig(Section):
    path: UserPath | None = Field(
        default=None, description="Shorthand for one concept with default settings: `concepts: [{path: ...}]`."
    )
    concepts: list[ConceptConfig] = Field(default_factory=list, description="The training concepts (see below).")
    shards: UserPath | None = Field(
        default=None,
        description="The shard set folder (`ot-dist shard build`). Unset: <cache_dir>/shards/<name from the concepts "
        "and settings>, built at train start when missing or stale (`ot-dist shard list | prune` show and remove old "
        "ones). Set without concepts: train from an existing shard set.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the object store that holds the tars of a set indexed from URLs (`ot-dist shard index "
        "s3://...`), passed to fsspec: e.g. {endpoint_url: https://ACCOUNT.r2.cloudflarestorage.com} for R2 or MinIO "
        "(s3fs's endpoint_url; client_kwargs: {region_name: ...}), {project: ...} for gcsfs. No credentials: keys "
        "that hold one are refused (the config is logged); they come from the environment the store's library reads "
        "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS; a Secret on Kubernetes: "
        "docs/kubernetes.md).",
    )
    remote_concurrency: int = Field(
        default=8, ge=1, le=256, description="Ranged reads of a set's URL tars each loader worker (or the rank, with "
        "loader_workers 0) keeps in flight: one per sample, its members' bytes in one request.",
    )
    remote_read_ahead: int = Field(
        default=2, ge=0, le=64, description="Micro batches beyond the one decoding whose samples each loader worker "
        "fetches from the store ahead (held in memory: about read_ahead x batch_size samples' bytes a worker).",
    )
    remote_retries: int = Field(
        default=10, ge=1, le=20, description="Tries of a read from the store that failed for a transient reason (5xx, "
        "429, a dropped connection), waiting 0.5 s, 1 s, 2 s, ... (up to 16 s, each with jitter) between them: the "
        "default rides out 40-80 s of an unavailable store (an S3 SlowDown storm, a restarting gateway) before the "
        "sample counts as unreadable; a 404 makes the sample unreadable (skipped, counted in max_bad_fraction), a "
        "401 / 403 stops the run.",
    )
    cache_dir: UserPath | None = Field(
        default=None,
        description="The cache folder of shard sets when data.shards is unset. Unset: the environment's OT_DIST_CACHE, "
        "else ot_dist-cache beside output_dir (in its parent folder, which every node of a run shares).",
    )
    crop: Literal["center", "random"] = Field(
        default="center", description="Images are resized to cover their bucket; which part of them to cut."
    )
    bucket_step: int | None = Field(
        default=None, ge=8, multiple_of=8,
        description="Bucket sides are multiples of this. Unset: the family's, as OneTrainer quantizes its buckets (8 "
        "for SD 1.x / 2.x, 64 for SDXL, SD3, Flux, Chroma). It must be a multiple of the family's latent grid: 8 for "
        "SD 1.x / 2.x / SDXL (VAE x8), 16 for SD3 / Flux / Chroma (VAE x8, 2x2 patches).",
    )
    bucket_assignment: Literal["rounded_aspect", "log_ratio", "square"] = Field(
        default="rounded_aspect",
        description="Which bucket an image goes to: rounded_aspect = the bucket whose rounded size (at the largest "
        "resolution) has the nearest height/width, by linear difference, as OneTrainer assigns; log_ratio = the "
        "nearest ideal aspect by log ratio (ot_dist's earlier rule: symmetric for tall and wide images); square = "
        "no aspect buckets: every image is scaled to cover the square of each resolution and cropped to it "
        "(data.crop), OneTrainer's aspect_ratio_bucketing false.",
    )
    image_format: Literal["auto", "png", "webp", "jpg"] = Field(
        default="auto",
        description="Image encoding in the shards. auto: a source JPEG / PNG / WebP that needs no resize, rotation or "
        "colour conversion is stored as its own bytes (the pixels a reader decodes are checked equal), other JPEG "
        "sources as JPEG quality 95, the rest as PNG (figures: docs/data.md). png / webp (quality 95) / jpg "
        "(quality 95): every image re-encoded so.",
    )
    shard_size_mb: float = Field(default=256, gt=0, description="Target size of one tar shard.")
    loader_workers: int = Field(default=0, ge=0, description="Data loader worker processes per rank (0 = in-process).")
    cache_text: bool = Field(
        default=False,
        description="Run the text encoders once over every caption (in chunks of 1024 samples split over the ranks; "
        "an interrupted run resumes at the missing chunks), store the outputs in the shard set (keyed to the encoders "
        "and tokenizers) and train from them. Needs frozen text encoders and method full or lora; a concept whose "
        "captions vary needs text_variations > 1.",
    )
    small_buckets: Literal["move", "drop"] = Field(
        default="move",
        description="Samples that fill no global batch of their bucket. move: a bucket with fewer samples than a "
        "global batch moves into the nearest bucket (by aspect) that fills one, its images scaled to cover it and "
        "cropped (the bucket report names each moved image), and every epoch the remainders of the buckets train "
        "together in global batches of neighbouring aspects: all but fewer than one global batch train every epoch. "
        "drop: each bucket's remainder is dropped (a different part every epoch) and smaller buckets never train.",
    )
    max_untrained_fraction: float = Field(
        default=0.2, ge=0, le=1, description="A run that would leave more than this share of the samples per epoch "
        "untrained stops before training (exit 3), with the bucket report and what fixes it; 1 accepts any share. "
        "Counted with small_buckets drop: the samples in buckets with fewer than one global batch (never trained); "
        "with move: the samples per epoch that fill no global batch.",
    )
    resume_with_changed_data: Literal["refuse", "next_epoch"] = Field(
        default="refuse",
        description="A resumed run whose epoch is planned differently from the checkpoint's (images added, removed or "
        "re-bucketed since, another seed, other concept settings): resuming at the saved global batch of another "
        "plan would train some samples twice in that epoch and skip others. refuse: stop before training, naming what "
        "changed. next_epoch: go on from the start of the epoch after the saved one, with the new data.",
    )
    max_bad_fraction: float = Field(
        default=0.01, ge=0, le=1, description="Unreadable samples (corrupt member, truncated shard) are skipped and "
        "logged by key; more than this fraction of a rank's epoch stops the run. `shard build` counts unreadable "
        "source images (broken, empty, over max_image_pixels) the same way: named, skipped, exit 3 past this fraction.",
    )
    max_image_pixels: int | None = Field(
        default=89478485, ge=1, description="Largest image (width x height) `shard build` decodes; a larger one (a "
        "decompression bomb) is an unreadable sample. Default: Pillow's limit. null: no limit.",
    )
    image_background: str = Field(
        default="white", description="Colour transparent pixels (RGBA, LA, palette or RGB transparency) are composited "
        "on when the shards are built: a name or `#rrggbb`, as Pillow reads colours (docs/data.md).",
    )
    skip_small_images: bool = Field(
        default=False, description="Leave out images with a side below a quarter of the bucket side they are scaled "
        "to (at the largest resolution). Off: they are kept, and named in a warning with their count.",
    )
    video_frames: int | None = Field(
        default=None, ge=1, description="A video family (wan): video clips in the concepts become samples of this "
        "many frames (musubi-tuner's target_frames, one value); the VAE needs k n + 1 (Wan: 4n + 1: 1, 5, ..., 81). "
        "null: clips are no samples (wan refuses them, image families list them as not used). Needs ot-dist[video] "
        "(PyAV). docs/data.md#video-clips",
    )
    video_fps: float | None = Field(
        default=None, gt=0, description="The frame rate clips are sampled at (Wan trains at 16): frames are skipped to "
        "it from the clip's rate. null: every frame in turn, at the clip's own rate.",
    )
    video_source_fps: float | None = Field(
        default=None, gt=0, description="The rate the clips are taken to have (musubi-tuner's source_fps), instead of "
        "their containers'. Only with video_fps.",
    )
    video_frame_extraction: Literal["head", "chunk", "slide", "uniform", "full"] = Field(
        default="head", description="Which windows of video_frames frames a clip gives, each a sample (musubi-tuner's "
        "frame_extraction, on the frames taken at video_fps): head, its first frames; chunk, consecutive windows "
        "(0, F, 2F, ...) while they fit; slide, one every video_frame_stride frames; uniform, video_frame_sample "
        "windows spread evenly from the first frame to the last; full, the whole clip cut to 4n + 1 frames and to "
        "video_frames (musubi's max_frames: clips of other lengths then train with batch_size 1). "
        "docs/data.md#video-clips",
    )
    video_frame_stride: int = Field(
        default=1, ge=1, description="video_frame_extraction slide: frames between the starts of two windows "
        "(musubi-tuner's frame_stride).",
    )
    video_frame_sample: int = Field(
        default=1, ge=1, description="video_frame_extraction uniform: windows a clip gives, spread evenly "
        "(musubi-tuner's frame_sample; a start that two of them share counts once).",
    )
    cache_latents: bool = Field(
        default=False,
        description="Encode every image with the VAE once (batched, in chunks of 1024 samples split over the ranks "
        "of the launch; an interrupted run resumes at the missing chunks, on any number of processes), store the "
        "latents in the shard set (keyed to the VAE, the resolutions, the shards and the data.video_* frame choice) and "
        "train from them; a video clip's latent is cached whole (C, F', h, w). "
        "Needs crop center; an augmenting concept needs image_variations > 1. docs/data.md#latent-and-text-caches",
    )

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, value: dict) -> dict:
        from ot_dist.data.remote import credential_keys

        found = credential_keys(value)
        if found:
            raise ValueError(f"storage_options: {', '.join(found)} holds a credential, and the config is logged and "
                             "copied with every checkpoint; give it through the environment the store's library reads "
                             "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ~/.netrc; on "
                             "Kubernetes a Secret: docs/kubernetes.md)")
        return value

    @field_validator("image_background")
    @classmethod
    def _colour(cls, value: str) -> str:
        from PIL import ImageColor

        try:
            ImageColor.getrgb(value)
        except ValueError:
            raise ValueError(f"image_background: {value!r} is not a colour (a name like white, or #rrggbb)") from None
        return value

    @model_validator(mode="after")
    def _source(self) -> "DataConfig":
        if self.path is not None and self.concepts:
            raise ValueError("data: give either data.path (one folder) or data.concepts, not both")
        if self.path is None and not self.concepts and self.shards is None:
            raise ValueError("data: nothing to train on; set data.path, data.concepts or data.shards")
        if self.cache_latents and self.crop != "center":
            raise ValueError("data.cache_latents: cached latents hold one crop; set data.crop to center")
        if self.cache_latents:
            from ot_dist.data.augment import has_augmentation

            augmented = [label for label, c in self.concept_list() if has_augmentation(c) and c.image_variations == 1]
            if augmented:
                raise ValueError(f"data.cache_latents: {augmented[0]} augments its images every epoch (flip, rotation, "
                                 "colour jitter), which one cached latent per image cannot hold; set "
                                 f"{augmented[0]}.image_variations to N > 1 to cache N augmented versions (N times the "
                                 "cache's size), or turn cache_latents or the augmentation off")
        if self.video_source_fps is not None and self.video_fps is None:
            raise ValueError("data.video_source_fps: only with data.video_fps (the rate it is resampled to)")
        if self.video_frame_stride != 1 and self.video_frame_extraction != "slide":
            raise ValueError(f"data.video_frame_stride: only with video_frame_extraction slide (it is "
                             f"{self.video_frame_extraction})")
        if self.video_frame_sample != 1 and self.video_frame_extraction != "uniform":
            raise ValueError(f"data.video_frame_sample: only with video_frame_extraction uniform (it is "
                             f"{self.video_frame_extraction})")
        return self

    def concept_list(self) -> list[tuple[str, ConceptConfig]]:
        """(config key, concept) pairs; the key names the concept in errors."""
        if self.path is not None:
            return [("data.path", ConceptConfig(path=self.path))]
        return [(f"data.concepts[{i}]", c) for i, c in enumerate(self.concepts)]


class DDPConfig(Section):
    """Settings of strategy ddp (replicated weights)."""

    bucket_mb: float = Field(
        default=32, gt=0,
        description="MB of gradients per all-reduce bucket of torch's DistributedDataParallel (each bucket is reduced "
        "as soon as backward has filled it): raise it on a slow interconnect, lower it to overlap sooner. With "
        "optimizer.fused_back_pass, gradients smaller than this are averaged together in buckets of this size; "
        "larger ones alone.",
    )
    reduce_dtype: Dtype = Field(
        default="float32",
        description="Dtype gradients are averaged in; each is rounded back to its own dtype (nearest) after. Matters "
        "for bfloat16 gradients (trained_weight_dtype bfloat16), which float32 sums without a rounding at every hop "
        "of the all-reduce (OneTrainer's gradient_reduce_precision FLOAT_32, its default's precision).",
    )
    reduce_rounding: Literal["nearest", "stochastic"] = Field(
        default="nearest",
        description="How a gradient averaged in a wider reduce_dtype is rounded back into bfloat16 "
        "(trained_weight_dtype bfloat16): nearest, or stochastic (OneTrainer's default gradient_reduce_precision "
        "FLOAT_32_STOCHASTIC), so that the part of the average below bfloat16's resolution still counts on average. "
        "The noise is keyed by seed, step and tensor: every rank rounds the same average the same way.",
    )
    fused_reduce_buffer_mb: int = Field(
        default=100, ge=0,
        description="With optimizer.fused_back_pass: MB of averaged gradients in flight before the oldest one's "
        "parameter is stepped (OneTrainer's async_gradient_reduce_buffer). Each gradient is all-reduced as soon as "
        "backward completes it and the parameter stepped inside backward; the buffer lets the communication overlap "
        "backward, at the cost of this much memory. 0: each step waits for its own reduce.",
    )


class FSDPConfig(Section):
    """Settings of strategy fsdp (torch FSDP2)."""

    sharding: Literal["full_shard", "shard_grad_op", "hybrid_shard"] = Field(
        default="full_shard",
        description="full_shard: parameters re-gathered in backward (least memory); shard_grad_op: kept "
        "gathered from forward to backward; hybrid_shard: shard within a node, replicate across nodes.",
    )
    reduce_dtype: Dtype = Field(default="float32", description="Dtype gradients are reduced in.")
    cpu_offload: bool = Field(default=False, description="Keep sharded parameters, gradients and optimizer state in CPU memory.")
    reduce_every_micro_step: bool | None = Field(
        default=None,
        description="With gradient_accumulation_steps > 1: reduce-scatter the gradients after every micro step and "
        "accumulate this rank's shards (true), or only after the last one, each rank holding every trained "
        "parameter's whole gradient until then (false: one reduce-scatter per step, but a whole gradient per GPU in "
        "reduce_dtype, 48 GB for a Flux full finetune in float32). Unset: true with cpu_offload or where the whole gradients would take over a quarter of "
        "the GPU's memory, false otherwise.",
    )


class DeepSpeedConfig(Section):
    """Settings of strategies zero1 / zero2 / zero3 (DeepSpeed)."""

    offload_optimizer: bool = Field(default=False, description="Optimizer state in CPU memory (ZeRO-Offload).")
    offload_params: bool = Field(default=False, description="Parameters in CPU memory (zero3 only).")
    overlap_comm: bool | None = Field(
        default=None,
        description="ZeRO-1/2: reduce gradient buckets on a side stream while backward goes on (DeepSpeed turns "
        "it on by itself only for ZeRO-3). Unset: on with a GPU, off on the CPU (no side stream to overlap on).",
    )
    reduce_bucket_size: int = Field(
        default=200_000_000, gt=0,
        description="Elements per gradient reduction bucket. With overlap_comm DeepSpeed holds about 4.5x this "
        "(and allgather_bucket_size) in buffers: lower it if memory is short, raise it on slow interconnects.",
    )
    allgather_bucket_size: int = Field(
        default=200_000_000, gt=0, description="Elements per all-gather of the updated parameters (ZeRO-1/2)."
    )
    config_file: str | None = Field(
        default=None,
        description="A DeepSpeed JSON whose keys override the generated DeepSpeed config. \"auto\" (HF's convention) "
        "takes ot_dist's value for the key; an optimizer or scheduler section, or batch sizes, accumulation or a ZeRO "
        "stage other than this config's, are refused (docs/parallel.md).",
    )
    mixed_precision: Literal["auto", "autocast", "engine"] = Field(
        default="auto",
        description="How train_dtype bfloat16 / float16 computes under zero1/2/3. autocast: float32 weights and "
        "torch autocast in train_dtype, as single, ddp and fsdp compute (DeepSpeed's torch_autocast; Linear and Conv "
        "weights are all-gathered (zero3) and their gradients reduced in train_dtype): ends within about 1x the "
        "bfloat16 noise of one process. engine: DeepSpeed's bf16 / fp16 engine, the weights held in train_dtype and "
        "no autocast: half the bytes of the weights zero1/2 replicate on every rank and zero3 gathers, but a coarser "
        "recipe (up to 56x the bfloat16 noise from one process, docs/parallel.md); its float32 masters start from the "
        "loaded weights; float16 on a CPU only with AVX512-FP16 / AMX-FP16 (DeepSpeed's CPU accelerator refuses it "
        "elsewhere). auto: autocast with bfloat16, engine with float16 (autocast float16 is refused: DeepSpeed 0.19's "
        "ZeRO clips the still-scaled gradients).",
    )


def checked_layer_filter(section, field: str) -> bool:
    """A section's OneTrainer-style layer filter (`field`.layer_filter and layer_filter_regex: lora, quantization):
    the regex switch only with patterns, each pattern a regular expression where it says so. Returns whether
    patterns are set."""
    if section.layer_filter is None:
        if section.layer_filter_regex:
            raise ValueError(f"{field}.layer_filter_regex: reads {field}.layer_filter's patterns, which is not set")
        return False
    for i, pattern in enumerate(section.layer_filter if section.layer_filter_regex else ()):
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"{field}.layer_filter[{i}]: {pattern!r} is not a regular expression "
                             f"({field}.layer_filter_regex is true): {err}") from None
    return True


class QuantizationConfig(Section):
    """Which layers of the denoiser a quantized storage (weight_dtype float8, nf4, int8) stores so (OneTrainer's
    `quantization` section)."""

    layer_filter: list[str] | None = Field(
        default=None, min_length=1,
        description="The denoiser's Linear layers whose module path contains one of these patterns (with "
        "layer_filter_regex: in which one is found by re.search) are stored in the denoiser's quantized weight_dtype; "
        "its other layers keep train_dtype (OneTrainer's quantization.layer_filter, e.g. transformer_block: the "
        "blocks, not the embedders and the final layer). Unset: every frozen layer the storage takes. Each pattern "
        "must select a layer.",
    )
    layer_filter_regex: bool = Field(
        default=False, description="Read quantization.layer_filter's patterns as regular expressions.")


class EMAConfig(Section):
    """Exponential moving average of the trained weights (OneTrainer's EMA), kept sharded like the
    optimizer state and exported beside the normal outputs (model_ema/, model_ema.safetensors,
    lora_ema.safetensors, embedding_ema.safetensors)."""

    enabled: bool = Field(default=False, description="Keep an EMA of the trained weights.")
    decay: float = Field(
        default=0.999, gt=0, lt=1,
        description="EMA decay: 0.999 or 0.998 for small datasets, 0.9999 for hundreds or thousands of images. "
        "The decay used at step n is min((1 + n) / (10 + n), decay).",
    )
    update_step_interval: int = Field(default=5, ge=1, description="Update the average every N optimizer steps.")
    device: Literal["accelerator", "cpu"] = Field(
        default="accelerator",
        description="Where the average lives: beside the weights (accelerator), or in CPU memory to save GPU "
        "memory at the price of a copy per update.",
    )


class ValidationConfig(Section):
    """The loss of the validation concepts (concepts with type: validation), at fixed noise and timesteps."""

    every_n_steps: int | None = Field(
        default=None, ge=1, description="Compute it every N optimizer steps (and before the first step and after "
        "the last). Unset: every_n_epochs.",
    )
    every_n_epochs: int | None = Field(
        default=1, ge=1, description="Compute it after every N epochs (and before the first step and after the "
        "last), when every_n_steps is unset.",
    )


class DistributedConfig(Section):
    timeout_minutes: float = Field(
        default=30, gt=0, description="Process-group timeout: a rank that waits longer on a collective fails. A rank "
        "that raises does not leave the others to wait it out: they end within seconds (docs/parallel.md)."
    )
    load_ranks_per_node: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default="auto",
        description="How many ranks of a node read the model into CPU memory (float32) and place it at the same "
        "time; the others wait their turn. auto: as many as the node's available memory (MemAvailable, or the "
        "container's cgroup limit) holds, from the float32 size of model.path's safetensors files. Each turn waits "
        "within distributed.timeout_minutes.",
    )


class MlflowConfig(Section):
    """Experiment tracking (rank 0 logs; the others make no tracking calls)."""

    enabled: bool = Field(default=True, description="Track the run in MLflow.")
    tracking_uri: str | None = Field(
        default=None,
        description="An MLflow server (http://host:5000) or store URI. null = the environment's MLFLOW_TRACKING_URI, "
        "else a local store output_dir/mlflow.db (browse: mlflow ui --backend-store-uri sqlite:///OUTPUT_DIR/mlflow.db). "
        "Credentials only through MLflow's environment variables (MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN).",
    )
    experiment: str = Field(
        default="ot_dist", min_length=1,
        description="Experiment name (created if missing). When the config does not set it, the environment's "
        "MLFLOW_EXPERIMENT_NAME (as in MLflow), else ot_dist; set here, it wins over the environment.",
    )
    run_name: str | None = Field(default=None, description="Run name; null = the name of output_dir.")
    system_metrics: bool | None = Field(
        default=None,
        description="Log MLflow's system metrics (system/...: CPU, memory, disk, network; GPU with nvidia-ml-py "
        "installed) from the sender process, every 10 s (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL). null = "
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING (or mlflow.enable_system_metrics_logging()) where set, else on.",
    )
    shutdown_timeout_seconds: float = Field(
        default=30, ge=0, description="At the end, how long a server that answers gets to take what is left; "
        "a server that does not answer gets one last attempt. What is not delivered stays in "
        "output_dir/mlflow-outbox/ (a warning names the file and the command that sends it later).",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        if uri is not None and has_credentials(uri):
            raise ValueError(
                "mlflow.tracking_uri: the URI contains credentials (user:password@); remove them and set "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment"
            )
        return uri


def has_credentials(uri: str) -> bool:
    """user:password@host (or token@host) in a URI: secrets that would end up in logged params."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return False
    return parts.scheme not in ("", "file", "sqlite") and "@" in parts.netloc


class TrainConfig(Section):
    model: ModelConfig
    method: Literal["full", "lora", "embedding"] = Field(
        description="full = finetune the weights; lora = train LoRA adapters (peft); "
        "embedding = textual inversion."
    )
    output_dir: UserPath = Field(description="Where exports, checkpoints (output_dir/checkpoints) and the local MLflow store go.")
    data: DataConfig
    seed: int = Field(default=42, description="Seeds shuffling, noise and timesteps (per sample).")
    resolution: int | list[int] = Field(
        default=512,
        description="Training resolution in pixels (the side of a square of the same area as a bucket). Several, "
        "e.g. `384,448,512` or a list: multi-resolution, one drawn per optimizer step (the same on all ranks).",
    )
    batch_size: int = Field(default=1, ge=1, description="Micro batch per process.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro batches per optimizer step.")
    epochs: int = Field(default=1, ge=1, description="Passes over the data.")
    max_steps: int | None = Field(default=None, ge=1, description="Optional cap on optimizer steps.")
    learning_rate: float = Field(default=1e-5, gt=0, description="Base learning rate.")
    train_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", validate_default=True,
        description="Compute dtype of forward/backward (autocast); the trained weights stay float32 master weights "
        "(trained_weight_dtype). auto: bfloat16 where every GPU of the machine computes it natively (compute "
        "capability 8.0+: Ampere, Ada, Hopper, Blackwell), about twice TF32's speed; float32 on older GPUs and on the "
        "CPU. float16 uses loss scaling.",
    )
    weight_dtype: StorageDtype = Field(
        default="float32",
        description="Storage dtype of the frozen parts (VAE, frozen text encoders, LoRA base); a part's own "
        "`<part>.weight_dtype` and vae_weight_dtype override it for that component. float8: one byte per "
        "parameter (float8_e4m3fn with a per-tensor scale), upcast to train_dtype where used; the forward pass then "
        "differs from the bfloat16 one by a few percent (docs/low-memory.md). nf4: OneTrainer's NFLOAT_4 (QLoRA): "
        "each frozen Linear weight in 4-bit NormalFloat, blocks of 64 with a double-quantized absmax (about 0.52 "
        "bytes per weight, bitsandbytes: the optim extra), the other frozen parameters in train_dtype; the forward "
        "pass differs from the bfloat16 one about 3.5 times as much as float8's. int8: OneTrainer's INT_W8A8: each "
        "frozen Linear weight in int8 with a per-tensor scale, multiplied in int8 with inputs quantized per row (int8 "
        "tensor cores), the other frozen parameters in train_dtype. Exports write the frozen parts as "
        "loaded from model.path, not the stored copies. float8, nf4 and int8: strategies single and ddp.",
    )
    vae_weight_dtype: StorageDtype | None = Field(
        default=None,
        description="Storage of the latent encoder (the VAE; Stable Cascade's and Würstchen's EfficientNet); unset = "
        "weight_dtype. E.g. float32 beside a bfloat16 weight_dtype, as kohya's --no_half_vae and OneTrainer's "
        "presets keep the VAE.",
    )
    offload_frozen_components: bool = Field(
        default=False,
        description="Keep the frozen text encoders and the VAE in CPU memory; each of their blocks moves to the "
        "device only for its own forward (with data.cache_text / cache_latents they are not used while training). "
        "Ideogram 4's unconditional transformer, which only samples, waits there too.",
    )
    share_frozen_cpu_weights: bool = Field(
        default=True,
        description="With several ranks on a node, the frozen weights that stay in CPU memory (the streamed blocks of "
        "<denoiser>.offload_fraction, the components of offload_frozen_components) are held once per node in /dev/shm "
        "instead of once per rank, page-locked on GPUs. Results are unchanged; a node whose /dev/shm cannot hold them "
        "keeps a copy per rank, said in the log. false: a copy per rank.",
    )
    trained_weight_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Storage dtype of the trained weights. float32: master weights, the exact default. bfloat16: "
        "half the bytes for weights and gradients, as OneTrainer's bfloat16 weight dtype; each update is computed "
        "in float32 and rounded back (stochastically with optimizer.stochastic_rounding, so updates below "
        "bfloat16's resolution still count on average). Needs train_dtype bfloat16 and strategy single or ddp.",
    )
    output_dtype: Dtype = Field(default="float32", description="Dtype of exported weights.")
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in backward to save memory.")
    activation_offloading: bool = Field(
        default=False,
        description="With gradient_checkpointing (OneTrainer's activation offloading): the inputs of the denoiser's "
        "checkpointed blocks, all that a checkpointed block keeps for backward, wait in CPU memory (pinned, copied "
        "asynchronously) from its forward to its recomputation, so the device holds one block's instead of every "
        "block's. Costs two copies of each block's hidden states per step.",
    )
    clip_grad_norm: float | None = Field(default=1.0, gt=0, description="Clip the gradient norm; null = off.")
    clip_grad_norm_scope: Literal["global", "per_tensor"] = Field(
        default="global",
        description="global: the norm of all gradients together is clipped to clip_grad_norm (torch's "
        "clip_grad_norm_). per_tensor: each parameter's gradient is clipped by its own norm, inside the fused back pass "
        "(optimizer.fused_back_pass), where no global norm exists: what OneTrainer and kohya do with theirs.",
    )
    tf32: bool = Field(default=True, description="Allow TF32 matmuls on CUDA (ignored elsewhere).")
    strategy: Literal["single", "ddp", "fsdp", "zero1", "zero2", "zero3"] = Field(
        default="single",
        description="single: one process, no process group; ddp: replicated weights, averaged gradients; "
        "fsdp: torch FSDP2 sharding; zero1/zero2/zero3: DeepSpeed ZeRO stages.",
    )
    ddp: DDPConfig = Field(default_factory=DDPConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    performance: PerformanceConfig = Field(default_factory=PerformanceConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    masked_training: MaskedTrainingConfig = Field(default_factory=MaskedTrainingConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    log_every_steps: int = Field(
        default=10, ge=1, description="Copy the step losses to the host (one sync), log them and update the progress "
        "every N optimizer steps.",
    )
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    unet: PartConfig = Field(default_factory=PartConfig)
    transformer: PartConfig = Field(default_factory=PartConfig)
    prior: PartConfig = Field(default_factory=PartConfig)
    text_encoder: PartConfig = Field(default_factory=PartConfig)
    text_encoder_2: PartConfig = Field(default_factory=PartConfig)
    text_encoder_3: PartConfig = Field(default_factory=PartConfig)
    text_encoder_4: PartConfig = Field(default_factory=PartConfig)  # HiDream's Llama
    text_conditioner: PartConfig = Field(default_factory=PartConfig)  # Anima's LLM adapter (Qwen3 -> T5 queries)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig)
    additional_embeddings: list[AdditionalEmbeddingConfig] = Field(
        default_factory=list,
        description="New tokens trained together with the method's weights (pivotal tuning; OneTrainer's additional "
        "embeddings): each in its own parameter group, its token expanded where captions (and sample prompts) have "
        "it. Written as output_dir/embeddings/<token>.safetensors (the layout of method embedding's file: diffusers' "
        "load_textual_inversion, A1111, ComfyUI) and, with bundle_additional_embeddings, inside the LoRA file too. "
        "Families with a CLIP text encoder (not PixArt / Chroma, T5 only); not with data.cache_text.",
    )
    bundle_additional_embeddings: bool = Field(
        default=False,
        description="Method lora: also write the additional embeddings into lora.safetensors as "
        "bundle_emb.<token>.<key> tensors (A1111's bundled embeddings; OneTrainer's default). Off by default: "
        "diffusers' load_lora_weights refuses a LoRA file with such keys (\"Invalid LoRA checkpoint\"), ComfyUI "
        "loads the LoRA but warns \"lora key not loaded\" for each, and Forge (since its 2024 LoRA rework) ignores "
        "them; the separate files are written either way.",
    )
    preserve_embedding_norm: bool = Field(
        default=False,
        description="After every optimizer step, rescale the trained embedding vectors (method embedding's and the "
        "trained additional_embeddings) as OneTrainer's preserve_embedding_norm does: each input vector to the median "
        "L2 norm of its text encoder's token-embedding rows (measured once, before training); an output embedding's "
        "vectors as a whole so that their mean per-vector standard deviation stays the one they started with.",
    )
    metadata: MetadataConfig = Field(default_factory=MetadataConfig)

    @field_validator("train_dtype")
    @classmethod
    def _resolve_train_dtype(cls, value: str) -> str:
        from ot_dist.config.device_dtype import resolve_train_dtype

        return resolve_train_dtype(value)

    @field_validator("resolution", mode="before")
    @classmethod
    def _parse_resolutions(cls, value):
        fixed = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", value) if isinstance(value, str) else None
        if fixed:  # OneTrainer's fixed size: pydantic alone would only say it is not an integer
            width, height = int(fixed[1]), int(fixed[2])
            raise ValueError(f"resolution: {value!r} is a fixed width x height (OneTrainer's: every image cropped to "
                             f"it); ot_dist trains aspect-ratio buckets of the area of a square: give the square's side "
                             f"(about {(width * height) ** 0.5:.0f} for {width}x{height}), a multiple of "
                             "data.bucket_step")
        if isinstance(value, str) and "," in value:
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("resolution")
    @classmethod
    def _check_resolutions(cls, value):
        for r in value if isinstance(value, list) else [value]:
            if r < 8 or r % 8:
                raise ValueError(f"resolution: {r} is not a multiple of 8 (at least 8)")
        if isinstance(value, list) and not value:
            raise ValueError("resolution: give at least one")
        return value

    def _check_quantization(self, denoiser: str) -> None:
        if not checked_layer_filter(self.quantization, "quantization"):
            return
        storage = self.component_storage(denoiser)
        if storage not in QUANTIZED_STORAGE:
            raise ValueError(f"quantization.layer_filter: chooses the {denoiser}'s layers a quantized storage "
                             f"({', '.join(QUANTIZED_STORAGE)}) takes; the {denoiser} is stored as {storage}")

    def _check_block_offload(self, denoiser: str) -> None:
        """offload_fraction streams the denoiser's frozen block weights: refused where that cannot work or save."""
        for name in PART_FIELDS:
            if name != denoiser and getattr(self, name).offload_fraction:
                raise ValueError(f"{name}.offload_fraction: only the denoiser ({denoiser}) streams its blocks; a frozen "
                                 "text encoder moves to the device block by block with offload_frozen_components")
        if not getattr(self, denoiser).offload_fraction:
            return
        field = f"{denoiser}.offload_fraction"
        if self.strategy not in ("single", "ddp"):
            raise ValueError(f"{field}: strategies single and ddp stream blocks; {self.strategy} shards them "
                             "(fsdp.cpu_offload / deepspeed offload keep them in CPU memory)")
        if not self.gradient_checkpointing:
            raise ValueError(f"{field}: needs gradient_checkpointing: true (without it every block's device copy is "
                             "kept for backward, and nothing is saved)")
        if self.streams_trained_weights() and not self.optimizer.fused_back_pass:
            raise ValueError(f"{field}: the {denoiser} trains, so its streamed weights are updated inside backward "
                             "while their copies are on the device: set optimizer.fused_back_pass: true (an "
                             f"optimizer that supports it: {', '.join(FUSED_BACK_PASS)})")
        if self.streams_trained_weights() and self.gradient_accumulation_steps > 1:
            raise ValueError(f"{field}: the {denoiser}'s streamed weights are stepped inside each backward, so "
                             "gradient_accumulation_steps must be 1 (their gradients would wait in CPU memory between "
                             "micro steps)")
        if self.performance.float8_matmuls:
            raise ValueError(f"{field}: not with performance.float8_matmuls (float8 layers replace the modules whose "
                             "weights the streamed blocks swap)")
        if self.performance.records_cuda_graphs:
            raise ValueError(f"{field}: not with performance.compile_mode: {self.performance.compile_mode} (CUDA "
                             "graphs replay on the addresses they recorded; a streamed block computes on new device "
                             "copies of its weights every step); use compile_mode default or "
                             "max-autotune-no-cudagraphs")
        if self.performance.selective_checkpointing:
            raise ValueError(f"{field}: not with performance.checkpoint_every_n_blocks / checkpoint_only_attention "
                             "(a block recomputed without its call hooks would compute with the weights left in CPU "
                             "memory); plain gradient_checkpointing recomputes every block's whole call")

    def _check_cuda_graphs(self) -> None:
        """CUDA graphs replay kernels on the addresses they were recorded with: weights and gradients must stay put
        from one step to the next."""
        key = f"performance.compile_mode: {self.performance.compile_mode} (CUDA graphs)"
        if self.strategy not in ("single", "ddp"):
            raise ValueError(f"{key} needs strategy single or ddp: {self.strategy} gathers or moves the weights "
                             f"every step")
        if self.gradient_accumulation_steps > 1:
            raise ValueError(f"{key} needs gradient_accumulation_steps 1: a recorded backward writes its gradients "
                             f"where the next micro step's replay writes again")
        if self.optimizer.fused_back_pass:
            raise ValueError(f"{key} does not go with optimizer.fused_back_pass: it steps weights inside backward")

    def _check_layer_filter(self, denoiser_targets: str) -> None:
        lora = self.lora
        if not checked_layer_filter(lora, "lora"):
            return
        if getattr(lora, denoiser_targets) is not None:
            raise ValueError(f"lora.layer_filter: chooses the {denoiser_targets[:-len('_targets')]} modules, and so "
                             f"does lora.{denoiser_targets}; set one of them")
        if "preset" in lora.model_fields_set and lora.preset != "default":
            raise ValueError(f"lora.layer_filter: replaces lora.preset ({lora.preset!r}); set one of them")

    def _check_sample_prompts(self, family) -> None:
        """Each sample prompt's sides on the family's pixel grid (else its pipeline refuses, fails or resizes them,
        after training has run up to the first sampling point), a negative prompt, a sampler and a guidance rescale
        only where the pipeline uses them, and its guidance scale, the family's when unset."""
        multiple = family.sample_pixel_multiple or family.pixel_multiple
        for i, prompt in enumerate(self.sampling.prompts):
            for key in ("width", "height"):
                value = getattr(prompt, key)
                if value is not None and value % multiple:
                    nearest = max(multiple, round(value / multiple) * multiple)
                    raise ValueError(f"sampling.prompts[{i}].{key}: {value} is not a multiple of {multiple}, the pixel "
                                     f"grid of {self.model.family} samples; use {nearest}")
            if prompt.negative_prompt and not family.sample_negative_prompt:
                raise ValueError(f"sampling.prompts[{i}].negative_prompt: {self.model.family} samples without "
                                 "classifier-free guidance (its pipeline would ignore the negative prompt); remove it")
            if prompt.guidance_scale is None:
                prompt.guidance_scale = family.sample_guidance_scale
            if prompt.sampler not in (None, "auto", *family.samplers):
                raise ValueError(f"sampling.prompts[{i}].sampler: {prompt.sampler} does not fit {self.model.family} "
                                 f"(allowed: auto, {', '.join(family.samplers)})")
            if prompt.guidance_rescale and not family.sample_guidance_rescale:
                raise ValueError(f"sampling.prompts[{i}].guidance_rescale: {self.model.family}'s pipeline "
                                 f"({family.pipeline_class}) has no guidance_rescale; remove it (SD 1.x / 2.x / SDXL "
                                 "only)")
            given = len(prompt.reference_images())
            if family.takes_reference_images and given > family.max_reference_images:
                from ot_dist.train.references import several_reference_families

                takers = [name for name in several_reference_families()
                          if get_family(name).max_reference_images >= given]
                raise ValueError(f"sampling.prompts[{i}].reference_image: {given} reference images for the prompt "
                                 f"{prompt.prompt[:40]!r}, and {self.model.family} takes at most "
                                 f"{family.max_reference_images}; {', '.join(takers) or 'no family'} take {given}")

    def resolutions(self) -> list[int]:
        return sorted(set(self.resolution)) if isinstance(self.resolution, list) else [self.resolution]

    @model_validator(mode="after")
    def _combinations(self) -> "TrainConfig":
        family = get_family(self.model.family)
        if self.data.bucket_step is None:
            self.data.bucket_step = family.bucket_step
        if self.data.bucket_step % family.pixel_multiple:
            raise ValueError(f"data.bucket_step: {self.data.bucket_step} is not a multiple of {family.pixel_multiple}, "
                             f"the pixel grid of {self.model.family} latents")
        for r in self.resolutions():
            # Bucket sides are multiples of bucket_step: another resolution would silently train at the nearest one.
            if r < self.data.bucket_step or r % self.data.bucket_step:
                raise ValueError(
                    f"resolution: {r} is not a multiple of data.bucket_step {self.data.bucket_step} (bucket sides are "
                    f"multiples of it, so square images would train at "
                    f"{max(1, round(r / self.data.bucket_step)) * self.data.bucket_step} px); choose a multiple, or "
                    f"lower data.bucket_step (a multiple of {family.pixel_multiple} for {self.model.family})")
        if self.performance.records_cuda_graphs:
            self._check_cuda_graphs()
        if self.performance.channels_last == "on" and self.strategy not in CHANNELS_LAST_STRATEGIES:
            raise ValueError(f"performance.channels_last: on needs strategy {' or '.join(CHANNELS_LAST_STRATEGIES)}: "
                             f"{self.strategy} cannot take channels_last weights (FSDP2 shards contiguous weights only, "
                             "DeepSpeed broadcasts and flattens each weight as bytes); use auto (channels_last where "
                             "the strategy allows it) or off")
        if self.activation_offloading and not self.gradient_checkpointing:
            raise ValueError("activation_offloading: offloads what gradient checkpointing keeps for backward (the "
                             "checkpointed blocks' inputs); set gradient_checkpointing: true")
        if self.performance.selective_checkpointing and not self.gradient_checkpointing:
            raise ValueError("performance.checkpoint_every_n_blocks / checkpoint_only_attention choose what "
                             "gradient_checkpointing recomputes; set gradient_checkpointing: true")
        self._check_block_offload(family.denoiser)
        self._check_quantization(family.denoiser)
        parts = self.part_names()
        for name in PART_FIELDS:
            if name not in parts and getattr(self, name) != PartConfig():
                raise ValueError(
                    f"{name}: model family {self.model.family} has no {name} (it has: {', '.join(parts)})"
                )
        denoiser_targets = f"{family.denoiser}_targets"
        for key in ("unet_targets", "transformer_targets", "prior_targets"):
            if key != denoiser_targets and getattr(self.lora, key) is not None:
                raise ValueError(f"lora.{key}: model family {self.model.family} has a {family.denoiser}; "
                                 f"use lora.{denoiser_targets}")
        if self.lora.file_layout == "kohya" and family.lora_file_prefixes is None:
            raise ValueError(f"lora.file_layout: {self.model.family} has no kohya LoRA names yet; use diffusers")
        self._check_layer_filter(denoiser_targets)
        if (self.lora.variant == "oft" and self.lora_file_layout() != "kohya"
                and not family.lora_oft_diffusers_layout):
            if family.lora_file_prefixes is not None:  # SD 1.x / 2.x / SDXL / Stable Cascade: kohya names only
                raise ValueError("lora.file_layout: variant oft of a UNet family is written in the kohya / LyCORIS "
                                 "layout ComfyUI reads (oft_blocks); set kohya (diffusers has no OFT loader)")
            written = ", ".join(n for n in FAMILY_NAMES if get_family(n).lora_oft_diffusers_layout)
            raise ValueError(f"lora.variant: oft is not written for {self.model.family}: ComfyUI's names for its LoRA "
                             "modules (fused q | k | v, or a mapping not checked for OFT) would not apply the trained "
                             f"rotation; oft is written for the kohya-layout families and {written}")
        if self.lora.variant == "oft" and self.lora.dropout:
            raise ValueError("lora.dropout: variant oft has no dropout here (OneTrainer's OFT_2 drops whole "
                             "rotation blocks, not implemented); set it to 0")
        if self.lora.variant in ("loha", "lokr") and self.lora.dropout:
            raise ValueError(f"lora.dropout: peft's {self.lora.variant} has no dropout on the adapter input (only rank / "
                             "module dropout, another regularizer); set it to 0 or use variant lora / dora")
        for key in ("rank_dropout", "module_dropout"):
            if self.lora.variant != "lora" and getattr(self.lora, key):
                raise ValueError(f"lora.{key}: kohya's {key} of a plain LoRA (networks.lora); lora.variant "
                                 f"{self.lora.variant} has no such dropout here (set it to 0 or use variant lora)")
        if self.lora.variant != "lora" and self.lora.init_from:
            raise ValueError(f"lora.init_from: starts plain LoRA adapters from a file; lora.variant {self.lora.variant} "
                             "cannot start from one (use variant lora, or start from zero)")
        presets = ("all_linear", "all_layers", *family.denoiser_lora_presets)
        if self.lora.preset not in presets:
            raise ValueError(f"lora.preset: {self.lora.preset!r} is not a preset of {self.model.family} "
                             f"(allowed: {', '.join(presets)})")
        for encoder in ("text_encoder", "text_encoder_2"):
            if getattr(self.model, f"{encoder}_layer_skip") and encoder not in family.layer_skip_encoders:
                takes = ", ".join(f"model.{e}_layer_skip" for e in family.layer_skip_encoders) or "none"
                raise ValueError(f"model.{encoder}_layer_skip: {self.model.family} has no layer skip for {encoder} "
                                 f"(it takes: {takes})")
        prior_concepts = [f"data.concepts[{i}]" for i, concept in enumerate(self.data.concepts)
                          if concept.type == "prior_prediction"]
        if prior_concepts and self.method != "lora":
            raise ValueError(f"{prior_concepts[0]}.type: prior_prediction trains towards the model's prediction "
                             f"without its LoRA; method {self.method} has no such model (it needs method lora)")
        if self.masked_training.prior_preservation_weight and not (self.masked_training.enabled
                                                                    and self.method == "lora"):
            raise ValueError("masked_training.prior_preservation_weight: the prior is the model without its LoRA; it "
                             "needs method lora and masked_training.enabled: true")
        weight_fn = self.loss.weighting()[0]
        if family.objective_kind() == "flow":
            if self.loss.min_snr_gamma is not None:
                raise ValueError(f"loss.min_snr_gamma: min-SNR weighting is defined for DDPM objectives; "
                                 f"{self.model.family} trains with flow matching (turn it off)")
            if weight_fn in ("MIN_SNR_GAMMA", "P2", "DEBIASED_ESTIMATION"):
                raise ValueError(f"loss.weight_fn: {weight_fn} is defined for DDPM objectives (from the SNR); "
                                 f"{self.model.family} trains with flow matching (SIGMA or CONSTANT)")
            if self.loss.pseudo_huber_strength and self.loss.pseudo_huber_threshold()[0] == "snr":
                raise ValueError(f"loss.pseudo_huber_schedule: snr (the default) reads the DDPM schedule's "
                                 f"alphas_cumprod; {self.model.family} trains with flow matching, which has none (kohya's "
                                 "Flux / SD3 scripts stop there too): set it to exponential or constant")
            if self.loss.generalized_offset_noise:
                raise ValueError(f"loss.generalized_offset_noise: needs DDPM betas; {self.model.family} trains with "
                                 "flow matching (use plain offset noise)")
            if self.model.prediction_type != "auto":
                raise ValueError(f"model.prediction_type: {self.model.family} trains with flow matching, whose "
                                 "target is always noise - latents; leave it at auto")
        else:
            if weight_fn == "SIGMA":
                raise ValueError(f"loss.weight_fn: SIGMA weights by the flow-matching noise level; {self.model.family} "
                                 "is a DDPM family (MIN_SNR_GAMMA, P2, DEBIASED_ESTIMATION or CONSTANT)")
            if self.loss.dynamic_timestep_shifting != "auto":  # OneTrainer's DDPM / Würstchen setups ignore it
                raise ValueError(f"loss.dynamic_timestep_shifting: shifts flow-matching timesteps by the resolution; "
                                 f"{self.model.family} is not a flow-matching family (leave it at auto; "
                                 "loss.timestep_shift shifts its draw by a fixed k)")
        if self.model.zero_terminal_snr and family.zero_terminal_snr_refusal:
            raise ValueError(f"model.zero_terminal_snr: rescales the DDPM betas of a UNet family (SD 1.x / 2.x / "
                             f"SDXL); {self.model.family} {family.zero_terminal_snr_refusal}")
        if self.model.inpainting and family.inpaint_pipeline_class is None:
            raise ValueError(f"model.inpainting: model family {self.model.family} has no inpainting models")
        if self.data.video_frames is not None:
            from ot_dist.data.video import check_clip_settings
            from ot_dist.errors import ConfigError

            try:  # a video family and a frame count its VAE takes (checked again at build and train start)
                check_clip_settings(self.data, family)
            except ConfigError as err:
                raise ValueError(str(err)) from None
            if self.masked_training.enabled:
                raise ValueError("masked_training: video clips (data.video_frames) have no masks yet; turn "
                                 "masked_training off")
        if self.sampling.prompts and not family.samplers:
            raise ValueError(f"sampling.prompts: ot_dist does not sample {self.model.family} during training yet; "
                             "remove the prompts")
        for name in self.model.component_files:
            if name not in family.component_files:
                takes = ", ".join(family.component_files) or "none"
                raise ValueError(f"model.component_files.{name}: {self.model.family} takes no {name} from a separate "
                                 f"file (it takes: {takes})")
        if self.model.decoder is not None and family.decoder_pipeline_class is None:
            raise ValueError(f"model.decoder: {self.model.family} has no separate decoder stages (its pipeline "
                             "decodes by itself); remove it")
        if self.sampling.prompts and family.decoder_pipeline_class and self.model.decoder is None:
            raise ValueError(f"model.decoder: sampling {self.model.family} needs its decoder stages: set it to a "
                             f"{family.decoder_pipeline_class} folder (or remove sampling.prompts)")
        self._check_sample_prompts(family)
        if self.sampling.sampler not in ("auto", *family.samplers):
            raise ValueError(f"sampling.sampler: {self.sampling.sampler} does not fit {self.model.family} "
                             f"(allowed: auto, {', '.join(family.samplers)})")
        if self.method == "embedding" and not family.embedding_keys:
            raise ValueError(f"method: model family {self.model.family} has no text encoder that takes embeddings")
        if self.method == "embedding" and self.embedding.output_embedding:
            check_output_embedding("embedding.output_embedding", self, family)
        check_token_case(self, family)
        check_additional_embeddings(self, family)
        if self.preserve_embedding_norm and self.method != "embedding" and not any(
                entry.train for entry in self.additional_embeddings):
            raise ValueError(f"preserve_embedding_norm: method {self.method} trains no embedding vectors here (no "
                             "additional_embeddings entry with train: true); turn it off or add one")
        if self.strategy in ("fsdp", "zero1", "zero2", "zero3"):
            for name in self.part_names():
                if getattr(self, name).stop_training_after is not None:
                    raise ValueError(
                        f"{name}.stop_training_after: not supported with strategy {self.strategy} yet "
                        "(sharded parameters cannot leave training mid-run); use strategy single or ddp"
                    )
        if self.trained_weight_dtype == "bfloat16":
            if self.train_dtype != "bfloat16":
                raise ValueError(
                    "trained_weight_dtype: bfloat16 weights need train_dtype: bfloat16 (the forward pass computes in "
                    f"the weights' dtype), not {self.train_dtype}"
                )
            if self.strategy not in ("single", "ddp"):
                why = (
                    "FSDP2 owns the storage of its parameter shards, so the float32 update cannot be swapped in"
                    if self.strategy == "fsdp"
                    else "DeepSpeed keeps float32 master partitions itself (deepspeed.mixed_precision: engine holds "
                    "the weights in bfloat16)"
                )
                raise ValueError(f"trained_weight_dtype: bfloat16 is not supported with strategy {self.strategy}: {why}")
        if self.strategy == "ddp" and self.ddp.reduce_rounding == "stochastic" and (
                self.trained_weight_dtype != "bfloat16" or self.ddp.reduce_dtype != "float32"):
            raise ValueError(
                "ddp.reduce_rounding: stochastic rounds float32 averages back into bfloat16 gradients; it needs "
                f"trained_weight_dtype: bfloat16 (is {self.trained_weight_dtype}) and ddp.reduce_dtype: float32 (is "
                f"{self.ddp.reduce_dtype}), else nothing is rounded")
        if self.method == "embedding":
            for name in self.part_names():
                if getattr(self, name).train:
                    raise ValueError(
                        f"{name}.train: method embedding trains only the embedding vectors; "
                        f"set {name}.train to false or use method full / lora"
                    )
        elif not any(self.part_trains(name) for name in self.part_names()):
            raise ValueError(
                f"method {self.method}: nothing to train; set {family.denoiser}.train or a text encoder's train to true"
            )
        if (self.strategy.startswith("zero") and self.train_dtype == "float16"
                and self.deepspeed.mixed_precision == "autocast"):
            raise ValueError(
                "deepspeed.mixed_precision: autocast with train_dtype float16 is not supported: DeepSpeed 0.19's ZeRO "
                "clips the gradients by their norm before its GradScaler unscales them, and skips an overflowing step "
                "without lowering the GradScaler's scale (every later step overflows too); use engine (DeepSpeed's "
                "fp16 engine) or train_dtype bfloat16"
            )
        for field, storage in self.storage_settings().items():
            if storage in QUANTIZED_STORAGE and self.strategy not in ("single", "ddp"):
                raise ValueError(f"{field}: {storage} storage is supported with strategy single or ddp, not "
                                 f"{self.strategy} (sharding would split the stored weights from their scales)")
        if self.model.inpainting and self.data.cache_latents:
            raise ValueError("data.cache_latents: an inpainting finetune encodes each step's masked image with the "
                             "VAE; turn cache_latents off")
        if self.data.cache_text and (self.method == "embedding" or any(
                self.part_trains(n) for n in self.part_names() if n != family.denoiser)):
            raise ValueError("data.cache_text: the text encoders' outputs change while they (or an embedding) train; "
                             "turn cache_text off or freeze the text encoders")
        if self.data.cache_text:
            from ot_dist.data.captions import caption_options

            every_n = [label for label, c in self.data.concept_list() if c.caption_dropout_every_n_epochs]
            if every_n:  # an epoch's choice, not a draw: cached versions are read in other epochs than their own
                raise ValueError(f"data.cache_text: {every_n[0]}.caption_dropout_every_n_epochs empties the captions "
                                 "of given epochs, which cached text (also with text_variations) cannot follow; turn "
                                 "cache_text off or the option off")
            varied = [(label, options) for label, c in self.data.concept_list()
                      if (options := caption_options(c)) and c.text_variations == 1]
            if varied:
                label, options = varied[0]
                raise ValueError(f"data.cache_text: {label} varies its captions every epoch or changes them as they "
                                 f"are read ({label}.{options[0]}), which a cache of each stored caption's encoding "
                                 f"cannot follow; set {label}.text_variations to N > 1 to cache N varied versions of "
                                 "each caption (N times the cache's size), or turn cache_text off or the option off")
        if (self.checkpoint.on_nonfinite_loss == "skip_step" and self.strategy.startswith("zero")
                and self.checkpoint.step_guard != "lagged"):
            raise ValueError(
                f"checkpoint.on_nonfinite_loss: skip_step with strategy {self.strategy} needs checkpoint.step_guard: "
                "lagged (the step is skipped on the device): DeepSpeed reduces the gradients during backward and "
                "steps in one call, so the blocking guard cannot drop a step; use stop or step_guard: lagged"
            )
        if self.checkpoint.step_guard == "lagged" and (reason := self._no_device_skip()):
            raise ValueError(f"checkpoint.step_guard: lagged needs an optimizer step that skips on the device; {reason}. "
                             "Use auto or blocking")
        check_optimizer_setup(self)
        # A feature whose optional package is missing is refused here, in one line naming the extra.
        if self.strategy.startswith("zero") and (hint := missing_extra("deepspeed")):
            raise ValueError(f"strategy: {self.strategy} {hint}")
        if hint := missing_extra(SPECS[self.optimizer.name].target.partition(":")[0]):
            raise ValueError(f"optimizer.name: {self.optimizer.name} {hint}")
        nf4 = [field for field, storage in self.storage_settings().items() if storage == "nf4"]
        if nf4 and (hint := missing_extra("bitsandbytes")):
            raise ValueError(f"{nf4[0]}: nf4 {hint}")
        return self

    def lora_file_layout(self) -> str:
        """The layout lora.safetensors is written in: lora.file_layout with auto resolved for the family."""
        if self.lora.file_layout != "auto":
            return self.lora.file_layout
        return "diffusers" if get_family(self.model.family).lora_file_prefixes is None else "kohya"

    def _no_device_skip(self) -> str | None:
        """Why checkpoint.step_guard: lagged cannot work here, as far as the config tells (the trainer checks the
        built optimizer too: ot_dist/train/device_skip.py)."""
        from ot_dist.parallel.zero_skip import zero_device_skip_unavailable

        optimizer = self.optimizer
        if self.strategy.startswith("zero") and (reason := zero_device_skip_unavailable(self)):
            return f"strategy {self.strategy}, {reason}"
        if self.train_dtype == "float16":
            return "train_dtype float16: the loss scaler decides the step on its own overflow check"
        if optimizer.name not in ("ADAM", "ADAMW", "SGD", "PRODIGY"):
            return f"optimizer.name: {optimizer.name} cannot skip an update on the device (ADAM, ADAMW, SGD, PRODIGY can)"
        if optimizer.name != "PRODIGY" and optimizer.fused is False:
            return "optimizer.fused: false keeps torch's foreach kernels, which cannot skip an update on the device"
        if optimizer.fused_back_pass:
            return "optimizer.fused_back_pass: parameters are stepped during backward, before the loss is checked"
        return None

    def part_names(self) -> tuple[str, ...]:
        """The trainable parts this family has: its denoiser and its text encoders."""
        family = get_family(self.model.family)
        return (family.denoiser,) + family.text_encoders

    def storage_settings(self) -> dict[str, str]:
        """Every storage setting that applies, by its field: weight_dtype, then the overrides."""
        settings = {"weight_dtype": self.weight_dtype}
        if self.vae_weight_dtype is not None:
            settings["vae_weight_dtype"] = self.vae_weight_dtype
        for name in self.part_names():
            if getattr(self, name).weight_dtype is not None:
                settings[f"{name}.weight_dtype"] = getattr(self, name).weight_dtype
        return settings

    def storage_field(self, component: str) -> str:
        """The setting that says how a component's frozen weights are stored: a part by its name (`transformer`,
        `text_encoder_2`), the latent encoder as `vae`, each by its own override where set; anything else (a decoder
        loaded for samples) follows weight_dtype."""
        if component == "vae":
            return "vae_weight_dtype" if self.vae_weight_dtype is not None else "weight_dtype"
        if component in self.part_names() and getattr(self, component).weight_dtype is not None:
            return f"{component}.weight_dtype"
        return "weight_dtype"

    def component_storage(self, component: str) -> str:
        """How a component's frozen weights are stored (storage_field names the setting)."""
        return self.storage_settings()[self.storage_field(component)]

    def streams_trained_weights(self) -> bool:
        """A full finetune whose denoiser streams blocks: their trained weights stream too
        (memory/trained_streaming.py)."""
        denoiser = get_family(self.model.family).denoiser
        return bool(getattr(self, denoiser).offload_fraction) and self.method == "full" and self.part_trains(denoiser)

    def part_trains(self, name: str) -> bool:
        """Whether a part trains, with the method's default applied."""
        explicit = getattr(self, name).train
        if explicit is not None:
            return explicit
        return name == get_family(self.model.family).denoiser and self.method != "embedding"

    def part_learning_rate(self, name: str) -> float:
        return getattr(self, name).learning_rate or self.learning_rate

    def additional_learning_rate(self, entry: AdditionalEmbeddingConfig) -> float:
        return entry.learning_rate or self.embedding.learning_rate or self.learning_rate

    def stop_rule(self, group: str):
        """The config section whose `stopped(epoch, step)` applies to parameter group `group` (a part, an additional
        embedding's "embedding/<token>"), or None."""
        if group in self.part_names():
            return getattr(self, group)
        return next((e for e in self.additional_embeddings if e.group_name() == group), None)
