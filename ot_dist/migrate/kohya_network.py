"""kohya's network (network_module, network_dim / network_alpha / network_dropout, network_args) and which parts
it adapts (network_train_unet_only, unet_lr / text_encoder_lr) as ot_dist's `lora` section and part sections.

kohya's networks.lora (lora_flux, lora_sd3) adapts every linear layer of the UNet's transformer blocks (the
attentions, their feed-forward and proj_in / proj_out: ot_dist's default targets) and the text encoders' attention
and MLP layers, at network_dim (default 4) and network_alpha (default 1); with network_args conv_dim it also adapts
the ResNet blocks and the down / up samplers (their linear and 1x1 layers at network_dim, their 3x3 convolutions at
conv_dim / conv_alpha). LyCORIS (lycoris.kohya) algo lora / locon, loha, lokr are ot_dist's variants lora, loha,
lokr, with the modules of its preset (LyCORIS' config.py PRESET)."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import Imported
from ot_dist.migrate.kohya_args import KohyaArgs
from ot_dist.models.families.registry import get_family

PLAIN = {"networks.lora": ("sd1", "sd2", "sdxl"), "networks.lora_flux": ("flux", "chroma"), "networks.lora_sd3": ("sd3",),
         "networks.lora_lumina": ("lumina2",)}
LYCORIS_ALGOS = {"lora": "lora", "locon": "lora", "loha": "loha", "lokr": "lokr"}
# The UNet modules kohya's conv_dim adds (ResnetBlock2D, Downsample2D, Upsample2D): 1x1 / linear ones and 3x3 ones.
RESNET_LINEAR = ("time_emb_proj", "conv_shortcut")
RESNET_CONV = ("conv1", "conv2", "conv")  # `conv`: the samplers' (down_blocks.N.downsamplers.0.conv, ...)
CONV_1X1 = ("proj_in", "proj_out")  # the transformer blocks' 1x1 convolutions in SD 1.x / 2.x (SDXL: linear layers)
UNET_FAMILIES = ("sd1", "sd2", "sdxl")
# LyCORIS' names outside the blocks, as kohya's SD 1.x / 2.x UNet (diffusers' names) has them; its SDXL UNet names them
# otherwise (time_embed, input_blocks.0.0, out.2), so LyCORIS adapts none of them there.
TIME_EMBEDDING = {"sd1": ("time_embedding.linear_1", "time_embedding.linear_2"),
                  "sd2": ("time_embedding.linear_1", "time_embedding.linear_2")}
CONV_IN_OUT = {"sd1": ("conv_in", "conv_out"), "sd2": ("conv_in", "conv_out")}
LYCORIS_PRESETS = ("full", "full-lin", "attn-mlp", "attn-only")
# The encoders kohya's scripts adapt besides the denoiser (by ot_dist part), and the T5 that network_args
# train_t5xxl adds.
TEXT_ENCODERS = {"sd1": ("text_encoder",), "sd2": ("text_encoder",), "sdxl": ("text_encoder", "text_encoder_2"),
                 "flux": ("text_encoder",), "chroma": (), "sd3": ("text_encoder", "text_encoder_2"),
                 "lumina2": ("text_encoder",)}  # Lumina: Gemma 2
T5 = {"flux": "text_encoder_2", "chroma": "text_encoder", "sd3": "text_encoder_3"}  # Chroma has no CLIP-L


def network_args(args: KohyaArgs) -> dict[str, str]:
    """network_args "key=value" words as kohya's scripts split them."""
    parsed = {}
    for word in args["network_args"] or []:
        key, sep, value = str(word).partition("=")
        if not sep:
            raise ConfigError(f"network_args: {word!r} is not key=value")
        parsed[key.strip()] = value.strip()
    return parsed


def _alpha(alpha, rank: int):
    """kohya's LoRAModule and LyCORIS' modules read an alpha of 0 as the rank (scale 1, "no scaling")."""
    return rank if alpha == 0 else alpha


