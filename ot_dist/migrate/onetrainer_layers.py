"""OneTrainer's LoRA layer filter as ot_dist's lora.preset / lora.<denoiser>_targets, or as lora.layer_filter
(OneTrainer's matching rule) where no preset is the same set.

OneTrainer adapts the modules whose name contains one of the comma-separated `layer_filter` patterns (every layer
when it is empty). Its UI fills `layer_filter` from the chosen `layer_filter_preset` (the model setup's
LAYER_PRESETS), so a UI-saved config holds both and a built-in preset only the preset name."""

from __future__ import annotations

from ot_dist.models.families.registry import get_family

_SD = {"attn-mlp": ("attentions",), "attn-only": ("attn",)}
_FLUX = {"attn-mlp": ("attn", "ff.net", "proj_mlp"), "attn-only": ("attn",), "blocks": ("transformer_block",)}
_PIXART = {"attn-mlp": ("attn1", "attn2", "ff.net"), "attn-only": ("attn1", "attn2"), "blocks": ("transformer_block",)}
_CASCADE = {"attn-only": ("attention",), "down-blocks": ("down_blocks",), "up-blocks": ("up_blocks",),
            "mapper-only": ("mapper",)}
# LAYER_PRESETS of OneTrainer's model setups, by ot_dist family ("full" is every layer everywhere).
ONETRAINER_PRESETS = {"sd1": _SD, "sd2": _SD, "sdxl": _SD,
                      "sd3": {"attn-only": ("attn",), "blocks": ("transformer_block",)}, "flux": _FLUX,
                      "chroma": _FLUX, "pixart_alpha": _PIXART, "pixart_sigma": _PIXART,
                      "stable_cascade": _CASCADE, "wuerstchen_v2": _CASCADE,
                      "sana": {**_PIXART, "attn-mlp": ("attn1", "attn2", "ff.")},
                      "qwen_image": {"attn-mlp": ("attn", "img_mlp", "txt_mlp"), "attn-only": ("attn",),
                                     "blocks": ("transformer_block",)},
                      # BaseHiDreamSetup: attn1 holds both streams' attention (ot_dist's attention preset); ff_i is
                      # the image stream's MoE (experts and shared expert, not ff_t): OneTrainer's own rule carries it
                      "hidream": {"attn-mlp": ("attn1", "ff_i"), "attn-only": ("attn1",), "blocks": ("stream_block",)}}
# Z-Image (BaseZImageSetup.LAYER_PRESETS): attention / feed_forward outside the refiners, as regular expressions
ONETRAINER_PRESETS["z_image"] = {"blocks": ("layers",),
                                 "attn-mlp": ("^(?=.*attention)(?!.*refiner).*", "^(?=.*feed_forward)(?!.*refiner).*"),
                                 "attn-only": ("^(?=.*attention)(?!.*refiner).*",)}
# Anima (BaseAnimaSetup.LAYER_PRESETS): attn1 / attn2 are the self- and cross-attention (q, k, v, out), ff the MLP
ONETRAINER_PRESETS["anima"] = {"attn-mlp": ("attn1", "attn2", "ff"), "attn-only": ("attn1", "attn2"),
                               "blocks": ("transformer_block",)}
# Presets OneTrainer matches as regular expressions (its preset's `regex: True`), whatever the config's
# layer_filter_regex says when it saved the preset's name alone.
REGEX_PRESETS = {"z_image": ("attn-mlp", "attn-only")}
# BaseKrea2Setup: attn-only is ot_dist's attention preset (every block's and text-fusion block's to_q / k / v / gate /
# out); attn-mlp ("attn", "ff") and blocks go through OneTrainer's own rule
ONETRAINER_PRESETS["krea2"] = {"attn-mlp": ("attn", "ff"), "attn-only": ("attn",), "blocks": ("transformer_blocks",)}
# BaseFlux2Setup: blocks (both block lists' Linear layers) and full
ONETRAINER_PRESETS |= {"flux2": {"blocks": ("transformer_block",)}, "flux2_klein": {"blocks": ("transformer_block",)}}
# BaseErnieSetup: its presets' names as OneTrainer matches them (attn-only is ot_dist's attention preset)
ONETRAINER_PRESETS["ernie_image"] = {"attn-mlp": ("self_attention", "mlp"), "attn-only": ("self_attention",),
                                     "blocks": ("layers",)}
# BaseIdeogramSetup: attn-mlp's Linear layers (attention.to_q / k / v / to_out.0, feed_forward.w1 / w2 / w3) are ot_dist's
# default preset, attn-only's its attention preset; blocks adapts every Linear of `layers` (OneTrainer's own rule)
ONETRAINER_PRESETS["ideogram4"] = {"attn-mlp": ("attention", "feed_forward"), "attn-only": ("attention",),
                                   "blocks": ("layers",)}
