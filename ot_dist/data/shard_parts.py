"""A shard set built in parts (`ot-dist shard build --part i/n`, one machine or pod each) and merged into one set
(`ot-dist shard merge`) without rewriting a tar.

Part i of n takes the i-th of n contiguous ranges of the list of every concept's images (concept, then path:
the order the one-process build names its samples by), so the parts are disjoint, cover the set, and stay the
same while the sources do; each part decodes only its own images. A part writes its shards into
OUT/part-IIIII-of-NNNNN/ and, last, `part.json` (its samples, their shards, the unreadable images and the
sources' fingerprint): a folder with one is finished, and building that part again skips it while the sources
are unchanged; a folder without one (an interrupted build) is cleared and built again.

The merge reads the part files (not the tars' contents: write_manifest indexes the member offsets from the tar
headers), orders the samples as the one-process build does (bucket, then image number) and writes one manifest
at OUT whose shard files are the parts' (`part-00000-of-00002/shard-000000.tar`). The set then trains, reports
and plans its epochs exactly as a one-process build of the same sources: the same samples under the same keys,
in the same order; only the split of samples over tar files differs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from ot_dist.config.schema import TrainConfig
from ot_dist.data.concepts import check_bad_fraction
from ot_dist.data.shards import (MANIFEST, build_order, clear_set, scan_sources, source_fingerprint, unused_report,
                                 write_manifest, write_shards)
from ot_dist.errors import ConfigError, InputFileError

PART_FILE = "part.json"
PART_FORMAT = "ot_dist.shard-part/1"
PART_FOLDER = re.compile(r"part-(\d{5})-of-(\d{5})")
MERGE_WAIT_S = 86400  # how long a merge at train start (or in the k8s merge pod) waits for parts still building
COLUMNS = ("key", "shard", "bucket", "concept", "mask", "number")  # a part's samples, one list per field
# added later: a part written before reads as the default
OPTIONAL_COLUMNS = {"reference": False, "clip": False, "frames": 0}  # frames: a clip window's (0: an image)


def parse_part(text: str) -> tuple[int, int]:
    """`--part i/n` -> (i, n), 0 <= i < n."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise ConfigError(f"shard build: --part {text!r}: expected I/N with 0 <= I < N (the I-th of N parts, "
                          "e.g. 0/4 .. 3/4)")
    if int(match[2]) > 99999:
        raise ConfigError(f"shard build: --part {text!r}: at most 99999 parts")
    return int(match[1]), int(match[2])


def part_dir(out_dir: Path, part: int, parts: int) -> Path:
    return Path(out_dir) / f"part-{part:05d}-of-{parts:05d}"


def part_folders(out_dir: Path) -> dict[Path, tuple[int, int]]:
    """The part folders in out_dir -> (part, parts)."""
    found = {}
    for path in sorted(Path(out_dir).glob("part-*-of-*")):
        match = PART_FOLDER.fullmatch(path.name)
        if match and path.is_dir():
            found[path] = (int(match[1]), int(match[2]))
    return found


def read_part(folder: Path) -> dict | None:
    """A finished part's part.json, or None (not built, interrupted, or unreadable)."""
    try:
        part = json.loads((Path(folder) / PART_FILE).read_text())
    except (OSError, ValueError):
        return None
    return part if isinstance(part, dict) and part.get("format") == PART_FORMAT else None


def build_part(config: TrainConfig, out_dir: str | Path, part: tuple[int, int], workers: int = 1,
               log=print) -> dict:
    """Build part `part` = (i, n) of the set into its part folder, unless it is finished from the same sources.
    Returns its part.json content."""
    out_dir = Path(out_dir)
    number, parts = part
    folder = part_dir(out_dir, number, parts)
    fingerprint = source_fingerprint(config)
    done = read_part(folder)
    if done and done["fingerprint"] == fingerprint:
        log(f"shard part {number}/{parts}: {folder} is built from the same sources ({len(done['key'])} samples); "
            "skipped")
        return done
    clear_set(out_dir, keep_parts=parts)  # the merged manifest is stale now; so are shards of a whole-set build
    shutil.rmtree(folder, ignore_errors=True)  # interrupted, or built from other sources
    folder.mkdir(parents=True)
    scan, sources = scan_sources(config, log, part, workers)
    start = time.perf_counter()
    records = write_shards(config, folder, sources, workers, log)
    content = {
        "format": PART_FORMAT, "part": number, "parts": parts, "fingerprint": fingerprint,
        "images": scan.files(),  # of this part's range, for the merged unreadable limit
        "shards": sorted(p.name for p in folder.glob("shard-*.tar")),
        **{column: [] for column in (*COLUMNS, *OPTIONAL_COLUMNS)},
        "unused_files": [{"file": str(path), "reason": reason} for path, reason in scan.unused],
        "unreadable_images": [{"file": str(path), "error": error} for path, error in scan.bad],
    }
    for record, source in zip(records, build_order(config, sources), strict=True):
        record["number"] = source.number
        for column in COLUMNS:
            content[column].append(record[column])
        for column, default in OPTIONAL_COLUMNS.items():
            content[column].append(record.get(column, default))
    tmp = folder / (PART_FILE + ".tmp")
    tmp.write_text(json.dumps(content))
    os.replace(tmp, folder / PART_FILE)  # last: a folder without it is an unfinished part
    log(f"shard part {number}/{parts}: {len(records)} samples in {len(content['shards'])} shards in {folder} in "
        f"{time.perf_counter() - start:.1f}s; merge the parts with: ot-dist shard merge CONFIG --parts {parts}")
    return content


