"""Full checkpoints of the transformer families: the denoiser, the VAE and every text encoder in one file, the layout
ComfyUI's Load Checkpoint reads (comfy/sd.py `load_state_dict_guess_config`) and its Save Checkpoint node writes.

A family declares where each component sits (`FullCheckpoint`); ComfyUI's own prefixes (read at Comfy-Org/ComfyUI
a125cd84b054a57729b5eecab930ca9408719832: comfy/supported_models.py,
`text_encoder_key_prefix` / `vae_key_prefix` and the CLIP model of each `clip_target`):

* the denoiser under ``model.diffusion_model.`` (the prefix by which ComfyUI tells a checkpoint from a bare
  transformer file), in the family's original layout;
* the VAE, in the LDM layout, under the family's prefix (SD3 / Chroma ``first_stage_model.``, Flux ``vae.``);
* each text encoder under ``<prefix><model>.transformer.``: SD3 ``text_encoders.clip_l`` / ``clip_g`` / ``t5xxl``,
  Flux ``text_encoders.clip_l`` / ``t5xxl``, Chroma ``cond_stage_model.t5xxl``, stage C ``text_encoder.clip_g``.

Under its prefix a text encoder keeps transformers' own names, which are ComfyUI's: a CLIP with its ``text_model.``
level (transformers >= 5.6 dropped it from CLIPTextModel, the original files always have it) and its
``text_projection.weight`` where it has one; a T5 with ``shared.weight`` and also its tied copy
``encoder.embed_tokens.weight``: diffusers 0.42's single-file T5 reader sets each tensor the file names and does not tie
them again, so without the copy its T5 keeps a meta-device input embedding; ComfyUI's T5 has no such weight and only
logs the key at debug level ("clip unexpected"). Files without the copy (ComfyUI's Save Checkpoint) load too.

Reading back: a component whose keys the file holds is taken from the file (checked key by key and shape by shape
against the `model.config` folder's component first); one the file lacks comes from the folder, as before. So a
user's all-in-one file (Stability's SD3 with its CLIPs, a ComfyUI-saved Flux or Chroma) trains with its own text
encoders and VAE, and ot_dist's exports read back through the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ot_dist.errors import InputFileError
from ot_dist.models.tied_weights import tied_weights

Tensor = torch.Tensor
DENOISER_PREFIX = "model.diffusion_model."  # comfy/model_detection.py unet_prefix_from_state_dict
LDM_VAE_PREFIXES = ("first_stage_model.", "vae.")  # what diffusers' from_single_file reads a VAE from (LDM_VAE_KEYS)
_IGNORED_SUFFIXES = ("position_ids",)  # buffers some files carry; the models count positions themselves
# Weights a file may leave out, the folder's then kept: a CLIP's projection, as ComfyUI's checkpoint loader tolerates
# (its "clip missing" warning leaves out `.transformer.text_projection.weight`); SD3's CLIP-L projection is never
# applied by the SD3 reference (ComfyUI pools CLIP-L without it, diffusers' from_single_file sets it to the identity).
_OPTIONAL = ("text_projection.weight",)
_MAX_NAMED = 5


@dataclass(frozen=True)
class FullCheckpoint:
    """Where a family's full checkpoint holds each component besides the denoiser (under DENOISER_PREFIX)."""

    text_encoders: Mapping[str, str] = field(default_factory=dict)  # component -> prefix of its keys
    vae: str | None = None  # prefix of the LDM-layout VAE; None: the layout holds no VAE (Stable Cascade's stage C)

    def text_encoder_keys(self, modules: Mapping[str, torch.nn.Module], states: Mapping[str, dict]) -> dict:
        """Every text encoder of the layout (the frozen ones too: ComfyUI builds its text-encoder model from what the
        file holds, and one it lacks would be missing, not taken from elsewhere) in its original names."""
        out = {}
        for name, prefix in self.text_encoders.items():
            out |= {prefix + k: v for k, v in original_text_keys(modules[name], states[name]).items()}
        return out

    def component_keys(self, modules: Mapping[str, torch.nn.Module], states: Mapping[str, dict]) -> dict:
        """What the file holds besides the denoiser: the VAE (where the layout has one) and every text encoder."""
        out = self.text_encoder_keys(modules, states)
        if self.vae:
            from ot_dist.models.families.sd3_single_file import sd3_vae_to_original

            out |= sd3_vae_to_original(states["vae"], dict(modules["vae"].config), self.vae)
        return out


def _clip_root(module: torch.nn.Module) -> str:
    """"text_model." when the module is a CLIP text model without that level (transformers >= 5.6 CLIPTextModel)."""
    model_type = getattr(getattr(module, "config", None), "model_type", "")
    if model_type.startswith("clip") and "text_model" not in dict(module.named_children()):
        return "text_model."
    return ""


def _tied_copies(module: torch.nn.Module) -> set[str]:
    return set(tied_weights(module))  # the loaded config's ties (an untied lm_head is read and written)


def _original_names(module: torch.nn.Module, keys) -> dict[str, str]:
    """module key -> the name its original (ComfyUI) file uses, without the prefix; buffers no file needs left out."""
    root = _clip_root(module)
    return {key: key if key.startswith(("text_model.", "text_projection.")) or not root else root + key
            for key in keys if not key.endswith(_IGNORED_SUFFIXES)}


