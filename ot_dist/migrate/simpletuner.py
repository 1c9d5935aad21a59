"""`ot-dist import simpletuner`: a SimpleTuner setup (config/config.json, config.toml or config.env, with its
multidatabackend.json, lycoris_config.json and user_prompt_library) as an ot_dist config that validates.

Every argument the setup sets either maps to an ot_dist key with the same meaning, is noted as one that changes how
SimpleTuner runs but not what it trains (attention kernels, caches, trackers, uploads), or is listed with the reason
it is not honoured, in the written file and on stderr. An argument the setup leaves out takes SimpleTuner's default
(simpletuner_defaults.ARGS, read from its own parser), so where SimpleTuner's default differs from ot_dist's its value
is written: learning rate 4e-7, batch 4, one epoch, gradient checkpointing, a 10% caption dropout, LoRA rank 16 with
alpha = rank, checkpoints every 500 steps (5 kept), Flux's guidance 1.0 and the flow models' shift 3.0.

This module drives the import and maps the model, the method, the precision, the run's length, the gradient clip,
EMA and saves; the other groups have their own modules: simpletuner_network (LoRA / LyCORIS), simpletuner_optim,
simpletuner_loss, simpletuner_dataset (multidatabackend.json), simpletuner_samples (validation images);
simpletuner_args reads the config, simpletuner_defaults holds SimpleTuner's defaults."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import ACCELERATE_PRECISION, Imported, list_unread, local_path, note_local_model
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs, read_args
from ot_dist.migrate.simpletuner_dataset import import_dataset
from ot_dist.migrate.simpletuner_loss import import_loss
from ot_dist.migrate.simpletuner_network import import_network
from ot_dist.migrate.simpletuner_optim import import_optimizer, import_scheduler
from ot_dist.migrate.simpletuner_samples import import_samples
from ot_dist.models.families.registry import get_family

# SimpleTuner's (model_family, model_flavour) of an edit model -> ot_dist's family: the base family's import, with the
# conditioning datasets as the concepts' reference_path (simpletuner_dataset.py)
EDIT_FLAVOURS = {("flux", "kontext"): "flux_kontext"}
# The families that train with references or without (SimpleTuner's flux2: supports_conditioning_dataset, optional):
# a dataset naming a reference dataset in its conditioning_data gets it as reference_path, the others none
OPTIONAL_EDIT_FAMILIES = ("flux2", "flux2_klein")
# Qwen-Image-Edit (the first one; SimpleTuner's edit-v1 flavour): its 2509 / 2511 flavours take several references
EDIT_FLAVOURS[("qwen_image", "edit-v1")] = "qwen_image_edit"
# Qwen-Image-Edit-2509 (edit-v2) with one reference per sample; edit-v2+ (2509 trained with zero_cond_t forced on) and
# edit-v3 (2511) stay listed: ot_dist takes zero_cond_t from the transformer's config, not from a flavour
EDIT_FLAVOURS[("qwen_image", "edit-v2")] = "qwen_image_edit_plus"
# SimpleTuner's model_family -> (ot_dist's family, its denoiser part, the default flavour's model: HUGGINGFACE_PATHS)
FAMILIES = {
    "sd1x": ("sd1", "unet", "Lykon/dreamshaper-8"), "sd2x": ("sd2", "unet", "bghira/pseudo-flex-v2"),
    "sdxl": ("sdxl", "unet", "stabilityai/stable-diffusion-xl-base-1.0"),
    "sd3": ("sd3", "transformer", "stabilityai/stable-diffusion-3.5-medium"),
    "flux": ("flux", "transformer", "black-forest-labs/flux.1-krea-dev"),
    "chroma": ("chroma", "transformer", "lodestones/Chroma1-Base"),
    "pixart": ("pixart_sigma", "transformer", "terminusresearch/pixart-900m-1024-ft-v0.6"),
    "pixart_sigma": ("pixart_sigma", "transformer", "terminusresearch/pixart-900m-1024-ft-v0.6"),
    "sana": ("sana", "transformer", "Efficient-Large-Model/SANA1.5_4.8B_1024px_diffusers"),
    "qwen_image": ("qwen_image", "transformer", "Qwen/Qwen-Image-2512"),
    # FLUX.2: SimpleTuner's default flavour klein-9b; model_flavour dev is FLUX.2 [dev] (FLUX2_FLAVOURS)
    "flux2": ("flux2_klein", "transformer", "black-forest-labs/FLUX.2-klein-base-9B"),
    "hidream": ("hidream", "transformer", "HiDream-ai/HiDream-I1-Full"),
    "lumina2": ("lumina2", "transformer", "Alpha-VLLM/Lumina-Image-2.0"),
}
# Wan: the default flavour t2v-480p-1.3b-2.1; ot_dist trains the single-transformer text-to-video flavours on images
FAMILIES["wan"] = ("wan", "transformer", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
WAN_FLAVOURS = ("t2v-480p-1.3b-2.1", "t2v-480p-14b-2.1")
# SimpleTuner's Wan 2.2 T2V A14B stages (WAN_STAGE_OVERRIDES, base Wan2.2-T2V-A14B-Diffusers) -> model.wan_expert;
# its I2V / FLF2V A14B stages are image-to-video, which ot_dist refuses
WAN_EXPERT_FLAVOURS = {"animegen-t2v-high": "high_noise", "animegen-t2v-low": "low_noise"}
# Z-Image: the default flavour turbo-ostris-v2 is Z-Image-Turbo (trained through an assistant LoRA)
FAMILIES["z_image"] = ("z_image", "transformer", "TONGYI-MAI/Z-Image-Turbo")
# Ideogram 4: SimpleTuner loads its own checkpoint format (the default flavour's ideogram-ai/ideogram-4-fp8: original
# names, float8 weights), ot_dist a diffusers Ideogram4Pipeline folder (written as the path; the flavour is noted)
FAMILIES["ideogram"] = ("ideogram4", "transformer", "ideogram-ai/ideogram-4-fp8")
# flavours SimpleTuner trains through ostris' assistant LoRA (ZImage.ASSISTANT_LORA_FLAVOURS), or with a transformer
# from another repository (TRANSFORMER_PATH_OVERRIDES)
Z_IMAGE_ASSISTED = ("turbo", "turbo-ostris-v2")
# ERNIE-Image: SimpleTuner's model_family ernie, default flavour base (baidu/ERNIE-Image; turbo: ERNIE-Image-Turbo)
FAMILIES["ernie"] = ("ernie_image", "transformer", "baidu/ERNIE-Image")
# model_family -> {model_flavour: ot_dist's family} where a flavour is another ot_dist family (SimpleTuner's Flux2
# picks Mistral-3 for dev and Qwen3 for its klein flavours by the flavour, not by the folder)
FLAVOUR_FAMILIES = {"flux2": {"dev": "flux2"}}
# SimpleTuner's Qwen-Image check_user_config aligns buckets to 32 pixels (the other image models: 64)
BUCKET_ALIGNMENT = {"qwen_image": 32}
# Anima: SimpleTuner's own Anima classes (helpers/models/anima, the adapter inside its transformer; the same flow step:
# t = sigma, target n - x) on the same weights; its default flavour preview-3 (SD.Next's diffusers folder), buckets
# aligned to 16 pixels (check_user_config); the gazingstars123-2.9b flavour is a single file of another size
FAMILIES["anima"] = ("anima", "transformer", "CalamitousFelicitousness/Anima-Preview-3-sdnext-diffusers")
BUCKET_ALIGNMENT["anima"] = 16
# model_family -> its flavours whose transformer SimpleTuner reads from a single file ot_dist does not read
SINGLE_FILE_FLAVOURS = {"anima": ("gazingstars123-2.9b",)}
LORA_KEYS = ("lora_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_init_type", "use_dora", "lycoris_config",
             "flux_lora_target", "peft_lora_target_modules", "init_lora")
FLOAT8 = ("fp8-torchao", "fp8-quanto", "fp8uz-quanto", "fp8-sdnq")
# Arguments that change how SimpleTuner runs, not what it trains: noted, not listed as not honoured.
NO_EFFECT = {
    "report_to": "logging (ot_dist: MLflow)", "tracker_project_name": "logging", "tracker_run_name": "logging",
    "tracker_image_layout": "logging", "logging_dir": "logging", "push_to_hub": "upload", "hub_model_id": "upload",
    "push_checkpoints_to_hub": "upload", "push_to_hub_background": "upload", "model_card_safe_for_work": "upload",
    "model_card_note": "upload", "resume_from_checkpoint": "resuming (`ot-dist train --resume`)",
    "disable_benchmark": "the first validation", "validation_torch_compile": "compilation",
    "enable_xformers_memory_efficient_attention": "attention kernel", "attention_mechanism": "attention kernel",
    "vae_cache_ondemand": "latent cache", "vae_cache_scan_behaviour": "latent cache", "vae_batch_size": "latent cache",
    "text_encoder_batch_size": "text cache", "write_batch_size": "caching", "read_batch_size": "caching",
    "aspect_bucket_worker_count": "bucketing workers", "image_processing_batch_size": "image loading",
    "metadata_update_interval": "metadata", "dataloader_prefetch": "loader", "dataloader_prefetch_qlen": "loader",
    "torch_num_threads": "threads", "aws_max_pool_connections": "uploads", "allow_tf32": "TF32 (ot_dist: tf32)",
    "disable_tf32": "TF32 (ot_dist: tf32)", "num_processes": "the launch (`ot-dist launch`)",
    "num_machines": "the launch (`ot-dist launch`)", "accelerate_config": "the launch",
    "accelerate_extra_args": "the launch", "dynamo_backend": "compilation", "webhook_config": "notifications",
    "aspect_bucket_rounding": "the aspect rounding of bucket keys",
    "validation_seed_source": "validation noise device", "hub_model_name": "upload", "webhook_reporting_interval":
    "notifications", "quantize_via": "where weights are quantised",
}


def import_simpletuner(config: str, backend_file: str | None = None, lycoris_file: str | None = None,
                       library_file: str | None = None, root: str | None = None) -> Imported:
    args = read_args(config, root)
    out = Imported({}, origins={})
    c = out.config
    family, denoiser = _model(args, c, out)
    method = str(args["model_type"])
    if method not in ("lora", "full"):
        raise ConfigError(f"model_type: {method} is not lora or full")
    c["method"] = method
    c["output_dir"] = str(args.path(local_path(str(args["output_dir"]), "output_dir", out)))
    _length(args, c, out)
    _precision(args, c, method, out)
    c["gradient_checkpointing"] = bool(args["gradient_checkpointing"])  # SimpleTuner's default: on
    if method == "lora":
        import_network(args, c, family, denoiser, out, lycoris_file)
    else:
        _unused(args, LORA_KEYS, "with model_type full", out)
    _text_encoders(args, c, family, method, out)
    import_optimizer(args, c, out)
    if c.get("trained_weight_dtype") == "bfloat16":
        c["optimizer"]["stochastic_rounding"] = True
    import_scheduler(args, c, out)
    _gradient_clip(args, c, family, out)
    import_loss(args, c, family, out)
    edit = EDIT_FLAVOURS.get((str(args["model_family"]), str(args["model_flavour"] or "")))
    optional = edit is None and family in OPTIONAL_EDIT_FAMILIES
    import_dataset(args, c, method, backend_file, out, references=edit is not None or optional,
                   references_optional=optional)
    if edit is not None:  # the base family's mapping above (loss, LoRA targets, samples) is the edit model's too
        c["model"]["family"] = edit
    if any("reference_path" in concept for concept in c["data"]["concepts"]):
        out.not_honoured.append("validation: SimpleTuner edits its reference dataset's images; the samples written "
                                "here draw from the prompt alone (give each sampling.prompts[] a reference_image)")
    c["data"]["bucket_step"] = BUCKET_ALIGNMENT.get(family, c["data"]["bucket_step"])
    _ema(args, c, out)
    import_samples(args, c, library_file, out)
    if edit is not None and get_family(edit).sample_reference_required and c.get("sampling", {}).get("prompts"):
        del c["sampling"]  # its pipeline cannot sample without a reference image: no prompts, no schedule
        out.not_honoured.append(f"validation prompts: {edit} samples only with a reference image; none are written "
                                "(add sampling.prompts[] with a reference_image each)")
    _saves(args, c)
    list_unread(args, out, NO_EFFECT, "SimpleTuner")
    if args.other_variables:
        out.notes.append(f"config.env: {', '.join(args.other_variables)} stand for no SimpleTuner argument (the "
                         "environment of its run); ignored")
    out.origins |= _origins(denoiser)
    out.notes.insert(0, f"imported from SimpleTuner's {args.source.name}")
    return out


def _origins(denoiser: str) -> dict[str, str]:
    """Where each ot_dist key comes from, named in a validation error (data.concepts[i] and sampling.prompts[i] are
    added by their modules)."""
    return {"model": "model_family", "model.path": "pretrained_model_name_or_path", "output_dir": "output_dir",
            "model.guidance_scale": "flux_guidance_value", "model.prediction_type": "prediction_type",
            "epochs": "num_train_epochs / max_train_steps", "max_steps": "max_train_steps",
            "batch_size": "train_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
            "learning_rate": "learning_rate", "train_dtype": "mixed_precision", "weight_dtype": "mixed_precision",
            "vae_weight_dtype": "vae_dtype",
            "clip_grad_norm": "max_grad_norm", "seed": "seed", "optimizer": "optimizer / optimizer_config",
            "scheduler": "lr_scheduler", "scheduler.warmup_steps": "lr_warmup_steps", "lora": "lora_type",
            "lora.rank": "lora_rank / linear_dim", "lora.alpha": "lora_alpha / linear_alpha",
            f"lora.{denoiser}_targets": "flux_lora_target / peft_lora_target_modules", "lora.init_from": "init_lora",
            "loss": "the loss arguments", "loss.offset_noise_weight": "noise_offset", "loss.min_snr_gamma": "snr_gamma",
            "loss.timestep_shift": "flow_schedule_shift", "loss.logit_normal_std": "flow_sigmoid_scale",
            "loss.input_perturbation": "input_perturbation", "resolution": "resolution / resolution_type",
            "data": "data_backend_config", "ema": "use_ema", "ema.decay": "ema_decay",
            "ema.update_step_interval": "ema_update_interval", "sampling": "validation_prompt / user_prompt_library",
            "sampling.every_n_steps": "validation_step_interval", "sampling.every_n_epochs": "validation_epoch_interval",
            "checkpoint.every_n_steps": "checkpoint_step_interval",
            "checkpoint.every_n_epochs": "checkpoint_epoch_interval", "checkpoint.keep_last": "checkpoints_total_limit",
            "text_encoder": "train_text_encoder / text_encoder_lr", "text_encoder_2": "train_text_encoder"}


def _model(args: SimpleTunerArgs, c: dict, out: Imported) -> tuple[str, str]:
    name = args["model_family"]
    if not name:
        raise ConfigError(f"model_family: not set (SimpleTuner needs it: {', '.join(FAMILIES)} are the families "
                          "ot_dist trains)")
    if name not in FAMILIES:
        raise ConfigError(f"model_family: {name} is not a model family ot_dist trains ({', '.join(FAMILIES)})")
    family, denoiser, default_path = FAMILIES[name]
    family = FLAVOUR_FAMILIES.get(name, {}).get(args["model_flavour"], family)
    path = args["pretrained_model_name_or_path"]
    if not path:
        if args["model_flavour"]:
            raise ConfigError(f"pretrained_model_name_or_path: not set; model_flavour {args['model_flavour']} names "
                              "a hub model SimpleTuner downloads: give its local copy")
        path = default_path
        out.notes.append(f"pretrained_model_name_or_path: not set: SimpleTuner's default flavour of {name}, "
                         f"{default_path}, is written")
    elif args["model_flavour"]:
        out.notes.append(f"model_flavour: {args['model_flavour']}: the model is pretrained_model_name_or_path's")
    if name == "flux" and args["model_flavour"] == "schnell":
        out.not_honoured.append("model_flavour: schnell: SimpleTuner trains it with an assistant LoRA, which ot_dist "
                                "does not")
    if name == "qwen_image" and str(args["model_flavour"] or "").startswith("edit") and \
            (name, args["model_flavour"]) not in EDIT_FLAVOURS:
        out.not_honoured.append(f"model_flavour: {args['model_flavour']}: SimpleTuner trains Qwen-Image-Edit with "
                                "image conditioning, which ot_dist does not")
    if name == "wan" and args["model_flavour"] in WAN_EXPERT_FLAVOURS:
        out.not_honoured.append(f"model_flavour: {args['model_flavour']}: SimpleTuner reads this stage's transformer "
                                "from AnimeGen's single file; ot_dist trains model.path's expert (a Wan 2.2 T2V A14B "
                                "diffusers folder, model.wan_expert written) and keeps its times on the expert's side "
                                "of the boundary, which SimpleTuner does not")
    elif name == "wan" and args["model_flavour"] and args["model_flavour"] not in WAN_FLAVOURS:
        out.not_honoured.append(f"model_flavour: {args['model_flavour']}: ot_dist trains Wan 2.1 text-to-video and "
                                "Wan 2.2 T2V A14B experts only (no TI2V-5B, image-to-video, VACE); its folder is "
                                "refused")
    if name == "z_image":
        _z_image(args, out)
    if args["model_flavour"] in SINGLE_FILE_FLAVOURS.get(name, ()):
        out.not_honoured.append(f"model_flavour: {args['model_flavour']}: SimpleTuner loads its transformer from a "
                                f"single file, a layout ot_dist does not read for {name}; model.path must be a "
                                "diffusers folder")
    if name == "ideogram":
        _ideogram(args, out)
    if name == "sana":
        _sana(args, out)
    if name == "lumina2":
        _lumina2(args, out)
    if args.given("aspect_bucket_alignment"):
        step = BUCKET_ALIGNMENT.get(family, 64)
        out.notes.append(f"aspect_bucket_alignment: SimpleTuner's {name} aligns buckets to {step} pixels whatever "
                         f"it says; data.bucket_step {step} is written")
    args["aspect_bucket_alignment"]
    path = local_path(str(path), "pretrained_model_name_or_path", out)
    note_local_model(path, "pretrained_model_name_or_path", out)
    c["model"] = {"family": family, "path": path}
    if name == "wan" and args["model_flavour"] in WAN_EXPERT_FLAVOURS:
        c["model"]["wan_expert"] = WAN_EXPERT_FLAVOURS[args["model_flavour"]]
    for key in ("pretrained_transformer_model_name_or_path", "pretrained_unet_model_name_or_path"):
        if args[key]:
            out.not_honoured.append(f"{key}: {args[key]}: a separate denoiser is not supported (model.path's is used)")
    vae = args["pretrained_vae_model_name_or_path"]
    if vae and (family in ("sdxl", "pixart_sigma") or "sdxl" not in str(vae)):  # SimpleTuner drops an SDXL VAE
        default = "" if args.given("pretrained_vae_model_name_or_path") else " (SimpleTuner's default for SDXL / PixArt)"
        out.not_honoured.append(f"pretrained_vae_model_name_or_path: {vae}{default}: a replacement VAE is not "
                                "supported (model.path's own VAE is used)")
    _prediction(args, c, family, out)
    if family in ("flux", "flux2"):  # SimpleTuner's Flux2 reads the same flux_guidance_* arguments
        c["model"]["guidance_scale"] = float(args["flux_guidance_value"])  # SimpleTuner's 1.0, as ot_dist's default
        if args["flux_guidance_mode"] != "constant":
            out.not_honoured.append(f"flux_guidance_mode: {args['flux_guidance_mode']}: a guidance drawn per step is "
                                    "not supported; flux_guidance_value is written")
    return family, denoiser


def _z_image(args, out: Imported) -> None:
    """SimpleTuner trains its Z-Image-Turbo flavours through ostris' training adapter, an assistant LoRA loaded beside
    the trained one (ot_dist trains the model as it is); ostris-de-turbo replaces the transformer."""
    flavour = args["model_flavour"] or "turbo-ostris-v2"
    if flavour in Z_IMAGE_ASSISTED and not args["disable_assistant_lora"]:
        out.not_honoured.append(f"model_flavour: {flavour}: SimpleTuner trains Z-Image-Turbo through an assistant "
                                "LoRA (ostris/zimage_turbo_training_adapter), which ot_dist does not load")
    elif flavour == "ostris-de-turbo":
        out.not_honoured.append("model_flavour: ostris-de-turbo: SimpleTuner loads ostris/Z-Image-De-Turbo's "
                                "transformer; give a folder holding it as pretrained_model_name_or_path")


def _ideogram(args, out: Imported) -> None:
    """What SimpleTuner's Ideogram 4 (helpers/models/ideogram/model.py) does beyond the common loop: its checkpoint
    format, captions rewritten as Ideogram's JSON, a fused qkv LoRA, a frozen text projection."""
    out.notes.append("model_family ideogram: SimpleTuner loads Ideogram 4 in its own (original, float8) format; "
                     "pretrained_model_name_or_path must be a diffusers Ideogram4Pipeline folder for ot_dist")
    if args["ideogram_auto_json"]:
        out.not_honoured.append("ideogram_auto_json: true (SimpleTuner's default): SimpleTuner wraps each plain caption "
                                "into Ideogram's JSON caption before encoding it; ot_dist encodes captions as written")
    if args["ideogram_prompt_upsample"]:
        out.not_honoured.append("ideogram_prompt_upsample: captions rewritten by the prompt enhancer are not supported")
    if not args["peft_lora_target_modules"] and args["model_type"] == "lora":
        out.not_honoured.append("SimpleTuner's Ideogram 4 LoRA (qkv, o, w1, w2, w3) adapts the fused qkv projection "
                                "with one rank-r adapter; ot_dist adapts diffusers' separate to_q / to_k / to_v at "
                                "rank r each (more parameters, the same modules)")
    if args["model_type"] == "full":
        out.not_honoured.append("SimpleTuner freezes Ideogram 4's text projection (llm_cond_norm, llm_cond_proj) in a "
                                "full finetune; ot_dist trains the whole transformer")
    for key in ("ideogram_load_unconditional_transformer", "ideogram_uncond_ramtorch", "ideogram_validation",
                "ideogram_prompt_enhancer_head_id", "ideogram_fp8_base_upcast"):
        if args.given(key):
            out.notes.append(f"{key}: {args[key]}: ot_dist loads the unconditional transformer from model.path for "
                             "the samples and samples through Ideogram4Pipeline")
        args[key]


