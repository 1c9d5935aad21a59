"""`preserve_embedding_norm` (OneTrainer's option of that name): after every optimizer step the trained embedding
vectors are rescaled, by OneTrainer's two rules (its after_optimizer_step of every model setup):

- input vectors (the trained rows of an encoder's ExtendedTokenEmbedding, token_vectors.py): each row L2-normalised
  and multiplied by the median L2 row norm of the encoder's token-embedding table, measured once before training
  (AdditionalEmbeddingWrapper.normalize_embeddings, `orig_median_norm = torch.norm(weight, dim=1).median()`);
- output vectors (output_vectors.py): the whole [n, width] tensor multiplied by start / now, where both are the mean
  over its rows of each row's standard deviation, `start` that of its starting values (ModelSetupEmbeddingMixin.
  _normalize_output_embeddings, BaseModelEmbedding.original_output_vector_std).
Only vectors that train now (OneTrainer: `requires_grad`; a stopped additional embedding is left as it is).

Sharding: the rescale acts on what this rank's optimizer steps (parallel/ownership.py): whole parameters (single,
ddp), DTensor row shards (fsdp), slices of flat fp32 partitions cut anywhere (ZeRO-1/2) or per-parameter partitions
(ZeRO-3). A row's sums of squares (and sums, for the standard deviation) are added up from this rank's fragments
into one small float64 vector, all-reduced once, and this rank's elements are scaled by the factors it gives; no
value is read on the host. It runs as a step post-hook of the torch optimizer, which is also the object DeepSpeed
steps: ZeRO-1/2 step it once per parameter group (showing it that group alone) and copy that group's fp32 partition
into the model's weights right after, before the all-gather; ZeRO-3 steps it once per sub-group (the group being
stepped holds that sub-group's partition, the others none) and copies after each. So the hook rescales the vectors of
the group(s) being stepped, found by group name (the same on every rank, unlike which fragments a rank holds).
A parameter group that ZeRO-3 splits into several sub-groups would be rescaled before its vectors stepped: refused
(parallel/deepspeed.py). A step skipped on the device (the lagged step guard's `found_inf`) scales by 1. With
deepspeed.offload_optimizer the partitions are on the host: the sums travel to the device for the all-reduce and the
factors back (a wait for the device, where DeepSpeed's offloaded step already waits on its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ot_dist.methods.token_vectors import ExtendedTokenEmbedding
from ot_dist.parallel.ownership import Ownership


@dataclass
class Vectors:
    """One trained tensor of embedding vectors, [rows, width]."""

    name: str  # "<part>.<parameter name>", as the strategy's trained_parameters and the ownership name it
    per_row: bool  # True: input rows, each to `target` L2 norm; False: output vectors, mean row std to `target`
    target: float
    group: str = ""  # the optimizer's parameter group that steps it
    param: torch.Tensor | None = None  # after wrapping (read for requires_grad where the strategy does not shard)
    pieces: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)  # (owned, start, numel, rows)


def trained_vectors(model) -> list[Vectors]:
    """Every trained embedding tensor of the model's text encoders, with its target (before the strategy wraps
    them: the token tables are whole here)."""
    found = []
    for part, encoder in model.text_encoders.items():
        embedding = encoder.get_input_embeddings()
        if not isinstance(embedding, ExtendedTokenEmbedding):
            continue
        names = {id(p): f"{part}.{n}" for n, p in encoder.named_parameters()}
        rows = [p for p in embedding.rows() if p.requires_grad]
        if rows:
            # OneTrainer's orig_median_norm: over the whole table (a T5's rows past its tokenizer's vocabulary too)
            median = torch.linalg.vector_norm(embedding.base.weight.detach().float(), dim=1).median()
            found += [Vectors(names[id(p)], True, float(median)) for p in rows]
        outputs = embedding._modules.get("outputs")
        for _, vectors in outputs.named_sets() if outputs is not None else ():
            if vectors.requires_grad:
                start = vectors.detach().float().std(dim=1).mean()
                found.append(Vectors(names[id(vectors)], False, float(start)))
    return found


def group_names(vectors: list[Vectors], optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> None:
    """Set each tensor's parameter group from the optimizer as built (before DeepSpeed replaces the groups' params
    with its partitions); `named`: the strategy's trained parameters after wrapping."""
    by_id = {id(p): n for n, p in named.items()}
    group_of = {by_id[id(p)]: g["name"] for g in optimizer.param_groups for p in g["params"] if id(p) in by_id}
    for v in vectors:
        v.group = group_of[v.name]
        v.param = named[v.name]


