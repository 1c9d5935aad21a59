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
from dataclasses import dataclass

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


def read_member(fd: int, offset: int, where: str) -> Member | None:
    """The member whose header starts at `offset` (None at the end-of-archive blocks or the end of the file).
    `where` names the file (and sample) in errors."""
    start, name, size = offset, None, None
    while True:
        block = os.pread(fd, BLOCK, offset)
        if not block and name is None and offset == start:
            return None
        if len(block) < BLOCK:
            raise InputFileError(f"{where}: truncated tar (a header at byte {offset} is cut off)")
        if block == b"\0" * BLOCK:
            if name is not None:
                raise InputFileError(f"{where}: truncated tar (an extended header at byte {start} has no member)")
            return None
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as err:
            raise InputFileError(f"{where}: not a readable tar header at byte {offset} ({err}; a compressed tar "
                                 "(.tar.gz) cannot be read by offset: decompress it)") from None
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME):
            data = os.pread(fd, info.size, offset + BLOCK)
            if len(data) < info.size:
                raise InputFileError(f"{where}: truncated tar (an extended header at byte {offset} is cut off)")
            if info.type == tarfile.GNUTYPE_LONGNAME:
                name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type != tarfile.XGLTYPE:  # global PAX headers carry no per-member path or size
                fields = _pax_fields(data)
                name = fields.get("path", name)
                size = int(fields["size"]) if "size" in fields else size
            offset += BLOCK + -(-info.size // BLOCK) * BLOCK
            continue
        name = name if name is not None else info.name
        size = size if size is not None else info.size
        if info.type not in _FILE_TYPES:  # a directory, link, ...: no data of a sample
            return Member("", name, start, offset + BLOCK, size if info.type not in (tarfile.DIRTYPE,) else 0)
        key_suffix = split_name(name)
        key, suffix = key_suffix if key_suffix else ("", name)
        return Member(key, suffix, start, offset + BLOCK, size)


def members_between(fd: int, start: int, end: int, where: str, sample: str = "") -> list[Member]:
    """The members whose headers start in [start, end): one sample's when the index gives its span. Errors name
    `where` (the shard) and the sample's key once its first header is read (else `sample`)."""
    out, offset = [], start
    try:
        while offset < end:
            member = read_member(fd, offset, where)
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


def iter_members(fd: int, where: str):
    """Every member of a whole tar, in order, up to its end-of-archive blocks."""
    offset = 0
    while True:
        member = read_member(fd, offset, where)
        if member is None:
            return
        yield member
        offset = member.end


@dataclass(frozen=True)
class SampleSpan:
    """One sample's run of consecutive members in a tar: where its first header starts, where its last data ends."""
    key: str
    start: int
    end: int
    members: dict[str, list[int]]  # suffix -> [data offset, size]


def samples_of(fd: int, where: str):
    """A whole tar's samples (consecutive members of one key, as webdataset groups them) in order; members that
    are no sample's (directories, names without a suffix) are skipped."""
    current: SampleSpan | None = None
    for member in iter_members(fd, where):
        if not member.key:
            continue
        if current is not None and member.key == current.key:
            current.members[member.suffix] = [member.data, member.size]
            current = SampleSpan(current.key, current.start, member.data + member.size, current.members)
            continue
        if current is not None:
            yield current
        current = SampleSpan(member.key, member.header, member.data + member.size,
                             {member.suffix: [member.data, member.size]})
    if current is not None:
        yield current