def _sana(args: SimpleTunerArgs, out: Imported) -> None:
    """What SimpleTuner's Sana model class (helpers/models/sana/model.py) does beyond the common loop."""
    out.not_honoured.append("model_family sana: SimpleTuner multiplies Sana's latents by 0.5 (LATENT_RESCALE, its "
                            "'calibrated latent rescale'); ot_dist trains on the DC-AE's scaled latents as "
                            "SanaPipeline and diffusers' script do")
    if args.given("tokenizer_max_length"):
        out.notes.append(f"tokenizer_max_length: {args['tokenizer_max_length']}: ignored for Sana, as in SimpleTuner "
                         "(300 tokens)")
    args["tokenizer_max_length"]


def _lumina2(args: SimpleTunerArgs, out: Imported) -> None:
    """SimpleTuner's Lumina 2 (helpers/models/lumina2/model.py): the pipeline's system prompt and 256 tokens, as
    ot_dist; another tokenizer_max_length is not."""
    length = args["tokenizer_max_length"]
    if length is not None and int(length) != 256:
        out.not_honoured.append(f"tokenizer_max_length: {length}: ot_dist encodes Lumina 2 captions at the "
                                "pipeline's 256 tokens")


def _prediction(args: SimpleTunerArgs, c: dict, family: str, out: Imported) -> None:
    """prediction_type (UNet families) and rescale_betas_zero_snr, which SimpleTuner turns on for SD 2.x."""
    prediction, zero_snr = args["prediction_type"], args["rescale_betas_zero_snr"] or family == "sd2"
    if family not in ("sd1", "sd2", "sdxl"):
        if prediction not in (None, "flow_matching", "epsilon") or args["rescale_betas_zero_snr"]:
            out.not_honoured.append(f"prediction_type / rescale_betas_zero_snr: {family} trains as its model does")
        return
    if prediction in ("epsilon", "v_prediction"):
        c["model"]["prediction_type"] = prediction
    elif prediction:
        out.not_honoured.append(f"prediction_type: {prediction} is not epsilon or v_prediction")
    if zero_snr:
        if prediction == "epsilon":
            out.not_honoured.append("rescale_betas_zero_snr: with epsilon prediction ot_dist refuses it (at SNR 0 the "
                                    "input is the noise itself); it trains v-prediction on that schedule")
        else:
            c["model"]["zero_terminal_snr"] = True


