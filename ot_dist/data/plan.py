"""The epoch plan: which samples form each global batch, computed identically on every rank.

From the sample table (each sample's bucket and concept), the seed and the epoch, every rank derives
the same list of global batches: each holds `global_batch` samples of one bucket and carries one
resolution. Ranks then take their slice of each global batch, so no communication is needed, every
rank runs the same number of steps, and a position in the epoch is just the global-batch index:
independent of the world size, which is what makes resume exact on a different number of ranks.

Balancing (OneTrainer's repeats / samples per concept) draws OneTrainer's number of samples per concept and epoch
(floor(images x repeats), or `samples`), shared over the concept's buckets in proportion to their images, so the
number of samples per bucket, hence the step count and the bucket report, is the same every epoch.
A repeated sample's copies get distinct sample ids (index + copy x number of samples), so their
noise and timesteps differ.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ot_dist.data.buckets import aspect_name, bucket_size
from ot_dist.data.small_buckets import moved_samples, pool_remainders
from ot_dist.randomness import generator
from ot_dist.tracking.base import metric_name


def small_int_dtype(largest: int):
    """The narrowest signed integer type (int16 / int32 / int64) that holds 0..largest."""
    for dtype in (np.int16, np.int32):
        if largest <= np.iinfo(dtype).max:
            return dtype
    return np.int64


class Column(Sequence):
    """A read-only column of integers, one per sample, kept as one numpy array (no Python object per sample).
    Indexing gives Python ints; it equals any sequence of the same integers; `.array` is the numpy array."""

    def __init__(self, values=()):
        array = np.asarray(values.array if isinstance(values, Column) else values)
        if array.dtype.kind not in "iu":
            array = array.astype(np.int64) if array.size else np.zeros(0, np.int16)
        if array.size and array.dtype.itemsize > 2 and array.max() <= np.iinfo(np.int16).max and array.min() >= 0:
            array = array.astype(small_int_dtype(int(array.max())))
        array = array.reshape(-1)
        array.flags.writeable = False
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Column(self.array[index])
        return int(self.array[index])

    def __iter__(self):
        return iter(self.array.tolist())

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype)

    def __eq__(self, other) -> bool:
        if isinstance(other, (Column, np.ndarray, Sequence)) and not isinstance(other, str):
            other = other.array if isinstance(other, Column) else np.asarray(other)
            return len(self) == len(other) and bool(np.array_equal(self.array, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"Column({self.array!r})"


@dataclass(frozen=True)
class SampleTable:
    """Per sample its bucket and concept (numpy columns: 2-4 bytes a sample each), per concept its balancing."""

    buckets: Column  # per sample (any sequence of ints is taken)
    concepts: Column  # per sample
    balancing: tuple[tuple[float, str], ...]  # per concept: (balancing, strategy)
    concept_names: tuple[str, ...]
    kinds: tuple[str, ...] = ()  # per concept: its type (standard, validation, prior_preservation); () = all standard
    # per sample: its bucket before small buckets moved (small_buckets.py); empty = none moved
    origin: Column = field(default_factory=Column)

    def __post_init__(self):
        for name in ("buckets", "concepts", "origin"):
            object.__setattr__(self, name, Column(getattr(self, name)))
        if len(self.buckets) != len(self.concepts):
            raise ValueError(f"SampleTable: {len(self.buckets)} buckets for {len(self.concepts)} concepts")

    def __len__(self) -> int:
        return len(self.buckets)

    def trains(self, concept: int) -> bool:
        """Whether a concept's samples are drawn for training (validation concepts' are not)."""
        return not self.kinds or self.kinds[concept] != "validation"

    @property
    def training(self) -> np.ndarray:
        """Per sample: whether its concept trains."""
        if not self.kinds or len(self) == 0:
            return np.ones(len(self), dtype=bool)
        trains = np.array([self.trains(c) for c in range(int(self.concepts.array.max()) + 1)])
        return trains[self.concepts.array]

    @cached_property
    def validation_samples(self) -> dict[int, list[int]]:
        """validation concept -> its sample indices (ascending)."""
        held = np.flatnonzero(~self.training)
        concepts = self.concepts.array[held]
        return {int(c): held[concepts == c].tolist() for c in np.unique(concepts)}

    def validation_names(self) -> dict[int, str]:
        """validation concept -> its name in the validation/loss/<name> metric (MLflow's characters; a name two
        concepts share gets the concept's index appended for the second)."""
        names: dict[int, str] = {}
        for concept in self.validation_samples:
            name = metric_name(self.concept_names[concept])
            names[concept] = name if name not in names.values() else f"{name}-{concept}"
        return names

    @property
    def members(self) -> dict[int, dict[int, np.ndarray]]:
        """bucket -> concept -> sample indices (ascending numpy array), of the concepts that train. Buckets in
        ascending order; a bucket's concepts in the order of their first sample. Computed on each call (4 bytes a
        sample while held: the plan takes it once an epoch)."""
        indices = np.flatnonzero(self.training).astype(np.int32 if len(self) < 2**31 else np.int64)  # kept: 4 B each
        buckets, concepts = self.buckets.array[indices], self.concepts.array[indices]
        order = np.lexsort((concepts, buckets))  # stable: ascending indices within a (bucket, concept)
        indices, buckets, concepts = indices[order], buckets[order], concepts[order]
        starts = np.flatnonzero(np.r_[True, (buckets[1:] != buckets[:-1]) | (concepts[1:] != concepts[:-1])])
        ends = np.r_[starts[1:], len(indices)]
        out: dict[int, list[tuple[int, int, np.ndarray]]] = defaultdict(list)
        for s, e in zip(starts.tolist(), ends.tolist()):
            group = indices[s:e]
            out[int(buckets[s])].append((int(group[0]), int(concepts[s]), group))
        return {b: {c: group for _, c, group in sorted(groups, key=lambda g: g[0])}
                for b, groups in sorted(out.items())}

    def copies(self, bucket: int, concept: int) -> int:
        """How many samples of the concept are drawn from one bucket per epoch."""
        return self.drawn[concept][bucket]

    @cached_property
    def drawn(self) -> dict[int, dict[int, int]]:
        """concept -> bucket -> samples drawn per epoch. A concept's total is OneTrainer's (mgds DiskCache:
        floor(images x repeats), or int(samples)), shared over its buckets by their share of its images: each
        gets the whole part of its share, and the samples left by rounding down go to the buckets with the largest
        fractions (ties: the lower bucket). Rounding each bucket's share on its own drew other totals, and none at
        all from a concept spread over buckets whose shares are all below one half."""
        per_concept: dict[int, dict[int, int]] = defaultdict(dict)
        for bucket, by_concept in self.group_sizes.items():
            for concept, n in by_concept.items():
                per_concept[concept][bucket] = n
        out = {}
        for concept, sizes in per_concept.items():
            value, strategy = self.balancing[concept]
            images = sum(sizes.values())
            total = int(value) if strategy == "samples" else math.floor(images * value)
            share = {b: divmod(total * n, images) for b, n in sizes.items()}  # (whole, fraction x images)
            counts = {b: whole for b, (whole, _) in share.items()}
            for b in sorted(share, key=lambda b: (-share[b][1], b))[:total - sum(counts.values())]:
                counts[b] += 1
            out[concept] = counts
        return out

    @cached_property
    def group_sizes(self) -> dict[int, dict[int, int]]:
        """bucket -> concept -> its number of samples in the bucket, of the concepts that train (buckets ascending)."""
        training = self.training
        buckets, concepts = self.buckets.array[training], self.concepts.array[training].astype(np.int64)
        keys, counts = np.unique(buckets.astype(np.int64) * (int(concepts.max(initial=0)) + 1) + concepts,
                                 return_counts=True)
        out: dict[int, dict[int, int]] = {}
        for key, n in zip(keys.tolist(), counts.tolist()):
            bucket, concept = divmod(key, int(concepts.max(initial=0)) + 1)
            out.setdefault(bucket, {})[concept] = n
        return out

    def epoch_sizes(self) -> dict[int, int]:
        """bucket -> samples drawn from it per epoch (after balancing)."""
        return {b: sum(self.copies(b, c) for c in by_concept) for b, by_concept in self.group_sizes.items()}


@dataclass(frozen=True)
class GlobalBatch:
    bucket: int
    resolution: int
    samples: tuple[int, ...]  # sample ids; the sample index is id % number of samples


class EpochPlan(Sequence):
    """An epoch's global batches in training order, kept as numpy arrays: the sample ids (steps x global batch),
    each step's bucket; a step's resolution is drawn when the step is read. Items are GlobalBatch; a slice
    [start:] is a plan of the later steps (their step numbers kept)."""

    def __init__(self, ids: np.ndarray, buckets: np.ndarray, resolutions: list[int], seed: int, epoch: int,
                 first: int = 0):
        self.ids, self.buckets, self.resolutions = ids, buckets, list(resolutions)
        self.seed, self.epoch, self.first = seed, epoch, first

    def __len__(self) -> int:
        return len(self.ids)

    def resolution(self, position: int) -> int:
        """The resolution of this plan's `position`-th step (step first + position of the epoch)."""
        if len(self.resolutions) == 1:
            return self.resolutions[0]
        g = generator(self.seed, self.epoch, self.first + position, "resolution")  # the same on every rank
        return self.resolutions[int(torch.randint(len(self.resolutions), (1,), generator=g))]

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stride != 1:
                return [self[i] for i in range(start, stop, stride)]
            return EpochPlan(self.ids[start:stop], self.buckets[start:stop], self.resolutions, self.seed, self.epoch,
                             self.first + start)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"step {index} of a plan of {len(self)}")
        return GlobalBatch(int(self.buckets[index]), self.resolution(index), tuple(self.ids[index].tolist()))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def without_ids(self) -> EpochPlan:
        """The same steps' buckets and resolutions, without their sample ids."""
        return EpochPlan(np.zeros((len(self), 0), np.int32), self.buckets, self.resolutions, self.seed, self.epoch,
                         self.first)

    def rank_ids(self, rank: int, world_size: int, batch_size: int, accumulation: int) -> np.ndarray:
        """This rank's sample ids: (steps, accumulation, batch_size); micro step m of a global batch takes samples
        [m*b*world + rank*b, +b) of it."""
        steps = self.ids.reshape(len(self), accumulation, world_size, batch_size)
        return np.ascontiguousarray(steps[:, :, rank, :])