def _number(key: str, value, kind: type = float):
    """A network_args value as kohya's networks read it (int(conv_dim), float(rank_dropout), ...); a word that is no
    number is an error naming the argument, not a bare ValueError."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(f"network_args: {key}={value}: kohya reads {key} as {what}") from None


def import_network(args: KohyaArgs, c: dict, family: str, out: Imported) -> None:
    skip = out.not_honoured.append
    module, extra = str(args["network_module"] or ""), network_args(args)
    rank = args["network_dim"] or 4  # networks.lora's default
    alpha = _alpha(args["network_alpha"] if args["network_alpha"] is not None else 1.0, rank)
    lora = {"rank": rank, "alpha": alpha}
    if module == "lycoris.kohya":
        algo = extra.pop("algo", "lora").lower()
        if algo not in LYCORIS_ALGOS:
            raise ConfigError(f"network_args: algo={algo}: ot_dist trains LyCORIS' lora / locon, loha and lokr, not "
                              f"{algo}")
        if LYCORIS_ALGOS[algo] != "lora":
            lora["variant"] = LYCORIS_ALGOS[algo]
        _lycoris_options(extra, lora, skip)
    elif module in PLAIN:
        if family not in PLAIN[module]:
            raise ConfigError(f"network_module: {module} is kohya's network for {', '.join(PLAIN[module])}, not for "
                              f"{args.script}")
    elif module == "networks.dylora":
        raise ConfigError("network_module: networks.dylora (DyLoRA, a LoRA trained at every rank up to network_dim) "
                          "is not trained by ot_dist; use networks.lora")
    elif not module:
        raise ConfigError(f"network_module: not set ({args.script} needs one: networks.lora, lycoris.kohya, ...)")
    else:
        raise ConfigError(f"network_module: {module} is not a network ot_dist trains (networks.lora, lora_flux, "
                          "lora_sd3, lora_lumina, lycoris.kohya with algo locon / loha / lokr)")
    _targets(extra, lora, family, module, skip)
    if args["network_dropout"] and lora.get("variant", "lora") == "lora":
        # both drop the rank features after lora_down, in training only (kohya's LoRAModule.forward)
        lora["dropout"] = float(args["network_dropout"])
    elif args["network_dropout"]:
        skip(f"network_dropout: {args['network_dropout']}: ot_dist's lora.dropout drops a plain LoRA's rank "
             f"features; for {lora['variant']} it is another regulariser than LyCORIS': not written")
    for key in ("rank_dropout", "module_dropout"):
        if key in extra and module in PLAIN:  # kohya's LoRAModule.forward: lora.rank_dropout / module_dropout's rule
            lora[key] = _number(key, extra.pop(key))
        elif key in extra:  # LyCORIS' rank dropout rescales only with rank_dropout_scale
            skip(f"network_args {key}={extra.pop(key)}: LyCORIS' {key} is not ot_dist's (kohya networks.lora's)")
    train_t5 = extra.pop("train_t5xxl", "False").lower() == "true"
    for key, value in extra.items():
        skip(f"network_args {key}={value}: not supported by ot_dist's LoRA")
    c["lora"] = lora
    _parts(args, c, family, train_t5, skip)
    if args["network_weights"]:
        if lora.get("variant", "lora") == "lora":
            c["lora"]["init_from"] = str(args["network_weights"])
        else:
            skip(f"network_weights: {args['network_weights']}: ot_dist continues plain LoRA files only")
    if args["dim_from_weights"]:
        out.notes.append("dim_from_weights: the rank is network_dim's; it must equal the file's (lora.init_from)")


def _lycoris_options(extra: dict, lora: dict, skip) -> None:
    """LyCORIS' own options that change the adapter: the ones ot_dist's peft variants lack are listed."""
    if "factor" in extra and lora.get("variant") == "lokr":
        factor = extra.pop("factor")
        if factor != "-1":
            skip(f"network_args factor={factor}: ot_dist's lokr (peft's) splits the dimensions its own way (factor -1)")
    for key in ("dora_wd", "use_tucker", "use_scalar", "rank_dropout_scale", "decompose_both", "full_matrix",
                "bypass_mode", "weight_decompose", "rs_lora"):
        if key in extra and extra[key].lower() not in ("false", "0"):
            skip(f"network_args {key}={extra.pop(key)}: not an option of ot_dist's {lora.get('variant', 'lora')}")
        extra.pop(key, None)


def _targets(extra: dict, lora: dict, family: str, module: str, skip) -> None:
    """Which denoiser modules carry adapters. networks.lora: the transformer blocks, and with conv_dim the ResNet
    blocks and samplers too (LoCon). LyCORIS' preset full (its default) adapts those and, on kohya's SD 1.x / 2.x UNet,
    conv_in, conv_out and the time embedding, its convolutions at conv_dim / conv_alpha (default: network_dim /
    network_alpha); attn-mlp, full-lin and attn-only leave the convolutions out. ot_dist has one rank and alpha for
    every module, so the convolutions are adapted only when their rank and alpha are the linear layers'."""
    lycoris = module == "lycoris.kohya"
    preset = extra.pop("preset", "full") if lycoris else "kohya"
    conv_dim, conv_alpha = extra.pop("conv_dim", None), extra.pop("conv_alpha", None)
    if lycoris:
        conv_dim = _number("conv_dim", conv_dim, int) if conv_dim else lora["rank"]
        conv_alpha = _alpha(_number("conv_alpha", conv_alpha), conv_dim) if conv_alpha else float(lora["alpha"])
    elif conv_dim is not None:
        conv_dim = _number("conv_dim", conv_dim, int)
        conv_alpha = _alpha(_number("conv_alpha", conv_alpha), conv_dim) if conv_alpha is not None else 1.0
    if family not in UNET_FAMILIES:
        _transformer_layout(lora, family, module, preset, skip)
        if conv_dim is not None and not lycoris:
            skip(f"network_args conv_dim={conv_dim}: {family}'s transformer has no convolutions to adapt")
        return
    default = get_family(family).denoiser_lora_presets["default"]
    linear = [t for t in default if family == "sdxl" or t not in CONV_1X1]  # SD 1.x / 2.x: proj_in / proj_out are convs
    if preset not in ("kohya", *LYCORIS_PRESETS):
        skip(f"network_args preset={preset}: not one of LyCORIS' presets ot_dist has ({', '.join(LYCORIS_PRESETS)}); "
             "full is written")
        preset = "full"
    if preset == "attn-only":
        lora["preset"] = "attention"
        return
    if preset in ("attn-mlp", "full-lin"):
        extras = ("time_emb_proj", *TIME_EMBEDDING.get(family, ())) if preset == "full-lin" else ()
        targets = [*linear, *extras]
        if targets != list(default):
            lora["unet_targets"] = targets
        return
    if conv_dim is None:  # networks.lora without conv_dim
        return
    extras = TIME_EMBEDDING.get(family, ()) + CONV_IN_OUT.get(family, ()) if lycoris else ()
    if (conv_dim, conv_alpha) != (lora["rank"], float(lora["alpha"])):
        if lycoris:
            skip(f"network_args conv_dim={conv_dim} conv_alpha={conv_alpha}: ot_dist adapts every module at one rank "
                 f"and alpha ({lora['rank']}, {lora['alpha']}); the ResNet blocks and samplers are not adapted (set "
                 "conv_dim and conv_alpha to network_dim and network_alpha to have them)")
            return
        # networks.lora adapts the ResNet blocks' linear and 1x1 layers at network_dim / network_alpha, conv_dim
        # applies to the 3x3 convolutions only
        skip(f"network_args conv_dim={conv_dim} conv_alpha={conv_alpha}: ot_dist adapts every module at one rank and "
             f"alpha ({lora['rank']}, {lora['alpha']}); the 3x3 convolutions of the ResNet blocks and samplers are not "
             "adapted, their time_emb_proj and 1x1 conv_shortcut are, at network_dim as in kohya (set conv_dim and "
             "conv_alpha to network_dim and network_alpha to have the convolutions too)")
        lora["unet_targets"] = [*default, *RESNET_LINEAR]
        return
    lora["unet_targets"] = [*default, *RESNET_LINEAR, *RESNET_CONV, *extras]