def _length(args: SimpleTunerArgs, c: dict, out: Imported) -> None:
    """SimpleTuner trains max_train_steps optimizer steps when set (num_train_epochs must then be 0), else
    num_train_epochs epochs (default 1)."""
    steps, epochs = args["max_train_steps"], args["num_train_epochs"]
    c["batch_size"] = int(args["train_batch_size"])
    c["gradient_accumulation_steps"] = int(args["gradient_accumulation_steps"])
    if steps:
        if epochs:
            raise ConfigError(f"max_train_steps: {steps} with num_train_epochs {epochs}: SimpleTuner refuses both; "
                              "set num_train_epochs 0")
        c["max_steps"] = int(steps)
        c["epochs"] = int(steps)  # every epoch takes at least one step: max_steps ends the run
        return
    if not epochs:
        raise ConfigError("num_train_epochs / max_train_steps: neither is set to a positive number")
    c["epochs"] = int(epochs)


def _precision(args: SimpleTunerArgs, c: dict, method: str, out: Imported) -> None:
    """mixed_precision is the compute dtype, and the dtype SimpleTuner loads the frozen weights in (no_change);
    base_model_precision quantises the frozen denoiser."""
    mixed = str(args["mixed_precision"])
    if mixed not in ACCELERATE_PRECISION:
        out.not_honoured.append(f"mixed_precision: {mixed}: ot_dist computes in float32, bfloat16 or float16; "
                                "bfloat16 is written")
    c["train_dtype"] = ACCELERATE_PRECISION.get(mixed, "bfloat16")
    if c["train_dtype"] != "float32":
        c["weight_dtype"] = c["train_dtype"]
    family = get_family(c["model"]["family"])
    # base_model_precision quantises the denoiser, text_encoder_<n>_precision the n-th text encoder
    quantised = {"base_model_precision": family.denoiser, **{
        f"text_encoder_{n}_precision": name for n, name in enumerate(family.text_encoders, start=1)}}
    for key, part in quantised.items():
        value = str(args[key])
        if value in FLOAT8:
            c.setdefault(part, {})["weight_dtype"] = "float8"
            out.notes.append(f"{key}: {value}: ot_dist's float8 stores {part} in one byte per weight with a "
                             "per-tensor scale")
        elif value == "nf4-bnb":
            c.setdefault(part, {})["weight_dtype"] = "nf4"
            out.notes.append(f"{key}: {value}: ot_dist's nf4 stores {part}'s Linear weights in 4-bit NF4 with "
                             "bitsandbytes (blocks of 64, double-quantized absmax, as OneTrainer's NFLOAT_4), its "
                             "other parameters in train_dtype")
        elif value != "no_change":
            out.not_honoured.append(f"{key}: {value}: integer / other 4-bit quantisation is not supported "
                                    f"({part} is stored in weight_dtype {c.get('weight_dtype', 'float32')})")
    vae = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(str(args["vae_dtype"]))
    if vae and vae != c.get("weight_dtype", "float32"):
        c["vae_weight_dtype"] = vae  # the VAE is loaded in vae_dtype, the other frozen weights in mixed_precision
    if method == "full" and args["optimizer"] == "adamw_bf16" and c["train_dtype"] == "bfloat16":
        c["trained_weight_dtype"] = "bfloat16"  # AdamWBF16 steps bfloat16 weights (ot_dist: stochastic rounding)
    if args["seed"] is None:
        out.notes.append("seed: not set (SimpleTuner draws one per run); seed 42 is written")
    else:
        c["seed"] = int(args["seed"])


