"""The files of a latent / text cache (caches.py): fixed chunks of samples, and their compact index.

    <cache>/chunk-CCCCCC.tar        samples [C*K, (C+1)*K) of the shard set (K: `chunk_size`), members named
                                    `<sample id, 10 digits>.<member>`, in the order they were encoded
    <cache>/chunk-CCCCCC.npy        where each member of the chunk lies: rows (sample id, member number, data offset,
                                    size), written before the tar is renamed into place: the tar's name commits the chunk
    <cache>/progress.json           what the chunks are of (model key, resolutions, crop, shard set, chunk size,
                                    members): chunks of anything else are cleared before caching resumes
    <cache>/index/<member>.offset.npy   uint64  where sample i's member data starts in chunk-(i // K).tar
    <cache>/index/<member>.size.npy     uint32  its size
    <cache>/manifest.json           written last, once every chunk is there: the record, the sample count

Chunks depend on the sample ids only, never on the world size, so an interrupted caching run resumes on any number
of processes, computing only the chunks that are not committed. The index is one pair of memory-mapped numpy columns
per member kind (12 bytes a sample each; a resolution's latents and the text are one member kind each), aligned with
the shard set's sample ids: every rank and loader worker of a node maps the same page-cache pages, and a spawned
worker pickles the folder's path, not the arrays. It is built in one linear pass over the chunks' `.npy` tables (no
tar is read), and an index that is missing or cut short is refused naming the file.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np

from ot_dist.data.sample_index import mapped_column
from ot_dist.errors import InputFileError

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
INDEX_DIR = "index"
COLUMNS = {"offset": "<u8", "size": "<u4"}
_BLOCK = tarfile.BLOCKSIZE


def chunk_name(chunk: int) -> str:
    return f"chunk-{chunk:06d}"


def chunk_count(samples: int, chunk_size: int) -> int:
    return -(-samples // chunk_size)


def chunk_samples(chunk: int, samples: int, chunk_size: int) -> range:
    return range(chunk * chunk_size, min(samples, (chunk + 1) * chunk_size))


def committed(cache_dir: Path, chunk: int) -> bool:
    return (cache_dir / f"{chunk_name(chunk)}.tar").is_file() and (cache_dir / f"{chunk_name(chunk)}.npy").is_file()


def column_name(member: str) -> str:
    """`1024.latent.safetensors` -> `1024.latent`: the stem of the member's index columns."""
    return member.removesuffix(".safetensors")


