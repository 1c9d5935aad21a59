"""`ot-dist lora extract BASE TUNED --rank R`: a LoRA from a full finetune. Every adaptable module whose weight
differs is approximated at rank R by SVD and written in the family's own LoRA layout (kohya names where the family
declares them, else the diffusers layout), so the result loads wherever the family's trained LoRAs load."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ot_dist.checkpoint.modelspec import header_for, tool_facts
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.lora_tools.files import write_lora_file
from ot_dist.lora_tools.lowrank import low_rank_pair
from ot_dist.lora_tools.matching import adaptable_modules, module_index
from ot_dist.methods.lora_layouts import kohya_metadata


HALF_PRECISIONS = (torch.float16, torch.bfloat16)


def only_rounded(base: torch.Tensor, tuned: torch.Tensor) -> bool:
    """Whether two weights differ only by one of them having been stored at half precision: one holds only values
    of float16 (bfloat16) and both round to the same values there. A finetune saved in float16 beside a float32 base
    (SD 1.5's) differs from it in every module by that rounding, which is no change of the model's."""
    for dtype in HALF_PRECISIONS:
        stored = any(torch.equal(w.to(dtype).float(), w.float()) for w in (base, tuned))
        if stored and torch.equal(base.to(dtype), tuned.to(dtype)):
            return True
    return False


@torch.no_grad()
def extract_pairs(base, tuned, layout: str, rank: int, min_change: float,
                  conv_rank: int | None = None) -> tuple[dict, dict[str, float]]:
    """(file name -> Pair, file name -> kept energy) for the modules whose relative change exceeds min_change and
    is more than a half-precision rounding (`only_rounded`). `conv_rank`: the rank of convolutions with a kernel
    above 1x1 (kohya's --conv_dim; default `rank`)."""
    index = module_index(base, layout)
    tuned_parts = tuned.parts()
    names_of = {}
    for name, target in index.items():
        names_of.setdefault((target.part, target.path), name)  # the first (canonical) name of each module
    pairs, kept = {}, {}
    for part, module in base.parts().items():
        tuned_modules = adaptable_modules(tuned_parts[part])
        for path, sub in adaptable_modules(module).items():
            if (part, path) not in names_of:
                continue
            other = tuned_modules.get(path)
            if other is None or other.weight.shape != sub.weight.shape:
                raise InputFileError(f"TUNED: {part}.{path} is missing or has another shape: not a finetune of BASE")
            delta = other.weight.float() - sub.weight.float()
            if float(delta.norm()) <= min_change * float(sub.weight.float().norm()):
                continue
            if only_rounded(sub.weight, other.weight):
                continue
            name = names_of[(part, path)]
            spatial = delta.dim() == 4 and tuple(delta.shape[2:]) != (1, 1)
            pairs[name], kept[name] = low_rank_pair(delta, conv_rank if spatial and conv_rank else rank)
    return pairs, kept


def extract_command(base_path: str, tuned_path: str, family: str, rank: int, out: str, min_change: float,
                    dtype_name: str, log=print, conv_rank: int | None = None) -> dict[str, float]:
    from ot_dist.config.schema import ModelConfig
    from ot_dist.models.families.registry import get_family
    from ot_dist.models.loading import load_model
    from ot_dist.precision import DTYPES

    for flag, value in (("--rank", rank), ("--conv-rank", rank if conv_rank is None else conv_rank)):
        if value < 1:
            raise ConfigError(f"{flag}: {value} is not a rank (at least 1)")
    family_spec = get_family(family)
    layout = "kohya" if family_spec.lora_file_prefixes else "diffusers"
    # in their files' dtype (half a float32 load's memory, twice over): extract_pairs subtracts in float32
    base = load_model(ModelConfig(family=family, path=base_path), in_files_dtype=True)
    tuned = load_model(ModelConfig(family=family, path=tuned_path), in_files_dtype=True)
    pairs, kept = extract_pairs(base, tuned, layout, rank, min_change, conv_rank)
    if not pairs:
        raise InputFileError(f"{tuned_path}: no module differs from {base_path} by more than --min-change {min_change}")
    metadata = {"ot_dist_lora": json.dumps({"layout": layout, "family": family, "rank": rank, "alpha": float(rank),
                                            "extracted_from": Path(tuned_path).name})}
    if layout == "kohya":
        metadata.update(kohya_metadata(rank, float(rank), base_model_version=family_spec.lora_base_model_version))
    metadata.update(header_for(tuned, "lora", tool_facts(tuned.family, out), lora_layout=layout))
    write_lora_file(out, layout, pairs, metadata, DTYPES[dtype_name])
    values = sorted(kept.values())
    log(f"extracted {len(pairs)} changed modules at rank {rank}: energy kept min {values[0]:.4f}, "
        f"mean {sum(values) / len(values):.4f}")
    log(f"wrote {Path(out)}")
    return kept