def _text_encoders(args: SimpleTunerArgs, c: dict, family: str, method: str, out: Imported) -> None:
    if not args["train_text_encoder"]:
        if args["text_encoder_lr"] is not None:
            out.notes.append("text_encoder_lr: not read without train_text_encoder, as in SimpleTuner")
        return
    if method == "lora" or family not in ("sd1", "sd2", "sdxl"):
        out.not_honoured.append(f"train_text_encoder: SimpleTuner's text encoder training of a {family} {method} is "
                                "not mapped; the text encoders stay frozen")
        return
    lr = args["text_encoder_lr"]
    for part in ("text_encoder", "text_encoder_2") if family == "sdxl" else ("text_encoder",):
        c[part] = {"train": True} | ({"learning_rate": lr} if lr is not None else {})


def _gradient_clip(args: SimpleTunerArgs, c: dict, family: str, out: Imported) -> None:
    """SimpleTuner clips at max_grad_norm (2.0; PixArt: 0.01) by value (grad_clip_method's default) or by norm, and
    not at all for prodigy and optimi-stableadamw or at 0."""
    limit = args["max_grad_norm"]
    if family == "pixart_sigma" and (not args.given("max_grad_norm") or limit > 0.01):
        limit = 0.01  # SimpleTuner's PixArt overrides it unless i_know_what_i_am_doing
        if args["i_know_what_i_am_doing"]:
            limit = args["max_grad_norm"]
    if not limit or args["optimizer"] in ("prodigy", "optimi-stableadamw"):
        c["clip_grad_norm"] = None
    elif args["grad_clip_method"] == "norm":
        c["clip_grad_norm"] = float(limit)
    else:
        c["clip_grad_norm"] = None
        out.not_honoured.append(f"grad_clip_method: {args['grad_clip_method']} (SimpleTuner's default): each "
                                f"gradient element is clipped to +-{limit}; ot_dist clips the norm only; no clipping "
                                "is written (grad_clip_method norm maps)")


