"""`ot-dist import diffusers`: a diffusers example-script training command (a saved `accelerate launch [options]
train_dreambooth_lora.py --key value ...` line, and optionally the accelerate config it used) as an ot_dist config
that validates.

Every argument the command sets either maps to an ot_dist key with the same meaning, is noted as one that changes
nothing ot_dist trains (attention kernels, logging, uploads), or is listed with the reason it is not honoured, in the
written file and on stderr: `DiffusersArgs` remembers what was read, and whatever is left is listed. An argument the
command leaves out takes the script's own default (diffusers_defaults, read from the scripts' parsers), written where
ot_dist's differs (learning rate, batch size, checkpoints every 500 steps, ...).

This module maps the script (family, method), the model, precision, length, optimizer and schedule, loss, LoRA,
embedding, EMA, saves and validation; diffusers_dataset maps the data, diffusers_args reads the command line."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import (ACCELERATE_PRECISION, T5_DEFAULTS, Imported, list_unread, local_path,
                                    note_local_model, warmup_micro_steps)
from ot_dist.migrate.diffusers_args import DiffusersArgs, read_args
from ot_dist.migrate.diffusers_dataset import import_dataset
from ot_dist.migrate.kohya_loss import weighting_scheme
from ot_dist.migrate.kohya_optim import POLYNOMIAL_LR_END, SCHEDULES

# script -> (family, None: sd1 or sd2 by the model; method; dataset kind)
SCRIPTS = {
    "train_text_to_image.py": (None, "full", "text_to_image"),
    "train_text_to_image_lora.py": (None, "lora", "text_to_image"),
    "train_text_to_image_sdxl.py": ("sdxl", "full", "text_to_image"),
    "train_text_to_image_lora_sdxl.py": ("sdxl", "lora", "text_to_image"),
    "train_dreambooth.py": (None, "full", "dreambooth"), "train_dreambooth_lora.py": (None, "lora", "dreambooth"),
    "train_dreambooth_lora_sdxl.py": ("sdxl", "lora", "dreambooth"),
    "train_dreambooth_sd3.py": ("sd3", "full", "dreambooth"),
    "train_dreambooth_lora_sd3.py": ("sd3", "lora", "dreambooth"),
    "train_dreambooth_flux.py": ("flux", "full", "dreambooth"),
    "train_dreambooth_lora_flux.py": ("flux", "lora", "dreambooth"),
    "train_dreambooth_lora_sana.py": ("sana", "lora", "dreambooth"),
    "train_dreambooth_lora_qwen_image.py": ("qwen_image", "lora", "dreambooth"),
    "train_dreambooth_lora_flux2.py": ("flux2", "lora", "dreambooth"),
    "train_dreambooth_lora_flux2_klein.py": ("flux2_klein", "lora", "dreambooth"),
    "train_dreambooth_lora_lumina2.py": ("lumina2", "lora", "dreambooth"),
    "train_dreambooth_lora_z_image.py": ("z_image", "lora", "dreambooth"),
    "train_dreambooth_lora_krea2.py": ("krea2", "lora", "dreambooth"),
    "train_dreambooth_lora_hidream.py": ("hidream", "lora", "dreambooth"),
    "train_dreambooth_lora_ideogram4.py": ("ideogram4", "lora", "dreambooth"),
    "textual_inversion.py": (None, "embedding", "textual_inversion"),
}
# The scripts that validate every validation_steps optimizer steps (the others: every validation_epochs epochs).
VALIDATION_BY_STEPS = ("train_dreambooth.py", "textual_inversion.py")
# The attention projections the UNet scripts adapt (train_text_to_image_lora*, train_dreambooth_lora*: the
# add_k_proj / add_v_proj they add exist only in UNets with added KV attention, not in SD / SDXL) and the text
# encoders' (every LoRA script with --train_text_encoder).
UNET_LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
TEXT_ENCODER_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
# The transformer modules the SD3 / Flux / Sana / Qwen-Image LoRA scripts adapt without --lora_layers (peft suffixes,
# as ot_dist's transformer_targets; ot_dist's preset default differs for SD3 (attn2 of 3.5's dual attention) and Flux
# (proj_mlp); Sana's and Qwen-Image's are these lists)
ATTENTION = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
             "attn.add_v_proj", "attn.to_add_out"]
TRANSFORMER_LORA_TARGETS = {"sd3": ATTENTION, "flux": ATTENTION + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                                                   "ff_context.net.2"],
                           "sana": ["to_k", "to_q", "to_v"], "qwen_image": ["to_k", "to_q", "to_v", "to_out.0"],
                           "hidream": ["to_k", "to_q", "to_v", "to_out"],
                           "lumina2": ["to_k", "to_q", "to_v", "to_out.0"]}
# The FLUX.2 scripts: the double blocks' image attention, the single blocks' fused projection and their output named
# by path (48 in the [dev] script, 24 in the [klein] one)
TRANSFORMER_LORA_TARGETS |= {
    family: ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
             *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(singles))]
    for family, singles in (("flux2", 48), ("flux2_klein", 24))}
# The flow families whose scripts draw sigmas from the scheduler's unshifted table: Flux's and Qwen-Image's configs
# shift dynamically (FlowMatchEulerDiscreteScheduler applies no shift at init then: the Qwen script's shift=3.0 is
# dropped), Sana's DPM-solver config has flow_shift, which FlowMatchEulerDiscreteScheduler does not read.
UNSHIFTED_FLOW_SCRIPTS = ("flux", "sana", "qwen_image", "flux2", "flux2_klein")
LUMINA_IMAGE_2_SHIFT = 6.0  # Alpha-VLLM/Lumina-Image-2.0's scheduler config (and ComfyUI's sampling shift for it)
# The flow families whose scripts draw from the scheduler's table shifted by its fixed shift (Z-Image's config: 3.0,
# use_dynamic_shifting false), which is ot_dist's auto; SD3's has its own branch (precondition_outputs).
SHIFTED_FLOW_SCRIPTS = ("z_image",)
TRANSFORMER_LORA_TARGETS["z_image"] = ["to_k", "to_q", "to_v", "to_out.0"]
# The Krea 2 script: its default list (the Krea 2 authors'; ot_dist's krea2 preset default) and Krea 2's scheduler
# config, which shifts dynamically: its training table is unshifted, as Flux's and Qwen-Image's
TRANSFORMER_LORA_TARGETS["krea2"] = ["img_in", "final_layer.linear", "to_q", "to_k", "to_v", "to_out.0", "to_gate",
                                     "ff.up", "ff.down", "text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2",
                                     "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj"]
UNSHIFTED_FLOW_SCRIPTS += ("krea2",)
# The flow families whose scripts load their scheduler with a shift of their own, whatever the model's config says (the
# HiDream script: FlowMatchEulerDiscreteScheduler.from_pretrained(..., shift=3.0)), and the text length ot_dist encodes
# them with (the pipeline's max_sequence_length, which ot_dist does not change).
FORCED_SHIFT_SCRIPTS = {"hidream": 3.0}
FIXED_TEXT_LENGTH = {"hidream": 128}
# The Ideogram 4 script: sigma is compute_density_for_timestep_sampling's u itself, its logit-normal's mean moved by
# the pipeline's _resolution_aware_mu (ot_dist's family shift e^mu: the same draw); the other schemes' u unshifted.
# Its default modules: attention and the SwiGLU (peft suffixes).
RESOLUTION_MEAN_SCRIPTS = ("ideogram4",)
TRANSFORMER_LORA_TARGETS["ideogram4"] = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
FIXED_TEXT_LENGTH["ideogram4"] = 2048
# Where a script loads a component from an argument of its own and ot_dist reads it from model.path's folder
SEPARATE_COMPONENTS = {"train_dreambooth_lora_hidream.py": (
    "pretrained_text_encoder_4_name_or_path",
    "the script loads its Llama (text_encoder_4 / tokenizer_4) from this; ot_dist reads it from model.path's "
    "text_encoder_4 / tokenizer_4: save the base folder with it once (docs/families.md, HiDream-I1)")}
# Arguments that change how the script runs, not what it trains: noted, not listed as not honoured.
NO_EFFECT = {
    "enable_xformers_memory_efficient_attention": "attention kernel", "enable_npu_flash_attention": "attention kernel",
    "allow_tf32": "matmul precision", "report_to": "logging (ot_dist: MLflow)", "logging_dir": "logging",
    "tracker_project_name": "logging", "push_to_hub": "upload", "hub_token": "upload", "hub_model_id": "upload",
    "cache_dir": "download cache", "local_rank": "set by the launcher", "set_grads_to_none": "gradient memory",
    "foreach_ema": "EMA kernel", "no_safe_serialization": "file format (ot_dist writes safetensors)",
    "sample_batch_size": "class image generation batch", "prior_generation_precision": "class image generation",
    "upcast_before_saving": "saved dtype (output_dtype)",
    "save_as_full_pipeline": "export layout (`ot-dist export`)",
    "output_kohya_format": "export layout (lora.file_layout)",
    "offload": "where the VAE / text encoder wait (CPU or GPU)", "enable_vae_tiling": "validation image decoding",
    # HiDream's Llama arguments, left in the Qwen-Image script's parser: it loads neither
    "pretrained_text_encoder_4_name_or_path": "not read by the script",
    "pretrained_tokenizer_4_name_or_path": "not read by the script (the HiDream script's: with its text encoder's)",
    "cache_latents": "latents cached or not (data.cache_latents: the same training)",
    "remote_text_encoder": "where the captions are encoded",
    "fsdp_text_encoder": "where the frozen text encoder lives (the Z-Image script shards it with FSDP)",
    "prompt_enhancer_head_id": "the prompt enhancer's LM head (upsample_prompt)",
}


def import_diffusers(command_line: str, script: str | None = None, accelerate_config: str | None = None,
                     captions_folder: str | None = None) -> Imported:
    args = read_args(command_line, script, accelerate_config)
    family, method, kind = SCRIPTS[args.script]
    out = Imported({}, origins={})
    c = out.config
    family = family or _sd_version(args, out)
    c["model"] = {"family": family, "path": _model_path(args, out)}
    if args.script in SEPARATE_COMPONENTS:
        key, why = SEPARATE_COMPONENTS[args.script]
        out.notes.append(f"{key}: {args[key]}: {why}")
    c["method"] = method
    c["output_dir"] = local_path(str(args["output_dir"]), "output_dir", out)
    c["mlflow"] = {"run_name": c["output_dir"].rstrip("/").split("/")[-1]}
    _launch(args, c, out)
    import_dataset(args, c, kind, out, captions_folder)
    _length(args, c, out)
    c["gradient_accumulation_steps"] = args["gradient_accumulation_steps"]
    if "max_grad_norm" in args.defaults:
        c["clip_grad_norm"] = args["max_grad_norm"]
    if args["gradient_checkpointing"]:
        c["gradient_checkpointing"] = True
    if args["seed"] is None:
        out.notes.append("seed: not set (the script draws its randomness unseeded); seed 42 is written")
    else:
        c["seed"] = args["seed"]
    if method == "lora":
        _lora(args, c, family, out)
    elif method == "embedding":
        _embedding(args, c, out)
    else:
        _full_text_encoders(args, c, family, out)
    _optimizer(args, c, out)
    _scheduler(args, c, out)
    _loss(args, c, family, out)
    _ema(args, c, out)
    _saves(args, c, out)
    _validation(args, c, out)
    list_unread(args, out, NO_EFFECT, args.script)
    out.origins.update(ORIGINS)
    out.notes.insert(0, f"imported from the diffusers example script {args.script}'s arguments")
    return out


ORIGINS = {
    "model.path": "pretrained_model_name_or_path", "output_dir": "output_dir", "resolution": "resolution",
    "batch_size": "train_batch_size", "epochs": "num_train_epochs / max_train_steps", "max_steps": "max_train_steps",
    "learning_rate": "learning_rate / scale_lr", "clip_grad_norm": "max_grad_norm", "seed": "seed",
    "train_dtype": "mixed_precision", "optimizer": "optimizer / use_8bit_adam / adam_*",
    "scheduler": "lr_scheduler / lr_warmup_steps", "lora": "rank / lora_alpha", "embedding": "placeholder_token",
    "loss": "snr_gamma / noise_offset / weighting_scheme", "checkpoint": "checkpointing_steps",
    "sampling": "validation_prompt", "ema": "use_ema", "text_encoder": "train_text_encoder / text_encoder_lr",
}


def _sd_version(args: DiffusersArgs, out: Imported) -> str:
    """The SD scripts train 1.x and 2.x alike; the model says which (its text encoder: 768 wide for 1.x, 1024 for
    2.x), else its name."""
    import json
    from pathlib import Path

    path = Path(str(args["pretrained_model_name_or_path"] or ""))
    config = path / "text_encoder" / "config.json"
    if config.is_file():
        width = json.loads(config.read_text(encoding="utf-8")).get("hidden_size")
        return "sd2" if width == 1024 else "sd1"
    family = "sd2" if "stable-diffusion-2" in str(path) else "sd1"
    out.notes.append(f"model.family {family}: from the model's name ({path}); the folder is not readable here to tell "
                     "SD 1.x from 2.x by its text encoder: check it")
    return family


def _model_path(args: DiffusersArgs, out: Imported) -> str:
    path = args["pretrained_model_name_or_path"]
    if not path:
        raise ConfigError("pretrained_model_name_or_path: not set (the script needs it: the base model)")
    path = local_path(str(path), "pretrained_model_name_or_path", out)
    note_local_model(path, "pretrained_model_name_or_path", out)
    for key, reason in (("revision", "a Hub revision (ot_dist reads a local folder)"),
                        ("variant", "weight files of a variant (ot_dist reads the folder's plain files)"),
                        ("pretrained_vae_model_name_or_path", "a replacement VAE (the model's own is used)"),
                        ("tokenizer_name", "a replacement tokenizer (the model's own is used)"),
                        ("non_ema_revision", "a Hub revision")):
        if args[key]:
            out.not_honoured.append(f"{key}: {args[key]}: {reason} is not supported")
    return path


def _launch(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """The script's --mixed_precision wins; unset (None), accelerate's (launch option, else config file) decides."""
    launch = args.launch
    precision = args["mixed_precision"] or launch["mixed_precision"] or "no"
    if str(precision) not in ACCELERATE_PRECISION:
        raise ConfigError(f"mixed_precision: {precision} is not no, fp16 or bf16")
    c["train_dtype"] = ACCELERATE_PRECISION[str(precision)]
    if c["train_dtype"] != "float32":  # the scripts cast every frozen model (VAE, text encoders, LoRA base) to it
        c["weight_dtype"] = c["train_dtype"]
    processes, kind = launch["num_processes"], str(launch["distributed_type"] or "").upper()
    if kind == "FSDP":
        c["strategy"] = "fsdp"
    elif kind == "DEEPSPEED":
        c["strategy"] = f"zero{launch['zero_stage'] or 2}"
    elif processes > 1 or kind == "MULTI_GPU":
        c["strategy"] = "ddp"
    if launch["other"]:
        out.notes.append(f"the launcher's options ({' '.join(launch['other'])}) are the launch's: `ot-dist launch` or "
                         "accelerate / torchrun start ot_dist's processes")


def _length(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """max_train_steps (optimizer steps) wins over num_train_epochs, as the scripts recompute the epochs from it."""
    steps = args["max_train_steps"]
    if steps:
        c["max_steps"] = steps
        c["epochs"] = steps  # every epoch takes at least one step: max_steps ends the run
        if args.given("num_train_epochs"):
            out.notes.append(f"num_train_epochs: {args['num_train_epochs']} is overridden by max_train_steps {steps}, "
                             "as in the script")
        return
    c["epochs"] = args["num_train_epochs"]


def _full_text_encoders(args: DiffusersArgs, c: dict, family: str, out: Imported) -> None:
    """train_dreambooth.py trains the text encoder at learning_rate; train_dreambooth_sd3.py both CLIP encoders and
    train_dreambooth_flux.py its CLIP one, at text_encoder_lr (unset: learning_rate)."""
    if "train_text_encoder" not in args.defaults or not args["train_text_encoder"]:
        return
    parts = {"sd3": ("text_encoder", "text_encoder_2", "text_encoder_3")}.get(family, ("text_encoder",))
    lr = args["text_encoder_lr"] if "text_encoder_lr" in args.defaults else None
    for part in parts:
        c[part] = {"train": True} | ({"learning_rate": lr} if lr else {})
    _text_encoder_weight_decay(args, out)


def _text_encoder_weight_decay(args: DiffusersArgs, out: Imported) -> None:
    decay = args["adam_weight_decay_text_encoder"] if "adam_weight_decay_text_encoder" in args.defaults else None
    if decay is not None and decay != args["adam_weight_decay"]:
        out.not_honoured.append(f"adam_weight_decay_text_encoder: {decay}: ot_dist "
                                f"takes one weight decay for every part (adam_weight_decay {args['adam_weight_decay']} "
                                "is used)")


def _lora(args: DiffusersArgs, c: dict, family: str, out: Imported) -> None:
    """The LoRA scripts' peft LoraConfig: r = rank, lora_alpha = rank (the Flux / Sana / Qwen-Image LoRA scripts:
    --lora_alpha), the attention projections of a UNet, the transformer's list of its script or --lora_layers."""
    rank = args["rank"]
    alpha = args["lora_alpha"] if "lora_alpha" in args.defaults else rank
    lora = {"rank": rank, "alpha": float(alpha)}
    if args["use_dora"]:
        lora["variant"] = "dora"
    if args["lora_dropout"] and args["use_dora"]:
        lora["dropout"] = args["lora_dropout"]  # peft's: the adapted layer's input, as ot_dist's DoRA drops
    elif args["lora_dropout"]:
        out.not_honoured.append(f"lora_dropout: {args['lora_dropout']}: peft drops the adapted layer's input; "
                                "ot_dist's lora.dropout drops the rank features (kohya's network_dropout); not written")
    if family in ("sd1", "sd2", "sdxl"):
        lora["unet_targets"] = list(UNET_LORA_TARGETS)
    else:
        layers = args["lora_layers"]
        targets = [t.strip() for t in str(layers).split(",")] if layers else list(TRANSFORMER_LORA_TARGETS[family])
        if args["lora_blocks"]:  # the SD3 script: its modules in the numbered blocks only
            try:
                blocks = [int(b) for b in str(args["lora_blocks"]).split(",")]
            except ValueError:
                raise ConfigError(f"lora_blocks: {args['lora_blocks']} is not block numbers (0,1,2)") from None
            targets = [f"transformer_blocks.{b}.{t}" for b in blocks for t in targets]
        lora["transformer_targets"] = targets
    if "train_text_encoder" in args.defaults and args["train_text_encoder"]:
        parts = ("text_encoder", "text_encoder_2") if family in ("sdxl", "sd3") else ("text_encoder",)
        lr = args["text_encoder_lr"] if "text_encoder_lr" in args.defaults else None
        for part in parts:
            c[part] = {"train": True} | ({"learning_rate": lr} if lr else {})
        lora["text_encoder_targets"] = list(TEXT_ENCODER_LORA_TARGETS)
        _text_encoder_weight_decay(args, out)
    c["lora"] = lora