def original_text_keys(module: torch.nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A transformers text encoder's state dict in the names its original (ComfyUI) file uses, without the prefix."""
    tied = _tied_copies(module)
    # a tied copy gets its own storage: safetensors refuses two names for one
    return {name: state[key].clone() if key in tied else state[key] for key, name in _original_names(module, state).items()}


def _module_key(module: torch.nn.Module, key: str) -> str:
    root = _clip_root(module)
    return key[len(root):] if root and key.startswith(root) else key


# ---- reading -----------------------------------------------------------------------------------------------------


def _under(header: Mapping[str, tuple[int, ...]], prefix: str) -> dict[str, tuple[int, ...]]:
    return {k[len(prefix):]: v for k, v in header.items() if k.startswith(prefix)}


def _names(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:_MAX_NAMED]) + (f" and {len(keys) - _MAX_NAMED} more" if len(keys) > _MAX_NAMED else "")


def check_text_encoder(path: Path, prefix: str, found: Mapping[str, tuple[int, ...]], module: torch.nn.Module) -> None:
    """InputFileError naming the keys under `prefix` that do not fit the folder's text encoder."""
    own = module.state_dict()
    expected = {name: tuple(own[key].shape) for key, name in _original_names(module, own).items()}
    found = {k: v for k, v in found.items() if not k.endswith(_IGNORED_SUFFIXES)}
    # a tied copy may be left out (ComfyUI's files), and the optional weights
    missing = set(expected) - set(found) - _tied_copies(module) - set(_OPTIONAL)
    unexpected = set(found) - set(expected)
    wrong = [f"{prefix}{k} is {list(found[k])}, expected {list(expected[k])}"
             for k in sorted(set(expected) & set(found)) if tuple(found[k]) != expected[k]]
    parts = ([f"missing {_names(prefix + k for k in missing)}"] if missing else []) + \
            ([f"unexpected {_names(prefix + k for k in unexpected)}"] if unexpected else []) + wrong[:_MAX_NAMED]
    if parts:
        raise InputFileError(f"model.path: {path}: the text encoder under {prefix} does not fit the model.config "
                             f"folder's {type(module).__name__}: " + "; ".join(parts))


def load_file_components(path: Path, pipeline, layout: FullCheckpoint | None, skip: set[str] = frozenset()) -> list[str]:
    """Put the text encoders and the VAE the file holds into `pipeline` (loaded from the config folder), after
    checking each against the folder's component; the components in `skip` are left as they are. Returns the
    components read from the file."""
    if layout is None:
        return []
    from safetensors import safe_open

    from ot_dist.models.families import single_file_keys as K

    header = K.read_safetensors_header(path)
    read = []
    with safe_open(str(path), "pt") as f:
        for name, prefix in layout.text_encoders.items():
            found = _under(header, prefix)
            if name not in file_components(header, layout, skip):
                continue  # this encoder comes from the folder
            module = getattr(pipeline, name)
            check_text_encoder(path, prefix, found, module)
            # a tied copy is not read: the module shares it with the weight it copies
            state = {_module_key(module, k): f.get_tensor(prefix + k) for k in found
                     if not k.endswith(_IGNORED_SUFFIXES) and _module_key(module, k) not in _tied_copies(module)}
            _load_strict(module, state, path, prefix)
            read.append(name)
        prefix = _vae_prefix(header, layout, skip)
        if prefix is not None:
            from ot_dist.models.families.sd3_single_file import expected_vae_header, sd3_vae_from_original

            config = dict(pipeline.vae.config)
            K.check_header(header, expected_vae_header(config), "VAE", (prefix,), bare_ok=False).raise_if_bad(path)
            vae_state = {k: f.get_tensor(k) for k in header if k.startswith(prefix)}
            _load_strict(pipeline.vae, sd3_vae_from_original(vae_state, config), path, prefix)
            read.append("vae")
    return read


def file_components(header: Mapping[str, tuple[int, ...]], layout: FullCheckpoint | None,
                    skip: set[str] = frozenset()) -> set[str]:
    """The text encoders and the VAE a file (its header) holds for `load_file_components` to read, but `skip`."""
    if layout is None:
        return set()
    found = {name for name, prefix in layout.text_encoders.items() if name not in skip and _under(header, prefix)}
    return found | ({"vae"} if _vae_prefix(header, layout, skip) is not None else set())


def _vae_prefix(header: Mapping[str, tuple[int, ...]], layout: FullCheckpoint, skip: set[str]) -> str | None:
    """The prefix of the file's VAE: the layout's own first, then the other one diffusers reads a VAE from."""
    vae_prefixes = (layout.vae, *LDM_VAE_PREFIXES) if layout.vae and "vae" not in skip else ()
    return next((p for p in vae_prefixes if any(k.startswith(p) for k in header)), None)


def _load_strict(module: torch.nn.Module, state: dict[str, Tensor], path: Path, prefix: str) -> None:
    """Copy the file's tensors into the module (its dtype kept); every parameter but a tied copy must be given."""
    own = module.state_dict()
    missing = set(own) - set(state) - _tied_copies(module) - set(_OPTIONAL) - {k for k in own
                                                                               if k.endswith(_IGNORED_SUFFIXES)}
    if missing:
        raise InputFileError(f"model.path: {path}: {prefix} lacks {_names(missing)}")
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value.to(own[key].dtype))
