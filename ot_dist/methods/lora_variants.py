"""The LoRA variants (`lora.variant`): which peft adapter trains each one, and how a trained adapter's tensors are
named and scaled in the files loaders read.

| variant | peft | tensors per module (file names, kohya / LyCORIS as ComfyUI reads them) |
|---|---|---|
| lora | LoraConfig | lora_down.weight, lora_up.weight, alpha |
| dora | LoraConfig(use_dora=True) | as lora + dora_scale (the magnitude, [out, 1] / [out, 1, 1, 1]: output axis) |
| loha | LoHaConfig | hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b, alpha |
| lokr | LoKrConfig | lokr_w1 (or lokr_w1_a / lokr_w1_b), lokr_w2 (or lokr_w2_a / lokr_w2_b), alpha |

Each adapter's change is scale x its product (up @ down; (w1a @ w1b) * (w2a @ w2b); kron(w1, w2)) with
scale = alpha / rank, except for a LoKr module whose two factors are both full matrices (no rank in them): LyCORIS
(the reference LoKr), OneTrainer (modules/module/LoRAModule.py: alpha set to the rank there), ComfyUI
(comfy/weight_adapter/lokr.py) and diffusers (`_bake_lokr_alpha_`) apply those at 1.0 whatever alpha. peft's LoKr
layer applies alpha / rank to every module, so ot_dist sets those modules' peft scale to 1.0 after adding the adapter
(`match_lycoris_scale`): they train at the scale every reader applies, and the files hold the factors as trained.

LoHa and LoKr start from LyCORIS's initial factors, which OneTrainer's LoHaModule / LoKrModule copy, not peft's
defaults: LoHa hada_w1_a ~ N(0, 0.1), hada_w1_b and hada_w2_b ~ N(0, 1), hada_w2_a = 0 (peft: Kaiming-uniform
factors, of std ~1 / sqrt(3 fan_in), and hada_w2_b = 0: at the same learning rate its first AdamW steps changed a
320- to 3072-wide layer's output 130 - 270x less than OneTrainer's); LoKr lokr_w1 (or lokr_w1_a / _b) and lokr_w2_a
Kaiming-uniform, lokr_w2 or lokr_w2_b zero (peft's default zeroes the other factor, lokr_w1, and moved ~0.89x as
far; its `init_weights="lycoris"` is LyCORIS's: with the same seed the same factors as OneTrainer's).
"""

from __future__ import annotations

import torch

VARIANTS = ("lora", "dora", "loha", "lokr", "oft")  # oft: ot_dist's own module (ot_dist/methods/oft.py)

# peft state-dict suffix (as get_peft_model_state_dict names it) -> the kohya / LyCORIS file suffix
PEFT_TO_KOHYA = {
    ".lora_A.weight": ".lora_down.weight",
    ".lora_B.weight": ".lora_up.weight",
    ".lora_magnitude_vector": ".dora_scale",
    **{f".hada_{n}": f".hada_{n}" for n in ("w1_a", "w1_b", "w2_a", "w2_b")},
    **{f".lokr_{n}": f".lokr_{n}" for n in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")},
    ".oft_blocks": ".oft_blocks",
}


def peft_config(variant: str, rank: int, alpha: float, dropout: float, targets: list[str]):
    """The peft config that trains `variant` on `targets` (module-name suffixes). peft's `lora_dropout` drops the
    adapter's input, which is where OneTrainer's DoRA drops (DoRA's own code); a plain LoRA's dropout is added on
    its down projection's output instead (`drop_down_output`)."""
    if variant in ("lora", "dora"):
        from peft import LoraConfig

        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout if variant == "dora" else 0.0,
                          target_modules=targets, use_dora=variant == "dora")
    if variant == "loha":
        from peft import LoHaConfig

        return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)
    if variant == "lokr":
        from peft import LoKrConfig

        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, init_weights="lycoris")
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


def full_kronecker(factors) -> bool:
    """A LoKr module whose two Kronecker factors are full matrices (lokr_w1 and lokr_w2, neither split into _a / _b).
    `factors`: peft suffix -> tensor (or any container of the suffixes)."""
    return ".lokr_w1" in factors and ".lokr_w2" in factors


