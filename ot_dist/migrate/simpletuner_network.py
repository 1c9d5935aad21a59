"""SimpleTuner's LoRA (model_type lora): lora_type standard (peft: lora_rank, lora_alpha (unset: the rank),
lora_dropout, use_dora, the family's target modules or flux_lora_target / peft_lora_target_modules, init_lora) or
lycoris (the lycoris_config JSON: algo lora / locon, loha, lokr with linear_dim / linear_alpha and apply_preset's
target_module) as ot_dist's `lora` section. The targets are peft's module-name suffixes in both."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import Imported, local_path, read_json
from ot_dist.migrate.kohya_network import LYCORIS_ALGOS
from ot_dist.migrate.simpletuner_args import SimpleTunerArgs

ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]  # every family's DEFAULT_LORA_TARGET but Flux's / Chroma's
# flux_lora_target (Flux and Chroma), without the fused projections (to_qkv, add_qkv_proj), which exist only when
# SimpleTuner fuses them (fuse_qkv_projections)
FLUX_TARGETS = {
    "all": ["to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"],
    "context": ["add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"],
    "context+ffs": ["add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "ff_context.net.0.proj",
                    "ff_context.net.2"],
    "all+ffs": ["to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"],
}
FUSED = {"to_qkv", "add_qkv_proj"}
# DEFAULT_LORA_TARGET of the families whose list is not ATTENTION: Flux2's (helpers/models/flux2/model.py) adds the
# single blocks' fused qkv + MLP input
DEFAULT_TARGETS = {family: ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj"]
                   for family in ("flux2", "flux2_klein")}
# Ideogram 4's DEFAULT_LORA_TARGET (qkv, o, w1, w2, w3 of SimpleTuner's transformer) in diffusers' module names
DEFAULT_TARGETS["ideogram4"] = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
LYCORIS_DEFAULTS = {"linear_dim": 4, "linear_alpha": 1, "multiplier": 1}  # trainer.py's, for keys the JSON leaves out
LYCORIS_READ = {"algo", "linear_dim", "linear_alpha", "multiplier", "apply_preset", "factor"}


def import_network(args: SimpleTunerArgs, c: dict, family: str, denoiser: str, out: Imported,
                   lycoris_file: str | None) -> None:
    lora_type = str(args["lora_type"]).lower()
    if lora_type == "lycoris":
        c["lora"] = _lycoris(args, out, lycoris_file)
        return
    if lora_type != "standard":
        raise ConfigError(f"lora_type: {lora_type} is not standard or lycoris")
    if args.given("lycoris_config"):
        out.notes.append("lycoris_config: not read with lora_type standard, as in SimpleTuner")
    args["lycoris_config"]
    rank = int(args["lora_rank"])
    alpha = args["lora_alpha"]
    lora = {"rank": rank, "alpha": float(alpha if alpha is not None else rank)}  # SimpleTuner: unset alpha = rank
    dropout = args["lora_dropout"]
    if args["use_dora"]:
        lora["variant"] = "dora"
        lora["dropout"] = dropout  # peft's lora_dropout drops the adapted layer's input, as ot_dist's dora
    elif dropout:
        out.not_honoured.append(f"lora_dropout: {dropout}: SimpleTuner's (peft's) drops the adapted layer's input; "
                                "ot_dist's lora.dropout drops the rank features; not written")
    if args["lora_init_type"] != "default":
        out.not_honoured.append(f"lora_init_type: {args['lora_init_type']}: ot_dist starts a LoRA at zero change "
                                "(peft's default initialisation)")
    lora[f"{denoiser}_targets"] = _targets(args, family, out)
    if args["init_lora"]:
        lora["init_from"] = str(args.path(local_path(str(args["init_lora"]), "init_lora", out)))
    c["lora"] = lora


def _targets(args: SimpleTunerArgs, family: str, out: Imported) -> list[str]:
    manual = args["peft_lora_target_modules"]
    if manual:
        targets = manual if isinstance(manual, list) else [t.strip() for t in str(manual).strip("[]").split(",")]
        return [str(t).strip("'\" ") for t in targets]
    target = args["flux_lora_target"]
    if family not in ("flux", "chroma"):
        if args.given("flux_lora_target"):
            out.notes.append(f"flux_lora_target: {target} is read for Flux and Chroma only, as in SimpleTuner")
        return list(DEFAULT_TARGETS.get(family, ATTENTION))
    if target not in FLUX_TARGETS:
        out.not_honoured.append(f"flux_lora_target: {target}: not mapped (all, context, context+ffs, all+ffs are); "
                                "the modules of `all` are written")
        target = "all"
    if args["fuse_qkv_projections"]:
        out.not_honoured.append("fuse_qkv_projections: ot_dist adapts diffusers' separate q / k / v projections")
    return list(FLUX_TARGETS[target])


def _lycoris(args: SimpleTunerArgs, out: Imported, lycoris_file: str | None) -> dict:
    skip = out.not_honoured.append
    path = args.file(lycoris_file, "lycoris_config", out)
    config = read_json(path, "lycoris_config")
    algo = str(config.get("algo", "lora")).lower()
    if algo not in LYCORIS_ALGOS:
        raise ConfigError(f"lycoris_config ({path.name}) algo: {algo}: ot_dist trains LyCORIS' lora / locon, loha and "
                          "lokr, not this algorithm")
    settings = LYCORIS_DEFAULTS | config
    lora = {"rank": int(settings["linear_dim"]), "alpha": float(settings["linear_alpha"])}
    if LYCORIS_ALGOS[algo] != "lora":
        lora["variant"] = LYCORIS_ALGOS[algo]
    if float(settings["multiplier"]) != 1:
        skip(f"lycoris_config multiplier: {settings['multiplier']}: ot_dist applies the adapter at strength 1")
    if "factor" in config and str(config["factor"]) != "-1":
        skip(f"lycoris_config factor: {config['factor']}: ot_dist's lokr (peft's) splits the dimensions its own way "
             "(factor -1)")
    preset = config.get("apply_preset") or {}
    modules = preset.get("target_module", ["Attention"])  # the image families' DEFAULT_LYCORIS_TARGET
    if list(modules) != ["Attention"]:
        skip(f"lycoris_config apply_preset target_module: {modules}: ot_dist adapts module names, not LyCORIS' "
             "module classes; the Attention layers are written (lora.preset attention)")
    for key in preset:
        if key != "target_module":
            skip(f"lycoris_config apply_preset {key}: {preset[key]!r} has no ot_dist counterpart")
    for key, value in config.items():
        if key not in LYCORIS_READ:
            skip(f"lycoris_config {key}: {value!r} is not an option of ot_dist's {lora.get('variant', 'lora')}")
    lora["preset"] = "attention"
    for key in ("lora_rank", "lora_alpha", "use_dora", "flux_lora_target", "peft_lora_target_modules"):
        if args.given(key):
            out.notes.append(f"{key}: not read with lora_type lycoris (lycoris_config sets the adapter), as in "
                             "SimpleTuner")
        args[key]
    return lora
