"""The compact sample index of a shard set: one column per field, memory-mapped, 28 bytes per sample.

`<set>/index/<column>.npy` (numpy's own format, read with `np.load(mmap_mode="r")`):

    shard   uint32  the sample's tar (the manifest's `shards[shard]`)
    offset  uint64  where the sample's first member header starts in it
    span    uint32  bytes from there to the end of its last member's data
    bucket  uint8   its aspect bucket (buckets.py)
    concept uint16  its concept
    flags   uint8   MASK: it has a mask; REFERENCE: it has a reference image; bits 2-5: how many more it has
    width   uint32  its image's size, where the index knows it (sets indexed from existing tars; 0 for sets
    height  uint32  `shard build` wrote: their json member holds it)

The columns are files, so every rank and loader worker of a node maps the same pages of the page cache: no
per-process copy, and a spawned loader worker pickles the folder's path, not the arrays. Everything that does not
fit a column (keys, member names and offsets, captions, metadata) is read from the tar headers and members when a
sample is loaded (tar_members.py). `SampleRecords` shows the index as the list of sample dicts the JSON manifest
held before (key, shard, bucket, concept, mask, members), one sample read on access.

Built in one pass over the samples (`IndexWriter.add`, amortised O(1)); the manifest, written after the index,
records the sample count, so a set whose index is missing or cut short is refused naming the file.
"""

from __future__ import annotations

import errno
import os
import resource
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ot_dist.data.remote import RemoteStore, is_url
from ot_dist.data.tar_members import members_between, read_member
from ot_dist.errors import InputFileError, OpenFileLimit, ShardSetChanged

INDEX_DIR = "index"
# Shard (and cache chunk) descriptors one process keeps open, the least recently read closed first. An epoch reads
# samples from every shard in a shuffled order, so an unbounded cache held one descriptor per shard and cache chunk of
# the set: a million samples with latent and text caches passed the 1024 descriptors many containers allow.
OPEN_SHARDS = 128
COLUMNS = {"shard": "<u4", "offset": "<u8", "span": "<u4", "bucket": "u1", "concept": "<u2", "flags": "u1",
           "width": "<u4", "height": "<u4"}
_ARRAY_CODES = {"<u4": "I", "<u8": "Q", "u1": "B", "<u2": "H"}
MASK = 1
REFERENCE = 2
# An edit model's second, third ... reference images (FLUX.2, Qwen-Image-Edit-2509): their count in bits 2-5, so a
# set written before (no such bits) reads as one reference per flagged sample.
MORE_REFERENCES_SHIFT, MORE_REFERENCES_MOST = 2, 15


def bytes_per_sample() -> int:
    return sum(np.dtype(d).itemsize for d in COLUMNS.values())


class IndexWriter:
    """Collects the columns sample by sample (typed arrays: 28 bytes a sample while building, not a dict)."""

    def __init__(self):
        self.columns = {name: array(_ARRAY_CODES[dtype]) for name, dtype in COLUMNS.items()}

    def __len__(self) -> int:
        return len(self.columns["shard"])

    def add(self, shard: int, offset: int, span: int, bucket: int, concept: int, mask: bool = False,
            width: int = 0, height: int = 0, reference: bool | int = False) -> None:
        """`reference`: how many reference images the sample has (a bool: one or none)."""
        c = self.columns
        c["shard"].append(shard)
        c["offset"].append(offset)
        c["span"].append(span)
        c["bucket"].append(bucket)
        c["concept"].append(concept)
        more = max(int(reference) - 1, 0)
        if more > MORE_REFERENCES_MOST:
            raise InputFileError(f"a sample with {int(reference)} reference images: the index holds at most "
                                 f"{MORE_REFERENCES_MOST + 1}")
        c["flags"].append((MASK if mask else 0) | (REFERENCE if reference else 0) | (more << MORE_REFERENCES_SHIFT))
        c["width"].append(width)
        c["height"].append(height)

    def write(self, set_dir: Path) -> int:
        """Write `<set_dir>/index/*.npy` (each through a temporary file and a rename); returns the sample count."""
        folder = Path(set_dir) / INDEX_DIR
        folder.mkdir(parents=True, exist_ok=True)
        for name, dtype in COLUMNS.items():
            values = np.frombuffer(self.columns[name], dtype=np.dtype(dtype).newbyteorder("=")).astype(dtype)
            tmp = folder / f"{name}.tmp.npy"
            np.save(tmp, values)
            os.replace(tmp, folder / f"{name}.npy")
        return len(self)


def mapped_column(path: Path, count: int, dtype: str, what: str, fix: str) -> np.ndarray:
    """A memory-mapped index column, refused naming the file (`what` PATH ...; `fix`) when it is missing, unreadable,
    cut short or of another dtype than the manifest's `count` samples of `dtype`."""
    try:
        values = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise InputFileError(f"{what} {path} is missing or unreadable ({err}); {fix}") from None
    if values.shape != (count,) or values.dtype != np.dtype(dtype):
        raise InputFileError(f"{what} {path} holds {values.shape} {values.dtype}, the manifest {count} samples of "
                             f"{dtype}; {fix}")
    return values


