"""Single-file Stable Diffusion checkpoints in the original (LDM / A1111 / ComfyUI) key layout.

`export_single_file` writes the UNet, VAE and text encoder(s) of a diffusers pipeline as ONE
`.safetensors` file keyed like the original CompVis / Stability checkpoints:

* ``model.diffusion_model.*``  UNet (input_blocks / middle_block / output_blocks / time_embed / out,
  plus ``label_emb`` for SDXL's text-time embedding),
* ``first_stage_model.*``      VAE (encoder.down.N.block.M, mid.attn_1.{q,k,v,proj_out} as 1x1 convs, ...),
* text encoders: SD 1.x ``cond_stage_model.transformer.text_model.*`` (HF CLIP layout); SD 2.x
  ``cond_stage_model.model.*`` (OpenCLIP layout); SDXL ``conditioner.embedders.0.transformer.text_model.*``
  (HF CLIP) and ``conditioner.embedders.1.model.*`` (OpenCLIP, ``text_projection`` transposed).

The mapping follows diffusers' ``scripts/convert_diffusers_to_original_stable_diffusion.py`` and
``scripts/convert_diffusers_to_original_sdxl.py`` but derives every block index from the module
configs (layers_per_block, number of levels, which levels have attention) instead of hard-coding the
real SD widths, so it also works for the tiny test models. The inverse is diffusers' own loader
(``diffusers.loaders.single_file_utils``), which `load_single_file` uses through ``from_single_file``
-- the code path a user's A1111 / civitai checkpoint takes; text-encoder keys in an older form that A1111 and
ComfyUI accept are renamed to the current one first (`_LEGACY_TEXT_PREFIXES`).

Nothing here ever unpickles: only `.safetensors` files are read.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ot_dist.errors import ConfigError, InputFileError

FAMILIES = ("sd1", "sd2", "sdxl")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD1_TEXT_PREFIX = "cond_stage_model.transformer."
SD2_TEXT_PREFIX = "cond_stage_model.model."
SDXL_TEXT_PREFIX = "conditioner.embedders.0.transformer."
SDXL_TEXT2_PREFIX = "conditioner.embedders.1.model."
# The marker of a v-prediction model: an empty tensor under this root key. ComfyUI writes it when it saves a
# v-prediction model, and ComfyUI and Forge read it to tell v-prediction SDXL checkpoints (NoobAI-XL v-pred...) from
# epsilon ones; the weights alone cannot say. Readers that do not know it ignore it (A1111 and diffusers).
V_PRED_KEY = "v_pred"
# Beside it, the marker of a zero-terminal-SNR schedule (diffusers' rescale_betas_zero_snr): ComfyUI samples a v_pred
# SDXL file that also has it with zero terminal SNR, Forge any file that has it.
ZTSNR_KEY = "ztsnr"

# Keys under a component prefix that real checkpoints carry but no diffusers module has (buffers,
# OpenCLIP's contrastive temperature); the diffusers loader ignores them as well.
_IGNORABLE_SUFFIXES = (".position_ids", ".logit_scale", ".attn_mask")
_IGNORABLE_PREFIXES = (VAE_PREFIX + "loss.",)
_COMPONENT_PREFIXES = (UNET_PREFIX, VAE_PREFIX, "cond_stage_model.", "conditioner.embedders.")
_MAX_KEYS_IN_MESSAGE = 5


# ----------------------------------------------------------------------------------------------
# diffusers -> LDM key mapping
# ----------------------------------------------------------------------------------------------

_UNET_TOP_LEVEL = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
    # SDXL's text-time embedding (addition_embed_type="text_time") or a class embedding.
    "add_embedding.linear_1.": "label_emb.0.0.",
    "add_embedding.linear_2.": "label_emb.0.2.",
    "class_embedding.linear_1.": "label_emb.0.0.",
    "class_embedding.linear_2.": "label_emb.0.2.",
}

_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}


def _rename_first(rest: str, table: Mapping[str, str], what: str) -> str:
    head, _, tail = rest.partition(".")
    if head not in table:
        raise ValueError(f"cannot map {what} parameter {rest!r} to the original layout")
    return f"{table[head]}.{tail}"


def _config_get(config: Any, name: str):
    return config[name] if isinstance(config, Mapping) else getattr(config, name)


def _unet_key_mapper(config: Any) -> Callable[[str], str]:
    """diffusers UNet2DConditionModel key -> LDM key (without the model.diffusion_model. prefix)."""
    lpb = _config_get(config, "layers_per_block")
    if not isinstance(lpb, int):
        # The original layout and diffusers' loader both assume one resnet count for every level.
        raise ValueError(f"per-level layers_per_block {lpb!r} cannot be written in the original layout")
    up_types = list(_config_get(config, "up_block_types"))
    up_has_attn = ["Attn" in t for t in up_types]
    per_level = lpb + 1  # input_blocks per down level (resnets + downsampler); output_blocks per up level

    down_res = re.compile(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)")
    down_attn = re.compile(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)")
    down_samp = re.compile(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)")
    mid_res = re.compile(r"mid_block\.resnets\.(\d+)\.(.+)")
    mid_attn = re.compile(r"mid_block\.attentions\.0\.(.+)")
    up_res = re.compile(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)")
    up_attn = re.compile(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)")
    up_samp = re.compile(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)")

    def mapper(key: str) -> str:
        for old, new in _UNET_TOP_LEVEL.items():
            if key.startswith(old):
                return new + key[len(old) :]
        if m := down_res.fullmatch(key):
            b, j, rest = int(m[1]), int(m[2]), m[3]
            return f"input_blocks.{1 + b * per_level + j}.0.{_rename_first(rest, _UNET_RESNET, 'resnet')}"
        if m := down_attn.fullmatch(key):
            b, j, rest = int(m[1]), int(m[2]), m[3]
            return f"input_blocks.{1 + b * per_level + j}.1.{rest}"
        if m := down_samp.fullmatch(key):
            b, rest = int(m[1]), m[2]
            return f"input_blocks.{(b + 1) * per_level}.0.op.{rest}"
        if m := mid_res.fullmatch(key):
            j, rest = int(m[1]), m[2]
            return f"middle_block.{2 * j}.{_rename_first(rest, _UNET_RESNET, 'resnet')}"
        if m := mid_attn.fullmatch(key):
            return f"middle_block.1.{m[1]}"
        if m := up_res.fullmatch(key):
            b, j, rest = int(m[1]), int(m[2]), m[3]
            return f"output_blocks.{b * per_level + j}.0.{_rename_first(rest, _UNET_RESNET, 'resnet')}"
        if m := up_attn.fullmatch(key):
            b, j, rest = int(m[1]), int(m[2]), m[3]
            return f"output_blocks.{b * per_level + j}.1.{rest}"
        if m := up_samp.fullmatch(key):
            b, rest = int(m[1]), m[2]
            # The upsampler follows the level's last resnet (and its attention, if the level has one).
            return f"output_blocks.{b * per_level + lpb}.{2 if up_has_attn[b] else 1}.conv.{rest}"
        raise ValueError(f"cannot map UNet parameter {key!r} to the original layout")

    return mapper


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_ATTN_CONV = ("q", "k", "v", "proj_out")


def _vae_key_mapper(config: Any) -> Callable[[str], str]:
    """diffusers AutoencoderKL key -> LDM key (without first_stage_model.)."""
    num_up = len(_config_get(config, "up_block_types"))

    enc_res = re.compile(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)")
    enc_samp = re.compile(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)")
    dec_res = re.compile(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)")
    dec_samp = re.compile(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)")
    mid_res = re.compile(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)")
    mid_attn = re.compile(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.+)")
    plain = re.compile(r"(?:encoder|decoder)\.(?:conv_in|conv_out)\..+|(?:post_)?quant_conv\..+")

    def resnet(rest: str) -> str:
        return rest.replace("conv_shortcut.", "nin_shortcut.")

    def mapper(key: str) -> str:
        if m := enc_res.fullmatch(key):
            return f"encoder.down.{m[1]}.block.{m[2]}.{resnet(m[3])}"
        if m := enc_samp.fullmatch(key):
            return f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
        if m := dec_res.fullmatch(key):
            return f"decoder.up.{num_up - 1 - int(m[1])}.block.{m[2]}.{resnet(m[3])}"
        if m := dec_samp.fullmatch(key):
            return f"decoder.up.{num_up - 1 - int(m[1])}.upsample.conv.{m[2]}"
        if m := mid_res.fullmatch(key):
            return f"{m[1]}.mid.block_{int(m[2]) + 1}.{resnet(m[3])}"
        if m := mid_attn.fullmatch(key):
            return f"{m[1]}.mid.attn_1.{_VAE_ATTN[m[2]]}.{m[3]}"
        if key.startswith(("encoder.conv_norm_out.", "decoder.conv_norm_out.")):
            return key.replace("conv_norm_out.", "norm_out.", 1)
        if plain.fullmatch(key):
            return key
        raise ValueError(f"cannot map VAE parameter {key!r} to the original layout")

    return mapper


def _hf_clip_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Normalise a CLIPTextModel[WithProjection] state dict to the `text_model.*` layout.

    transformers >= 5.6 flattened CLIPTextModel (its keys no longer start with `text_model.`), while
    CLIPTextModelWithProjection still wraps; the original checkpoints always use `text_model.*`.
    """
    out = {}
    for key, value in state_dict.items():
        if key.endswith("position_ids"):
            continue
        if not key.startswith(("text_model.", "text_projection.")):
            key = "text_model." + key
        out[key] = value
    return out