def finished_parts(fingerprint: str, out_dir: Path, parts: int) -> tuple[list[dict], list[str]]:
    """(the finished parts' contents, in order, [why each other part is not ready]) for a build in `parts` parts
    from the sources of `fingerprint`."""
    found, waiting = [], []
    for number in range(parts):
        folder = part_dir(out_dir, number, parts)
        content = read_part(folder)
        if content is None:
            waiting.append(f"part {number}/{parts} ({folder}) is not built or not finished")
        elif content["fingerprint"] != fingerprint:
            waiting.append(f"part {number}/{parts} ({folder}) was built from other sources or settings; build it "
                           f"again (ot-dist shard build CONFIG --part {number}/{parts})")
        else:
            found.append(content)
    return found, waiting


def infer_parts(out_dir: Path) -> int:
    counts = sorted({parts for _, parts in part_folders(out_dir).values()})
    if len(counts) != 1:
        raise ConfigError(f"shard merge: {out_dir} holds " + (f"parts of builds in {counts} parts" if counts else
                          "no part folders (part-IIIII-of-NNNNN)") + "; give --parts N")
    return counts[0]


def merge_parts(config: TrainConfig, out_dir: str | Path, parts: int | None = None, config_path: str | None = None,
                wait: float = 0, log=print) -> dict:
    """Write out_dir's manifest over the shards of its `parts` finished parts (waiting up to `wait` seconds for
    parts still building). Returns the manifest."""
    out_dir = Path(out_dir)
    parts = parts or infer_parts(out_dir)
    deadline, pause = time.monotonic() + wait, 0.25
    fingerprint = source_fingerprint(config)  # once: a stat of every source file
    while True:
        contents, waiting = finished_parts(fingerprint, out_dir, parts)
        if not waiting:
            break
        stale = [line for line in waiting if "other sources" in line]  # finished: waiting will not change them
        if stale or time.monotonic() >= deadline:
            raise InputFileError(f"shard merge: {len(waiting)} of {parts} parts are not ready: " + "; ".join(waiting))
        pause = min(2 * pause, 30.0)
        time.sleep(min(pause, max(0.1, deadline - time.monotonic())))
    shard_files, records, unused, bad = [], [], contents[0]["unused_files"], []
    for content in contents:
        folder = part_dir(out_dir, content["part"], parts)
        first = len(shard_files)
        shard_files += [folder / name for name in content["shards"]]
        count = len(content["key"])
        columns = {**{c: content[c] for c in COLUMNS},
                   **{c: content.get(c, [default] * count) for c, default in OPTIONAL_COLUMNS.items()}}
        for values in zip(*columns.values()):
            record = dict(zip(columns, values))
            record["shard"] += first
            records.append(record)
        bad += content["unreadable_images"]
    check_bad_fraction(config.data, [(b["file"], b["error"]) for b in bad], sum(c["images"] for c in contents), log)
    if not records:
        raise InputFileError("data: no image is left to build the shard set from")
    records.sort(key=lambda r: (r["bucket"], r["number"]))  # the one-process build's order (a clip's windows: stable)
    records = [{field: r[field] for field in ("key", "shard", "bucket", "concept", "mask", "reference", "clip")}
               | ({"frames": r["frames"]} if r["clip"] else {}) for r in records]
    (out_dir / MANIFEST).unlink(missing_ok=True)
    manifest = write_manifest(config, out_dir, records, contents[0]["fingerprint"], config_path, unused, bad,
                              shard_files=shard_files)
    log(f"shard set {out_dir}: {len(records)} samples in {len(shard_files)} shards of {parts} parts "
        f"({sum(s['bytes'] for s in manifest['shards']) / 1e6:.1f} MB); {len(unused)} file"
        f"{'s' if len(unused) != 1 else ''} not used, {len(bad)} unreadable")
    for line in unused_report(manifest):
        log(line)
    return manifest
