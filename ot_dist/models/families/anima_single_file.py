"""Anima single files: circlestone-labs' `anima-*.safetensors` (the DiT users download and ComfyUI's Load Diffusion
Model reads) <-> diffusers CosmosTransformer3DModel + AnimaTextConditioner.

The file holds two of ot_dist's components under Cosmos' `net.` wrapper: the transformer as Cosmos-Predict2's
MiniTrainDIT names it (`net.blocks.N.self_attn.q_proj.weight`, ...) and the LLM adapter as its `llm_adapter` child
(`net.llm_adapter.blocks.N.cross_attn.k_proj.weight`, ...). The ComfyUI snapshot ot_dist reads predates Anima, so the
layout is the one diffusers documents: scripts/convert_anima_to_diffusers.py splits `net.llm_adapter.` off (the adapter's
keys are AnimaTextConditioner's own, loaded strictly) and converts the rest with Cosmos-Predict2's renames, which
diffusers' convert_cosmos_transformer_checkpoint_to_diffusers applies to the same keys; SwarmUI tells the file by
`t_embedder.1.linear_2.weight`, `llm_adapter.blocks.0.self_attn.v_proj.weight` and
`blocks.27.adaln_modulation_cross_attn.2.weight` under `net.` (or bare, or `model.diffusion_model.`).
No weight is split or fused: every transformer key is a rename (anima_lora.py names the Linear modules; the q / k
norms are named here). The non-weights Cosmos training checkpoints carry beside the model (`accum_*` counters,
`pos_embedder.*` RoPE tables, `_extra_state`), which diffusers' converter drops, are ignored on reading.
Qwen3-0.6B is not in the file (ComfyUI reads it from `qwen_3_06b_base.safetensors`); the `model.config` folder supplies
it, the VAE, the tokenizers and every config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ot_dist.errors import InputFileError
from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import Rule

PREFIX = "net."
ADAPTER = "llm_adapter."
# What a file may put before the keys: Cosmos' wrapper (the published files), ComfyUI's prefix for models it saves
_INPUT_PREFIXES = (PREFIX, "model.diffusion_model.")
# Keys of Cosmos checkpoints that are not the model's weights (diffusers' converter removes them)
NOT_WEIGHTS = ("accum_video_sample_counter", "accum_image_sample_counter", "accum_iteration", "accum_train_in_hours",
               "pos_embedder.seq", "pos_embedder.dim_spatial_range", "pos_embedder.dim_temporal_range", "_extra_state")
# The q / k norms inside a block (what anima_lora's Linear names leave out): diffusers -> original
NORMS = (("attn1.norm_q", "self_attn.q_norm"), ("attn1.norm_k", "self_attn.k_norm"),
         ("attn2.norm_q", "cross_attn.q_norm"), ("attn2.norm_k", "cross_attn.k_norm"))
TOP_NORMS = (("time_embed.norm", "t_embedding_norm"),)


def original_key(key: str) -> str:
    """The MiniTrainDIT key of a CosmosTransformer3DModel key (Anima's layout)."""
    from ot_dist.models.families.anima_lora import original_path

    module, parameter = key.rsplit(".", 1)
    for ours, theirs in TOP_NORMS:
        if module == ours:
            return f"{theirs}.{parameter}"
    if module.startswith("transformer_blocks."):
        _, index, inner = module.split(".", 2)
        for ours, theirs in NORMS:
            if inner == ours:
                return f"blocks.{index}.{theirs}.{parameter}"
    return f"{original_path(module)}.{parameter}"


def transformer_rules(config: Any) -> list[Rule]:
    """The key map of a CosmosTransformer3DModel with this config: every key renamed, none split."""
    from diffusers import CosmosTransformer3DModel

    cfg = K.full_config(CosmosTransformer3DModel, config)
    return [Rule(original_key(key), (key,)) for key in K.meta_state_dict(CosmosTransformer3DModel, cfg)]


def adapter_rules(config: Any) -> list[Rule]:
    """The adapter's keys under `llm_adapter.`: AnimaTextConditioner names them as the original does."""
    from diffusers import AnimaTextConditioner

    cfg = K.full_config(AnimaTextConditioner, config)
    return [Rule(ADAPTER + key, (key,)) for key in K.meta_state_dict(AnimaTextConditioner, cfg)]


def to_original(transformer: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], transformer_config,
                adapter_config, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """The two state dicts as the file's keys (under `prefix`)."""
    return {**K.to_original(transformer, transformer_rules(transformer_config), prefix),
            **K.to_original(adapter, adapter_rules(adapter_config), prefix)}


def weights_only(state: dict) -> dict:
    """The file's entries without the non-weights Cosmos checkpoints carry."""
    return {k: v for k, v in state.items() if not k.endswith(NOT_WEIGHTS)}


def from_original(state: dict[str, torch.Tensor], transformer_config, adapter_config):
    """The file's keys (under an input prefix or bare) -> (transformer, adapter) diffusers state dicts; a missing or
    unexpected key raises KeyLayoutError naming it. The adapter's entries are told apart by `llm_adapter.` before
    either map applies (the two models' diffusers names may coincide)."""
    prefix, bare = K.strip_prefix(weights_only(state), _INPUT_PREFIXES)
    given = (prefix,) if prefix else ()
    parts = [{prefix + k: v for k, v in bare.items() if k.startswith(ADAPTER) == adapter} for adapter in (False, True)]
    return (K.from_original(parts[0], transformer_rules(transformer_config), given),
            K.from_original(parts[1], adapter_rules(adapter_config), given))


def expected_header(transformer_config, adapter_config) -> dict[str, tuple[int, ...]]:
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    out = {}
    for cls, config, rules in ((CosmosTransformer3DModel, transformer_config, transformer_rules),
                               (AnimaTextConditioner, adapter_config, adapter_rules)):
        cfg = K.full_config(cls, config)
        out.update(K.expected_header(cls, cfg, rules(cfg)))
    return out


def validate(path: Path, transformer_config, adapter_config) -> None:
    """InputFileError naming the file and its missing / unexpected / wrong-shaped keys unless its header is an Anima
    DiT (with its adapter) of these configs."""
    header = weights_only(K.read_safetensors_header(path))
    report = K.check_header(header, expected_header(transformer_config, adapter_config), "Anima", _INPUT_PREFIXES)
    report.raise_if_bad(path)


def load_anima_file(path: Path, config_folder: str | None, family):
    """A pipeline whose transformer and adapter come from `path` (its header checked against the folder's configs
    before any tensor is read) and whose other components come from `config_folder` (ot_dist's AnimaPipeline folder
    or a published modular one)."""
    from safetensors.torch import load_file

    if config_folder is None:
        raise InputFileError(f"model.config: {path.name} holds only the Anima transformer and its LLM adapter; name an "
                             "Anima diffusers folder that supplies Qwen3, the VAE and the tokenizers")
    folder = Path(config_folder)
    configs = {}
    for part in ("transformer", "text_conditioner"):
        file = folder / part / "config.json"
        if not file.is_file():
            raise InputFileError(f"model.config: {folder} has no {part}/config.json (not an Anima diffusers folder)")
        configs[part] = json.loads(file.read_text())
    validate(path, configs["transformer"], configs["text_conditioner"])
    index = folder / "model_index.json"
    if not index.is_file():
        index = folder / "modular_model_index.json"
    if not index.is_file():
        raise InputFileError(f"model.config: {folder} is not a diffusers folder (no model_index.json)")
    try:
        pipeline = family.load_folder(folder, json.loads(index.read_text()))
    except Exception as err:  # diffusers raises many kinds; the user needs the folder and the reason
        raise InputFileError(f"model.config: could not load the other components from {folder}: {err}") from None
    transformer, adapter = from_original(load_file(path), configs["transformer"], configs["text_conditioner"])
    for part, state in (("transformer", transformer), ("text_conditioner", adapter)):
        getattr(pipeline, part).load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return pipeline