# BaseHunyuanVideoSetup: Flux's presets (its attn-only is ot_dist's attention preset: every projection named attn.*)
ONETRAINER_PRESETS["hunyuan_video"] = _FLUX
# Flux's (and Chroma's) attention projections of both streams, its double blocks' image MLP and the single blocks' MLP
# input: the Linear layers whose names contain "attn", "ff.net" or "proj_mlp".
FLUX_ATTN_MLP = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                 "ff.net.0.proj", "ff.net.2", "proj_mlp")


def filter_patterns(text: str | None) -> list[str]:
    """A OneTrainer layer filter's comma-separated patterns, each stripped as its ModuleFilter strips it (none for an
    empty filter)."""
    text = (text or "").strip()
    return [p.strip() for p in text.split(",")] if text else []


def import_layer_filter(ot: dict, lora: dict, family: str, denoiser: str, out) -> None:
    presets = ONETRAINER_PRESETS.get(family, {})
    patterns = tuple(filter_patterns(ot.get("layer_filter"))) or presets.get(ot.get("layer_filter_preset") or "full",
                                                                           ())
    named = next((name for name, value in presets.items() if value == patterns), None)
    if not any(patterns):
        lora["preset"] = "all_layers"  # every Linear and Conv2d, as OneTrainer's empty filter selects
        if family in ("stable_cascade", "wuerstchen_v2"):
            out.notes.append("layer_filter: every layer -> lora.preset all_layers, without the prior's depthwise "
                             "convolutions, which OneTrainer also adapts (peft: rank divisible by their groups)")
    elif ot.get("layer_filter_regex") or named in REGEX_PRESETS.get(family, ()):
        lora.update(layer_filter=list(patterns), layer_filter_regex=True)
    elif named == "attn-only":
        lora["preset"] = "attention"
    elif named == "attn-mlp" and family in ("sd1", "sd2", "sdxl", "ideogram4"):
        pass  # ot_dist's default: the Linear / 1x1 Conv layers of the UNet's attention (Transformer2D) blocks
    elif named == "attn-mlp" and family in ("pixart_alpha", "pixart_sigma", "qwen_image", "anima"):
        # Qwen-Image: both streams' attention projections and MLPs (img_mlp, txt_mlp), its attention_mlp preset;
        # Anima: attn1, attn2 and ff's two Linear layers, its attention_mlp preset
        lora["preset"] = "attention_mlp"
    elif named == "attn-mlp" and family == "sana":  # attn1, attn2, "ff.": the Mix-FFN's convolutions
        lora["preset"] = "attention_mlp"
        out.notes.append("layer_filter_preset: attn-mlp -> lora.preset attention_mlp, without the Mix-FFN's depthwise "
                         "ff.conv_depth, which OneTrainer also adapts (peft: rank divisible by its groups)")
    elif named == "attn-mlp" and family in ("flux", "chroma"):
        lora[f"{denoiser}_targets"] = list(FLUX_ATTN_MLP)
    else:  # blocks, the Cascade presets, custom patterns: OneTrainer's own rule (lora.layer_filter)
        lora["layer_filter"] = list(patterns)


# Trained text encoders whose Linear layers include a `text_projection` (CLIPTextModelWithProjection: it makes the
# pooled embedding), by family. OneTrainer adapts every Linear of a trained text encoder (no layer filter there),
# ot_dist's default text targets are kohya's (attention and MLP).
PROJECTED_ENCODERS = {"sdxl": ("text_encoder_2",), "sd3": ("text_encoder", "text_encoder_2"),
                      "stable_cascade": ("text_encoder",)}


def import_text_encoder_layers(c: dict, family: str, out) -> None:
    fam = get_family(family)
    trained = [part for part in fam.text_encoders if (c.get(part) or {}).get("train")]
    projected = [part for part in trained if part in PROJECTED_ENCODERS.get(family, ())]
    if not projected:
        return
    defaults = {fam.text_lora_default_targets(part) for part in trained}
    if len(defaults) > 1:  # a T5 trains beside: lora.text_encoder_targets is one list for every encoder
        out.not_honoured.append(f"{', '.join(p + '.text_projection' for p in projected)}: OneTrainer adapts every "
                                "Linear of a trained text encoder; lora.text_encoder_targets (one list for all "
                                "encoders, and a T5 trains too) cannot add it")
        return
    c["lora"]["text_encoder_targets"] = [*defaults.pop(), "text_projection"]