def _transformer_layout(lora: dict, family: str, module: str, preset: str, skip) -> None:
    """kohya's Flux, SD3 and Lumina networks adapt every linear layer of the blocks in the original layout: one adapter
    on the fused qkv (and Flux's single blocks' fused input), the modulation layers too (Lumina: the final layer's as
    well); ot_dist's targets are diffusers' separate q, k, v, attention outputs and feed-forward layers."""
    if family in ("sd3", "lumina2"):
        lora["preset"] = "attention_mlp"
    skip(f"network_module {module}{' preset ' + preset if preset != 'kohya' else ''}: kohya adapts {family}'s fused "
         "qkv projections with one adapter each and the modulation layers too; ot_dist adapts diffusers' separate q, "
         f"k, v, the attention outputs and the feed-forward layers (lora.preset {lora.get('preset', 'default')})")


def _parts(args: KohyaArgs, c: dict, family: str, train_t5: bool, skip) -> None:
    """Which parts carry adapters, at which learning rate. kohya: unet_lr / text_encoder_lr default to
    learning_rate, a learning rate of 0 leaves the part out; network_train_unet_only / _text_encoder_only; the text
    encoders of SDXL, Flux and SD3 are not adapted when their outputs are cached."""
    denoiser = get_family(family).denoiser
    unet_lr = args["unet_lr"]
    if args["network_train_text_encoder_only"] or unet_lr == 0:
        c[denoiser] = {"train": False}
    elif unet_lr:
        c[denoiser] = {"learning_rate": unet_lr}
    te_lrs = args["text_encoder_lr"]
    te_lrs = [te_lrs] if isinstance(te_lrs, (int, float)) else list(te_lrs or [])
    cached = args["cache_text_encoder_outputs"] and family != "sd1" and family != "sd2"
    if args["network_train_unet_only"] or cached:
        return
    encoders = TEXT_ENCODERS[family] + ((T5[family],) if train_t5 and family in T5 else ())
    for i, part in enumerate(encoders):
        # kohya: one value for every encoder, or one per encoder (the last repeats)
        lr = te_lrs[min(i, len(te_lrs) - 1)] if te_lrs else None
        if lr == 0:
            continue
        c[part] = {"train": True} | ({"learning_rate": lr} if lr else {})
