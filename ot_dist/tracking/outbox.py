"""The outbox: everything a run logs to MLflow, as JSON lines appended to a file in the output
directory. The training process only appends to it (microseconds, no MLflow); the sender process
reads it and delivers it in order, noting how far it got in a small `.sent` file next to it. A file
that was not delivered completely stays where it is, and `python -m ot_dist.tracking.replay FILE`
delivers the rest later: nothing logged is lost with the server, nor with the sender.

Records, by "kind": "run" (the first line: where the run goes), "metrics" (one step's values),
"params", "tags", "text" (a text artifact), "file" (a file artifact by its path, e.g. a sample image
the run wrote under output_dir), "image" (a PNG the run wrote, by its path, shown per step in MLflow's image view:
key, step, timestamp_ms), "end" (the run's final status). Plain JSON and the
standard library only: the sender imports this before MLflow, the training process never imports
MLflow at all."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# MLflow's per-request limits (mlflow.utils.validation: MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH,
# MAX_ENTITIES_PER_BATCH).
METRICS_PER_REQUEST = 1000
PARAMS_PER_REQUEST = 100  # and tags
ENTITIES_PER_REQUEST = 1000
OUTBOX_FOLDER = "mlflow-outbox"  # in the output directory
BATCHED = ("metrics", "params", "tags")  # kinds that go in one log_batch request together

Record = dict
Entry = tuple[int, Record]  # (the file offset just after the record, the record)


class OutboxWriter:
    """The training process's side: append one record per call, flushed to the OS at once (a crash
    of this process loses nothing written)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 - open for the run's lifetime
        self._lock = threading.Lock()
        self.size = self._file.tell()

    def add(self, record: Record) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line)
            self._file.flush()
            self.size += len(line)

    def add_values(self, kind: str, values: dict[str, str], new_run_only: bool = False) -> None:
        """Params or tags, split so that each record fits one request. `new_run_only`: sent only if the run is
        created by the delivery (a resumed run's params: the run has them, unless it is not in the store)."""
        items = list(values.items())
        for start in range(0, len(items), PARAMS_PER_REQUEST):
            record = {"kind": kind, "values": dict(items[start:start + PARAMS_PER_REQUEST])}
            self.add({**record, "new_run_only": True} if new_run_only else record)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()


def read_records(path: Path, offset: int) -> list[Entry]:
    """The complete records after `offset` (a line still being written is left for later)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    entries, position = [], offset
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        position += len(line)
        entries.append((position, json.loads(line)))
    return entries


def requests(entries: list[Entry]) -> Iterator[list[Entry]]:
    """The entries grouped as MLflow requests: consecutive metrics/params/tags in one log_batch
    within MLflow's limits; any other record alone."""
    batch: list[Entry] = []
    counts: Counter = Counter()
    for entry in entries:
        record = entry[1]
        kind = record["kind"]
        if kind not in BATCHED:
            if batch:
                yield batch
                batch, counts = [], Counter()
            yield [entry]
            continue
        n = len(record["values"])
        limit = METRICS_PER_REQUEST if kind == "metrics" else PARAMS_PER_REQUEST
        if batch and (counts[kind] + n > limit or sum(counts.values()) + n > ENTITIES_PER_REQUEST):
            yield batch
            batch, counts = [], Counter()
        batch.append(entry)
        counts[kind] += n
    if batch:
        yield batch


def summary(records: list[Record]) -> str:
    """"20 metric points, 131 params, ..." for messages."""
    counts: Counter = Counter()
    for record in records:
        kind = record["kind"]
        if kind in BATCHED:
            counts[kind] += len(record["values"])
        elif kind in ("text", "file"):
            counts["artifacts"] += 1
        elif kind == "image":
            counts["images"] += 1
    names = {"metrics": "metric points", "params": "params", "tags": "tags", "artifacts": "artifacts", "images": "images"}
    return ", ".join(f"{counts[k]} {name}" for k, name in names.items() if counts[k]) or "nothing"


# -- how far delivery got: {"uri", "run_id", "offset"} in FILE.sent ---------------------------------
def sent_path(path: Path) -> Path:
    return path.with_name(path.name + ".sent")


def run_note_path(path: Path) -> Path:
    """FILE.run: the id of the run FILE's values went into, kept after delivery (a checkpoint saved before
    the run existed finds its run here on resume)."""
    return path.with_name(path.name + ".run")


def remembered_run(path: Path) -> str | None:
    try:
        return run_note_path(path).read_text().strip() or None
    except OSError:
        return None


def refused_path(path: Path) -> Path:
    """Records the server refused (a 4xx answer): kept, never sent again."""
    return path.with_name(path.name + ".refused")


def read_sent(path: Path) -> dict:
    try:
        return json.loads(sent_path(path).read_text())
    except (OSError, ValueError):
        return {}


def write_sent(path: Path, uri: str, run_id: str | None, offset: int, new_run: bool = False) -> None:
    target = sent_path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"uri": uri, "run_id": run_id, "offset": offset, "new_run": new_run}))
    tmp.replace(target)


def remove_delivered(path: Path) -> None:
    """Everything reached MLflow: the outbox and its progress note go."""
    for file in (path, sent_path(path)):
        file.unlink(missing_ok=True)
    if path.parent.name == OUTBOX_FOLDER:
        try:
            path.parent.rmdir()  # unless other runs left files there
        except OSError:
            pass