class SampleIndex:
    """The columns of a set, memory-mapped on first use; pickles as its folder (loader workers map their own)."""

    def __init__(self, set_dir: Path, count: int):
        self.folder, self.count = Path(set_dir) / INDEX_DIR, count
        self._columns: dict[str, np.ndarray] = {}

    def __getattr__(self, name: str) -> np.ndarray:
        if name not in COLUMNS:
            raise AttributeError(name)
        return self.column(name)

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self._columns[name] = mapped_column(
                self.folder / f"{name}.npy", self.count, COLUMNS[name], "data.shards: the sample index",
                "rebuild the set (ot-dist shard build CONFIG, or ot-dist shard index for existing tars)")
        return self._columns[name]

    def __len__(self) -> int:
        return self.count

    def __getstate__(self):
        return {"folder": self.folder, "count": self.count, "_columns": {}}

    def __setstate__(self, state):
        self.__dict__.update(state)


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Raise this process's soft limit of open files towards its hard limit (what a process may do by itself): loader
    workers, the process groups' sockets (a gloo group holds one per other rank) and the shard descriptors add up at
    scale, and containers often start processes at a soft 1024. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):  # a sandbox that refuses: the cache's bound still holds
            pass
    return soft


class ShardFiles:
    """The shards of one process: local ones by descriptor (opened lazily; `os.pread`, so forked workers may share
    them), ones named by URL by ranged reads (remote.py). A URL sample's whole span (its headers and members) is read
    in one request and held while it loads; the loader fetches the spans of micro batches ahead (hold / release)."""

    def __init__(self, remote: RemoteStore | None = None, max_open: int | None = None):
        self._fds: dict[Path, int] = {}  # in the order last read: the first is closed when a new one needs room
        self._identity: dict[Path, tuple[int, int, int, int]] = {}  # each file as first opened (a reopen compares)
        # at most a quarter of what the process may open (it has loader workers, sockets and checkpoints to open too)
        self.max_open = max_open or max(4, min(OPEN_SHARDS, raise_open_file_limit() // 4))
        self.remote = remote or RemoteStore()
        self._held: dict[str, dict[int, bytes]] = {}  # url -> {span start: its bytes}
        self._last: tuple[str, int] | None = None  # the span fetched for the sample loaded last (not fetched ahead)

    def fd(self, path: Path) -> int:
        """A descriptor of a local shard, valid until the next call opens another (read it at once: `read`)."""
        fd = self._fds.pop(path, None)
        if fd is None:
            while len(self._fds) >= max(self.max_open, 1):
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._open(path)
            self._check_unchanged(path, fd)
        self._fds[path] = fd  # now the most recently read
        return fd

    def _check_unchanged(self, path: Path, fd: int) -> None:
        """A file opened again after the cache closed it must be the one first opened: a set rebuilt in place (by
        another run of the same data) has other samples at the offsets this run's index holds."""
        stat = os.fstat(fd)
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        first = self._identity.setdefault(path, identity)
        if identity != first:
            os.close(fd)
            raise ShardSetChanged(f"data.shards: {path} was replaced while this run read it (the shard set rebuilt in "
                                  "place, by another run or `ot-dist shard build`?): its samples are no longer where "
                                  "this run's index says; resume the run to read the set as it is now")

    def _open(self, path: Path) -> int:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise InputFileError(f"data.shards: cannot open shard {path}: {err.strerror}") from None
        self.close()  # the process's other files need descriptors too: give back this cache's and try once more
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise InputFileError(f"data.shards: cannot open shard {path}: {err.strerror}") from None
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            raise OpenFileLimit(
                f"data.shards: cannot open shard {path}: {err.strerror} (open files: soft limit {soft}, hard limit "
                f"{hard}); raise the limit (`ulimit -n`, or the container runtime's nofile limit) or use fewer "
                "data.loader_workers") from None

    def read(self, location, offset: int, size: int, where: str) -> bytes:
        """Bytes [offset, offset + size) of a shard (fewer at its end): from a held span when one covers them."""
        if not is_url(location):
            return os.pread(self.fd(location), size, offset)
        for start, data in self._held.get(location, {}).items():
            if start <= offset and offset + size <= start + len(data):
                return data[offset - start:offset - start + size]
        return self.remote.read(location, offset, size, where)

    def reader(self, location, where: str):
        """read(offset, size) of one shard (tar_members' form). Never a bare descriptor: the cache may close it."""
        return lambda offset, size: self.read(location, offset, size, where)

    def hold(self, url: str, start: int, data: bytes) -> None:
        self._held.setdefault(url, {})[start] = data

    def release(self, url: str, start: int) -> None:
        self._held.get(url, {}).pop(start, None)

    def fetch(self, url: str, start: int, span: int, where: str) -> None:
        """Hold a sample's span (one ranged read unless it is held already), in place of the last one fetched so."""
        if start in self._held.get(url, {}):
            return
        if self._last is not None:
            self.release(*self._last)
        self.hold(url, start, self.remote.read(url, start, span, where))
        self._last = (url, start)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds, self._held, self._last = {}, {}, None

    def __getstate__(self):  # descriptors stay in their process; a spawned loader worker opens its own
        return {"_fds": {}, "_identity": dict(self._identity), "max_open": self.max_open, "remote": self.remote,
                "_held": {}, "_last": None}

    def __del__(self):
        self.close()


def shard_label(location) -> str:
    """A shard as errors name it: a local tar by its file name, one in a store by its whole URL."""
    return location if is_url(location) else Path(location).name


def reference_counts(flags: np.ndarray) -> np.ndarray:
    """The number of reference images of each sample whose index flags these are (0 for a sample without)."""
    flags = np.asarray(flags, dtype=np.int64)
    return np.where(flags & REFERENCE, 1 + ((flags >> MORE_REFERENCES_SHIFT) & MORE_REFERENCES_MOST), 0)


class SampleRecord(Mapping):
    """One sample as the dict the JSON manifest held: key, shard, bucket, concept, mask, reference, clip, members
    (suffix -> [data offset, size]). Columns are read from the index; key and members from the tar headers, once."""

    FIELDS = ("key", "shard", "bucket", "concept", "mask", "reference", "clip", "members")

    def __init__(self, records: SampleRecords, index: int):
        self._records, self.index = records, index
        self._walked: tuple[str, dict] | None = None

    def __getitem__(self, field: str):
        columns = self._records.index
        if field == "shard":
            return int(columns.shard[self.index])
        if field == "bucket":
            return int(columns.bucket[self.index])
        if field == "concept":
            return int(columns.concept[self.index])
        if field == "mask":
            return bool(columns.flags[self.index] & MASK)
        if field == "reference":  # how many reference images (0 without), as the build's record holds it
            return int(reference_counts(columns.flags[self.index:self.index + 1])[0])
        if field == "clip":  # a video clip's sample holds its own bytes as `clip.<extension>` (video.py)
            return any(suffix.startswith("clip.") for suffix in self["members"])
        if field == "key" and self._walked is None:
            return self._records.key(self.index)  # one header: also the key of a sample whose later members are lost
        if field in ("key", "members"):
            if self._walked is None:
                self._walked = self._records.walk(self.index)
            return self._walked[0] if field == "key" else self._walked[1]
        raise KeyError(field)

    def __iter__(self):
        return iter(self.FIELDS)

    def __len__(self) -> int:
        return len(self.FIELDS)

    def __repr__(self) -> str:
        return f"SampleRecord({dict(self)!r})"


class SampleRecords(Sequence):
    """The samples of a set as a read-only list of SampleRecord (what `manifest["samples"]` was)."""

    def __init__(self, set_dir: Path, shards: list[dict], index: SampleIndex, files: ShardFiles | None = None):
        self.dir, self.shards, self.index = Path(set_dir), shards, index
        self.files = files or ShardFiles()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of {n}")
        return SampleRecord(self, i % n)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or len(self) != len(other):
            return False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None

    def shard_path(self, shard: int) -> Path | str:
        """Where a shard is: a path (stored relative to the set's folder) or a URL, as `shard index` was given it."""
        file = self.shards[shard]["file"]
        return file if is_url(file) else self.dir / file

    def span(self, i: int) -> tuple[Path | str, int, int]:
        """(shard location, offset, bytes) of sample i's members in its tar."""
        return self.shard_path(int(self.index.shard[i])), int(self.index.offset[i]), int(self.index.span[i])

    def _source(self, i: int, where: str):
        """What tar_members reads sample i's headers from: the shard's descriptor, or its URL's span, fetched whole."""
        location, start, span = self.span(i)
        if is_url(location):
            self.files.fetch(location, start, span, where)
        return self.files.reader(location, where)

    def key(self, i: int) -> str:
        """Sample i's key, from its first member header."""
        path = self.shard_path(int(self.index.shard[i]))
        where = f"shard {shard_label(path)} sample #{i}"
        member = read_member(self._source(i, where), int(self.index.offset[i]), where)
        if member is None:
            raise InputFileError(f"{where}: the tar ends before it; rebuild the set")
        return member.key

    def walk(self, i: int) -> tuple[str, dict[str, list[int]]]:
        """(key, suffix -> [data offset, size]) of sample i, from its tar headers."""
        columns = self.index
        path = self.shard_path(int(columns.shard[i]))
        start = int(columns.offset[i])
        label = f"shard {shard_label(path)}"
        members = members_between(self._source(i, f"{label} sample #{i}"), start, start + int(columns.span[i]),
                                  label, f"#{i}")
        # members no sample owns (directories, names without a suffix, macOS tar's `._<name>` AppleDouble entries
        # between a sample's members) are skipped, as the index's scan (tar_members.samples_of) and webdataset do
        members = [m for m in members if m.key]
        keys = {m.key for m in members}
        if len(keys) != 1:
            raise InputFileError(f"{label} sample {i}: the index points at members of {sorted(keys)} at byte "
                                 f"{start}, not one sample's; the shard changed since it was indexed: rebuild the set")
        return members[0].key, {m.suffix: [m.data, m.size] for m in members}