def match_lycoris_scale(module: torch.nn.Module, adapter: str) -> int:
    """Set the peft scale of `module`'s LoKr layers with two full factors to 1.0 (peft: alpha / rank), LyCORIS's rule:
    with OneTrainer's defaults (alpha 1, rank 16) peft trained them at 1/16 of OneTrainer's change. Returns how many
    layers were set. To be called once the adapter exists, before training or loading its state."""
    from peft.tuners.lokr.layer import LoKrLayer

    count = 0
    for layer in module.modules():
        if isinstance(layer, LoKrLayer) and adapter in layer.lokr_w1 and adapter in layer.lokr_w2:
            layer.scaling[adapter] = 1.0
            count += 1
    return count


def drop_down_output(module: torch.nn.Module, adapter: str, p: float, rank_p: float = 0.0,
                     module_p: float = 0.0) -> int:
    """Dropout on the output of every peft LoRA layer's down projection (lora_A) in `module`, in train mode only,
    where OneTrainer's LoRAModule (`lora_up(dropout(lora_down(x)))`, its `dropout_probability`) and kohya's
    LoRAModule (networks/lora.py `forward`) drop. peft's `lora_dropout` drops the input x instead: another
    regulariser (in_features features dropped instead of rank ones). Returns how many layers.

    In kohya's order, each drawn only when its rate is set: `module_p` (kohya's module_dropout) skips the adapter for
    this forward when torch.rand(1) < module_p (its output zeroed, so lora_up adds nothing; the adapter gets a zero
    gradient rather than none); `p` (network_dropout) drops each rank feature; `rank_p` (rank_dropout) keeps a rank
    where rand(batch, rank) > rank_p, one mask per sample over every token / pixel, and scales by 1 / (1 - rank_p)
    (kohya scales lora_up's output, the same as lora_up has no bias)."""
    import functools

    from peft.tuners.lora.layer import LoraLayer

    count = 0
    for layer in module.modules():
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
            down = layer.lora_A[adapter]
            rank_axis = 1 if isinstance(down, torch.nn.Conv2d) else -1
            down.register_forward_hook(functools.partial(_dropout_hook, p, rank_p, module_p, rank_axis))
            count += 1
    return count


def _dropout_hook(p: float, rank_p: float, module_p: float, rank_axis: int, module: torch.nn.Module, args,
                  output: torch.Tensor) -> torch.Tensor:
    if not module.training:
        return output
    if module_p and torch.rand(1) < module_p:
        return output * 0
    if p:
        output = torch.nn.functional.dropout(output, p)
    if rank_p:
        keep = torch.rand((output.size(0), output.size(rank_axis)), device=output.device) > rank_p
        shape = [output.size(0)] + [1] * (output.dim() - 1)
        shape[rank_axis] = output.size(rank_axis)
        output = output * keep.reshape(shape) / (1 - rank_p)
    return output


@torch.no_grad()
def init_loha_as_lycoris(module: torch.nn.Module, adapter: str) -> int:
    """LyCORIS's (and OneTrainer's) initial LoHa factors on every peft LoHa layer of `module`: hada_w1_a ~ N(0, 0.1),
    hada_w1_b ~ N(0, 1), hada_w2_a = 0, hada_w2_b ~ N(0, 1); the product is zero, and the zero factor is the one
    beside the larger ones (peft's own init has no such option). Returns how many layers were set. To be called
    once the adapter exists, before training or loading its state."""
    from peft.tuners.loha.layer import LoHaLayer

    count = 0
    for layer in module.modules():
        if isinstance(layer, LoHaLayer) and adapter in layer.hada_w1_a:
            layer.hada_w1_a[adapter].normal_(0, 0.1)
            layer.hada_w1_b[adapter].normal_(0, 1)
            layer.hada_w2_a[adapter].zero_()
            layer.hada_w2_b[adapter].normal_(0, 1)
            count += 1
    return count


def file_factors(factors: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """One module's peft tensors as written beside an `.alpha` tensor of value `alpha`: as trained (each module trains
    at the scale readers apply from that alpha: alpha / rank, 1.0 where `full_kronecker`); DoRA's magnitude shaped
    for the output axis ([out, 1] for a Linear, [out, 1, 1, 1] for a conv: ComfyUI takes a dora_scale whose first
    dimension is the weight's output size as output-axis magnitude)."""
    out = dict(factors)
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
    args = {"algo": {"dora": "lora", "oft": "diag-oft"}.get(variant, variant)}
    if variant == "dora":
        args.update(dora_wd="True", wd_on_output="True")
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args)}
