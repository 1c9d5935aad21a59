"""The LoRA variants (`lora.variant`): which peft adapter trains each one, and how a trained adapter's tensors are
named and scaled in the files loaders read.

| variant | peft | tensors per module (file names, kohya / LyCORIS as ComfyUI reads them) |
|---|---|---|
| lora | LoraConfig | lora_down.weight, lora_up.weight, alpha |
| dora | LoraConfig(use_dora=True) | as lora + dora_scale (the magnitude, [out, 1] / [out, 1, 1, 1]: output axis) |
| loha | LoHaConfig | hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b, alpha |
| lokr | LoKrConfig | lokr_w1 (or lokr_w1_a / lokr_w1_b), lokr_w2 (or lokr_w2_a / lokr_w2_b), alpha |

Each adapter's change is scale x its product (up @ down; (w1a @ w1b) * (w2a @ w2b); kron(w1, w2)) with
scale = alpha / rank in peft, and in ComfyUI (comfy/weight_adapter/*.py) alpha / rank too, except for a LoKr module
whose two factors are both full matrices: ComfyUI (like LyCORIS) applies it at 1.0 there, while peft applies
alpha / rank. For those modules the scale is multiplied into lokr_w1 before writing (`file_factors`), so every reader
applies the trained change.
"""

from __future__ import annotations

import torch

VARIANTS = ("lora", "dora", "loha", "lokr")

# peft state-dict suffix (as get_peft_model_state_dict names it) -> the kohya / LyCORIS file suffix
PEFT_TO_KOHYA = {
    ".lora_A.weight": ".lora_down.weight",
    ".lora_B.weight": ".lora_up.weight",
    ".lora_magnitude_vector": ".dora_scale",
    **{f".hada_{n}": f".hada_{n}" for n in ("w1_a", "w1_b", "w2_a", "w2_b")},
    **{f".lokr_{n}": f".lokr_{n}" for n in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")},
}


def peft_config(variant: str, rank: int, alpha: float, dropout: float, targets: list[str]):
    """The peft config that trains `variant` on `targets` (module-name suffixes)."""
    if variant in ("lora", "dora"):
        from peft import LoraConfig

        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                          use_dora=variant == "dora")
    if variant == "loha":
        from peft import LoHaConfig

        return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)
    if variant == "lokr":
        from peft import LoKrConfig

        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets)
    raise ValueError(f"lora.variant: {variant!r} is not one of {', '.join(VARIANTS)}")


def split_modules(peft_state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module path -> {peft suffix: tensor}, for a state dict as `get_peft_model_state_dict` returns it."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in peft_state.items():
        suffix = next((s for s in PEFT_TO_KOHYA if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"adapter tensor {key!r} is none of the variants' tensors ({', '.join(PEFT_TO_KOHYA)})")
        modules.setdefault(key[: -len(suffix)], {})[suffix] = value
    return modules


def loader_scale(factors: dict[str, torch.Tensor], rank: int, alpha: float) -> float:
    """The scale ComfyUI (and LyCORIS) apply to this module from its alpha: alpha / rank, or 1.0 for a LoKr module
    with two full factors (no rank to divide by)."""
    if ".lokr_w1" in factors and ".lokr_w2" in factors:
        return 1.0
    return alpha / rank


def file_factors(factors: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """One module's peft tensors as written beside an `.alpha` tensor of value `alpha`: the peft scale (alpha / rank)
    multiplied into lokr_w1 where loaders apply 1.0 instead; DoRA's magnitude shaped for the output axis
    ([out, 1] for a Linear, [out, 1, 1, 1] for a conv: ComfyUI takes a dora_scale whose first dimension is the
    weight's output size as output-axis magnitude)."""
    out = dict(factors)
    missing = (alpha / rank) / loader_scale(factors, rank, alpha)
    if missing != 1.0:
        out[".lokr_w1"] = out[".lokr_w1"].float() * missing
    if ".lora_magnitude_vector" in out:
        ndim = out[".lora_A.weight"].dim()
        out[".lora_magnitude_vector"] = out[".lora_magnitude_vector"].reshape(-1, *[1] * (ndim - 1))
    return out


def baked_factors(factors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """One module's peft tensors with `scale` multiplied into one factor of its product, so that a loader applying
    1.0 (no alpha; alpha = rank) applies the trained change."""
    out = dict(factors)
    for key in (".lora_B.weight", ".hada_w1_a", ".lokr_w1", ".lokr_w1_a"):
        if key in out:
            out[key] = out[key].float() * scale
            return out
    raise ValueError(f"no factor to scale among {sorted(factors)}")


def config_scale(metadata: dict) -> tuple[float, dict]:
    """(the scale peft applies, the config with alpha written as the rank) for an adapter config dict (LoraConfig's
    `lora_alpha` / `use_rslora`, LoHa / LoKr's `alpha`)."""
    rank = metadata["r"]
    key = "lora_alpha" if "lora_alpha" in metadata else "alpha"
    scale = metadata[key] / (rank ** 0.5 if metadata.get("use_rslora") else rank)
    return scale, {**metadata, key: rank, **({"use_rslora": False} if "use_rslora" in metadata else {})}


def network_metadata(variant: str) -> dict[str, str]:
    """kohya's `ss_network_module` / `ss_network_args` for the variant (what LyCORIS writes for LoHa / LoKr / DoRA;
    A1111 / Forge show them)."""
    import json

    if variant == "lora":
        return {"ss_network_module": "networks.lora"}
    args = {"algo": "lora" if variant == "dora" else variant}
    if variant == "dora":
        args.update(dora_wd="True", wd_on_output="True")
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args)}