_OPENCLIP_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)")
_OPENCLIP_LAYER_PARTS = {
    "self_attn.out_proj.": "attn.out_proj.",
    "layer_norm1.": "ln_1.",
    "layer_norm2.": "ln_2.",
    "mlp.fc1.": "mlp.c_fc.",
    "mlp.fc2.": "mlp.c_proj.",
}


def _to_openclip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF CLIP text model (`text_model.*` keys) -> OpenCLIP text tower keys (no prefix)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key == "text_model.embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif key == "text_model.embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif key.startswith("text_model.final_layer_norm."):
            out["ln_final." + key[len("text_model.final_layer_norm.") :]] = value
        elif key == "text_projection.weight":
            # nn.Linear stores [proj_dim, width]; OpenCLIP multiplies x @ text_projection ([width, proj_dim]).
            out["text_projection"] = value.t()
        elif m := _OPENCLIP_LAYER.fullmatch(key):
            layer, rest = int(m[1]), m[2]
            if q := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest):
                qkv.setdefault((layer, q[2]), {})[q[1]] = value
                continue
            for old, new in _OPENCLIP_LAYER_PARTS.items():
                if rest.startswith(old):
                    out[f"transformer.resblocks.{layer}.{new}{rest[len(old):]}"] = value
                    break
            else:
                raise ValueError(f"cannot map text encoder parameter {key!r} to the OpenCLIP layout")
        else:
            raise ValueError(f"cannot map text encoder parameter {key!r} to the OpenCLIP layout")
    for (layer, kind), parts in sorted(qkv.items()):
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"text encoder layer {layer} lacks one of q/k/v {kind}")
        out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def _component_names(family: str) -> tuple[str, ...]:
    return ("unet", "vae", "text_encoder", "text_encoder_2") if family == "sdxl" else ("unet", "vae", "text_encoder")


