"""Which setup of the memory table (ot_dist/memory/table.py) fits the user's GPUs, for a family and a method.

The table counts weights, gradients and optimizer state. Activations, the CUDA context and the allocator's slack
are not in it: `ACTIVATIONS_GIB` adds them per reference model at its native resolution, batch 1, gradient
checkpointing on. Without checkpointing a setup needs about `NO_CHECKPOINTING_FACTOR` times that."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ot_dist.errors import ConfigError
from ot_dist.memory.table import (DENOISERS, GIB, SETUPS, ModelSizes, Setup, build_components, fsdp_rank_bytes,
                                  model_sizes, setup_bytes)

# GiB for activations (checkpointed, batch 1, native resolution) + CUDA context + allocator slack. Estimates from
# the activation sizes of the blocks at that resolution (not measured on a GPU yet: docs/performance.md has the
# bench's measured peaks, which these must stay above).
# Stable Cascade's prior runs on 24 x 24 latents at 1024 px (576 positions): small activations for its width;
# Würstchen v2's prior on the same latents, with the lite prior's width (1536) and block count (32 x 3).
# Qwen-Image: Flux.1 dev's width (24 heads x 128) over the same 4096 image tokens at 1024 px and a caption trimmed
# to the batch's longest, in 60 blocks that each keep both streams (Flux: 19 of them, then 38 single-stream ones):
# Flux's estimate and half a GiB for the wider blocks' recompute.
# Sana 1600M: 1024 positions at 1024 px (the DC-AE's 32x, 1x1 patches) at width 2240 over 20 linear-attention blocks
# and a 300-token caption: Würstchen v2's estimate (1536 wide over 576 positions) and half a GiB for the width.
ACTIVATIONS_GIB = {"SD 1.5": 1.5, "SDXL": 4.0, "SD3.5 Large": 6.0, "Flux.1 dev": 6.0, "Stable Cascade C": 3.0,
                   "Stable Cascade C lite": 2.0, "Würstchen v2": 2.0, "Qwen-Image": 6.5, "Sana 1600M": 2.5}
# Lumina-Image 2.0: 4096 image tokens at 1024 px (x8, 2x2 patches) joined to a 256-token caption, 2304 wide over 26
# joint blocks (and the refiners): SD3.5 Large's estimate (4096 + 333 tokens, 2432 wide, 38 blocks).
ACTIVATIONS_GIB["Lumina-Image 2.0"] = 6.0
# Z-Image: 4096 image tokens at 1024 px joined with the caption (its own length, up to 512) in 34 single-stream
# blocks 3840 wide (Flux: 57 blocks 3072 wide over 4096 + 512 tokens): Flux's estimate.
ACTIVATIONS_GIB["Z-Image"] = 6.0
# FLUX.2 dev: twice Flux.1 dev's width (48 heads x 128) over the same 4096 image tokens at 1024 px and all 512 caption
# tokens (the pipeline's padding, no trimming), 56 blocks: twice Flux's estimate. [klein] 9B: 4096 wide, 32 blocks.
ACTIVATIONS_GIB |= {"FLUX.2 dev": 12.0, "FLUX.2 klein 9B": 8.0}
# HiDream-I1: 4096 image tokens at 1024 px beside 384 text tokens (T5, Llama and each block's own Llama layer) at
# width 2560 (Flux.1 dev: 3072) over 48 blocks, whose trained MoE keeps each token twice (2 active experts): Flux's.
ACTIVATIONS_GIB["HiDream-I1"] = 6.0
# Flux.1 Kontext dev: Flux.1 dev's blocks over twice the image tokens at 1024 px (the reference's 4096 appended to the
# target's), the activations of the checkpointed blocks growing with the sequence: Flux's estimate less a GiB of
# context and slack, scaled by the sequence (8704 tokens with the caption's 512, against 4608), and that GiB again.
ACTIVATIONS_GIB["Flux.1 Kontext dev"] = 10.5
# Qwen-Image-Edit: Qwen-Image's blocks over the target's 4096 image tokens, the reference's 4096 and a text stream that
# holds the reference's vision tokens (about 1400 at 1024 px: 14 px patches merged 2x2) with the caption: Qwen-Image's
# estimate less a GiB of context and slack, scaled by the sequence (about 9700 tokens against 4608), and that GiB again.
ACTIVATIONS_GIB["Qwen-Image-Edit"] = 12.5
# Wan 2.1 T2V 14B on images: 2704 image tokens at 832 x 832 (x8, 2x2 patches; one frame) cross-attending to 512 UMT5
# tokens, 5120 wide over 40 blocks (Flux.1 dev: 4608 tokens, 3072 wide, 57 blocks, 6 GiB): about 0.7 of Flux's
# activations, and Flux's context and slack.
ACTIVATIONS_GIB["Wan 2.1 T2V 14B"] = 4.5
# Krea 2: 4096 image tokens at 1024 px joined with the caption (trimmed to the batch's longest, up to 512) in 28
# single-stream blocks 6144 wide (Flux.1 dev: 57 blocks 3072 wide over 4608 tokens, about the same kept activations),
# each block's FFN 16384 wide in its recompute: Flux's estimate and half a GiB, as Qwen-Image's.
ACTIVATIONS_GIB["Krea 2"] = 6.5
# ERNIE-Image: 4096 image tokens at 1024 px joined with the caption (its own length, up to 512) in 36 single-stream
# blocks 4096 wide (Flux: 57 blocks 3072 wide over 4096 + 512 tokens): about Flux's estimate.
ACTIVATIONS_GIB["ERNIE-Image"] = 6.0
# Anima: 4096 image tokens at 1024 px (x8, 2x2 patches) cross-attending to 512 adapter tokens, 2048 wide over 28 blocks
# (Flux.1 dev: 4608 tokens, 3072 wide, 57 blocks, 6 GiB): about 0.3 of Flux's activations, and Flux's context and slack.
ACTIVATIONS_GIB["Anima"] = 2.5
# Ideogram 4: 4096 image tokens at 1024 px (x8, 2x2 patches) after the caption (the batch's longest, up to 2048) in
# one stream 4608 wide over 34 blocks (Flux.1 dev: 4608 tokens, 3072 wide, 57 blocks): Flux's estimate.
ACTIVATIONS_GIB["Ideogram 4"] = 6.0
# HunyuanVideo on images: 3600 image tokens at 960 x 960 (x8, 2x2 patches; one frame) joined to 256 Llama tokens, 3072
# wide over 20 dual- and 40 single-stream blocks, Flux.1 dev's layout (4608 tokens, 6 GiB): Flux's estimate less a GiB
# of context and slack, scaled by the sequence (3856 tokens against 4608), and that GiB again.
ACTIVATIONS_GIB["HunyuanVideo"] = 5.5
NO_CHECKPOINTING_FACTOR = 4


@dataclass(frozen=True)
class Choice:
    setup: Setup
    strategy: str  # "single", "ddp" or "fsdp"
    need_gib: float  # per GPU, activations included
    table_gib: float  # the memory table's figure for the setup (per GPU)
    gradient_checkpointing: bool
    reference: str  # the memory-table model the numbers are for


def candidates(method: str) -> list[Setup]:
    """The table's setups for a method, least lossy first. Frozen float32 is never a GPU choice (bfloat16 frozen
    weights change nothing that trains). An embedding trains a few vectors: LoRA's frozen-weight setups bound it."""
    trained = "full" if method == "full" else "lora"
    return [s for s in SETUPS if s.trained == trained and not (s.trained == "lora" and s.frozen == "float32")]