def prepare(cache_dir: Path, progress: dict) -> int:
    """Make the folder ready to cache into: chunks of another `progress` (another model, resolutions, chunk size,
    ...) and half-written files are removed; returns the committed chunks kept."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / PROGRESS
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        earlier = None
    stale = earlier != progress
    for old in cache_dir.iterdir():
        if ".tmp" in old.name or (stale and old.name.startswith("chunk-")):  # chunk-C.tar.tmp, chunk-C.tmp.npy
            old.unlink()
    if stale:
        tmp = path.with_name(PROGRESS + ".tmp")
        tmp.write_text(json.dumps(progress, sort_keys=True))
        os.replace(tmp, path)
    return sum(1 for _ in cache_dir.glob("chunk-*.tar"))


class ChunkWriter:
    """One chunk's tar (deterministic headers: the same samples give the same bytes) and its table of places."""

    def __init__(self, cache_dir: Path, chunk: int, members: list[str]):
        self.final = cache_dir / f"{chunk_name(chunk)}.tar"
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        self.members = {m: n for n, m in enumerate(members)}
        self.tar = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)
        self.rows: list[tuple[int, int, int, int]] = []

    def add(self, sample_id: int, members: dict[str, bytes]) -> None:
        for member, data in members.items():
            info = tarfile.TarInfo(f"{sample_id:010d}.{member}")
            info.size, info.mtime, info.mode = len(data), 0, 0o444
            self.tar.addfile(info, io.BytesIO(data))
            # after addfile the tar's offset is past the data, padded to whole blocks
            self.rows.append((sample_id, self.members[member], self.tar.offset - -(-len(data) // _BLOCK) * _BLOCK, len(data)))

    def commit(self) -> None:
        """Close the tar, write the table, then rename the tar into place (its name is the commit)."""
        self.tar.close()
        table = self.final.with_suffix(".npy")
        tmp_table = table.with_name(table.stem + ".tmp.npy")
        np.save(tmp_table, np.array(self.rows, dtype=np.uint64).reshape(-1, 4))
        os.replace(tmp_table, table)
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.final)

    def abandon(self) -> None:
        self.tar.close()
        self.tmp.unlink(missing_ok=True)


def write_index(cache_dir: Path, record: dict, samples: int, chunk_size: int, members: list[str],
                held: np.ndarray | None = None) -> None:
    """The index columns from every chunk's table (one linear pass), then the manifest. Refuses a missing chunk or
    one whose table does not cover each of its samples' members exactly once. `held`: per sample the number of
    leading members it has (a sample of a concept with fewer cached variations has fewer; size 0 in the index for
    the others); None: all of them."""
    offsets = np.zeros((len(members), samples), dtype=COLUMNS["offset"])
    sizes = np.zeros((len(members), samples), dtype=COLUMNS["size"])
    for chunk in range(chunk_count(samples, chunk_size)):
        ids = chunk_samples(chunk, samples, chunk_size)
        tar = cache_dir / f"{chunk_name(chunk)}.tar"
        if not committed(cache_dir, chunk):
            raise InputFileError(f"data: the cache chunk {tar} is missing; run again to compute it")
        rows = np.load(tar.with_suffix(".npy"), allow_pickle=False)
        sample_id, member, offset, size = rows.T
        slots = sample_id * len(members) + member
        expected = np.arange(ids.start * len(members), ids.stop * len(members), dtype=np.uint64)
        if held is not None:
            expected = expected[(expected % len(members)) < np.repeat(held[ids.start:ids.stop], len(members))]
        if rows.shape != (len(expected), 4) or not np.array_equal(np.sort(slots), expected):
            raise InputFileError(f"data: the cache chunk {tar} does not hold its samples {ids.start}-{ids.stop - 1} "
                                 f"x {members}; delete it and run again")
        if len(rows) and int((offset + size).max()) > tar.stat().st_size:
            raise InputFileError(f"data: the cache chunk {tar} is truncated; delete it and run again")
        offsets[member.astype(np.intp), sample_id.astype(np.intp)] = offset
        sizes[member.astype(np.intp), sample_id.astype(np.intp)] = size
    folder = cache_dir / INDEX_DIR
    folder.mkdir(exist_ok=True)
    for n, member in enumerate(members):
        for name, values in (("offset", offsets[n]), ("size", sizes[n])):
            tmp = folder / f"{column_name(member)}.{name}.tmp.npy"
            np.save(tmp, values)
            os.replace(tmp, folder / f"{column_name(member)}.{name}.npy")
    tmp = cache_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({**record, "chunk_size": chunk_size, "members": members, "sample_count": samples}))
    os.replace(tmp, cache_dir / MANIFEST)


class CacheIndex:
    """A cache's columns, memory-mapped (checked when opened); pickles as its folder (loader workers map their own)."""

    def __init__(self, cache_dir: Path, manifest: dict, what: str):
        self.dir, self.what = Path(cache_dir), what
        self.count, self.chunk_size = int(manifest["sample_count"]), int(manifest["chunk_size"])
        self.members = list(manifest["members"])
        self._columns: dict[str, np.ndarray] = {}
        for member in self.members:
            for name in COLUMNS:
                self.column(member, name)

    def column(self, member: str, name: str) -> np.ndarray:
        stem = f"{column_name(member)}.{name}"
        if stem not in self._columns:
            self._columns[stem] = mapped_column(self.dir / INDEX_DIR / f"{stem}.npy", self.count, COLUMNS[name],
                                                f"{self.what}: the cache index", "delete the folder to recompute the cache")
        return self._columns[stem]

    def place(self, sample: int, member: str) -> tuple[Path, int, int]:
        """(chunk tar, data offset, size) of a sample's member."""
        if member not in self.members:
            raise InputFileError(f"{self.what}: the cache {self.dir} holds no {member} (it has {self.members})")
        size = int(self.column(member, "size")[sample])
        if not size:  # a sample of a concept with fewer cached variations
            raise InputFileError(f"{self.what}: the cache {self.dir} holds no {member} of sample {sample}")
        return self.dir / f"{chunk_name(sample // self.chunk_size)}.tar", int(self.column(member, "offset")[sample]), size

    def nbytes(self) -> int:
        return sum(self.column(m, name).nbytes for m in self.members for name in COLUMNS)

    def __len__(self) -> int:
        return self.count

    def __getstate__(self):
        return {**self.__dict__, "_columns": {}}
