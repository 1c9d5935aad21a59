"""`ot-dist import kohya`: a kohya sd-scripts training setup (the arguments of train_network.py, sdxl_train_network.py,
sdxl_train.py, train_db.py, fine_tune.py, flux_train_network.py, sd3_train_network.py, flux_train.py, sd3_train.py or
the textual-inversion scripts as a `--config_file` TOML and / or a saved command line, with the dataset TOML, a
DreamBooth `--train_data_dir` or a fine-tuning `--in_json`) as an ot_dist config that validates.

Every argument the setup sets either maps to an ot_dist key with the same meaning, is noted as one that changes nothing
ot_dist trains (attention kernels, loader workers, logging), or is listed with the reason it is not honoured, in the
written file and on stderr: `KohyaArgs` remembers what the sections read, and whatever is left is listed. Where kohya's
default differs from ot_dist's (bucket step 64, caption extension .caption, Flux's training guidance 3.5, SD3's
unshifted timesteps, Prodigy's slice_p 1, Adafactor's relative step) kohya's value is written.

This module drives the import and maps the script (family, method), the model, the precision, the run's length and
saves; the other groups have their own modules: kohya_network (LoRA), kohya_optim, kohya_loss, kohya_dataset,
kohya_samples, kohya_metadata (fine-tuning captions), kohya_embedding (textual inversion), kohya_full (the full
finetunes' text encoders and fused steps); kohya_args reads the arguments, kohya_defaults holds kohya's defaults."""

from __future__ import annotations

from pathlib import Path

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import (ACCELERATE_PRECISION, T5_DEFAULTS, Imported, list_unread, local_path,
                                    note_local_model)
from ot_dist.migrate.kohya_args import KohyaArgs, read_args
from ot_dist.migrate.kohya_dataset import import_dataset
from ot_dist.migrate.kohya_embedding import import_embedding
from ot_dist.migrate.kohya_full import import_full_parts, import_fused_step
from ot_dist.migrate.kohya_loss import import_loss
from ot_dist.migrate.kohya_network import import_network
from ot_dist.migrate.kohya_optim import import_optimizer, import_scheduler
from ot_dist.migrate.kohya_samples import import_samples
from ot_dist.models.families.registry import get_family

