"""The full-finetune scripts' own arguments (train_db.py, fine_tune.py, sdxl_train.py, flux_train.py, sd3_train.py):
which text encoders train beside the denoiser, and the fused optimizer steps of the SDXL / Flux / SD3 scripts."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import Imported
from ot_dist.migrate.kohya_args import KohyaArgs


def import_full_parts(args: KohyaArgs, c: dict, family: str, out: Imported) -> None:
    """The text encoders that train beside the denoiser; the denoiser's blocks kohya freezes are listed."""
    if family == "sdxl":
        _two_clips(args, c)
    elif family == "sd3":
        _sd3_text_encoders(args, c)
    elif family in ("sd1", "sd2"):
        _sd_text_encoder(args, c)
    # flux_train.py trains the transformer alone (it has no text-encoder arguments)
    freeze = args["num_last_block_to_freeze"]
    if freeze:
        out.not_honoured.append(f"num_last_block_to_freeze: {freeze}: a full finetune trains every block of the "
                                "transformer in ot_dist (no per-block freezing)")


def _two_clips(args: KohyaArgs, c: dict) -> None:
    """sdxl_train.py trains both CLIPs only with --train_text_encoder, each at learning_rate_te1 / _te2 (None: the
    learning rate; 0: that encoder frozen)."""
    lrs = {"text_encoder": args["learning_rate_te1"], "text_encoder_2": args["learning_rate_te2"]}
    if args["train_text_encoder"]:
        _train(c, lrs)


def _sd3_text_encoders(args: KohyaArgs, c: dict) -> None:
    """sd3_train.py: --train_text_encoder trains CLIP-L and CLIP-G, --train_t5xxl (which kohya accepts only with
    it) T5 too, each at learning_rate_te1 / _te2 / _te3 (None: the learning rate; 0: that encoder frozen)."""
    if args["train_t5xxl"] and not args["train_text_encoder"]:
        raise ConfigError("train_t5xxl: kohya's sd3_train.py trains T5-XXL only with train_text_encoder (it stops "
                          "otherwise); set both or neither")
    if not args["train_text_encoder"]:
        return
    lrs = {"text_encoder": args["learning_rate_te1"], "text_encoder_2": args["learning_rate_te2"]}
    if args["train_t5xxl"]:
        lrs["text_encoder_3"] = args["learning_rate_te3"]
    _train(c, lrs)


def _train(c: dict, lrs: dict) -> None:
    for part, lr in lrs.items():
        if lr != 0:
            c[part] = {"train": True} | ({"learning_rate": lr} if lr else {})


def _sd_text_encoder(args: KohyaArgs, c: dict) -> None:
    """train_db.py trains the text encoder unless stop_text_encoder_training is negative (until that step when set);
    fine_tune.py trains it only with --train_text_encoder, at learning_rate_te (else learning_rate)."""
    if args.script == "fine_tune.py":
        if args["train_text_encoder"]:
            c["text_encoder"] = {"train": True} | ({"learning_rate": args["learning_rate_te"]}
                                                   if args["learning_rate_te"] is not None else {})
        return
    stop, lr = args["stop_text_encoder_training"], args["learning_rate_te"]
    if stop is not None and stop < 0:
        return
    c["text_encoder"] = {"train": True} | ({"learning_rate": lr} if lr else {})
    if stop is not None:
        c["text_encoder"] |= {"stop_training_after": stop, "stop_training_after_unit": "step"}


def import_fused_step(args: KohyaArgs, c: dict, out: Imported) -> None:
    """fused_backward_pass (Adafactor only in kohya) steps each parameter inside backward; blockwise_fused_optimizers
    (flux_train.py, sd3_train.py) and sdxl_train.py's fused_optimizer_groups step one optimizer per block / group of
    parameters as soon as its gradients exist. Either updates each parameter as one
    optimizer step would: ot_dist's optimizer.fused_back_pass. kohya clips each gradient by its own norm there, as
    ot_dist's clip_grad_norm_scope per_tensor does; ot_dist's fused step refuses float16 loss scaling, and with
    accumulation steps in the last micro step only (kohya refuses accumulation for fused_backward_pass), so neither
    imports."""
    fused = [key for key in ("fused_backward_pass", "blockwise_fused_optimizers") if args[key]]
    if args["fused_optimizer_groups"] and args.script == "sdxl_train.py":  # its optimizers per group of parameters
        fused.append("fused_optimizer_groups")
    elif args["fused_optimizer_groups"]:
        out.notes.append(f"fused_optimizer_groups: {args['fused_optimizer_groups']}: ignored, as {args.script} "
                         "ignores it (its help: it does not work)")
    if not fused:
        return
    from ot_dist.optim.registry import SPECS

    what, name = " / ".join(fused), c["optimizer"]["name"]
    if not SPECS[name].supports_fused_back_pass:
        out.not_honoured.append(f"{what}: ot_dist's {name} cannot step inside backward (its update of a parameter "
                                "depends on the others); the optimizer steps after backward")
        return
    if args["gradient_accumulation_steps"] > 1 or c.get("train_dtype") == "float16":
        # kohya steps in every micro step's backward there (or refuses); ot_dist's fused step waits for the last
        out.not_honoured.append(f"{what}: ot_dist's fused back pass needs gradient_accumulation_steps 1 and a "
                                "train_dtype other than float16 to step as kohya does; the optimizer steps after "
                                "backward")
        return
    c["optimizer"]["fused_back_pass"] = True
    out.notes.append(f"{what} -> optimizer.fused_back_pass: each parameter is stepped inside backward")
    if c.get("clip_grad_norm"):
        c["clip_grad_norm_scope"] = "per_tensor"
        out.notes.append(f"max_grad_norm: {c['clip_grad_norm']} with {what} -> clip_grad_norm_scope: per_tensor (each "
                         "parameter's gradient clipped by its own norm, as kohya does there)")
    else:
        c["clip_grad_norm"] = None
