"""Components from their own files (`model.component_files`), as ComfyUI / Forge / SwarmUI users hold them: Flux's
`clip_l.safetensors`, `t5xxl_fp16.safetensors` (or its fp8 casts) and `ae.safetensors`, SD3.5's `clip_g`, Z-Image's
`qwen_3_4b`, Qwen-Image's `qwen_2.5_vl_7b`. The `model.config` folder then needs only the configs and tokenizers.

A family declares which of its components such a file may replace and in which layout (`Family.component_files`:
component name -> one of the layouts below); this module checks a file against the component the folder's config
describes (names and shapes, read from the header: nothing heavy before the check) and builds the component from it.

The layouts, as ComfyUI reads them (read at Comfy-Org/ComfyUI a125cd84 and its January 2026 state; comfy/sd.py
`load_clip` / `load_text_encoder_state_dicts`: a text-encoder file is the state dict of the model class ComfyUI builds
for it, loaded with `load_state_dict` as is):

* CLIP_TEXT (clip_l, clip_g): transformers' CLIPTextModel(WithProjection) names with the `text_model.` level
  (comfy/clip_model.py keeps it); `text_projection.weight` where the file has one. Without one, the projection is the
  identity, as ComfyUI pools SD3's CLIP-L without projecting and diffusers' from_single_file sets it.
  CLIP_TEXT_PROJECTED (clip_g, whose projected pooled output SD3 reads): the same, the projection required (ComfyUI
  gives a missing one no value).
* T5_ENCODER (t5xxl): transformers' T5EncoderModel names (comfy/text_encoders/t5.py uses them): `shared.weight`,
  `encoder.block.N.layer.{0,1}...`, `encoder.final_layer_norm.weight`; the tied `encoder.embed_tokens.weight` may be
  left out.
* QWEN3 (Z-Image's qwen_3_4b), and `decoder_lm(...)` for any other decoder-only text encoder: ComfyUI's Llama2_ under
  `model.` (comfy/text_encoders/llama.py Qwen3_4B: `model.embed_tokens`, `model.layers.N.{self_attn,mlp}...`,
  `model.norm`), the names of transformers' Qwen3Model under `model.`; an `lm_head.weight` is ignored where the module
  has none (Z-Image reads hidden states only).
* QWEN25_VL (Qwen-Image's qwen_2.5_vl_7b): Qwen2.5-VL's original checkpoint layout, as ComfyUI's Qwen25_7BVLI holds it:
  the language model under `model.`, the vision tower under `visual.`, `lm_head.weight`; transformers 5 keeps them
  under `model.language_model.`, `model.visual.` and `lm_head.`. ComfyUI's model has no lm_head: a file without one
  loads with a zero lm_head (Qwen-Image reads hidden states only, and the exported folder then says so plainly).
* WAN_VAE (Qwen-Image's qwen_image_vae.safetensors): Wan 2.1's VAE as ComfyUI's WanVAE holds it (comfy/ldm/wan/vae.py):
  flat `encoder.downsamples.N` / `decoder.upsamples.N`, residual blocks as `residual.{0,2,3,6}` + `shortcut`,
  `middle.{0,1,2}`, `head.{0,2}`, the quant convs `conv1` / `conv2`; diffusers' convert_wan_vae_to_diffusers reads the
  same names for the real configuration (two residual blocks per level), this map follows any num_res_blocks.
* LDM_VAE (Flux / Chroma / Z-Image `ae.safetensors`, an SD3 VAE file): the LDM autoencoder with bare keys
  (`encoder.down.N.block.M...`, `decoder.up.N...`), the layout of a full checkpoint's VAE without its prefix
  (sd3_single_file.vae_rules, which diffusers' convert_ldm_vae_checkpoint reads the same way).

Quantized files: a float8 cast (`t5xxl_fp8_e4m3fn.safetensors`) is upcast like any other dtype. ComfyUI's scaled
float8 files (`*_fp8_scaled`) store each Linear weight as float8 with a float32 scale beside it, and the weight is
the product (comfy/ops.py scaled_fp8_ops: `weight * scale_weight`): the old form marks the file with a `scaled_fp8`
tensor and names the scale `<layer>.scale_weight`; the newer one (comfy/utils.py convert_old_quants, comfy/quant_ops.py)
names it `<layer>.weight_scale`, with a `<layer>.comfy_quant` JSON tensor (or the `_quantization_metadata` header
entry) giving the format. Input scales only matter to float8 matmuls and are ignored. Formats other than float8
(nvfp4) are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from ot_dist.errors import InputFileError
from ot_dist.models.tied_weights import tied_weights

Tensor = torch.Tensor
FIELD = "model.component_files"
_MAX_NAMED = 5
# Buffers some files carry (CLIP's position_ids); the models count positions themselves.
_IGNORED_SUFFIXES = ("position_ids",)
# ComfyUI's quantization entries, old and new; the weight scales are applied, the rest read by nothing.
_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_QUANT_EXTRAS = (".scale_input", ".input_scale", ".comfy_quant")
_QUANT_MARKER = "scaled_fp8"
_FLOAT8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def _names(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:_MAX_NAMED]) + (f" and {len(keys) - _MAX_NAMED} more" if len(keys) > _MAX_NAMED else "")


def _tied_copies(module: torch.nn.Module) -> set[str]:
    return set(tied_weights(module))


# ---- layouts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenamedLayout:
    """A file whose tensors are the module's under other names (the text encoders): `file_key(module, key)` gives the
    file's name of a module key; `optional` module keys may be missing (their `fill` applies), `ignored` file keys are
    read by nothing."""

    what: str
    file_key: Callable[[torch.nn.Module, str], str]
    optional: tuple[str, ...] = ()
    fill: Callable[[str, Tensor], None] | None = None
    ignored: tuple[str, ...] = ()

    def names(self, module: torch.nn.Module) -> dict[str, str]:
        """file key -> module key, for every module tensor a file holds."""
        return {self.file_key(module, k): k for k in module.state_dict() if not k.endswith(_IGNORED_SUFFIXES)}

    def check(self, header: Mapping[str, tuple[int, ...]], module: torch.nn.Module) -> list[str]:
        own, names = module.state_dict(), self.names(module)
        expected = {f: tuple(own[k].shape) for f, k in names.items()}
        may_lack = {f for f, k in names.items() if k in _tied_copies(module) or k in self.optional}
        # an ignored key is read where the module has it (a causal LM's own lm_head), skipped where it has not
        found = {k: v for k, v in header.items()
                 if not k.endswith(_IGNORED_SUFFIXES) and (k not in self.ignored or k in expected)}
        problems = []
        if missing := set(expected) - set(found) - may_lack:
            problems.append(f"missing {_names(missing)}")
        if unexpected := set(found) - set(expected):
            problems.append(f"unexpected {_names(unexpected)}")
        problems += [f"{k} is {list(found[k])}, expected {list(expected[k])}"
                     for k in sorted(set(expected) & set(found)) if tuple(found[k]) != expected[k]][:_MAX_NAMED]
        return problems

    def load(self, module: torch.nn.Module, read: Callable[[str], Tensor], header) -> None:
        own = module.state_dict()
        tied = _tied_copies(module)
        with torch.no_grad():
            for file_key, key in self.names(module).items():
                if file_key in header and key not in tied:
                    own[key].copy_(read(file_key))
                elif file_key not in header and key in self.optional and self.fill:
                    self.fill(key, own[key])
        if tied:  # built without transformers' initialisation, which is what ties them: tie them now
            module.tie_weights()


@dataclass(frozen=True)
class ConvertedLayout:
    """A file in another layout, converted as a whole: `expected(module)` gives the file's names and shapes,
    `convert(state, module)` the module's state dict from the file's (the VAEs)."""

    what: str
    expected: Callable[[torch.nn.Module], dict[str, tuple[int, ...]]]
    convert: Callable[[dict[str, Tensor], torch.nn.Module], dict[str, Tensor]]

    def check(self, header: Mapping[str, tuple[int, ...]], module: torch.nn.Module) -> list[str]:
        expected = self.expected(module)
        problems = []
        if missing := set(expected) - set(header):
            problems.append(f"missing {_names(missing)}")
        if unexpected := set(header) - set(expected):
            problems.append(f"unexpected {_names(unexpected)}")
        problems += [f"{k} is {list(header[k])}, expected {list(expected[k])}"
                     for k in sorted(set(expected) & set(header)) if tuple(header[k]) != expected[k]][:_MAX_NAMED]
        return problems

    def load(self, module: torch.nn.Module, read: Callable[[str], Tensor], header) -> None:
        state = self.convert({k: read(k) for k in header}, module)
        own = module.state_dict()
        with torch.no_grad():
            for key, value in state.items():
                own[key].copy_(value)


def _clip_key(module: torch.nn.Module, key: str) -> str:
    """transformers >= 5.6 CLIPTextModel dropped the `text_model.` level that every CLIP file has."""
    if key.startswith(("text_model.", "text_projection.")) or "text_model" in dict(module.named_children()):
        return key
    return "text_model." + key


def _identity_projection(key: str, tensor: Tensor) -> None:
    if key == "text_projection.weight" and tensor.shape[0] == tensor.shape[1]:
        tensor.copy_(torch.eye(tensor.shape[0], dtype=tensor.dtype))
    else:
        raise InputFileError(f"{FIELD}: the file has no {key}, and {list(tensor.shape)} cannot be the identity")


def _decoder_lm_key(module: torch.nn.Module, key: str) -> str:
    """A decoder-only language model's key under ComfyUI's `model.` (its Llama2_: Qwen3, Llama, Gemma, Mistral); a
    *ForCausalLM has that level itself."""
    return key if key.startswith(("model.", "lm_head.")) else "model." + key


def decoder_lm(what: str) -> RenamedLayout:
    """The layout of ComfyUI's file of a decoder-only text encoder (comfy/text_encoders/llama.py: the decoder under
    `model.` with transformers' layer names). ComfyUI's models have no lm_head: a file's `lm_head.weight` is read where
    the module has one (a *ForCausalLM) and ignored where it has not; a causal LM whose file has none gets a zero one
    (the text encoders read hidden states only). `spiece_model` (the SentencePiece tokenizer ComfyUI keeps in its
    Gemma files) is read by nothing."""
    return RenamedLayout(what, _decoder_lm_key, optional=("lm_head.weight",), fill=_zero,
                         ignored=("lm_head.weight", "spiece_model"))


def _qwen25_vl_key(module: torch.nn.Module, key: str) -> str:
    for ours, original in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(ours):
            return original + key[len(ours):]
    return key


_WAN_RESNET = ((".norm1.gamma", ".residual.0.gamma"), (".conv1.", ".residual.2."), (".norm2.gamma", ".residual.3.gamma"),
               (".conv2.", ".residual.6."), (".conv_shortcut.", ".shortcut."))
_WAN_TOP = (("encoder.conv_in.", "encoder.conv1."), ("decoder.conv_in.", "decoder.conv1."),
            ("encoder.norm_out.", "encoder.head.0."), ("decoder.norm_out.", "decoder.head.0."),
            ("encoder.conv_out.", "encoder.head.2."), ("decoder.conv_out.", "decoder.head.2."),
            ("quant_conv.", "conv1."), ("post_quant_conv.", "conv2."),
            ("mid_block.resnets.0.", "middle.0."), ("mid_block.attentions.0.", "middle.1."),
            ("mid_block.resnets.1.", "middle.2."))


def _wan_vae_key(module: torch.nn.Module, key: str) -> str:
    """An AutoencoderKLQwenImage key in Wan 2.1's VAE layout (comfy/ldm/wan/vae.py WanVAE): the encoder's and
    decoder's blocks are one flat `downsamples` / `upsamples` Sequential each (per decoder level num_res_blocks + 1
    residual blocks, then its upsampler), a residual block is one `residual` Sequential (RMS norm 0, conv 2, norm 3,
    conv 6) with its `shortcut`, `middle.{0,1,2}` is resnet, attention, resnet, `head.{0,2}` the output norm and conv,
    and the quant convs are `conv1` / `conv2`."""
    for ours, original in _WAN_TOP:
        if key.startswith(ours) or f".{ours}" in key:
            key = key.replace(ours, original, 1)
            break
    if key.startswith("encoder.down_blocks."):
        key = "encoder.downsamples." + key[len("encoder.down_blocks."):]
    elif key.startswith("decoder.up_blocks."):
        level, kind, index, rest = key[len("decoder.up_blocks."):].split(".", 3)
        per_level = module.config.num_res_blocks + 2  # its residual blocks and the upsampler
        flat = int(level) * per_level + (int(index) if kind == "resnets" else per_level - 1)
        key = f"decoder.upsamples.{flat}.{rest}"
    if ".residual." not in key and (".middle.0." in key or ".middle.2." in key or "samples." in key):
        for ours, original in _WAN_RESNET:
            key = key.replace(ours, original)
    return key


def _zero(key: str, tensor: Tensor) -> None:
    tensor.zero_()


def _ldm_vae_expected(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    from ot_dist.models.families.sd3_single_file import expected_vae_header

    return expected_vae_header(dict(module.config))


def _ldm_vae_convert(state: dict[str, Tensor], module: torch.nn.Module) -> dict[str, Tensor]:
    from ot_dist.models.families import single_file_keys as K
    from ot_dist.models.families.sd3_single_file import vae_rules

    return K.from_original(state, vae_rules(dict(module.config)), ())


CLIP_TEXT = RenamedLayout("CLIP text encoder (ComfyUI's clip_l)", _clip_key,
                          optional=("text_projection.weight",), fill=_identity_projection)
# A CLIP whose projected pooled output the family reads (SD3's CLIP-G): the file must hold its projection.
CLIP_TEXT_PROJECTED = RenamedLayout("CLIP text encoder with its projection (ComfyUI's clip_g)", _clip_key)
T5_ENCODER = RenamedLayout("T5 encoder (ComfyUI's t5xxl)", lambda module, key: key)
QWEN3 = decoder_lm("Qwen3 text encoder (ComfyUI's qwen_3_4b)")
QWEN25_VL = RenamedLayout("Qwen2.5-VL text encoder (ComfyUI's qwen_2.5_vl_7b)", _qwen25_vl_key,
                          optional=("lm_head.weight",), fill=_zero)
WAN_VAE = RenamedLayout("Qwen-Image VAE in Wan 2.1's layout (ComfyUI's qwen_image_vae)", _wan_vae_key)
LDM_VAE = ConvertedLayout("LDM VAE (Black Forest Labs' ae.safetensors)", _ldm_vae_expected, _ldm_vae_convert)


# ---- quantized tensors -----------------------------------------------------------------------------------------


@dataclass
class FileTensors:
    """A component file's header and its tensors as stored, float8 weights multiplied by their scales (in float32)."""

    path: Path
    header: dict[str, tuple[int, ...]]  # the component's tensors only (the quantization entries left out)
    scales: dict[str, str] = field(default_factory=dict)  # weight key -> its scale's key

    @classmethod
    def open(cls, path: Path, label: str) -> "FileTensors":
        from ot_dist.models.families.single_file_keys import read_safetensors_header

        header = read_safetensors_header(path)
        layers = _quantized_layers(path, header)
        for layer, fmt in layers.items():
            if fmt not in _FLOAT8_FORMATS:
                raise InputFileError(f"{label}: {path}: {layer} is quantized as {fmt}; ot_dist reads float8 "
                                     f"({', '.join(_FLOAT8_FORMATS)}) and unquantized files only")
        scales = {}
        for key in header:
            for suffix in _SCALE_SUFFIXES:
                if key.endswith(suffix) and (weight := key[: -len(suffix)] + ".weight") in header:
                    scales[weight] = key
        extras = set(scales.values()) | {k for k in header if k.endswith(_QUANT_EXTRAS) or k == _QUANT_MARKER}
        return cls(path, {k: v for k, v in header.items() if k not in extras}, scales)

    def read(self, handle, key: str) -> Tensor:
        tensor = handle.get_tensor(key)
        if key in self.scales:
            tensor = tensor.float() * handle.get_tensor(self.scales[key]).float()
        return tensor

    def load_dtype(self) -> torch.dtype:
        """What the component is built in: the file's own width where it holds every value exactly
        (models/load_dtype.py), float32 for a scaled file (its weights are float32 products)."""
        from ot_dist.models.load_dtype import FLOAT32, load_dtype_of

        return FLOAT32 if self.scales else load_dtype_of([self.path])


