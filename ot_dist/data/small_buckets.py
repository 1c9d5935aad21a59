"""What happens to samples that would not fill a global batch of their own bucket (data.small_buckets).

`move` (the default) loses the least data while every global batch stays one bucket and one resolution and every
rank runs the same number of steps:

1. Buckets that cannot fill a global batch move, whole, into the bucket nearest in aspect (log ratio of the ideal
   aspects) with which they fill one (a bucket that fills one already, or a small neighbour), the smallest first,
   until every bucket fills one (or one bucket is left). Their images are
   scaled to cover the new bucket and cropped to it when read. The bucket report names every moved image.
2. Every epoch, the remainder of each bucket's shuffle (fewer than a global batch) goes to a pool. The pool is
   shuffled (seed, epoch), cut to a multiple of the global batch (the rest, fewer than one global batch in all,
   waits for another epoch), sorted by aspect and cut into global batches, each trained at the bucket of its middle
   sample. So an epoch has floor(samples / global batch) steps whatever the buckets, at any world size.

`drop` is the earlier behaviour: each bucket's remainder is dropped (a different part each epoch) and a bucket
smaller than a global batch never trains.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from ot_dist.data.buckets import ASPECTS
from ot_dist.randomness import generator

POLICIES = ("move", "drop")


def aspect_distance(a: int, b: int) -> float:
    return abs(math.log(ASPECTS[a]) - math.log(ASPECTS[b]))


def move_small_buckets(table, global_batch: int):
    """The table with the samples of buckets that cannot fill a global batch moved into the nearest bucket that can;
    `origin` holds each sample's bucket before (unchanged samples keep theirs)."""
    origin = table.origin if len(table.origin) else table.buckets
    while True:
        sizes = table.epoch_sizes()
        small = sorted((n, b) for b, n in sizes.items() if n < global_batch)
        if not small or len(sizes) < 2:
            break
        _, bucket = small[0]
        # together they fill one: a bucket that fills one by itself, or a small neighbour (then both keep their images)
        fillable = [b for b, n in sizes.items() if b != bucket and n + sizes[bucket] >= global_batch]
        candidates = fillable or [b for b in sizes if b != bucket]
        dest = min(candidates, key=lambda b: (aspect_distance(b, bucket), -sizes[b], b))
        buckets = table.buckets.array
        table = replace(table, buckets=np.where(buckets == bucket, np.asarray(dest, buckets.dtype), buckets))
    return replace(table, origin=origin)


def pool_remainders(ids: np.ndarray, buckets: np.ndarray, global_batch: int, seed: int, epoch: int):
    """The sample ids (and their buckets) left over by every bucket's full global batches -> (ids: batches x
    global_batch, each batch's bucket): global batches of neighbouring aspects; fewer than one global batch of them
    is left out."""
    order = torch.randperm(len(ids), generator=generator(seed, epoch, "remainders")).numpy()
    order = order[:len(ids) // global_batch * global_batch]
    ids, buckets = ids[order], buckets[order]
    aspects = np.asarray(ASPECTS, dtype=np.float64)[buckets]
    kept = np.lexsort((buckets, aspects))  # stable: the shuffle decides within a bucket
    ids, buckets = ids[kept].reshape(-1, global_batch), buckets[kept].reshape(-1, global_batch)
    return ids, buckets[:, global_batch // 2]  # each batch trains at the bucket of its middle sample


def moved_samples(table) -> dict[int, tuple[int, int]]:
    """sample index -> (its bucket, the bucket it trains in), for the samples that moved."""
    if not len(table.origin):
        return {}
    origin, buckets = table.origin.array, table.buckets.array
    moved = np.flatnonzero((origin != buckets) & table.training)
    return {i: (o, b) for i, o, b in zip(moved.tolist(), origin[moved].tolist(), buckets[moved].tolist())}
