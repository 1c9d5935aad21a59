"""Reading tar headers by offset: the members of one sample (or of a whole tar) without tarfile's member list.

A shard set's index keeps, per sample, only where its members start in the tar and how many bytes they span
(sample_index.py); the member names, offsets and sizes are read back here from the tar headers when a sample is
loaded: a few 512-byte reads (`os.pread`: no shared file position, so forked loader workers can share a
descriptor). USTAR, GNU long names and PAX headers (what Python's tarfile, hence webdataset's TarWriter, writes
for long or non-ASCII names) are understood; a compressed tar cannot be read by offset and is refused.
Member names split into key and suffix as webdataset groups them: the key is the path up to the first dot of the
file name (`dir/000123.jpg` -> `dir/000123`, `jpg`).
"""

from __future__ import annotations

import os
import re
import tarfile
from dataclasses import dataclass, field

from ot_dist.errors import InputFileError

BLOCK = 512
_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # webdataset's base_plus_ext: key, then suffix
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)


@dataclass(frozen=True)
class Member:
    key: str
    suffix: str
    header: int  # offset of its first header block (a PAX / long-name header when it has one)
    data: int  # offset of its data
    size: int

    @property
    def end(self) -> int:
        """Offset after its data, padded to the block size: where the next header starts."""
        return self.data + -(-self.size // BLOCK) * BLOCK


def split_name(name: str) -> tuple[str, str] | None:
    """(key, suffix) as webdataset groups members; None for a name without a suffix (not a sample's member)."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def _pax_fields(data: bytes) -> dict[str, str]:
    """The records of a PAX extended header: `<length> <keyword>=<value>\\n` each."""
    fields, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] not in (b"", b"\0"):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        keyword, _, value = data[space + 1:pos + length - 1].partition(b"=")
        fields[keyword.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return fields


def _number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256, for sizes of 8 GB and more
        return tarfile.nti(field)
    field = field.split(b"\0", 1)[0].strip()
    return int(field, 8) if field else 0


def _header(block: bytes, where: str, offset: int) -> tuple[str, int, bytes]:
    """(name, size, type) of a tar header block, its checksum checked (tarfile.TarInfo.frombuf's rules, at a
    fraction of its cost: a scan of millions of members reads only these fields)."""
    try:
        checksum = _number(block[148:156])
        size = _number(block[124:136])
    except ValueError:
        checksum, size = -1, 0
    if checksum != sum(block) - sum(block[148:156]) + 256:
        raise InputFileError(f"{where}: not a readable tar header at byte {offset} (bad checksum; a compressed tar "
                             "(.tar.gz) cannot be read by offset: decompress it)")
    name = block[:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix and block[257:263] != b"ustar ":  # GNU tars use those bytes for times, not a prefix
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size, block[156:157] or tarfile.REGTYPE


def pread_of(fd: int):
    return lambda offset, size: os.pread(fd, size, offset)


def reader_of(source):
    """read(offset, size) of a tar: `source` is a descriptor (os.pread) or already such a function (a ranged read of
    a URL, remote.py)."""
    return pread_of(source) if isinstance(source, int) else source


class Window:
    """Reads of a tar scanned front to back: 64 KB at a time, so small members cost no system call (or, for a URL,
    no request) each, and a large one costs one 64 KB read for its header."""

    def __init__(self, source, size: int = 1 << 16):
        self.read, self.size, self.start, self.data = reader_of(source), size, 0, b""

    def __call__(self, offset: int, size: int) -> bytes:
        if not (self.start <= offset and offset + size <= self.start + len(self.data)):
            self.start, self.data = offset, self.read(offset, max(size, self.size))
        return self.data[offset - self.start:offset - self.start + size]


def read_member(read, offset: int, where: str) -> Member | None:
    """The member whose header starts at `offset` (None at the end-of-archive blocks or the end of the file).
    `read(offset, size)` reads the tar (`pread_of(fd)`); `where` names the file (and sample) in errors."""
    read = reader_of(read)
    start, name, size = offset, None, None
    while True:
        block = read(offset, BLOCK)
        if not block and name is None and offset == start:
            return None
        if len(block) < BLOCK:
            raise InputFileError(f"{where}: truncated tar (a header at byte {offset} is cut off)")
        if not any(block):
            if name is not None:
                raise InputFileError(f"{where}: truncated tar (an extended header at byte {start} has no member)")
            return None
        header_name, header_size, kind = _header(block, where, offset)
        if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME):
            data = read(offset + BLOCK, header_size)
            if len(data) < header_size:
                raise InputFileError(f"{where}: truncated tar (an extended header at byte {offset} is cut off)")
            if kind == tarfile.GNUTYPE_LONGNAME:
                name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind != tarfile.XGLTYPE:  # global PAX headers carry no per-member path or size
                fields = _pax_fields(data)
                name = fields.get("path", name)
                size = int(fields["size"]) if "size" in fields else size
            offset += BLOCK + -(-header_size // BLOCK) * BLOCK
            continue
        name = name if name is not None else header_name
        size = size if size is not None else header_size
        if kind not in _FILE_TYPES:  # a directory, link, ...: no data of a sample
            return Member("", name, start, offset + BLOCK, 0 if kind == tarfile.DIRTYPE else size)
        key_suffix = split_name(name)
        key, suffix = key_suffix if key_suffix else ("", name)
        return Member(key, suffix, start, offset + BLOCK, size)


def members_between(source, start: int, end: int, where: str, sample: str = "") -> list[Member]:
    """The members whose headers start in [start, end): one sample's when the index gives its span. `source`: a
    descriptor or a read function (reader_of). Errors name `where` (the shard) and the sample's key once its first
    header is read (else `sample`)."""
    out, offset, read = [], start, reader_of(source)
    try:
        while offset < end:
            member = read_member(read, offset, where)
            if member is None:
                raise InputFileError(f"{where}: truncated tar (the archive ends at byte {offset}, before {end})")
            out.append(member)
            offset = member.end
    except InputFileError as err:
        name = out[0].key if out else sample
        if not name:
            raise
        raise InputFileError(str(err).replace(where, f"{where} sample {name}", 1)) from None
    return out


def iter_members(source, where: str):
    """Every member of a whole tar (a descriptor or a read function), in order, up to its end-of-archive blocks."""
    offset, read = 0, Window(source)
    while True:
        member = read_member(read, offset, where)
        if member is None:
            return
        yield member
        offset = member.end


@dataclass
class SampleSpan:
    """One sample's run of consecutive members in a tar: where its first header starts, where its last data ends."""
    key: str
    start: int
    end: int
    members: dict[str, list[int]]  # suffix -> [data offset, size]
    repeated: list[str] = field(default_factory=list)  # suffixes met again (lower-case): webdataset refuses those


def samples_of(source, where: str):
    """A whole tar's samples (consecutive members of one key, as webdataset groups them) in order; members that
    are no sample's (directories, names without a suffix) are skipped."""
    current: SampleSpan | None = None
    for member in iter_members(source, where):
        if not member.key:
            continue
        if current is not None and member.key == current.key:
            if member.suffix.lower() in {suffix.lower() for suffix in current.members}:
                current.repeated.append(member.suffix.lower())
            current.members[member.suffix] = [member.data, member.size]
            current.end = member.data + member.size
            continue
        if current is not None:
            yield current
        current = SampleSpan(member.key, member.header, member.data + member.size,
                             {member.suffix: [member.data, member.size]})
    if current is not None:
        yield current
