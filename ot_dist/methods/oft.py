"""OFT (`lora.variant: oft`): orthogonal finetuning, each adapted layer's weight rotated block by block.

Written as ComfyUI reads an OFT file (comfy/weight_adapter/oft.py) and LyCORIS writes one (diag-oft): per module
`<name>.oft_blocks` [block_num, block_size, block_size] and `<name>.alpha` (COFT's constraint, 0 = none). With
Q = blocks - blocksᵀ, scaled to norm `constraint` when its norm (over all the module's blocks) exceeds it, each
block's rotation is R = (I + Q)(I - Q)⁻¹ (Cayley, exact) and the adapted weight is, per block k of the weight's
*output* rows, W'[k] = R[k]ᵀ W[k]. ot_dist trains exactly that, so the file is applied as trained.

Not peft's OFT: peft (and OneTrainer's OFT_2, a copy of it) rotates the layer's *input* features with a 5-term
Cayley-Neumann approximation and saves `oft_R.weight` (the upper triangle), which no ComfyUI OFT rule reads; an input
rotation cannot be rewritten as the output rotation the file holds. The blocks start at zero (R = I): the layer's
output is unchanged at step 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUFFIX = ".oft_blocks"


def block_size_for(out_features: int, wanted: int) -> int:
    """The divisor of `out_features` nearest `wanted` (the lower one on a tie; `out_features` itself when `wanted`
    exceeds it): OneTrainer's rule for a block size that does not divide the rotated dimension."""
    if wanted >= out_features:
        return out_features
    lower = next(d for d in range(wanted, 0, -1) if out_features % d == 0)
    higher = next(d for d in range(wanted, out_features + 1) if out_features % d == 0)
    return lower if wanted - lower <= higher - wanted else higher


def rotations(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """Each block's orthogonal matrix R = (I + Q)(I - Q)⁻¹, Q = blocks - blocksᵀ, constrained as ComfyUI does."""
    q = blocks - blocks.transpose(1, 2)
    if constraint > 0:
        norm = torch.norm(q) + 1e-8
        q = torch.where(norm > constraint, q * (constraint / norm), q)
    eye = torch.eye(blocks.shape[-1], device=blocks.device, dtype=blocks.dtype)
    # (I + Q)(I - Q)⁻¹ = X with X (I - Q) = (I + Q): a solve from the right, no explicit inverse
    return torch.linalg.solve(eye - q, eye + q, left=False)


def rotated_weight(weight: torch.Tensor, blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """W' with W'[k] = R[k]ᵀ W[k] over blocks of output rows (einsum "k n m, k n ... -> k m ...", ComfyUI's)."""
    block_num, block_size, _ = blocks.shape
    r = rotations(blocks.float(), constraint)
    rows = weight.float().unflatten(0, (block_num, block_size))
    return torch.einsum("knm,kn...->km...", r, rows).flatten(0, 1).to(weight.dtype)


class _Orthogonal:
    """Mixed into a Linear / Conv2d whose class is swapped in place (`add_oft`): the state-dict keys of the base
    weights stay as they were and the blocks are one more parameter, `<path>.oft_blocks`."""

    oft_constraint: float = 0.0
    # peft's flag, by the same name: train/loss.py `adapters_disabled` (the prior model) sets it on every adapter
    _disable_adapters: bool = False

    def adapted_weight(self) -> torch.Tensor:
        return rotated_weight(self.weight, self.oft_blocks, self.oft_constraint)

    def used_weight(self) -> torch.Tensor:
        return self.weight if self._disable_adapters else self.adapted_weight()


class OrthogonalLinear(_Orthogonal, torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.used_weight(), self.bias)


class OrthogonalConv2d(_Orthogonal, torch.nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.used_weight(), self.bias)


ORTHOGONAL = {torch.nn.Linear: OrthogonalLinear, torch.nn.Conv2d: OrthogonalConv2d}


def add_oft(module: torch.nn.Module, targets: list[str], block_size: int, constraint: float,
            exclude: list[str] | None = None) -> dict[str, int]:
    """Turn the Linear / Conv2d layers of `module` whose path is in `targets` or ends in ".<target>" (peft's rule),
    but the paths in `exclude`, into OFT layers with zero blocks. Returns path -> the block size used (a divisor of
    the output size)."""
    chosen, excluded = {}, set(exclude or ())
    for path, layer in module.named_modules():
        if path in excluded or not any(path == t or path.endswith("." + t) for t in targets):
            continue
        kind = ORTHOGONAL.get(type(layer))
        if kind is None:
            continue
        out = layer.weight.shape[0]
        size = block_size_for(out, block_size)
        layer.__class__ = kind
        # as the file's float32 .alpha holds it: readers apply exactly the trained constraint
        layer.oft_constraint = torch.tensor(constraint, dtype=torch.float32).item()
        layer.oft_blocks = torch.nn.Parameter(torch.zeros(out // size, size, size, device=layer.weight.device))
        chosen[path] = size
    return chosen


def oft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The OFT blocks out of a module's full state dict (`<path>.oft_blocks`)."""
    return {k: v for k, v in state.items() if k.endswith(SUFFIX)}