def _ema(args: SimpleTunerArgs, c: dict, out: Imported) -> None:
    """SimpleTuner's EMAModel (diffusers'): decay min((1 + n) / (10 + n), ema_decay), as ot_dist's."""
    if not args["use_ema"]:
        _unused(args, ("ema_decay", "ema_update_interval", "ema_device", "ema_cpu_only", "ema_validation"),
                "without use_ema", out)
        return
    device = "cpu" if args["ema_cpu_only"] or args["ema_device"] == "cpu" else "accelerator"
    c["ema"] = {"enabled": True, "decay": float(args["ema_decay"]),
                "update_step_interval": int(args["ema_update_interval"]), "device": device}
    if args["use_ema_warmup"]:
        out.not_honoured.append("use_ema_warmup: diffusers' inverse-gamma EMA warmup is not supported (ot_dist "
                                "warms up as (1 + n) / (10 + n))")


def _unused(args: SimpleTunerArgs, keys, why: str, out: Imported) -> None:
    """Keys SimpleTuner reads only in a setting this setup does not have: noted, not listed."""
    for key in keys:
        if args.given(key):
            out.notes.append(f"{key}: {args[key]!r} is not used {why}, as in SimpleTuner")
        args[key]


def _saves(args: SimpleTunerArgs, c: dict) -> None:
    """SimpleTuner saves every checkpoint_step_interval steps (500) and / or checkpoint_epoch_interval epochs, keeping
    checkpoints_total_limit (5); it has no saves on a clock (ot_dist's default: every 30 minutes)."""
    checkpoint = {"every_n_minutes": None}
    if args["checkpoint_step_interval"]:
        checkpoint["every_n_steps"] = int(args["checkpoint_step_interval"])
    if args["checkpoint_epoch_interval"]:
        checkpoint["every_n_epochs"] = int(args["checkpoint_epoch_interval"])
    limit = args["checkpoints_total_limit"]
    checkpoint["keep_last"] = int(limit) if limit else None
    c["checkpoint"] = checkpoint
