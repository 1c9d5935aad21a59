"""The weight change of one module of a LoHa / LoKr / OFT / DoRA file, as the loaders apply it (ComfyUI's
comfy/weight_adapter/loha.py, lokr.py, oft.py, base.py `weight_decompose`; LyCORIS), for `ot-dist lora merge`.
(Plain LoRA and DoRA are `Pair` in files.py; DoRA's magnitude is applied by `dora_weight` below.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Hadamard:
    """LoHa: delta W = scale * (w1_a @ w1_b) * (w2_a @ w2_b) (elementwise), reshaped to the weight."""

    w1_a: torch.Tensor  # [out, rank]
    w1_b: torch.Tensor  # [rank, in * kh * kw]
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    alpha: float | None
    variant = "loha"

    @property
    def rank(self) -> int:
        return self.w1_b.shape[0]

    @property
    def scale(self) -> float:
        return (self.alpha / self.rank) if self.alpha is not None else 1.0

    def delta(self, shape) -> torch.Tensor:
        product = (self.w1_a.float() @ self.w1_b.float()) * (self.w2_a.float() @ self.w2_b.float())
        return (product * self.scale).reshape(shape)

    def merged(self, weight: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
        return weight.float() + strength * self.delta(weight.shape)


@dataclass
class Kronecker:
    """LoKr: delta W = scale * kron(w1, w2), w1 = lokr_w1 or lokr_w1_a @ lokr_w1_b (w2 likewise, 4-d for convs).
    scale = alpha / rank where a factor is decomposed (rank: its _b's first dimension), else 1.0, as ComfyUI's
    lokr.py computes it."""

    w1: torch.Tensor | None
    w1_a: torch.Tensor | None
    w1_b: torch.Tensor | None
    w2: torch.Tensor | None
    w2_a: torch.Tensor | None
    w2_b: torch.Tensor | None
    alpha: float | None
    variant = "lokr"

    @property
    def rank(self) -> int | None:
        """The decomposed factors' rank (w2's when both are), None when both factors are full."""
        if self.w2_b is not None:
            return self.w2_b.shape[0]
        return self.w1_b.shape[0] if self.w1_b is not None else None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.alpha is not None and self.rank is not None else 1.0

    def delta(self, shape) -> torch.Tensor:
        w1 = self.w1.float() if self.w1 is not None else self.w1_a.float() @ self.w1_b.float()
        if self.w2 is not None:
            w2 = self.w2.float()
        else:
            w2 = self.w2_a.float() @ self.w2_b.float().flatten(1)
            if len(shape) == 4 and self.w2_b.dim() == 4:
                w2 = w2.reshape(w2.shape[0], *self.w2_b.shape[1:])
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        return (torch.kron(w1, w2) * self.scale).reshape(shape)

    def merged(self, weight: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
        return weight.float() + strength * self.delta(weight.shape)


def dora_weight(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's merged weight: magnitude * (W + delta) / ||W + delta||, the norm per output row when the magnitude's
    first dimension is the weight's (peft, ot_dist, OneTrainer's lora_decompose_output_axis: [out, 1, ...]), else per
    input column ([1, in, ...]: LyCORIS's and OneTrainer's default)."""
    combined = weight.float() + delta
    magnitude = magnitude.float()
    if magnitude.shape[0] == combined.shape[0] and magnitude.numel() == combined.shape[0]:
        norm = combined.flatten(1).norm(dim=1).reshape(-1, *[1] * (combined.dim() - 1))
        return magnitude.reshape(norm.shape) * combined / norm
    norm = combined.transpose(0, 1).flatten(1).norm(dim=1)
    norm = norm.reshape(1, -1, *[1] * (combined.dim() - 2))
    return magnitude.reshape(norm.shape) * combined / norm


@dataclass
class Orthogonal:
    """OFT (LyCORIS diag-oft, ot_dist's oft): W' = R[k]ᵀ W[k] per block k of output rows, R = (I + Q)(I - Q)⁻¹,
    Q = blocks - blocksᵀ scaled to norm alpha when alpha > 0 and its norm exceeds it, as ComfyUI's oft.py applies
    it (ot_dist/methods/oft.py). A rotation, not an addition: the change depends on the weight it is merged into.
    Strength s merges W + s (W' - W) (ComfyUI multiplies its change by s twice: the same at strength 1)."""

    blocks: torch.Tensor  # [block_num, block_size, block_size]
    alpha: float | None
    variant = "oft"

    def merged(self, weight: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
        from ot_dist.methods.oft import rotated_weight

        weight = weight.float()
        return weight + strength * (rotated_weight(weight, self.blocks.float(), self.alpha or 0.0) - weight)
