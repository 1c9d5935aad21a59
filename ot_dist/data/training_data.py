"""The training data of a run: the shard set (built from the concepts when missing or stale), its
reader for this rank, and the bucket report. Used by the trainer and by `ot-dist schedule`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ot_dist.data.buckets import config_bucket_of, merged_buckets
from ot_dist.data.concepts import concept_name, scan_concepts
from ot_dist.data.shard_cache import mark_used
from ot_dist.data.plan import SampleTable, bucket_report, untrained_fraction
from ot_dist.data.small_buckets import move_small_buckets, moved_samples
from ot_dist.data.reader import ShardDataset, ShardReader
from ot_dist.data.shard_parts import MERGE_WAIT_S, merge_parts, part_folders
from ot_dist.data.shards import build_shard_set, default_shard_dir, is_current, source_fingerprint
from ot_dist.errors import InputFileError

# beyond the parts' wait: the merge itself, or a whole build of the set by the main process
BUILD_WAIT_MARGIN_S = 6 * 3600


def shard_dir_of(config) -> Path:
    return Path(config.data.shards) if config.data.shards else default_shard_dir(config)


def ensure_shards(config, runtime, log=print) -> Path:
    """With concepts: (re)build the shard set when it is missing or its sources/settings changed.
    The main process builds (the shard folder must be shared by all nodes); the others wait, and
    learn whether it worked from a collective, so a failed build stops every rank instead of hanging."""
    out = shard_dir_of(config)
    if runtime.is_main:
        mark_used(out)  # for `ot-dist shard prune --unused-days` (a set built below is marked when built)
    if not config.data.concept_list():
        return out
    error = None
    # The others wait for the main process's build or merge in a group that waits as long as a merge may
    waiting = runtime.waiting_group(MERGE_WAIT_S + BUILD_WAIT_MARGIN_S)
    # Only the main process decides: another rank checking on its own could see the set rebuilt
    # already and skip the collective below, leaving the main process waiting in it.
    if runtime.is_main:
        try:
            if not is_current(out, source_fingerprint(config)) and part_folders(out):
                # being built in parts (ot-dist shard build --part, the k8s shard jobs): wait for them, not over them
                log(f"data: shard set {out} is built in parts; waiting for them to finish, then merging them")
                merge_parts(config, out, wait=MERGE_WAIT_S, log=log)
                mark_used(out)
            elif not is_current(out, source_fingerprint(config)):
                log(f"data: shard set {out} is missing or stale; building it (`ot-dist shard build` does it ahead)")
                build_shard_set(config, out, log)
                mark_used(out)
        except Exception as err:  # noqa: BLE001  (any failure: the other ranks must hear of it, then it is raised)
            error = err
    runtime.fail_together(error, waiting, f"data: building the shard set {out}")
    return out


def open_training_data(config, runtime, log=print) -> tuple[ShardDataset, ShardReader]:
    dataset = ShardDataset(ensure_shards(config, runtime, log), config)
    reader = ShardReader(dataset, dataset.table(config.data), config.batch_size, config.gradient_accumulation_steps,
                         runtime.rank, runtime.world_size, config.data.loader_workers, config.data.max_bad_fraction,
                         small_buckets=config.data.small_buckets, changed_plan=config.data.resume_with_changed_data)
    check_untrained_share(config, dataset, reader, runtime.world_size)
    return dataset, reader


def check_untrained_share(config, dataset: ShardDataset, reader: ShardReader, world_size: int) -> None:
    """Every rank computes the same plan, so every rank stops here alike (no collective is left waiting)."""
    global_batch = reader.global_batch
    share = untrained_fraction(reader.table, global_batch, reader.pool)
    limit = config.data.max_untrained_fraction
    if share > limit and share < 1:  # nothing trains at all: the step count check says so more plainly (exit 3)
        why = ("fill no global batch and would not train" if reader.pool else
               "are in buckets with fewer samples than the global batch and would never train")
        fixes = ([] if reader.pool else ["move them into the nearest bucket that trains (data.small_buckets: move)"]) + [
            "lower batch_size or gradient_accumulation_steps", "train on fewer processes",
            "crop to fewer aspects (data.bucket_step)", "add images of those aspects",
            f"accept it with data.max_untrained_fraction: {min(1.0, round(share + 0.005, 2))}"]
        raise InputFileError(
            "\n".join(report_lines(dataset, reader, world_size)) + f"\ndata.max_untrained_fraction: {100 * share:.0f}% of "
            f"the samples per epoch {why} (global batch {global_batch}, limit {100 * limit:.0f}%). Fixes: "
            + "; ".join(fixes))


def training_captions(dataset: ShardDataset, table: SampleTable) -> Iterator[str]:
    """Every caption of the samples that train (not the validation concepts'), as the shards hold them (a concept's
    prefix and suffix in place), one sample read at a time."""
    for i in np.flatnonzero(table.training):
        yield from dataset.captions(int(i))


def main_process_report(dataset: ShardDataset, reader: ShardReader, runtime) -> list[str]:
    """The bucket report on the main process, which logs and tracks it; nothing on the others: naming the moved
    samples reads a metadata record each (30,000 of them at a global batch of 16,384 on a 2M-sample set, each a
    request where the shards are in object storage), which every rank would otherwise do at once for nothing."""
    return report_lines(dataset, reader, runtime.world_size) if runtime.is_main else []


def report_lines(dataset: ShardDataset, reader: ShardReader, world_size: int) -> list[str]:
    """The bucket report for this run's world size and global batch."""
    return bucket_report(reader.table, reader.global_batch, world_size, dataset.resolutions, dataset.step, reader.pool,
                         moved_names(dataset, reader.table))


