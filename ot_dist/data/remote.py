"""Tars in object storage (S3, GCS, R2, MinIO, plain HTTPS): ranged reads through fsspec, retried when transient.

A shard named by a URL (`s3://bucket/laion/00000.tar`, `https://host/x.tar`, any protocol fsspec knows) is read by
byte range, never downloaded whole: `fs.cat_file(path, start, end)` (an HTTP `Range` request, an S3 / GCS ranged
GET). Credentials come from where the store's own library looks (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an
instance role for s3fs, GOOGLE_APPLICATION_CREDENTIALS for gcsfs, ~/.netrc for HTTP): never from the config, which
is logged; `data.storage_options` holds the rest (an endpoint_url for MinIO / R2, a region) and is checked for keys
that look like secrets (schema.py).

Errors: a 5xx, 408 / 429 or a dropped connection is retried with growing waits (data.remote_retries tries); a
404 names the URL and sample as unreadable (the loader skips and counts it like a truncated shard); a 401 / 403
stops the run, naming the URL: no sample of that store would read. webdataset's `pipe:` URLs only stream, so they
are refused with the fsspec form to use instead.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import re
import time

from ot_dist.errors import ConfigError, InputFileError, UserError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# protocol -> the module fsspec needs for it (the extra of pyproject.toml that installs it: ot_dist/extras.py)
NEEDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}
TRANSIENT_STATUS = {408, 425, 429}  # and every 5xx
TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE,
                    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}
FIRST_WAIT_S = 0.5  # the wait after the first failure; doubled each try, up to MAX_WAIT_S
MAX_WAIT_S = 16.0
# 10 tries wait 0.5 + 1 + 2 + 4 + 8 + 16 x 4 = 79.5 s at most (jitter: 40-80 s): a store's short outage (an S3 SlowDown
# storm, a gateway restarting) is ridden out, where 5 tries (7.5 s) turned every sample read during it into a
# skipped one, enough in a minute to pass data.max_bad_fraction and stop a long run.
DEFAULT_RETRIES = 10


class RemoteAccessDenied(UserError):
    """The store refused the credentials (401 / 403): no sample would read, so the run stops (not skipped)."""

    exit_code = 3


def is_url(location) -> bool:
    """A shard named by a URL (`s3://...`, `https://...`), read through fsspec; else a local path."""
    return isinstance(location, str) and bool(_SCHEME.match(location))


def refuse_pipe(source: str, what: str) -> None:
    """webdataset's `pipe:CMD` shards are a command's output: a stream, which cannot be read by offset."""
    if isinstance(source, str) and source.startswith("pipe:"):
        raise ConfigError(
            f"{what}: {source}: a pipe: URL streams the tar through a command and cannot be read by byte offset; "
            "name the tar by its URL instead, read by range through fsspec: s3://bucket/path/x.tar, gs://..., "
            "https://... (pip install 'ot_dist[s3]' / 'ot_dist[gcs]'; an endpoint such as MinIO or R2 goes in "
            "data.storage_options.endpoint_url)")


_FILESYSTEMS: dict[tuple, object] = {}


def filesystem(url: str, storage_options: dict | None = None):
    """(fsspec filesystem, its path) for `url`, one filesystem per process and options: fsspec's async ones (HTTP,
    S3, GCS) hold an event loop that a forked loader worker cannot use, so a worker makes its own."""
    protocol = url.split("://", 1)[0].lower()
    module = NEEDS.get(protocol)
    if module is not None:
        from ot_dist.extras import missing_extra

        if (hint := missing_extra(module)) is not None:
            raise ConfigError(f"shard {url}: reading {protocol}:// URLs {hint}")
    options = storage_options or {}
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=str))
    if key not in _FILESYSTEMS:
        import fsspec.core

        try:
            _FILESYSTEMS[key] = fsspec.core.url_to_fs(url, **options)[0]
        except (ImportError, ValueError, TypeError) as err:
            raise ConfigError(f"shard {url}: fsspec cannot open {protocol}:// URLs with data.storage_options "
                              f"{sorted(options)}: {err}") from None
    fs = _FILESYSTEMS[key]
    return fs, fs._strip_protocol(url)  # the path url_to_fs gives, without making the filesystem again


def expand_url(pattern: str, storage_options: dict | None = None) -> list[str]:
    """The URLs a glob names (`s3://b/laion/*.tar`), sorted, as the store lists them; a URL without a glob as it is."""
    if not any(c in pattern for c in "*?["):
        return [pattern]
    fs, path = filesystem(pattern, storage_options)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))


def _status(err: BaseException) -> int | None:
    """The HTTP status of a store's error: aiohttp's `status`, gcsfs's `code`, botocore's response."""
    for name in ("status", "code", "status_code"):
        value = getattr(err, name, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return value if isinstance(value, int) else None
    return None


def _connection_error(err: BaseException) -> bool:
    """A dropped or timed-out connection (builtin, asyncio's, or aiohttp's own classes, which are not all OSError)."""
    if isinstance(err, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS:
        return True
    try:
        import aiohttp
    except ImportError:
        return False
    return isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def kind_of(err: BaseException) -> str:
    """`transient` (retry), `denied` (stop the run) or `missing` / `failed` (this sample is unreadable)."""
    status = _status(err)
    if isinstance(err, PermissionError) or status in (401, 403):
        return "denied"
    if isinstance(err, FileNotFoundError) or status in (404, 410):
        return "missing"
    if status is not None and (status >= 500 or status in TRANSIENT_STATUS):
        return "transient"
    if status is None and _connection_error(err):
        return "transient"
    return "failed"


def _describe(err: BaseException) -> str:
    """`HTTP 503 Service Unavailable`, or the error's own text (the URL is named by the caller)."""
    status = _status(err)
    if status is not None:
        reason = getattr(err, "message", None) or getattr(err, "reason", None)
        return f"HTTP {status}" + (f" {reason}" if isinstance(reason, str) and reason else "")
    return f"{type(err).__name__}: {err}".rstrip(": ")


