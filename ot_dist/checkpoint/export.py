"""Exports that the diffusers ecosystem loads. Every export is written under a temporary name and
swapped in only when complete, so a crash mid-export never destroys the previous good one."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ot_dist.checkpoint.canonical import make_all_canonical
from ot_dist.file_modes import share_with_umask
from ot_dist.models.tied_weights import tied_weights


@contextlib.contextmanager
def atomic_path(target: Path):
    """Yield a temporary sibling path to write; on success it replaces `target` (file or folder)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if target.suffix == ".safetensors" or tmp.is_dir():
        make_all_canonical(tmp)  # the same bytes whichever process writes the same tensors
    share_with_umask(tmp)  # safetensors' save_file writes 0600
    if tmp.is_dir() and target.is_dir():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        _remove(old)
        os.replace(target, old)  # the good export stays on disk until the new one is in place
        os.replace(tmp, target)
        _remove(old)
    else:
        os.replace(tmp, target)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def cast_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        key: (value.detach().to("cpu", dtype) if value.is_floating_point() else value.detach().cpu()).contiguous()
        for key, value in state.items()
    }


def without_tied_copies(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the keys transformers ties to another (T5's `encoder.embed_tokens.weight` is `shared.weight`), as its
    save_pretrained does: safetensors refuses two names for one storage, and from_pretrained re-ties them."""
    tied = tied_weights(model)
    return {k: v for k, v in state.items() if not (k in tied and tied[k] in state)}


def export_diffusers_folder(pipeline, folder: Path, dtype: torch.dtype, states: dict | None = None,
                            family=None) -> Path:
    """Write `pipeline` as a diffusers folder (what `DiffusionPipeline.from_pretrained` reads), with
    the weights in `dtype`, without changing the dtype of the modules in memory. `states` optionally
    gives a component's full state dict (gathered from shards by the caller). With `family`, its `save_extras`
    adds the files its loader reads beside diffusers' (Stable Cascade's EfficientNet), inside the same atomic
    write, so the folder is a model ot_dist loads again."""
    states = states or {}
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        pipeline.save_config(tmp)  # model_index.json
        for name, component in pipeline.components.items():
            if component is None:
                continue
            sub = tmp / name
            if isinstance(component, ModelMixin):
                component.save_config(sub)
                state = states.get(name) or component.state_dict()
                save_file(cast_state_dict(state, dtype), sub / "diffusion_pytorch_model.safetensors")
            elif isinstance(component, PreTrainedModel):
                component.config.save_pretrained(sub)
                state = without_tied_copies(component, states.get(name) or component.state_dict())
                save_file(cast_state_dict(state, dtype), sub / "model.safetensors", metadata={"format": "pt"})
            else:  # tokenizers, schedulers, feature extractors: configs only
                component.save_pretrained(sub)
        if family is not None:
            family.save_extras(pipeline, tmp)
    return folder