def _quantized_layers(path: Path, header: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """layer -> the format ComfyUI's newer files give it (per-layer `.comfy_quant` JSON or the header's
    `_quantization_metadata`); the old scaled-fp8 files are float8 throughout."""
    from safetensors import safe_open

    layers = {}
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
        if "_quantization_metadata" in metadata:
            try:
                layers |= {k: v.get("format", "") for k, v in json.loads(metadata["_quantization_metadata"])
                           .get("layers", {}).items()}
            except (ValueError, AttributeError):
                pass
        for key in header:
            if key.endswith(".comfy_quant"):
                try:
                    layers[key[: -len(".comfy_quant")]] = json.loads(bytes(f.get_tensor(key).tolist())).get("format", "")
                except (ValueError, AttributeError):
                    layers[key[: -len(".comfy_quant")]] = "unreadable"
    return layers


# ---- the override ----------------------------------------------------------------------------------------------


def config_folder(model_config) -> Path:
    """The folder whose configs describe the components: model.config for a single file, model.path for a folder."""
    path = Path(model_config.path)
    if not path.is_file():
        return path
    if model_config.config is None:
        raise InputFileError(f"model.config: {FIELD} builds each component from its config: name the family's "
                             "diffusers folder (its configs and tokenizers suffice) beside the single file")
    return Path(model_config.config)


def empty_component(folder: Path, name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The component the folder's `<name>/config.json` describes, in `dtype`, its weights not initialised (they all
    come from the file)."""
    import diffusers
    import transformers
    from transformers.initialization import no_init_weights

    index = folder / "model_index.json"
    try:
        library, class_name = json.loads(index.read_text())[name]
    except (OSError, ValueError, KeyError, TypeError):
        raise InputFileError(f"{FIELD}.{name}: {index} names no {name} (the model.config folder must be the "
                             "family's diffusers folder, its weights may be left out)") from None
    from ot_dist.models.load_dtype import default_dtype

    with default_dtype(dtype):  # built in it, as from_pretrained builds (no float32 copy on the way)
        if library == "transformers":
            cls = getattr(transformers, class_name)
            config = transformers.AutoConfig.from_pretrained(folder / name, local_files_only=True)
            with no_init_weights():
                module = cls(config)
        else:
            cls = getattr(diffusers, class_name)
            module = cls.from_config(cls.load_config(folder / name, local_files_only=True))
    return module.to(dtype).eval()


def check_component_files(family, model_config) -> None:
    """Each override names a component the family takes from a file, the file exists and its keys and shapes are that
    component's (from its header against the folder's config, built on the meta device): InputFileError naming the
    field and the file otherwise."""
    for name, file in model_config.component_files.items():
        layout = _layout(family, name)
        path = _existing(name, file)
        tensors = FileTensors.open(path, f"{FIELD}.{name}")
        with torch.device("meta"):
            module = empty_component(config_folder(model_config), name)
        _raise_if_bad(name, path, layout, layout.check(tensors.header, module))


def load_component_files(family, model_config) -> dict[str, torch.nn.Module]:
    """The components model.component_files names, each built from the folder's config and read from its file
    (checked first), in the file's dtype where that holds it exactly (FileTensors.load_dtype), else float32."""
    from safetensors import safe_open

    from ot_dist.models.load_dtype import as_float32_load

    modules = {}
    for name, file in model_config.component_files.items():
        layout = _layout(family, name)
        path = _existing(name, file)
        tensors = FileTensors.open(path, f"{FIELD}.{name}")
        dtype = tensors.load_dtype()
        module = empty_component(config_folder(model_config), name, dtype)
        _raise_if_bad(name, path, layout, layout.check(tensors.header, module))
        with safe_open(str(path), "pt") as handle:
            layout.load(module, lambda key: tensors.read(handle, key), tensors.header)
        as_float32_load(module, dtype, config_follows_load=False)  # built from the folder's config, which it keeps
        modules[name] = module
    return modules


def _layout(family, name: str):
    accepted = family.component_files
    if name not in accepted:
        takes = ", ".join(accepted) or "none"
        raise InputFileError(f"{FIELD}.{name}: {family.name} takes no {name} from a separate file (it takes: {takes})")
    return accepted[name]


def _existing(name: str, file: str) -> Path:
    path = Path(file).expanduser()
    if not path.is_file():
        raise InputFileError(f"{FIELD}.{name}: {path.resolve()} is not a file")
    return path


def _raise_if_bad(name: str, path: Path, layout, problems: list[str]) -> None:
    if problems:
        raise InputFileError(f"{FIELD}.{name}: {path} is not a {layout.what} for the model.config folder's "
                             f"{name}: " + "; ".join(problems))
