"""What is waiting to reach MLflow: metric points, params, tags, text artifacts and files, held until a send
succeeds. The training thread only appends; the sender thread removes what the server took."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

# MLflow's per-request limits (mlflow.utils.validation: MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH).
METRICS_PER_REQUEST = 1000
PARAMS_PER_REQUEST = 100


@dataclass
class Point:
    key: str
    value: float
    timestamp_ms: int
    step: int


@dataclass
class Contents:
    metrics: list[Point] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)  # artifact file -> text
    files: dict[str, str] = field(default_factory=dict)  # artifact file -> local path (e.g. sample images)

    def __bool__(self) -> bool:
        return bool(self.metrics or self.params or self.tags or self.artifacts or self.files)

    def summary(self) -> str:
        kinds = [(len(self.metrics), "metric points"), (len(self.params), "params"), (len(self.tags), "tags"),
                 (len(self.artifacts), "artifacts"), (len(self.files), "files")]
        return ", ".join(f"{n} {name}" for n, name in kinds if n)

    def write_json(self, path: Path, about: dict) -> None:
        data = {
            **about,
            "metrics": [vars(p) for p in self.metrics],
            "params": self.params,
            "tags": self.tags,
            "artifacts": self.artifacts,
            "files": self.files,  # still on disk at these paths
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


class Outbox:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = Contents()
        self.rejected = Contents()  # refused by the server (a 4xx): never retried, kept for the fallback
        self.taken = False  # once the fallback took everything, late sender results change nothing

    def add_metrics(self, points: list[Point]) -> None:
        with self.lock:
            self.pending.metrics.extend(points)

    def add_params(self, params: dict[str, str]) -> None:
        with self.lock:
            self.pending.params.update(params)

    def add_tags(self, tags: dict[str, str]) -> None:
        with self.lock:
            self.pending.tags.update(tags)

    def add_artifact(self, artifact_file: str, text: str) -> None:
        with self.lock:
            self.pending.artifacts[artifact_file] = text

    def add_file(self, artifact_file: str, local_path: str) -> None:
        with self.lock:
            self.pending.files[artifact_file] = local_path

    # -- the sender's side ---------------------------------------------------------------------
    def next_batch(self) -> Contents:
        """The oldest items, at most one request's worth of each kind (not removed yet)."""
        with self.lock:
            pending = self.pending
            return Contents(
                metrics=pending.metrics[:METRICS_PER_REQUEST],
                params=dict(list(pending.params.items())[:PARAMS_PER_REQUEST]),
                tags=dict(list(pending.tags.items())[:PARAMS_PER_REQUEST]),
                artifacts=dict(list(pending.artifacts.items())[:1]),
                files=dict(list(pending.files.items())[:1]),
            )

    def remove(self, batch: Contents, rejected: bool = False) -> None:
        """Drop a batch the server took (or refused for good: then it is kept aside)."""
        with self.lock:
            if self.taken:
                return
            pending = self.pending
            del pending.metrics[: len(batch.metrics)]  # only the sender removes, and always from the head
            for kind in ("params", "tags", "artifacts", "files"):
                for key in getattr(batch, kind):
                    getattr(pending, kind).pop(key, None)
            if rejected:
                self.rejected.metrics.extend(batch.metrics)
                for kind in ("params", "tags", "artifacts", "files"):
                    getattr(self.rejected, kind).update(getattr(batch, kind))

    def take_all(self) -> Contents:
        """Everything not delivered (pending and refused), for the fallback; the sender is done."""
        with self.lock:
            self.taken = True
            left = Contents(
                metrics=self.rejected.metrics + self.pending.metrics,
                params={**self.rejected.params, **self.pending.params},
                tags={**self.rejected.tags, **self.pending.tags},
                artifacts={**self.rejected.artifacts, **self.pending.artifacts},
                files={**self.rejected.files, **self.pending.files},
            )
            self.pending, self.rejected = Contents(), Contents()
            return left

    def is_empty(self) -> bool:
        with self.lock:
            return not self.pending
