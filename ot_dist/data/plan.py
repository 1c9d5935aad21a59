"""The epoch plan: which samples form each global batch, computed identically on every rank.

From the sample table (each sample's bucket and concept), the seed and the epoch, every rank derives
the same list of global batches: each holds `global_batch` samples of one bucket and carries one
resolution. Ranks then take their slice of each global batch, so no communication is needed, every
rank runs the same number of steps, and a position in the epoch is just the global-batch index:
independent of the world size, which is what makes resume exact on a different number of ranks.

Balancing (OneTrainer's repeats / samples per concept) is applied within each bucket, so the
number of samples per bucket, hence the step count and the bucket report, is the same every epoch.
A repeated sample's copies get distinct sample ids (index + copy x number of samples), so their
noise and timesteps differ.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property

import torch

from ot_dist.data.buckets import aspect_name, bucket_size
from ot_dist.data.small_buckets import moved_samples, pool_remainders
from ot_dist.randomness import generator
from ot_dist.tracking.base import metric_name


@dataclass(frozen=True)
class SampleTable:
    buckets: tuple[int, ...]  # per sample
    concepts: tuple[int, ...]  # per sample
    balancing: tuple[tuple[float, str], ...]  # per concept: (balancing, strategy)
    concept_names: tuple[str, ...]
    kinds: tuple[str, ...] = ()  # per concept: its type (standard, validation, prior_preservation); () = all standard
    origin: tuple[int, ...] = ()  # per sample: its bucket before small buckets moved (small_buckets.py); () = none

    def __len__(self) -> int:
        return len(self.buckets)

    def trains(self, concept: int) -> bool:
        """Whether a concept's samples are drawn for training (validation concepts' are not)."""
        return not self.kinds or self.kinds[concept] != "validation"

    @cached_property
    def validation_samples(self) -> dict[int, list[int]]:
        """validation concept -> its sample indices (ascending)."""
        out: dict[int, list[int]] = defaultdict(list)
        for index, concept in enumerate(self.concepts):
            if not self.trains(concept):
                out[concept].append(index)
        return dict(sorted(out.items()))

    def validation_names(self) -> dict[int, str]:
        """validation concept -> its name in the validation/loss/<name> metric (MLflow's characters; a name two
        concepts share gets the concept's index appended for the second)."""
        names: dict[int, str] = {}
        for concept in self.validation_samples:
            name = metric_name(self.concept_names[concept])
            names[concept] = name if name not in names.values() else f"{name}-{concept}"
        return names

    @cached_property
    def concept_sizes(self) -> Counter:
        return Counter(self.concepts)

    @cached_property
    def members(self) -> dict[int, dict[int, list[int]]]:
        """bucket -> concept -> sample indices (ascending), of the concepts that train."""
        out: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for index, (bucket, concept) in enumerate(zip(self.buckets, self.concepts)):
            if self.trains(concept):
                out[bucket][concept].append(index)
        return {b: dict(c) for b, c in sorted(out.items())}

    def copies(self, concept: int, in_bucket: int) -> int:
        """How many times the concept's `in_bucket` samples of one bucket are drawn per epoch."""
        value, strategy = self.balancing[concept]
        if strategy == "samples":
            return round(value * in_bucket / self.concept_sizes[concept])
        return round(value * in_bucket)

    def epoch_sizes(self) -> dict[int, int]:
        """bucket -> samples drawn from it per epoch (after balancing)."""
        return {b: sum(self.copies(c, len(ix)) for c, ix in by_concept.items())
                for b, by_concept in self.members.items()}


@dataclass(frozen=True)
class GlobalBatch:
    bucket: int
    resolution: int
    samples: tuple[int, ...]  # sample ids; the sample index is id % number of samples


def plan_epoch(table: SampleTable, global_batch: int, resolutions: list[int], seed: int, epoch: int,
               pool: bool = False) -> list[GlobalBatch]:
    """The epoch's global batches in training order. Pure function of its arguments. `pool`: the buckets'
    remainders train in global batches of neighbouring aspects (data.small_buckets move) instead of being dropped."""
    count = len(table)
    groups: list[tuple[int, tuple[int, ...]]] = []
    remainders: list[tuple[int, int]] = []
    for bucket, by_concept in table.members.items():
        drawn: list[int] = []
        for concept, indices in by_concept.items():
            full, rest = divmod(table.copies(concept, len(indices)), len(indices))
            for copy in range(full):
                drawn += [i + copy * count for i in indices]
            if rest:  # a fractional repeat: a random part of the concept's samples, new every epoch
                pick = torch.randperm(len(indices), generator=generator(seed, epoch, "balance", bucket, concept))
                drawn += [indices[j] + full * count for j in sorted(pick[:rest].tolist())]
        order = torch.randperm(len(drawn), generator=generator(seed, epoch, "bucket", bucket)).tolist()
        shuffled = [drawn[j] for j in order]
        # The remainder (fewer than a global batch) is pooled or dropped; the shuffle picks different samples each epoch.
        full = len(shuffled) // global_batch * global_batch
        groups += [(bucket, tuple(shuffled[s:s + global_batch])) for s in range(0, full, global_batch)]
        remainders += [(bucket, sample) for sample in shuffled[full:]]
    if pool:
        groups += pool_remainders(remainders, global_batch, seed, epoch)
    order = torch.randperm(len(groups), generator=generator(seed, epoch, "batches")).tolist()
    plan = []
    for step, j in enumerate(order):
        bucket, samples = groups[j]
        resolution = resolutions[0]
        if len(resolutions) > 1:  # drawn per step from (seed, epoch, step): the same on every rank
            resolution = resolutions[int(torch.randint(len(resolutions), (1,), generator=generator(seed, epoch, step, "resolution")))]
        plan.append(GlobalBatch(bucket, resolution, samples))
    return plan


@dataclass(frozen=True)
class BucketRow:
    bucket: int
    samples: int  # drawn per epoch (after balancing)
    batches: int  # global batches per epoch
    dropped: int  # samples per epoch that fit in no full global batch (pooled with data.small_buckets move)

    @property
    def never_trained(self) -> bool:
        return self.batches == 0


def bucket_rows(table: SampleTable, global_batch: int) -> list[BucketRow]:
    return [BucketRow(b, n, n // global_batch, n % global_batch) for b, n in table.epoch_sizes().items()]


def steps_per_epoch(table: SampleTable, global_batch: int, pool: bool = False) -> int:
    """Global batches per epoch: per bucket its full ones, plus (pool) those of the pooled remainders."""
    sizes = table.epoch_sizes().values()
    return sum(sizes) // global_batch if pool else sum(n // global_batch for n in sizes)


def untrained_fraction(table: SampleTable, global_batch: int, pool: bool = False) -> float:
    """Share of the samples drawn per epoch that do not train: in buckets with no full global batch (they never
    train), or with `pool` the part of the remainders that fills no global batch (a different part each epoch)."""
    rows = bucket_rows(table, global_batch)
    total = sum(r.samples for r in rows)
    if not total:
        return 0.0
    if pool:
        return total % global_batch / total
    return sum(r.samples for r in rows if r.never_trained) / total


def bucket_report(table: SampleTable, global_batch: int, world_size: int, resolutions: list[int], step: int,
                  pool: bool = False, names: dict[int, str] | None = None) -> list[str]:
    """Human-readable report: per bucket its size, batches and drops; the buckets that never train; with moved
    buckets (data.small_buckets move) where each moved image went (`names`: sample index -> its file)."""
    rows = bucket_rows(table, global_batch)
    lines = [f"bucket report: global batch {global_batch} on {world_size} process(es), resolutions "
             f"{', '.join(map(str, resolutions))}"]

    def sizes_of(bucket: int) -> str:
        return " ".join("{}x{}".format(*bucket_size(bucket, r, step)[::-1]) for r in resolutions)

    for row in rows:
        flag = "  NEVER TRAINED (fewer samples than the global batch)" if row.never_trained and not pool else ""
        lines.append(f"  bucket {aspect_name(row.bucket):<14} {sizes_of(row.bucket):<12} {row.samples:>6} samples/epoch "
                     f"{row.batches:>5} batches {row.dropped:>4} {'pooled' if pool else 'dropped'}{flag}")
    moved = moved_samples(table)
    by_move: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index, move in moved.items():
        by_move[move].append(index)
    for (source, dest), indices in sorted(by_move.items()):
        files = ", ".join((names or {}).get(i, f"sample {i}") for i in indices)
        lines.append(f"  moved {aspect_name(source)} -> {aspect_name(dest)} {sizes_of(dest)} (fewer samples than the "
                     f"global batch; scaled to cover, cropped): {files}")
    total = sum(r.samples for r in rows)
    steps = steps_per_epoch(table, global_batch, pool)
    if pool:
        pooled = sum(r.dropped for r in rows)
        dropped = total % global_batch
        if pooled:
            lines.append(f"  remainders: {pooled} samples/epoch train in {(pooled - dropped) // global_batch} global "
                         f"batches of neighbouring aspects, {dropped} wait for another epoch")
        lines.append(f"  total: {total} samples/epoch, {steps} steps/epoch, {dropped} dropped per epoch "
                     f"({100 * dropped / max(total, 1):.1f}%), {len(moved)} moved")
    else:
        dropped = sum(r.dropped for r in rows)
        never = [aspect_name(r.bucket) for r in rows if r.never_trained]
        lines.append(f"  total: {total} samples/epoch, {steps} steps/epoch, {dropped} dropped per "
                     f"epoch ({100 * dropped / max(total, 1):.1f}%)" + (f"; never trained: {', '.join(never)}" if never else ""))
    names = table.validation_names()
    for concept, indices in table.validation_samples.items():
        lines.append(f"  validation concept {table.concept_names[concept]}: {len(indices)} samples, not trained (their "
                     f"loss is logged as validation/loss/{names[concept]})")
    return lines