def _embedding(args: DiffusersArgs, c: dict, out: Imported) -> None:
    token, init = args["placeholder_token"], args["initializer_token"]
    if not token:
        raise ConfigError("placeholder_token: not set (textual_inversion.py needs it: the new word)")
    if not init:
        raise ConfigError("initializer_token: not set (textual_inversion.py needs it: the word the vectors start from)")
    c["embedding"] = {"token": token, "vectors": args["num_vectors"], "init_text": init}
    if args.given("save_steps"):
        out.notes.append(f"save_steps: {args['save_steps']}: the embedding is in every checkpoint "
                         "(checkpoint.every_n_steps: checkpointing_steps); `ot-dist export` writes it")


def _optimizer(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """AdamW (torch, or bitsandbytes' AdamW8bit with --use_8bit_adam) or, in the DreamBooth LoRA / SD3 / Flux
    scripts, --optimizer prodigy, with the adam_* options; scale_lr multiplies the learning rate by the global
    batch."""
    lr = args["learning_rate"]
    if args["scale_lr"]:
        batch = args["train_batch_size"] * args["gradient_accumulation_steps"] * args.launch["num_processes"]
        lr *= batch
        out.notes.append(f"scale_lr: learning_rate {args['learning_rate']} x {batch} (train_batch_size x "
                         f"gradient_accumulation_steps x {args.launch['num_processes']} processes) = {lr}")
    c["learning_rate"] = lr
    name = str(args["optimizer"] or "adamw").lower() if "optimizer" in args.defaults else "adamw"
    betas = {"beta1": args["adam_beta1"], "beta2": args["adam_beta2"]}
    common = {**betas, "weight_decay": args["adam_weight_decay"], "eps": args["adam_epsilon"]}
    if name == "prodigy":
        if args["use_8bit_adam"]:
            out.notes.append("use_8bit_adam: ignored with --optimizer prodigy, as the script warns")
        c["optimizer"] = {"name": "PRODIGY", **common, "beta3": args["prodigy_beta3"],
                          "decouple": args["prodigy_decouple"],
                          "use_bias_correction": args["prodigy_use_bias_correction"],
                          "safeguard_warmup": args["prodigy_safeguard_warmup"], "slice_p": 1}  # prodigyopt's default
        for part in ("text_encoder", "text_encoder_2"):  # the script gives the text encoders learning_rate too
            (c.get(part) or {}).pop("learning_rate", None)
        return
    if name != "adamw":
        out.not_honoured.append(f"optimizer: {args['optimizer']}: the script knows AdamW and prodigy only (it falls "
                                "back to AdamW); ADAMW is written")
    if "optimizer" in args.defaults:
        for key in ("prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction", "prodigy_safeguard_warmup"):
            args[key]  # read: prodigy's options, unused by AdamW as in the script
    c["optimizer"] = {"name": "ADAMW_8BIT" if args["use_8bit_adam"] else "ADAMW", **common}


def _scheduler(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """diffusers' get_scheduler, stepped once per optimizer step (accelerate skips the micro steps): constant has no
    warmup whatever lr_warmup_steps says; the warmup is in optimizer steps (ot_dist counts micro steps above 1)."""
    skip = out.not_honoured.append
    name, warmup, accumulation = str(args["lr_scheduler"]), args["lr_warmup_steps"], c["gradient_accumulation_steps"]
    if args.script == "train_text_to_image_sdxl.py":
        # it gives get_scheduler the warmup and the run's length x accumulation, not x processes (accelerate steps the
        # schedule once per process and optimizer step): lengths x accumulation / processes in optimizer steps
        processes = max(1, args.launch["num_processes"])
        warmup = warmup * accumulation // processes
        if name not in ("constant", "constant_with_warmup") and accumulation != processes:
            skip(f"lr_scheduler: {name}: train_text_to_image_sdxl.py decays over max_train_steps x "
                 f"{accumulation} (accumulation) / {processes} (processes) optimizer steps; ot_dist decays over "
                 "the run")
    cycles = args["lr_num_cycles"] if "lr_num_cycles" in args.defaults else 1
    power = args["lr_power"] if "lr_power" in args.defaults else 1.0
    scheduler = {"name": SCHEDULES.get(name, "CONSTANT")}
    if name == "constant":
        scheduler["warmup_steps"] = 0
        if warmup:
            out.notes.append(f"lr_warmup_steps: {warmup}: diffusers' constant schedule has no warmup "
                             "(constant_with_warmup has)")
    else:
        scheduler["warmup_steps"] = warmup_micro_steps(warmup, accumulation, "lr_warmup_steps", skip)
    if name not in SCHEDULES:
        skip(f"lr_scheduler: {name} has no ot_dist schedule (constant, constant_with_warmup, linear, cosine, "
             "cosine_with_restarts, polynomial with lr_power 1); CONSTANT is written")
    elif name == "cosine_with_restarts":
        scheduler["cycles"] = cycles
    elif name == "polynomial":
        if power != 1:
            skip(f"lr_power: {power}: ot_dist's decays are linear, cosine and REX; LINEAR is written")
        scheduler["min_factor"] = min(1.0, POLYNOMIAL_LR_END / c["learning_rate"])  # diffusers decays to lr_end
    if name != "cosine_with_restarts" and args.given("lr_num_cycles"):
        out.notes.append(f"lr_num_cycles: {cycles} is read by cosine_with_restarts only, as in diffusers")
    c["scheduler"] = scheduler


def _loss(args: DiffusersArgs, c: dict, family: str, out: Imported) -> None:
    skip = out.not_honoured.append
    loss = {}
    prediction = args["prediction_type"]
    if prediction:
        c["model"]["prediction_type"] = prediction  # epsilon / v_prediction, set on the noise scheduler
    if args["snr_gamma"]:
        loss["min_snr_gamma"] = args["snr_gamma"]  # min(SNR, g) / SNR, / (SNR + 1) for v: the scripts' formulas
    if args["noise_offset"]:
        if family in ("sd3", "flux"):
            skip(f"noise_offset: {args['noise_offset']}: the {family} scripts do not read it")
        else:
            loss["offset_noise_weight"] = args["noise_offset"]  # offset x N(0, 1) per sample and channel
    if args["input_perturbation"]:
        loss["input_perturbation"] = args["input_perturbation"]
    for key, reason in (("dream_training", "DREAM (the prediction fed back into the input)"),
                        ("do_edm_style_training", "EDM-style training"), ("debug_loss", "per-image loss logging"),
                        ("offset_noise", "textual_inversion's offset noise")):
        if args[key]:
            skip(f"{key}: {reason} is not supported")
    if args["timestep_bias_strategy"] not in (None, "none"):
        skip(f"timestep_bias_strategy: {args['timestep_bias_strategy']}: the script's timestep bias is not supported")
    if family == "sd3":
        weighting_scheme(args, loss, skip, descending=True)  # the scheduler's shift (3.0) is ot_dist's auto
        if args["precondition_outputs"]:
            skip("precondition_outputs: 1 (the script's default): it compares the preconditioned prediction "
                 "(noisy - sigma x prediction) with the latents, which weighs the flow loss by sigma^2; ot_dist "
                 "trains the unweighted flow-matching loss")
    if family in T5_DEFAULTS and args["max_sequence_length"] != T5_DEFAULTS[family]:
        c["model"]["t5_max_tokens"] = args["max_sequence_length"]  # the SD3 scripts' and train_dreambooth_flux's 77
    if family in SHIFTED_FLOW_SCRIPTS:
        weighting_scheme(args, loss, skip, descending=True)  # the shifted table from sigma 1 down: ot_dist's auto shift
    if family in FORCED_SHIFT_SCRIPTS:  # timesteps[(u x N)] of the table shifted at the script's own shift
        weighting_scheme(args, loss, skip, descending=True)
        loss |= {"timestep_shift": FORCED_SHIFT_SCRIPTS[family], "dynamic_timestep_shifting": False}
    if family in FIXED_TEXT_LENGTH and args["max_sequence_length"] != FIXED_TEXT_LENGTH[family]:
        skip(f"max_sequence_length: {args['max_sequence_length']}: ot_dist encodes {family} captions at the "
             f"pipeline's {FIXED_TEXT_LENGTH[family]} tokens")
    if family in UNSHIFTED_FLOW_SCRIPTS:
        weighting_scheme(args, loss, skip, descending=True)  # timesteps[(u x N)] of a table that runs from sigma 1
        loss |= {"timestep_shift": 1.0, "dynamic_timestep_shifting": False}
        if family in ("flux", "flux2"):  # the guidance-distilled transformers
            c["model"]["guidance_scale"] = args["guidance_scale"]  # the transformer is shown 3.5 unless told
    if family in RESOLUTION_MEAN_SCRIPTS:
        weighting_scheme(args, loss, skip, descending=False)  # u is the noise level
        if args["weighting_scheme"] != "logit_normal":  # only the logit-normal's mean follows the resolution
            loss |= {"timestep_shift": 1.0, "dynamic_timestep_shifting": False}
    if family == "lumina2":
        _lumina2_flow(args, c, loss, out)
    _new_script_options(args, family, skip)
    if loss:
        c["loss"] = loss


def _lumina2_flow(args: DiffusersArgs, c: dict, loss: dict, out: Imported) -> None:
    """The Lumina 2 script draws u by weighting_scheme, takes the scheduler's timesteps[(u x N)] (sigma 1 down, shifted
    by the scheduler's `shift` k) and uses that sigma as Lumina's t, the image's weight: its noise level 1 - sigma is
    u shifted by 1 / k, growing with u (a logit_mean m stays m). k is the model's scheduler config's (Lumina-Image-2.0:
    6.0) when the folder is here to read."""
    import json
    from pathlib import Path

    weighting_scheme(args, loss, out.not_honoured.append, descending=False)
    config = Path(c["model"]["path"]) / "scheduler" / "scheduler_config.json"
    if config.is_file():
        shift = float(json.loads(config.read_text()).get("shift", 1.0))
    else:
        shift = LUMINA_IMAGE_2_SHIFT
        out.notes.append(f"timestep_shift: {c['model']['path']} has no scheduler/scheduler_config.json here; "
                         f"Lumina-Image-2.0's shift {shift} is assumed (the script's draws are shifted by 1 / shift)")
    loss |= {"timestep_shift": round(1 / shift, 6), "dynamic_timestep_shifting": False}
    if args["max_sequence_length"] != 256:
        out.not_honoured.append(f"max_sequence_length: {args['max_sequence_length']}: ot_dist encodes Lumina 2 "
                                "captions at the pipeline's 256 tokens")
    if args["system_prompt"]:
        out.not_honoured.append("system_prompt: ot_dist puts Lumina2Pipeline's own system prompt in front of every "
                                "caption (the script's default)")


def _new_script_options(args: DiffusersArgs, family: str, skip) -> None:
    """The Sana / Qwen-Image / Z-Image scripts' own options that change what trains and have no ot_dist counterpart."""
    if args["complex_human_instruction"]:
        skip("complex_human_instruction: the Sana script prefixes every caption with it; ot_dist encodes the "
             "caption alone (the script's default)")
    if family in ("flux2", "flux2_klein"):
        _flux2_text(args, family, skip)
    if args["bnb_quantization_config_path"]:
        skip(f"bnb_quantization_config_path: {args['bnb_quantization_config_path']}: the Qwen-Image script "
             "quantizes the transformer with bitsandbytes; ot_dist's low-memory option is weight_dtype float8 "
             "(docs/low-memory.md)")
    if args["upsample_prompt"]:
        skip("upsample_prompt: the Ideogram 4 script rewrites each caption into Ideogram's JSON caption with the "
             "prompt enhancer before encoding it; ot_dist encodes the caption as written")
    if args["disable_training_autocast"]:
        skip("disable_training_autocast: the Ideogram 4 script then runs the transformer in its weight dtype without "
             "autocast; ot_dist computes under autocast in train_dtype")
    if args["validation_model_path"]:
        skip(f"validation_model_path: {args['validation_model_path']}: the Krea 2 script samples on that checkpoint "
             "(Krea 2 Turbo) with the trained LoRA moved onto it, at validation_num_inference_steps "
             f"{args['validation_num_inference_steps']} and guidance {args['validation_guidance_scale']}; ot_dist "
             "samples the model it trains")
    else:
        for key in ("validation_num_inference_steps", "validation_guidance_scale"):
            args[key]  # read: they apply to validation_model_path only
    if args["do_fp8_training"]:
        skip("do_fp8_training: the Z-Image script trains the transformer's linear layers in float8 (torchao's "
             "convert_to_float8_training); ot_dist computes in train_dtype, float8 holds frozen weights only")


def _flux2_text(args: DiffusersArgs, family: str, skip) -> None:
    """The FLUX.2 scripts' caption length and hidden layers: ot_dist encodes as the pipelines sample (512 tokens, layers
    10 / 20 / 30 of Mistral-3, 9 / 18 / 27 of Qwen3). The [klein] script's default is [dev]'s layers."""
    from ot_dist.models.families.registry import get_family

    layers = [int(layer) for layer in args["text_encoder_out_layers"]]
    if layers != list(get_family(family).layers):
        skip(f"text_encoder_out_layers: {layers}: the script encodes its captions with these hidden layers; ot_dist "
             f"with {list(get_family(family).layers)}, the ones the pipeline samples with")
    if args["max_sequence_length"] != 512:
        skip(f"max_sequence_length: {args['max_sequence_length']}: ot_dist pads FLUX.2 captions to 512 tokens, as "
             "the pipelines")
    if args["do_fp8_training"]:
        skip("do_fp8_training: the script trains the transformer's linear layers in torchao's float8; ot_dist's "
             "float8 is a storage dtype (weight_dtype)")


def _ema(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """diffusers' EMAModel: decay 0.9999, min((1 + n) / (10 + n), decay) at step n, updated every optimizer step."""
    if args["use_ema"]:
        c["ema"] = {"enabled": True, "decay": 0.9999, "update_step_interval": 1}
        if args["offload_ema"]:
            c["ema"]["device"] = "cpu"


def _saves(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """accelerate's save_state every checkpointing_steps, the newest checkpoints_total_limit kept (unset: all)."""
    c["checkpoint"] = {"every_n_steps": args["checkpointing_steps"], "every_n_minutes": None,
                       "keep_last": args["checkpoints_total_limit"]}
    if args["resume_from_checkpoint"]:
        out.not_honoured.append(f"resume_from_checkpoint: {args['resume_from_checkpoint']} is an accelerate state "
                                "folder; ot_dist resumes from its own checkpoints (`ot-dist train --resume`)")


def _validation(args: DiffusersArgs, c: dict, out: Imported) -> None:
    """validation_prompt: num_validation_images images (seeded by --seed) every validation_epochs epochs (every
    validation_steps steps in train_dreambooth.py and textual_inversion.py), and at the end (the Qwen-Image script:
    unless skip_final_inference; final_validation_prompt when validation_prompt is unset, at the end only)."""
    prompt, at_end = args["validation_prompt"], not args["skip_final_inference"]
    final_only = not prompt and at_end and bool(args["final_validation_prompt"])
    if final_only:
        prompt = args["final_validation_prompt"]
    if args["validation_prompts"]:
        out.not_honoured.append("validation_prompts: train_dreambooth.py's precomputed embeddings for its IF "
                                "upscaler runs are not supported")
    if args["validation_images"]:
        out.not_honoured.append("validation_images: image-to-image validation is not supported")
    if not prompt:
        for key in ("num_validation_images", "validation_epochs", "validation_steps", "validation_scheduler"):
            args[key]  # read: they shape the validation that does not run
        return
    count = args["num_validation_images"]
    seed = args["seed"] if args["seed"] is not None else 42
    prompts = [{"prompt": str(prompt), "seed": seed + i} for i in range(count)]
    sampling = {"prompts": prompts, "at_end": at_end}
    if final_only:
        pass  # no schedule: the end only
    elif args.script in VALIDATION_BY_STEPS:
        sampling["every_n_steps"] = args["validation_steps"]
    else:
        sampling["every_n_epochs"] = args["validation_epochs"] or 1
    if args.given("validation_scheduler"):
        out.notes.append(f"validation_scheduler: {args['validation_scheduler']}: samples use sampling.sampler (auto)")
    if "every_n_epochs" in sampling and sampling["every_n_epochs"] > 1:
        out.notes.append(f"validation_epochs: {sampling['every_n_epochs']}: the script also validates after the first "
                         "epoch (epoch 0 % n == 0); ot_dist after every n-th")
    out.notes.append(f"validation_prompt: {count} samples with seeds {seed}..{seed + count - 1} (the script draws "
                     f"{count} images from one generator seeded by --seed: other noise, same prompt)")
    c["sampling"] = sampling
