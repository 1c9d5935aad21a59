"""The numpy epoch plan and sample table (plan.py) give the very batches of the earlier Python-list plan.

`reference_plan` below is the earlier implementation (tuples and lists of Python ints), kept here as the
specification: the same seed gives the same global batches, order, resolutions, per-rank micro batches and
resume position, with balancing (whole and fractional repeats, samples), validation concepts, moved small
buckets and pooled remainders, at world sizes 1, 2 and 3. (Balancing's per-bucket counts are OneTrainer's totals
shared over the buckets since the balancing audit, `ref_copies`; the rest of the reference is unchanged.)
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from fractions import Fraction

import pytest
import torch

from ot_dist.data.buckets import ASPECTS
from ot_dist.data.plan import SampleTable, plan_epoch, steps_per_epoch
from ot_dist.data.reader import ShardReader
from ot_dist.data.small_buckets import move_small_buckets, moved_samples
from ot_dist.randomness import generator


# ---- the earlier implementation, verbatim in substance ----
def ref_members(buckets, concepts, kinds):
    out = defaultdict(lambda: defaultdict(list))
    for index, (bucket, concept) in enumerate(zip(buckets, concepts)):
        if not kinds or kinds[concept] != "validation":
            out[bucket][concept].append(index)
    return {b: dict(c) for b, c in sorted(out.items())}


def ref_copies(balancing, members, concept, bucket):
    """OneTrainer's samples per concept and epoch (floor(images x repeats), int(samples)), shared over the concept's
    buckets by their share of its images: the whole parts, then one more for the largest fractions (lower bucket
    first)."""
    sizes = {b: len(by[concept]) for b, by in members.items() if concept in by}
    value, strategy = balancing[concept]
    images = sum(sizes.values())
    total = int(value) if strategy == "samples" else math.floor(images * value)
    quota = {b: Fraction(total * n, images) for b, n in sizes.items()}
    counts = {b: math.floor(q) for b, q in quota.items()}
    for b in sorted(quota, key=lambda b: (counts[b] - quota[b], b))[:total - sum(counts.values())]:
        counts[b] += 1
    return counts[bucket]


def ref_sizes(buckets, concepts, balancing, kinds):
    members = ref_members(buckets, concepts, kinds)
    return {b: sum(ref_copies(balancing, members, c, b) for c in by) for b, by in members.items()}


def ref_move(buckets, concepts, balancing, kinds, global_batch):
    origin = tuple(buckets)
    while True:
        sizes = ref_sizes(buckets, concepts, balancing, kinds)
        small = sorted((n, b) for b, n in sizes.items() if n < global_batch)
        if not small or len(sizes) < 2:
            break
        _, bucket = small[0]
        fillable = [b for b, n in sizes.items() if b != bucket and n + sizes[bucket] >= global_batch]
        candidates = fillable or [b for b in sizes if b != bucket]
        dest = min(candidates, key=lambda b: (abs(math.log(ASPECTS[b]) - math.log(ASPECTS[bucket])), -sizes[b], b))
        buckets = tuple(dest if b == bucket else b for b in buckets)
    return buckets, origin


def ref_pool(remainders, global_batch, seed, epoch):
    order = torch.randperm(len(remainders), generator=generator(seed, epoch, "remainders")).tolist()
    kept = [remainders[j] for j in order][:len(remainders) // global_batch * global_batch]
    kept.sort(key=lambda entry: (ASPECTS[entry[0]], entry[0]))
    return [(group[len(group) // 2][0], tuple(s for _, s in group))
            for group in (kept[i:i + global_batch] for i in range(0, len(kept), global_batch))]


def reference_plan(buckets, concepts, balancing, kinds, global_batch, resolutions, seed, epoch, pool):
    count = len(buckets)
    groups, remainders = [], []
    members = ref_members(buckets, concepts, kinds)
    for bucket, by_concept in members.items():
        drawn = []
        for concept, indices in by_concept.items():
            full, rest = divmod(ref_copies(balancing, members, concept, bucket), len(indices))
            for copy in range(full):
                drawn += [i + copy * count for i in indices]
            if rest:
                pick = torch.randperm(len(indices), generator=generator(seed, epoch, "balance", bucket, concept))
                drawn += [indices[j] + full * count for j in sorted(pick[:rest].tolist())]
        order = torch.randperm(len(drawn), generator=generator(seed, epoch, "bucket", bucket)).tolist()
        shuffled = [drawn[j] for j in order]
        full = len(shuffled) // global_batch * global_batch
        groups += [(bucket, tuple(shuffled[s:s + global_batch])) for s in range(0, full, global_batch)]
        remainders += [(bucket, sample) for sample in shuffled[full:]]
    if pool:
        groups += ref_pool(remainders, global_batch, seed, epoch)
    order = torch.randperm(len(groups), generator=generator(seed, epoch, "batches")).tolist()
    plan = []
    for step, j in enumerate(order):
        bucket, samples = groups[j]
        resolution = resolutions[0]
        if len(resolutions) > 1:
            resolution = resolutions[int(torch.randint(len(resolutions), (1,), generator=generator(seed, epoch, step, "resolution")))]
        plan.append((bucket, resolution, samples))
    return plan


def ref_my_ids(samples, rank, world, batch, accumulation):
    micro = batch * world
    return [list(samples[m * micro + rank * batch:][:batch]) for m in range(accumulation)]


# ---- random tables ----
def random_table(rng: random.Random, count: int):
    # a few big buckets, a few small ones (fewer than a global batch: they move or never train)
    big = rng.sample(range(len(ASPECTS)), 4)
    small = rng.sample([b for b in range(len(ASPECTS)) if b not in big], 3)
    buckets = [rng.choice(big) if rng.random() < 0.99 else rng.choice(small) for _ in range(count)]
    concepts = [rng.choices(range(5), weights=(5, 3, 2, 1, 1))[0] for _ in range(count)]
    balancing = ((1.0, "repeats"), (2.5, "repeats"), (0.35, "repeats"), (40.0, "samples"), (1.0, "repeats"))
    kinds = ("standard", "standard", "prior_preservation", "standard", "validation")
    return tuple(buckets), tuple(concepts), balancing, kinds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_plan_equals_the_reference_plan(seed):
    rng = random.Random(seed)
    buckets, concepts, balancing, kinds = random_table(rng, 3000)
    names = tuple(f"c{i}" for i in range(5))
    for world in (1, 2, 3):
        batch, accumulation = 2, 2
        global_batch = batch * accumulation * world
        for pool in (False, True):
            table = SampleTable(buckets, concepts, balancing, names, kinds)
            ref_buckets, origin = buckets, ()
            if pool:
                table = move_small_buckets(table, global_batch)
                ref_buckets, origin = ref_move(buckets, concepts, balancing, kinds, global_batch)
                assert table.buckets == ref_buckets and table.origin == origin
                assert moved_samples(table) == {i: (o, b) for i, (o, b) in enumerate(zip(origin, ref_buckets))
                                                if o != b and kinds[concepts[i]] != "validation"}
            assert table.epoch_sizes() == ref_sizes(ref_buckets, concepts, balancing, kinds)
            for epoch in (0, 3):
                resolutions = [512, 768] if epoch else [512]
                want = reference_plan(ref_buckets, concepts, balancing, kinds, global_batch, resolutions, seed, epoch,
                                      pool)
                plan = plan_epoch(table, global_batch, resolutions, seed, epoch, pool)
                got = [(gb.bucket, gb.resolution, gb.samples) for gb in plan]
                assert got == want and len(got) == steps_per_epoch(table, global_batch, pool)
                assert all(type(i) is int for i in got[0][2])
                # every rank's micro batches, from the start and resumed mid-epoch
                for start in (0, len(want) // 2):
                    part = plan[start:]
                    assert [(gb.bucket, gb.resolution, gb.samples) for gb in part] == want[start:]
                    for rank in range(world):
                        ids = part.rank_ids(rank, world, batch, accumulation).reshape(-1, batch).tolist()
                        assert ids == [i for _, _, s in want[start:] for i in ref_my_ids(s, rank, world, batch,
                                                                                            accumulation)]
    assert table.validation_samples == {4: [i for i, c in enumerate(concepts) if c == 4]}


class FakeDataset:
    """Loads nothing: a sample is its id, bucket and resolution (to check the reader's micro batches)."""
    resolutions, seed = [512, 640], 7
    fetch_ahead = None  # local files: nothing read ahead (a store's tars set (micro batches, requests))

    def moved(self, i, bucket, resolution):
        return False

    def load(self, sample_id, epoch, resolution, bucket, latents):
        return {"original_size": torch.tensor([bucket, resolution]), "crop_top_left": torch.tensor([epoch, 0]),
                "target_size": torch.tensor([0, 0]), "caption": "", "sample_id": sample_id}


def test_the_reader_hands_each_rank_the_reference_micro_batches_and_resumes_mid_epoch():
    rng = random.Random(5)
    buckets, concepts, balancing, kinds = random_table(rng, 600)
    table = SampleTable(buckets, concepts, balancing, tuple("abcde"), kinds)
    data = FakeDataset()
    for world in (1, 2, 3):
        ref_buckets, _ = ref_move(buckets, concepts, balancing, kinds, 2 * 2 * world)
        want = reference_plan(ref_buckets, concepts, balancing, kinds, 4 * world, data.resolutions, data.seed, 1, True)
        for rank in range(world):
            expected = [(b, r, ids) for b, r, s in want for ids in ref_my_ids(s, rank, world, 2, 2)]

            def read(reader):
                return [(int(x["original_size"][0, 0]), int(x["original_size"][0, 1]), x["sample_id"].tolist())
                        for x in reader.epoch_batches(1)]

            reader = ShardReader(data, table, 2, 2, rank=rank, world_size=world, small_buckets="move", log=None)
            assert read(reader) == expected
            # stopped after 3 global batches, resumed by a fresh reader: the rest, none twice
            first = ShardReader(data, table, 2, 2, rank=rank, world_size=world, small_buckets="move", log=None)
            batches = first.epoch_batches(1)
            done = [next(batches) for _ in range(3 * 2)]
            resumed = ShardReader(data, table, 2, 2, rank=rank, world_size=world, small_buckets="move", log=None)
            resumed.load_state_dict(first.state_dict())
            assert first.state_dict()["step"] == 3 and len(done) == 6
            assert read(resumed) == expected[6:]