def moved_names(dataset: ShardDataset, table: SampleTable) -> dict[int, str]:
    """sample index -> its source image, for the samples data.small_buckets move moved (a metadata read each)."""
    names = {}
    for i in moved_samples(table):
        source, concept = Path(dataset.metadata(i)["source"]), dataset.concepts.get(table.concepts[i])
        names[i] = str(source.relative_to(concept.path)) if concept and source.is_relative_to(concept.path) else str(source)
    return names


def report_for(config, shard_dir, world_size: int) -> list[str]:
    """The bucket report of a built shard set for a world size (the config gives batch and accumulation)."""
    dataset = ShardDataset(shard_dir, config)
    reader = ShardReader(dataset, dataset.table(config.data), config.batch_size, config.gradient_accumulation_steps,
                         world_size=world_size, small_buckets=config.data.small_buckets)
    return report_lines(dataset, reader, world_size)


def planned_table(config, world_size: int) -> SampleTable:
    """The sample table as a run on `world_size` processes trains it (small buckets moved with data.small_buckets
    move), without building shards (`ot-dist schedule`)."""
    table = sample_table(config)
    if config.data.small_buckets == "move":
        table = move_small_buckets(table, config.batch_size * config.gradient_accumulation_steps * world_size)
    return table


def sample_table(config) -> SampleTable:
    """The sample table without building shards: from a current shard set if there is one, else from
    the image sizes in the concept folders (for `ot-dist schedule`)."""
    out = shard_dir_of(config) if config.data.shards or config.data.concept_list() else None
    if config.data.concept_list() and not is_current(out, source_fingerprint(config)):
        sources = scan_concepts(config.data)
        concepts = [c for _, c in config.data.concept_list()]
        merged = merged_buckets(config.resolutions(), config.data.bucket_step)
        return SampleTable(tuple(merged[config_bucket_of(config, *s.size)] for s in sources),
                           tuple(s.concept for s in sources),
                           tuple((c.balancing, c.balancing_strategy) for c in concepts),
                           tuple(concept_name(c) for c in concepts), tuple(c.type for c in concepts))
    return ShardDataset(out, config).table(config.data)
