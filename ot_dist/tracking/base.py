"""The tracker interface the trainer talks to. The base class tracks nothing: it is what
non-main ranks and untracked runs get, so they make no tracking calls at all."""

from __future__ import annotations

import json
import re


class Tracker:
    run_id: str | None = None
    step_offset = 0

    def log_metrics(self, metrics: dict[str, float], step: int, wall_time: float | None = None) -> None:
        """Values of one optimizer step (`step` counts from 1 within this run; resumed runs add an offset)."""

    def log_params(self, params: dict[str, str], new_run_only: bool = False) -> None:
        """`new_run_only`: a resumed run's params, sent only where its run is not found and a new one is made."""

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        """A text artifact (a report, a list of exported files)."""

    def log_artifact(self, local_path, artifact_dir: str) -> None:
        """A file (e.g. a sample image) as the artifact `<artifact_dir>/<its name>`; the file must stay on
        disk until the run is closed (it is sent in the background)."""

    def log_image(self, local_path, key: str, step: int) -> None:
        """A PNG the run wrote (a sample) as the image `key` at optimizer step `step`, shown per step in MLflow's image
        view (as MlflowClient.log_image(key=, step=) logs it); the file must stay on disk until the run is closed."""

    def log_dict(self, data: dict, artifact_file: str) -> None:
        """A dict as a YAML (.yaml / .yml) or JSON artifact, e.g. the bucket report."""
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2)
        self.log_text(text, artifact_file)

    def take_notices(self) -> list[str]:
        """Messages about the tracking itself (server gone, back again) for the user."""
        return []

    def close(self, status: str = "FINISHED") -> list[str]:
        """End the run (MLflow's RunStatus: FINISHED, FAILED, or KILLED for a run stopped by a signal); returns
        warnings for the user (e.g. where undelivered values went)."""
        return []

    def close_failed(self) -> None:
        """Training raised: end the run as FAILED (as MLflow ends a run left by an exception) without waiting for
        the delivery; nothing once the run is closed."""


def metric_name(name: str) -> str:
    """A name as MLflow takes it in a metric key, also after a prefix such as `validation/loss/`: letters, digits,
    _ - . / and space (any other character becomes _), and no part that MLflow's path check refuses (an empty
    part from a leading, trailing or doubled /, or a part of dots alone: "faces/", "a//b", ".."); such a part is
    dropped or becomes _."""
    parts = re.sub(r"[^A-Za-z0-9_\-. /]", "_", name).split("/")
    kept = [part if part.strip(".") else "_" * len(part) for part in parts if part]
    return "/".join(kept) or "_"