def plan_epoch(table: SampleTable, global_batch: int, resolutions: list[int], seed: int, epoch: int,
               pool: bool = False) -> EpochPlan:
    """The epoch's global batches in training order. Pure function of its arguments. `pool`: the buckets'
    remainders train in global batches of neighbouring aspects (data.small_buckets move) instead of being dropped."""
    count, members = len(table), table.members
    copies = {(b, c): table.copies(b, c) for b, by_concept in members.items() for c in by_concept}
    most = max([-(-n // len(members[b][c])) for (b, c), n in copies.items()] + [1])
    dtype = np.int32 if (most + 1) * count < np.iinfo(np.int32).max else np.int64  # sample ids: index + copy x count
    sizes = {b: sum(copies[b, c] for c in by_concept) for b, by_concept in members.items()}
    rows = sum(n // global_batch for n in sizes.values())
    rows += sum(n % global_batch for n in sizes.values()) // global_batch if pool else 0
    # The steps' order is drawn first (its generator is its own), so each global batch is written once, at its step.
    order = torch.randperm(rows, generator=generator(seed, epoch, "batches")).numpy()
    place = np.empty(rows, np.int64)
    place[order] = np.arange(rows)  # global batch j (in bucket order, then the pooled ones) -> its step
    ids, buckets = np.empty((rows, global_batch), dtype), np.empty(rows, np.int16)
    row, rest_ids, rest_buckets = 0, [], []
    for bucket, by_concept in members.items():
        drawn = []
        for concept, indices in by_concept.items():
            full, rest = divmod(copies[bucket, concept], len(indices))
            drawn += [indices.astype(dtype) + copy * count for copy in range(full)]
            if rest:  # a fractional repeat: a random part of the concept's samples, new every epoch
                pick = torch.randperm(len(indices), generator=generator(seed, epoch, "balance", bucket, concept))
                drawn.append(indices[np.sort(pick[:rest].numpy())].astype(dtype) + full * count)
        drawn = np.concatenate(drawn) if drawn else np.zeros(0, dtype)
        shuffled = drawn[torch.randperm(len(drawn), generator=generator(seed, epoch, "bucket", bucket)).numpy()]
        del drawn
        # The remainder (fewer than a global batch) is pooled or dropped; the shuffle picks different samples each epoch.
        full = len(shuffled) // global_batch
        ids[place[row:row + full]] = shuffled[:full * global_batch].reshape(-1, global_batch)
        buckets[place[row:row + full]] = bucket
        row += full
        rest_ids.append(shuffled[full * global_batch:].copy())
        rest_buckets.append(np.full(len(rest_ids[-1]), bucket, dtype=np.int16))
    if pool and rest_ids:
        pooled, pooled_buckets = pool_remainders(np.concatenate(rest_ids), np.concatenate(rest_buckets), global_batch,
                                                 seed, epoch)
        ids[place[row:]], buckets[place[row:]] = pooled, pooled_buckets
    return EpochPlan(ids, buckets, resolutions, seed, epoch)


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