class RemoteStore:
    """Ranged reads of URLs with retries; picklable (a spawned loader worker makes its own filesystem)."""

    def __init__(self, storage_options: dict | None = None, retries: int = DEFAULT_RETRIES, log=None):
        self.storage_options, self.retries = dict(storage_options or {}), retries
        self.log = log  # where retries are reported (None: quietly); never the options, which may name accounts
        self._sizes: dict[str, int] = {}

    def __getstate__(self):
        return {**self.__dict__, "log": None}

    def _call(self, what, url: str, where: str):
        """`what(fs, path)`, retried on transient errors with waits FIRST_WAIT_S, x2, ... up to MAX_WAIT_S. Errors
        start with `where` (the shard and sample), naming the URL when `where` does not."""
        where = where if url in where else f"{where}: {url}"
        for attempt in range(1, self.retries + 1):
            fs, path = filesystem(url, self.storage_options)
            try:
                return what(fs, path)
            except Exception as err:  # noqa: BLE001 - every store has its own classes; kind_of sorts them
                kind = kind_of(err)
                if kind == "denied":
                    raise RemoteAccessDenied(
                        f"{where}: access denied: {_describe(err)}; check the credentials the pods get (the "
                        "environment or the Secret of docs/kubernetes.md) and that they may read this bucket") from None
                if kind == "missing":  # (fsspec's FileNotFoundError holds only the URL, named already)
                    status = _status(err)
                    raise InputFileError(f"{where}: not found" + (f" ({_describe(err)})" if status else "")) from None
                if kind != "transient" or attempt == self.retries:
                    tries = f" after {attempt} tries" if attempt > 1 else ""
                    raise InputFileError(f"{where}: could not be read{tries}: {_describe(err)}") from None
                wait = min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                if self.log is not None:
                    self.log(f"{where}: {_describe(err)}; try {attempt + 1} of {self.retries} in {wait:.1f}s")
                time.sleep(wait)
        raise AssertionError("unreachable")

    def size(self, url: str, where: str) -> int:
        if url not in self._sizes:
            self._sizes[url] = int(self._call(lambda fs, path: fs.size(path), url, where))
        return self._sizes[url]

    def read(self, url: str, offset: int, size: int, where: str) -> bytes:
        """Bytes [offset, offset + size) of `url`, one ranged read (fewer at the end of the object)."""
        if size <= 0:
            return b""
        data = self._call(lambda fs, path: fs.cat_file(path, start=offset, end=offset + size), url, where)
        if len(data) > size:  # a server that ignores Range answers 200 with the whole object
            raise InputFileError(f"{where}: {url}: the server sent {len(data)} bytes for a range of {size}: it does not "
                                 "serve byte ranges, so the tar cannot be read by offset")
        return data

    def reader(self, url: str, where: str):
        """read(offset, size) for tar_members: past the object's end it returns what is there (b'' after it), as
        os.pread does, instead of the store's 416 (the size is asked once: a HEAD for HTTP)."""
        end = self.size(url, where)

        def read(offset: int, size: int) -> bytes:
            return self.read(url, offset, min(size, end - offset), where)

        return read


# storage option names that hold a secret (s3fs's key / secret / token, gcsfs's token, botocore's and aiohttp's
# spellings): refused in the config (schema.py), which is logged to MLflow and saved beside every checkpoint
_SECRET = re.compile(r"(^|_)(key|key_id|secret|token|password|passwd|credentials?|auth|authorization|signature)$",
                     re.I)
_NOT_SECRET_VALUES = {"anon", "google_default", "cloud", "cache"}  # gcsfs's token: where to look, not a secret


def credential_keys(options, prefix: str = "") -> list[str]:
    """The keys (dotted, nested dicts walked) of `options` that look like credentials."""
    found = []
    for name, value in (options or {}).items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict):
            found += credential_keys(value, f"{dotted}.")
        elif _SECRET.search(str(name)) and value not in (None, "", False) and value not in _NOT_SECRET_VALUES:
            found.append(dotted)
    return found