def to_ldm_state_dict(
    components: Mapping[str, Any], family: str, states: Mapping[str, Mapping[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """The original-layout state dict of the given diffusers modules (tensors are not copied or cast).

    Works on meta-device modules too, which is how `load_single_file` learns the expected keys/shapes.
    `states` optionally gives a component's full state dict (gathered from shards by the caller).
    """
    states = states or {}

    def state_of(name: str) -> Mapping[str, torch.Tensor]:
        return states[name] if name in states else components[name].state_dict()

    _check_family(family)
    names = _component_names(family)
    missing = [n for n in names if components.get(n) is None]
    if missing:
        raise ValueError(f"family {family!r} needs components {', '.join(names)}; missing {', '.join(missing)}")
    if family != "sdxl" and components.get("text_encoder_2") is not None:
        raise ValueError(f"family {family!r} has one text encoder, but text_encoder_2 was given")

    out: dict[str, torch.Tensor] = {}

    def put(key: str, value: torch.Tensor) -> None:
        if key in out:
            raise ValueError(f"two parameters map to the same original key {key!r}")
        out[key] = value

    unet, vae = components["unet"], components["vae"]
    unet_map = _unet_key_mapper(unet.config)
    for key, value in state_of("unet").items():
        put(UNET_PREFIX + unet_map(key), value)

    vae_map = _vae_key_mapper(vae.config)
    for key, value in state_of("vae").items():
        new = vae_map(key)
        if ".mid.attn_1." in new and new.rsplit(".", 2)[-2] in _VAE_ATTN_CONV and new.endswith(".weight"):
            if value.ndim == 2:  # original attention projections are 1x1 convolutions
                value = value.reshape(*value.shape, 1, 1)
        put(VAE_PREFIX + new, value)

    text = _hf_clip_keys(state_of("text_encoder"))
    if family == "sd1":
        for key, value in text.items():
            put(SD1_TEXT_PREFIX + key, value)
    elif family == "sd2":
        for key, value in _to_openclip(text).items():
            put(SD2_TEXT_PREFIX + key, value)
    else:
        for key, value in text.items():
            put(SDXL_TEXT_PREFIX + key, value)
        for key, value in _to_openclip(_hf_clip_keys(state_of("text_encoder_2"))).items():
            put(SDXL_TEXT2_PREFIX + key, value)
    return out


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------


def export_single_file(
    components: Mapping[str, Any],
    family: str,
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    states: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> Path:
    """Write unet / vae / text_encoder[/ text_encoder_2] as one original-layout `.safetensors` file.

    `components` may be a pipeline's `.components` (tokenizers etc. are ignored); a v-prediction `scheduler` among
    them adds the `v_pred` marker (V_PRED_KEY) that ComfyUI and Forge detect v-prediction by, a zero-terminal-SNR one
    (`rescale_betas_zero_snr`) the `ztsnr` marker (ZTSNR_KEY). `dtype`
    casts floating-point tensors on save. The file is written under a temporary name in the target
    folder and moved into place with os.replace, so readers never see a partial file.
    """
    from safetensors.torch import save_file

    from ot_dist.checkpoint.canonical import make_canonical
    from ot_dist.file_modes import share_with_umask

    path = Path(path)
    state = to_ldm_state_dict(components, family, states)
    tensors = {}
    for key, value in state.items():
        value = value.detach().to("cpu")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[key] = value.contiguous()
    scheduler_config = components["scheduler"].config if components.get("scheduler") is not None else {}
    markers = {V_PRED_KEY: scheduler_config.get("prediction_type") == "v_prediction",
               ZTSNR_KEY: bool(scheduler_config.get("rescale_betas_zero_snr"))}
    for key in (k for k, present in markers.items() if present):
        tensors[key] = torch.tensor([], dtype=dtype or torch.float32)  # present or not: it holds nothing

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", "ot_dist.family": family})
        make_canonical(tmp)  # the same bytes whichever process writes the same tensors (metadata order)
        share_with_umask(tmp)  # save_file writes 0600
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def with_prediction_type(pipe, prediction_type: str | None):
    """`pipe` with its scheduler set to `prediction_type` (None: unchanged): the scheduler is what sampling and every
    export (the diffusers folder's scheduler config, the single file's `v_pred` marker) take the type from.

    Never through diffusers' `prediction_type=` loading argument: it switches to its deprecated "legacy" scheduler
    with made-up betas."""
    if prediction_type is not None and pipe.scheduler.config.get("prediction_type") != prediction_type:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, prediction_type=prediction_type)
    return pipe


def with_zero_terminal_snr(pipe):
    """`pipe` with its scheduler's betas rescaled to zero terminal SNR (a file's `ztsnr` marker, model.zero_terminal_snr)
    and its timesteps spaced `trailing`, so that sampling starts at the last timestep, pure noise (Lin et al. 2023,
    section 3.3: `leading` never samples it; ComfyUI and Forge start there too). A scheduler class without the option
    (PNDM, SD 1.x's default, would drop it silently) becomes DDIM, the paper's sampler, on the same betas."""
    import inspect

    from diffusers import DDIMScheduler

    scheduler_cls = type(pipe.scheduler)
    options = {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    if "rescale_betas_zero_snr" not in inspect.signature(scheduler_cls.__init__).parameters:
        scheduler_cls, options["clip_sample"] = DDIMScheduler, False  # latents are not clipped to [-1, 1]
    if any(pipe.scheduler.config.get(key) != value for key, value in options.items()):
        pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config, **options)
    return pipe


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------


def _read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a safetensors file, reading only its header; InputFileError if unusable."""
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        raise InputFileError(f"model file not found: {path}")
    if not path.is_file():
        raise InputFileError(f"model path is not a file: {path}")
    if path.suffix != ".safetensors":
        # diffusers picks its reader by extension and would unpickle anything else (.ckpt/.pt).
        raise InputFileError(
            f"{path}: only .safetensors single-file checkpoints are supported "
            "(pickled .ckpt/.pt files are never loaded); convert it to .safetensors first"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except SafetensorError as exc:
        raise InputFileError(f"{path} is not a valid safetensors file ({exc})") from exc
    except OSError as exc:
        raise InputFileError(f"cannot read model file {path}: {exc}") from exc


def _resolve_config_source(config_source: str | os.PathLike | None, header: Mapping[str, tuple[int, ...]]) -> Path:
    """A local diffusers-format folder describing the architecture (never downloads)."""
    if config_source is not None and Path(config_source).is_dir():
        return Path(config_source)

    from huggingface_hub import snapshot_download

    if config_source is None:
        # What diffusers itself would pick: a default hub repo inferred from the checkpoint's keys.
        from diffusers.loaders.single_file_utils import fetch_diffusers_config

        stub = {k: torch.empty(s, device="meta") for k, s in header.items()}
        try:
            repo = fetch_diffusers_config(stub)["pretrained_model_name_or_path"]
        except Exception as exc:  # noqa: BLE001 - diffusers raises assorted errors for unknown layouts
            raise ConfigError(
                "model.config is not set and the checkpoint's architecture is not one diffusers recognises; "
                "set model.config to a local diffusers model folder of the same architecture"
            ) from exc
    else:
        repo = str(config_source)
        if repo.count("/") != 1:
            raise ConfigError(f"model.config: {repo} is neither a local folder nor a Hugging Face repo id")
    try:
        return Path(
            snapshot_download(
                repo, local_files_only=True, allow_patterns=["*.json", "**/*.json", "*.txt", "**/*.txt", "**/*.model"]
            )
        )
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError, offline mode, bad repo id ...
        raise ConfigError(
            f"the architecture config {repo!r} is not available locally and nothing can be downloaded; "
            "set model.config to a local diffusers model folder of the same architecture (model_index.json, unet/, "
            "vae/, text_encoder/, tokenizer/, scheduler/ configs)"
        ) from exc


def _check_config_folder(folder: Path, family: str) -> None:
    needed = ["model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json"]
    needed += ["tokenizer", "scheduler"]
    if family == "sdxl":
        needed += ["text_encoder_2/config.json", "tokenizer_2"]
    missing = [n for n in needed if not (folder / n).exists()]
    if missing:
        raise InputFileError(
            f"model.config: {folder} is not a complete diffusers {family} model folder; missing {', '.join(missing)}"
        )


def _expected_shapes(folder: Path, family: str) -> dict[str, tuple[int, ...]]:
    """Original-layout key -> shape for the architecture in `folder` (built on the meta device)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with torch.device("meta"):
        components = {
            "unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder, subfolder="unet")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(folder, subfolder="vae")),
            "text_encoder": CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder")),
        }
        if family == "sdxl":
            components["text_encoder_2"] = CLIPTextModelWithProjection(
                CLIPTextConfig.from_pretrained(folder / "text_encoder_2")
            )
    return {key: tuple(value.shape) for key, value in to_ldm_state_dict(components, family).items()}


def _shapes_match(key: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> bool:
    if expected == actual:
        return True
    # VAE mid-attention projections: 1x1 conv [C, C, 1, 1] in CompVis files, linear [C, C] in some others;
    # diffusers' loader accepts both.
    return ".mid.attn_1." in key and tuple(d for d in expected if d != 1) == tuple(d for d in actual if d != 1)


def _ignorable(key: str) -> bool:
    from diffusers.loaders.single_file_utils import SD_2_TEXT_ENCODER_KEYS_TO_IGNORE

    return (
        not key.startswith(_COMPONENT_PREFIXES)  # DDPM buffers (betas, alphas_cumprod...), model_ema.*, ...
        or key.endswith(_IGNORABLE_SUFFIXES)
        or key.startswith(_IGNORABLE_PREFIXES)
        or key in SD_2_TEXT_ENCODER_KEYS_TO_IGNORE  # SD 2.x's unused last OpenCLIP block and projection
    )


def _validate_keys(path: Path, header: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                   family: str, folder: Path) -> None:
    missing = [k for k in expected if k not in header]
    unexpected = [k for k in header if k not in expected and not _ignorable(k)]
    mismatched = [
        f"{k} (file {list(header[k])}, expected {list(expected[k])})"
        for k in expected
        if k in header and not _shapes_match(k, expected[k], header[k])
    ]
    if not (missing or unexpected or mismatched):
        return

    def show(keys: list[str]) -> str:
        more = f", ... ({len(keys)} in total)" if len(keys) > _MAX_KEYS_IN_MESSAGE else ""
        return ", ".join(keys[:_MAX_KEYS_IN_MESSAGE]) + more

    problems = []
    if missing:
        problems.append(f"missing keys: {show(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {show(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {show(mismatched)}")
    guessed = _guess_family(header)
    hint = f" (the file looks like an {guessed} checkpoint)" if guessed and guessed != family else ""
    from ot_dist.models.families.single_file_keys import quantization_hint

    raise InputFileError(
        f"{path} does not match the {family} architecture described by {folder}{hint}: " + "; ".join(problems)
        + quantization_hint(unexpected)
    )


# Older text-encoder key forms that A1111 / Forge and ComfyUI rename on load (A1111's sd_models.py
# checkpoint_dict_replacements_sd1 / _sd2_turbo, ComfyUI's SD15 / SD20 process_clip_state_dict): file prefix -> the
# prefix the current layout (what diffusers' loader and ot_dist's export use) has there.
_LEGACY_TEXT_PREFIXES = {
    # CLIP-L saved by transformers before CLIPTextModel gained its `text_model` level (many SD 1.x finetunes).
    "sd1": {
        SD1_TEXT_PREFIX + part: SD1_TEXT_PREFIX + "text_model." + part
        for part in ("embeddings.", "encoder.", "final_layer_norm.")
    },
    # OpenCLIP-H under the SGM prefix (Stability's SD 2.1 Turbo file).
    "sd2": {"conditioner.embedders.0.model.": SD2_TEXT_PREFIX},
}


def _legacy_text_key_renames(path: Path, family: str, header: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """file key -> current-layout key for the file's text-encoder keys in an older form (empty: nothing to rename)."""
    renames = {}
    for key in header:
        for old, new in _LEGACY_TEXT_PREFIXES.get(family, {}).items():
            if key.startswith(old):
                renames[key] = new + key[len(old) :]
    both = sorted(new for new in renames.values() if new in header)
    if both:
        # The peers would keep whichever copy they read last; which one the file means cannot be told.
        more = f", ... ({len(both)} in total)" if len(both) > _MAX_KEYS_IN_MESSAGE else ""
        raise InputFileError(f"{path} holds text-encoder weights twice, in the older and the current key form: "
                             + ", ".join(both[:_MAX_KEYS_IN_MESSAGE]) + more)
    return renames


def _text_encoder_from_renamed_keys(path: Path, renames: Mapping[str, str], family: str, folder: Path, torch_dtype):
    """The text encoder of a file whose keys are in an older form, read by diffusers' own converter once renamed
    (diffusers' loader only knows the current form; its pipeline takes a text encoder given to it as it is)."""
    from safetensors import safe_open
    from transformers import CLIPTextModel

    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm

    prefix = SD1_TEXT_PREFIX if family == "sd1" else SD2_TEXT_PREFIX
    with safe_open(str(path), framework="pt") as handle:
        checkpoint = {renames.get(k, k): handle.get_tensor(k) for k in handle.keys()
                      if renames.get(k, k).startswith(prefix)}
    return create_diffusers_clip_model_from_ldm(
        CLIPTextModel, checkpoint=checkpoint, config=str(folder), subfolder="text_encoder", torch_dtype=torch_dtype,
        local_files_only=True,
    )


def _guess_family(header: Mapping[str, tuple[int, ...]]) -> str | None:
    """Which family's text-encoder layout the file uses, for error messages."""
    if any(k.startswith(SDXL_TEXT2_PREFIX) for k in header):
        return "sdxl"
    if any(k.startswith(SD2_TEXT_PREFIX) for k in header):
        return "sd2"
    if any(k.startswith(SD1_TEXT_PREFIX) for k in header):
        return "sd1"
    return None


def load_single_file(
    path: str | os.PathLike,
    family: str,
    config_source: str | os.PathLike | None,
    prediction_type: str | None = None,
    *,
    torch_dtype: torch.dtype | None = None,
):
    """Load an original-layout single-file checkpoint through diffusers' `from_single_file`.

    Returns a StableDiffusionPipeline (sd1/sd2) or StableDiffusionXLPipeline (sdxl).

    `config_source` describes the architecture: a local diffusers-format folder (model_index.json,
    unet/, vae/, text_encoder/[, text_encoder_2/] configs, tokenizer folder(s), scheduler/). Weights
    in that folder are never used: the checkpoint is first checked to contain every parameter of that
    architecture with the right shape. A hub repo id or None (= the default repo diffusers infers
    from the checkpoint) only works if its configs are already in the local Hugging Face cache.

    The scheduler comes from `config_source`; `prediction_type` ("epsilon", "v_prediction", "sample")
    overrides its prediction type (e.g. an SD 2.x 768-v checkpoint with a config that says epsilon). Without one, a
    file that carries the `v_pred` marker (V_PRED_KEY) is a v-prediction model, as ComfyUI and Forge read it; one that
    carries `ztsnr` (ZTSNR_KEY) was trained on a zero-terminal-SNR schedule, which the scheduler is then given.
    """
    _check_family(family)
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise ConfigError(f"prediction_type {prediction_type!r} must be one of {', '.join(PREDICTION_TYPES)}")
    path = Path(path)
    header = _read_header(path)
    if prediction_type is None and V_PRED_KEY in header:
        prediction_type = "v_prediction"
    renames = _legacy_text_key_renames(path, family, header)
    header = {renames.get(k, k): shape for k, shape in header.items()}
    folder = _resolve_config_source(config_source, header)
    _check_config_folder(folder, family)
    _validate_keys(path, header, _expected_shapes(folder, family), family, folder)

    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    pipeline_class = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    kwargs: dict[str, Any] = {}
    if renames:
        kwargs["text_encoder"] = _text_encoder_from_renamed_keys(path, renames, family, folder, torch_dtype)
    if family == "sdxl":
        text_encoder_2 = _sdxl_text_encoder_2_if_ambiguous(path, header, folder, torch_dtype)
        if text_encoder_2 is not None:
            kwargs["text_encoder_2"] = text_encoder_2
    try:
        # config=<local folder> makes diffusers read every component config from it and never touch the
        # hub; local_files_only guards the sub-loaders. Do NOT pass prediction_type here (with_prediction_type).
        pipe = pipeline_class.from_single_file(
            str(path), config=str(folder), local_files_only=True, torch_dtype=torch_dtype, **kwargs
        )
    except Exception as exc:
        from safetensors import SafetensorError

        if isinstance(exc, SafetensorError):
            raise InputFileError(f"{path} is not a valid safetensors file ({exc})") from exc
        if isinstance(exc, OSError):
            raise InputFileError(f"cannot load {path} with the architecture config {folder}: {exc}") from exc
        raise
    pipe = with_prediction_type(pipe, prediction_type)
    return with_zero_terminal_snr(pipe) if ZTSNR_KEY in header else pipe


def _sdxl_text_encoder_2_if_ambiguous(path: Path, header, folder: Path, torch_dtype):
    """Build text_encoder_2 ourselves when diffusers' detection would load the wrong tower into it.

    diffusers decides which tower of an SDXL file feeds `CLIPTextModelWithProjection` by checking
    whether `conditioner.embedders.0.*.position_embedding` has the model's width. Real SDXL towers
    differ (768 vs 1280), but when both have the same width (the tiny test models) it would silently
    load embedders.0 (the CLIP-L tower) into text_encoder_2. Then we run diffusers' own converter on
    the embedders.1 keys only.
    """
    from transformers import CLIPTextConfig

    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    width_0 = header.get(CHECKPOINT_KEY_NAMES["clip_sdxl"], (None,))[-1]
    width_2 = CLIPTextConfig.from_pretrained(folder / "text_encoder_2").hidden_size
    if width_0 != width_2:
        return None

    from safetensors import safe_open
    from transformers import CLIPTextModelWithProjection

    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm

    with safe_open(str(path), framework="pt") as handle:
        checkpoint = {k: handle.get_tensor(k) for k in handle.keys() if k.startswith(SDXL_TEXT2_PREFIX)}
    return create_diffusers_clip_model_from_ldm(
        CLIPTextModelWithProjection,
        checkpoint=checkpoint,
        config=str(folder),
        subfolder="text_encoder_2",
        torch_dtype=torch_dtype,
        local_files_only=True,
    )


__all__ = ["FAMILIES", "V_PRED_KEY", "ZTSNR_KEY", "export_single_file", "load_single_file", "to_ldm_state_dict",
           "with_prediction_type"]