SCRIPTS = {  # kohya script -> (family, None: sd1 or sd2 by --v2; method)
    "train_network.py": (None, "lora"), "train_db.py": (None, "full"), "fine_tune.py": (None, "full"),
    "sdxl_train_network.py": ("sdxl", "lora"), "sdxl_train.py": ("sdxl", "full"),
    "flux_train_network.py": ("flux", "lora"), "sd3_train_network.py": ("sd3", "lora"),
    "flux_train.py": ("flux", "full"), "sd3_train.py": ("sd3", "full"),
    "lumina_train_network.py": ("lumina2", "lora"), "lumina_train.py": ("lumina2", "full"),
    "train_textual_inversion.py": (None, "embedding"), "sdxl_train_textual_inversion.py": ("sdxl", "embedding"),
}
SAVE_PRECISION = {"float": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Arguments that change how kohya runs, not what it trains: noted, not listed as not honoured.
NO_EFFECT = {
    "xformers": "attention kernel", "sdpa": "attention kernel", "mem_eff_attn": "attention kernel",
    "diffusers_xformers": "attention kernel", "torch_compile": "compilation", "dynamo_backend": "compilation",
    "max_data_loader_n_workers": "loader processes (data.loader_workers)", "persistent_data_loader_workers": "loader",
    "lowram": "memory placement", "highvram": "memory placement", "vae_batch_size": "latent caching batch",
    "cache_latents_to_disk": "where cached latents are kept (ot_dist keeps them in the shard set)",
    "cache_text_encoder_outputs_to_disk": "where cached text is kept", "skip_cache_check": "cache check",
    "disable_mmap_load_safetensors": "file loading", "cpu_offload_checkpointing": "memory placement",
    "blocks_to_swap": "memory placement (ot_dist: offload_frozen_components, strategies)",
    "logging_dir": "logging (ot_dist: MLflow)", "log_with": "logging (ot_dist: MLflow)", "log_prefix": "logging",
    "log_tracker_name": "logging", "log_tracker_config": "logging", "wandb_run_name": "logging", "wandb_api_key": "logging",
    "log_config": "logging", "console_log_level": "logging", "console_log_file": "logging", "console_log_simple": "logging",
    "ddp_timeout": "process group (distributed.timeout_minutes)", "ddp_gradient_as_bucket_view": "DDP buckets",
    "ddp_static_graph": "DDP graph", "save_state": "ot_dist's checkpoints always hold the training state",
    "save_state_on_train_end": "ot_dist's checkpoints always hold the training state",
    "save_model_as": "file format (ot_dist writes safetensors; `ot-dist export` writes the other layouts)",
    "use_safetensors": "file format", "no_metadata": "file metadata", "training_comment": "file metadata",
    "huggingface_repo_id": "upload", "huggingface_repo_type": "upload", "huggingface_path_in_repo": "upload",
    "huggingface_token": "upload", "huggingface_repo_visibility": "upload", "async_upload": "upload",
    "save_state_to_huggingface": "upload", "tokenizer_cache_dir": "download cache", "debug_dataset": "dataset preview",
    "cache_info": "image size cache", "text_encoder_batch_size": "text caching batch",
    "mem_eff_save": "saving", "skip_latents_validity_check": "cache check",
    "double_blocks_to_swap": "memory placement", "single_blocks_to_swap": "memory placement",
    "use_t5xxl_cache_only": "text caching", "use_flash_attn": "attention kernel", "use_sage_attn": "attention kernel",
    "sample_batch_size": "sampling batch",
}

# Where each ot_dist key comes from, named in a validation error (data.concepts[i] and sampling.prompts[i] are added
# by their modules).
ORIGINS = {
    "model.path": "pretrained_model_name_or_path", "model.text_encoder_layer_skip": "clip_skip",
    "model.guidance_scale": "guidance_scale", "output_dir": "output_dir / output_name",
    "epochs": "max_train_epochs / max_train_steps", "max_steps": "max_train_steps",
    "gradient_accumulation_steps": "gradient_accumulation_steps", "clip_grad_norm": "max_grad_norm", "seed": "seed",
    "train_dtype": "mixed_precision", "output_dtype": "save_precision", "learning_rate": "learning_rate",
    "lora": "network_module / network_args", "lora.rank": "network_dim", "lora.alpha": "network_alpha",
    "unet.learning_rate": "unet_lr", "transformer.learning_rate": "unet_lr", "text_encoder": "text_encoder_lr",
    "text_encoder_2": "text_encoder_lr", "text_encoder_3": "text_encoder_lr",
    "optimizer": "optimizer_type / optimizer_args", "scheduler": "lr_scheduler / lr_scheduler_type",
    "scheduler.warmup_steps": "lr_warmup_steps", "scheduler.cycles": "lr_scheduler_num_cycles",
    "scheduler.min_factor": "lr_scheduler_min_lr_ratio", "scheduler.params": "lr_scheduler_args",
    "loss": "the loss arguments", "loss.offset_noise_weight": "noise_offset", "loss.input_perturbation": "ip_noise_gamma",
    "loss.min_snr_gamma": "min_snr_gamma", "loss.min_timestep": "min_timestep", "loss.max_timestep": "max_timestep",
    "loss.timestep_shift": "discrete_flow_shift / training_shift", "loss.logit_normal_mean": "logit_mean",
    "loss.logit_normal_std": "sigmoid_scale / logit_std", "loss.noising_weight": "mode_scale",
    "embedding.token": "token_string", "embedding.vectors": "num_vectors_per_token",
    "embedding.init_text": "init_word", "resolution": "resolution", "batch_size": "train_batch_size / batch_size",
    "data.bucket_step": "bucket_reso_steps",
    "checkpoint.every_n_steps": "save_every_n_steps", "checkpoint.every_n_epochs": "save_every_n_epochs",
    "checkpoint.keep_last": "save_last_n_epochs / save_last_n_steps", "sampling": "sample_prompts",
    "sampling.every_n_steps": "sample_every_n_steps", "sampling.every_n_epochs": "sample_every_n_epochs",
}


def import_kohya(config_file: str | None = None, command: str | None = None, script: str | None = None,
                 dataset_config: str | None = None, sample_prompts: str | None = None,
                 captions_folder: str | None = None) -> Imported:
    args = read_args(config_file, command, script)
    out = Imported({}, origins=dict(ORIGINS))
    c = out.config
    if args.script not in SCRIPTS:
        raise ConfigError(f"--script: {args.script} is not a kohya script ot_dist imports ({', '.join(SCRIPTS)})")
    family, method = SCRIPTS[args.script]
    family = family or ("sd2" if args["v2"] else "sd1")
    if family == "flux":
        family = _flux_model_type(args, out)
    t5_length = _t5_length(args, family, out)
    if args["v2"] and family not in ("sd1", "sd2"):
        out.notes.append(f"v2: {args.script} trains {family}; the flag is ignored, as kohya does")
    c["model"] = {"family": family, "path": _model_path(args, out)}
    if t5_length:
        c["model"]["t5_max_tokens"] = t5_length
    if family == "lumina2":
        _gemma_text(args, out)
    if args["v_parameterization"]:
        if family in ("sd1", "sd2", "sdxl"):
            c["model"]["prediction_type"] = "v_prediction"
        else:
            out.not_honoured.append(f"v_parameterization: {family} trains flow matching")
    c["method"] = method
    _output(args, c, out)
    _length(args, c, out)
    c["gradient_accumulation_steps"] = args["gradient_accumulation_steps"]
    c["clip_grad_norm"] = args["max_grad_norm"] or None  # kohya: 0 turns clipping off
    _precision(args, c, method, out)
    if args["gradient_checkpointing"] or args.given("cpu_offload_checkpointing"):  # kohya turns it on for the latter
        c["gradient_checkpointing"] = True
    _clip_skip(args, c, family, out)
    if method == "lora":
        import_network(args, c, family, out)
    elif method == "embedding":
        import_embedding(args, c, out)
    else:
        import_full_parts(args, c, family, out)
    import_optimizer(args, c, out)  # after the parts: an adaptive optimizer takes one learning rate for all
    if method == "full":
        import_fused_step(args, c, out)  # after the optimizer: a fused step is one of its options
    import_scheduler(args, c, out)
    import_loss(args, c, family, out)
    import_dataset(args, c, family, dataset_config, out, captions_folder)
    import_samples(args, c, sample_prompts, out)
    _saves(args, c, out)
    _left_over(args, out)
    if len(args.launch) > 1:
        out.notes.append(f"the launcher's options ({' '.join(args.launch)}) are the launch's: `ot-dist launch` or "
                         "accelerate / torchrun start ot_dist's processes")
    out.notes.insert(0, f"imported from kohya sd-scripts' {args.script} arguments")
    return out


def _flux_model_type(args: KohyaArgs, out: Imported) -> str:
    """flux_train_network.py trains Chroma with model_type chroma (T5 only, with its attention mask, which kohya
    requires there and ot_dist's Chroma always applies); Flux.1 ignores apply_t5_attn_mask in ot_dist."""
    model_type, mask = args["model_type"], args["apply_t5_attn_mask"]
    if model_type not in ("flux", "chroma"):
        raise ConfigError(f"model_type: {model_type} is not one of kohya's (flux, chroma)")
    if model_type == "flux" and mask:
        out.not_honoured.append("apply_t5_attn_mask: True: ot_dist's Flux.1 attends to T5's padding tokens, as "
                                "FluxPipeline and diffusers' FluxTransformer2DModel do (no text attention mask)")
    if model_type == "chroma" and not mask:
        out.notes.append("apply_t5_attn_mask: False: kohya refuses to train Chroma without it; ot_dist's Chroma masks "
                         "T5's padding (its first padding token stays visible, as kohya's attn_padding 1)")
    return model_type


def _t5_length(args: KohyaArgs, family: str, out: Imported) -> int | None:
    """t5xxl_max_token_length, where it is not ot_dist's default (Flux / Chroma 512, SD3 256). Unset, kohya takes
    512 for Flux.1 dev and Chroma, 256 for schnell (which it tells by the checkpoint's weights), 256 for SD3."""
    length = args["t5xxl_max_token_length"]
    if family not in T5_DEFAULTS:
        return None
    if length is None and family == "flux":
        out.notes.append("t5xxl_max_token_length: unset: kohya pads T5 to 512 tokens for Flux.1 dev (ot_dist's "
                         "default) and to 256 for schnell: for schnell set model.t5_max_tokens: 256")
    return length if length is not None and length != T5_DEFAULTS[family] else None


def _gemma_text(args: KohyaArgs, out: Imported) -> None:
    """kohya's Lumina scripts encode `<system_prompt> <Prompt Start> <caption>`, the bare caption when system_prompt
    is empty (their default), padded to gemma2_max_token_length (unset: 256); ot_dist encodes every caption behind
    Lumina2Pipeline's system prompt at 256 tokens, as the pipeline does."""
    from ot_dist.models.families.lumina2 import MAX_SEQUENCE_LENGTH, SYSTEM_PROMPT

    prompt, length = args["system_prompt"], args["gemma2_max_token_length"]
    if not prompt:
        out.not_honoured.append("system_prompt: unset: kohya encodes the bare caption; ot_dist puts Lumina2Pipeline's "
                                "system prompt and <Prompt Start> in front of every caption (set system_prompt to "
                                "the pipeline's to train as ot_dist does)")
    elif prompt.strip() != SYSTEM_PROMPT:
        out.not_honoured.append(f"system_prompt: {prompt[:40]!r}...: ot_dist puts Lumina2Pipeline's own system prompt "
                                "in front of every caption")
    if length not in (None, MAX_SEQUENCE_LENGTH):
        out.not_honoured.append(f"gemma2_max_token_length: {length}: ot_dist encodes Lumina 2 captions at the "
                                f"pipeline's {MAX_SEQUENCE_LENGTH} tokens")


def _model_path(args: KohyaArgs, out: Imported) -> str:
    path = args["pretrained_model_name_or_path"]
    if not path:
        raise ConfigError("pretrained_model_name_or_path: not set (the base model: a diffusers folder or a single "
                          ".safetensors file)")
    path = local_path(str(path), "pretrained_model_name_or_path", out)
    note_local_model(path, "pretrained_model_name_or_path", out)
    for key in ("clip_l", "clip_g", "t5xxl", "gemma2", "ae"):  # Flux / SD3 / Lumina: kohya loads each from its file
        if args[key]:
            out.not_honoured.append(f"{key}: {args[key]}: ot_dist reads the text encoders and the VAE beside a "
                                    "single-file transformer from model.config (a diffusers folder); set it")
    if args["vae"]:
        out.not_honoured.append(f"vae: {args['vae']}: a replacement VAE is not supported (the model's own is used)")
    return path


def _output(args: KohyaArgs, c: dict, out: Imported) -> None:
    """kohya writes output_dir/output_name.safetensors; ot_dist writes a run's files inside one folder."""
    if not args["output_dir"]:
        raise ConfigError("output_dir: not set (where kohya writes the trained file)")
    output_dir = Path(local_path(str(args["output_dir"]), "output_dir", out))
    name = args["output_name"] or (args["token_string"] if "textual_inversion" in args.script else None)
    c["output_dir"] = str(output_dir / str(name)) if name else str(output_dir)
    c["mlflow"] = {"run_name": str(name) if name else output_dir.name}
    out.notes.append(f"output_dir / output_name -> output_dir {c['output_dir']} (ot_dist writes model/, "
                     "model.safetensors or lora.safetensors inside it)")


def _length(args: KohyaArgs, c: dict, out: Imported) -> None:
    """kohya trains max_train_steps optimizer steps (default 1600), or max_train_epochs epochs when set (it overrides
    the steps); ot_dist counts epochs with an optional cap of optimizer steps."""
    epochs, steps = args["max_train_epochs"], args["max_train_steps"]
    if epochs:
        c["epochs"] = epochs
        if args.given("max_train_steps"):
            out.notes.append(f"max_train_steps: {steps} is overridden by max_train_epochs {epochs}, as in kohya")
        return
    c["max_steps"] = steps
    c["epochs"] = steps  # every epoch takes at least one step: max_steps ends the run
    out.notes.append(f"max_train_steps: {steps} -> max_steps (epochs {steps} is only a bound; the run ends at the "
                     "steps)")


def _precision(args: KohyaArgs, c: dict, method: str, out: Imported) -> None:
    mixed = ACCELERATE_PRECISION.get(str(args["mixed_precision"]), "float32")
    c["train_dtype"] = mixed
    if mixed != "float32":
        # kohya casts every frozen model (the base of a LoRA, the VAE, frozen text encoders) to the mixed dtype
        c["weight_dtype"] = mixed
    if args["full_bf16"]:
        c["trained_weight_dtype"] = "bfloat16"
    if args["full_fp16"]:
        out.not_honoured.append("full_fp16: float16 trained weights and gradients are not supported (ot_dist trains "
                                "float32 or bfloat16 weights: trained_weight_dtype)")
    # kohya's train scripts: fp8_base stores the denoiser and the text encoders in float8, fp8_base_unet (which wins)
    # the denoiser only; the VAE stays in the mixed dtype, or float32 with no_half_vae
    if args["fp8_base_unet"]:
        c.setdefault(get_family(c["model"]["family"]).denoiser, {})["weight_dtype"] = "float8"
    elif args["fp8_base"]:
        c["weight_dtype"], c["vae_weight_dtype"] = "float8", mixed
    if args["no_half_vae"] and mixed != "float32":
        c["vae_weight_dtype"] = "float32"
    if args["save_precision"]:
        c["output_dtype"] = SAVE_PRECISION[str(args["save_precision"])]
    if args["seed"] is None:
        out.notes.append("seed: not set (kohya draws one per run); seed 42 is written")
    else:
        c["seed"] = args["seed"]


def _clip_skip(args: KohyaArgs, c: dict, family: str, out: Imported) -> None:
    """kohya's clip_skip n takes the n-th layer from the end (2: the penultimate), ot_dist's layer skip the layers
    left out (1: the penultimate)."""
    skip = args["clip_skip"]
    if not skip or skip == 1:
        return
    if family in ("sd1", "sd2"):
        c["model"]["text_encoder_layer_skip"] = skip - 1
    else:  # kohya's SDXL, Flux and SD3 scripts take their own layers whatever clip_skip says
        out.not_honoured.append(f"clip_skip: {skip}: kohya's {family} training ignores it; not written")


def _saves(args: KohyaArgs, c: dict, out: Imported) -> None:
    """kohya saves the trained file every N steps / epochs and keeps them all unless save_last_n_*; ot_dist saves
    resumable checkpoints (`ot-dist export` makes the files of any of them)."""
    checkpoint = {"every_n_minutes": None}  # kohya has no saves on a clock (ot_dist's default: every 30 minutes)
    if args["save_every_n_steps"]:
        checkpoint["every_n_steps"] = args["save_every_n_steps"]
    every_epochs = args["save_every_n_epochs"]
    ratio = args["save_n_epoch_ratio"]
    if ratio and c.get("max_steps") is None:
        every_epochs = max(1, c["epochs"] // ratio)  # kohya: at least `ratio` saves over the run
    elif ratio:
        out.not_honoured.append(f"save_n_epoch_ratio: {ratio} needs the epoch count (max_train_epochs); set "
                                "checkpoint.every_n_epochs")
    if every_epochs:
        checkpoint["every_n_epochs"] = every_epochs
    last_epochs = args["save_last_n_epochs_state"] or args["save_last_n_epochs"]
    last_steps = args["save_last_n_steps_state"] or args["save_last_n_steps"]
    if last_epochs and every_epochs:
        checkpoint["keep_last"] = last_epochs
    elif last_steps and args["save_every_n_steps"]:
        # kohya removes the saves older than N steps: those of the last N steps stay
        checkpoint["keep_last"] = max(1, last_steps // args["save_every_n_steps"])
    elif last_epochs or last_steps:
        out.not_honoured.append("save_last_n_epochs / save_last_n_steps: without the save interval they count, "
                                "nothing is removed")
    c["checkpoint"] = checkpoint
    if args["resume"]:
        out.not_honoured.append(f"resume: {args['resume']} is kohya's state folder; ot_dist resumes from its own "
                                "checkpoints (`ot-dist train --resume`)")


def _left_over(args: KohyaArgs, out: Imported) -> None:
    list_unread(args, out, NO_EFFECT, "kohya's training scripts")