@lru_cache(maxsize=None)
def _components(reference: str):
    return build_components(reference)  # meta-device modules: parameter counts without memory


# The reference models' figures, measured once per process: every candidate setup reads the same counts and shapes.
@lru_cache(maxsize=None)
def _sizes(reference: str) -> ModelSizes:
    return model_sizes(_components(reference), DENOISERS[reference][1], DENOISERS[reference][2])


@lru_cache(maxsize=None)
def _fsdp_rank_bytes(reference: str, gpus: int) -> dict[str, float]:
    return fsdp_rank_bytes(_components(reference), reference, gpus)


def choose(family, method: str, gpu_memory_gib: float, gpus: int) -> Choice:
    reference = family.memory_reference
    if reference is None:
        raise ConfigError(f"--family: {family.name} has no memory reference yet; start from a config in configs/")
    sizes = _sizes(reference)
    activations = ACTIVATIONS_GIB[reference]
    options: list[Choice] = []
    for setup in candidates(method):
        if setup.streamed and not family.shard_units.get(family.denoiser):
            continue  # no blocks to stream
        table = setup_bytes(setup, sizes) / GIB
        options.append(Choice(setup, "ddp" if gpus > 1 else "single", table + activations, table, True, reference))
        if method == "full" and gpus > 1 and setup.optimizer == "ADAMW" and not setup.fused_back_pass:
            # Sharded AdamW keeps the optimizer exact: preferred to 8-bit or factored state when it fits.
            sharded = _fsdp_rank_bytes(reference, gpus)
            per_rank = (sharded["sharded_state"] + sharded["gather_peak"]) / GIB
            options.append(Choice(setup, "fsdp", per_rank + activations, per_rank, True, reference))
    for option in options:
        if option.need_gib <= gpu_memory_gib:
            # streamed blocks need gradient checkpointing (without it every earlier block's copies stay for backward)
            roomy = (option.table_gib + NO_CHECKPOINTING_FACTOR * activations <= gpu_memory_gib
                     and not option.setup.streamed)
            return Choice(option.setup, option.strategy, option.need_gib, option.table_gib, not roomy, reference)
    least = min(options, key=lambda o: o.need_gib)
    raise ConfigError(f"--gpu-memory: {method} on {family.name} needs about {least.need_gib:.1f} GiB per GPU even with "
                      f"'{least.setup.label}' ({least.strategy}): a GPU with more memory, more GPUs for a full finetune (fsdp "
                      "shards it: --gpus), or a smaller model")