class EmbeddingNorms:
    def __init__(self, vectors: list[Vectors], ownership: Ownership):
        self.vectors = vectors
        self.ownership = ownership
        for v in vectors:
            width = ownership.shapes[v.name][-1]
            for i, owned in enumerate(ownership.owned):
                device = owned.local().device
                for f in owned.fragments:
                    if f.name == v.name:
                        rows = torch.arange(f.param_offset, f.param_offset + f.numel, device=device) // width
                        v.pieces.append((i, f.local_offset, f.numel, rows))

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(self.after_step)

    def stepped(self, optimizer: torch.optim.Optimizer) -> list[Vectors]:
        """The vectors this call of the optimizer's step has just updated."""
        groups = {g.get("name") for g in optimizer.param_groups if g["params"]}
        if self.ownership.sharded:
            return [v for v in self.vectors if v.group in groups]
        # unsharded: the tensors themselves (the fused back pass steps one parameter at a time)
        shown = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return [v for v in self.vectors if v.group in groups and id(v.param) in shown and v.param.requires_grad]

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
        todo = self.stepped(optimizer)
        if not todo:
            return
        device = self.ownership.device
        stats = torch.cat([self._sums(v).to(device) for v in todo])
        if self.ownership.sharded:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.ownership.group)
        skip = getattr(optimizer, "found_inf", None)
        offset = 0
        for v in todo:
            rows, width = self.ownership.shapes[v.name][0], self.ownership.shapes[v.name][-1]
            size = rows if v.per_row else 2 * rows
            factor = scale(stats[offset:offset + size], v.per_row, v.target, width)
            offset += size
            if skip is not None:  # a step skipped on the device changed nothing: neither does this
                factor = torch.where(skip.to(factor.device) != 0, torch.ones_like(factor), factor)
            for owned, start, numel, row in v.pieces:
                local = self.ownership.owned[owned].local().view(-1)[start:start + numel]
                by = factor.to(local.device)
                local.mul_((by[row] if v.per_row else by).to(local.dtype))

    def _sums(self, v: Vectors) -> torch.Tensor:
        """This rank's share of the row sums: of squares (input rows), or of values then of squares (output)."""
        rows = self.ownership.shapes[v.name][0]
        device = self.ownership.owned[v.pieces[0][0]].local().device if v.pieces else self.ownership.device
        sums = torch.zeros(rows if v.per_row else 2 * rows, dtype=torch.float64, device=device)
        for owned, start, numel, row in v.pieces:
            values = self.ownership.owned[owned].local().view(-1)[start:start + numel].double()
            if v.per_row:
                sums.index_add_(0, row.to(device), values * values)
            else:
                sums[:rows].index_add_(0, row.to(device), values)
                sums[rows:].index_add_(0, row.to(device), values * values)
        return sums


def scale(sums: torch.Tensor, per_row: bool, target: float, width: int) -> torch.Tensor:
    """The factors from the all-reduced sums: per row target / norm (torch's normalize: the norm at least 1e-12), or
    one target / mean row std (unbiased, torch.std's default, as OneTrainer measures it)."""
    if per_row:
        return (target / sums.sqrt().clamp_min(1e-12)).float()
    rows = sums.shape[0] // 2
    total, squares = sums[:rows], sums[rows:]
    variance = ((squares - total * total / width) / (width - 1)).clamp_min(0)
    return (target / variance.sqrt().mean()).float()
