"""`ot-dist lora merge-loras A B ... --rank R`: several LoRA files as one (no model needed), as kohya sd-scripts'
svd_merge_lora.py makes it: per module the sum of weight x alpha / rank x up @ down over the files that have it,
approximated at rank R by SVD (`--conv-rank` for convolutions with a kernel above 1x1), in the files' layout."""

from __future__ import annotations

from pathlib import Path

import torch

from ot_dist.errors import ConfigError, InputFileError
from ot_dist.lora_tools.files import read_lora_file, write_lora_file
from ot_dist.lora_tools.lowrank import low_rank_pair
from ot_dist.lora_tools.resize import STALE

# ot_dist's record and the first file's title describe that file, not the merge
NOT_CARRIED = (*STALE, "ot_dist_lora", "modelspec.title", "modelspec.merged_from")
BASE_MODEL_KEYS = ("ss_base_model_version", "modelspec.architecture")  # what kohya's and the ModelSpec's files name


@torch.no_grad()
def merge_loras_command(paths: list[str], weights: list[float], rank: int, out: str, conv_rank: int | None = None,
                        log=print) -> dict[str, float]:
    conv_rank = rank if conv_rank is None else conv_rank
    for flag, value in (("--rank", rank), ("--conv-rank", conv_rank)):
        if value < 1:
            raise ConfigError(f"{flag}: {value} is not a rank (at least 1)")
    if len(weights) != len(paths):
        raise ConfigError(f"--weight: {len(weights)} given for {len(paths)} LoRA files (one each, in order)")
    files = [read_lora_file(p, tool="ot-dist lora merge-loras") for p in paths]
    layouts = {lora.layout for lora in files}
    if len(layouts) > 1:
        raise InputFileError(f"{', '.join(paths)}: kohya- and diffusers-layout files name the same module differently; "
                             "merge files of one layout")
    for key in BASE_MODEL_KEYS:  # module names of two models can be disjoint: nothing else would notice
        named = {lora.metadata[key]: path for path, lora in zip(paths, files) if lora.metadata.get(key)}
        if len(named) > 1:
            raise InputFileError(f"LoRAs of different base models ({key}: "
                                 f"{', '.join(f'{v} in {p}' for v, p in named.items())}); merge LoRAs of one model")
    sums: dict[str, torch.Tensor] = {}
    for path, lora, weight in zip(paths, files, weights):
        for name, pair in lora.pairs.items():
            change = pair.delta() * weight
            if name in sums and sums[name].shape != change.shape:
                raise InputFileError(f"{path}: {name} changes a {tuple(change.shape)} weight, an earlier file's "
                                     f"{tuple(sums[name].shape)}: LoRAs of different models?")
            sums[name] = sums[name] + change if name in sums else change
    pairs, kept = {}, {}
    for name, change in sums.items():
        spatial = change.dim() == 4 and tuple(change.shape[2:]) != (1, 1)
        pairs[name], kept[name] = low_rank_pair(change, conv_rank if spatial else rank)
    metadata = {k: v for k, v in files[0].metadata.items() if k not in NOT_CARRIED}
    if files[0].layout == "kohya":
        metadata.update(ss_network_dim=str(rank), ss_network_alpha=str(float(rank)))
    if any(k.startswith("modelspec.") for k in metadata):
        titles = [lora.metadata.get("modelspec.title") or Path(p).stem for p, lora in zip(paths, files)]
        metadata.update({"modelspec.title": Path(out).stem, "modelspec.merged_from": ", ".join(titles)})
    dtype = next(iter(files[0].pairs.values())).up.dtype
    write_lora_file(out, files[0].layout, pairs, metadata, dtype)
    values = sorted(kept.values())
    log(f"merged {len(paths)} files into {len(pairs)} modules at rank {rank}: energy kept min {values[0]:.4f}, "
        f"mean {sum(values) / len(values):.4f}")
    log(f"wrote {Path(out)}")
    return kept
