"""Experiment tracking (MLflow, rank 0 only) and progress on screen.

Kept light (no torch, no pydantic, no MLflow): the sender process imports this package too."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ot_dist.errors import ConfigError
from ot_dist.tracking.base import Tracker

if TYPE_CHECKING:
    from ot_dist.config.schema import TrainConfig
    from ot_dist.tracking.mlflow_tracker import SenderProcess

LOCAL_STORE = "mlflow.db"  # under output_dir: the embedded default


def local_store_uri(output_dir: str | Path) -> str:
    # SQLite: MLflow 3's own default; its file store ("./mlruns") is in maintenance mode and refuses
    # new stores unless MLFLOW_ALLOW_FILE_STORE is set.
    return f"sqlite:///{Path(output_dir).resolve() / LOCAL_STORE}"


def tracking_uri(config: TrainConfig) -> str:
    """mlflow.tracking_uri, else MLFLOW_TRACKING_URI (as in MLflow, what is set explicitly wins),
    else the local store under output_dir."""
    from ot_dist.config.schema import has_credentials

    uri = config.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri(config.output_dir)
    if has_credentials(uri):
        raise ConfigError(
            "MLFLOW_TRACKING_URI: the URI contains credentials (user:password@); remove them and set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
        )
    return uri


def experiment_name(config: TrainConfig) -> str:
    """mlflow.experiment where the config sets it, else MLFLOW_EXPERIMENT_NAME (as MLflow's own runs take it), else
    the default (ot_dist)."""
    if "experiment" in config.mlflow.model_fields_set:
        return config.mlflow.experiment
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.mlflow.experiment


def system_metrics_enabled(config: TrainConfig) -> bool:
    """mlflow.system_metrics where set, else MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING (what
    mlflow.enable_system_metrics_logging() sets) where set, else on: a training run's GPU and CPU load is what
    one looks for first when it is slow, and sampling it costs the training process nothing (the sender does it)."""
    if config.mlflow.system_metrics is not None:
        return config.mlflow.system_metrics
    value = os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    if value:
        raise ConfigError(f"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING={value!r}: MLflow takes true, false, 1 or 0")
    return True


def start_sender(config: TrainConfig, is_main: bool, log=print) -> SenderProcess | None:
    """Start the MLflow sender process of this run now, on the main rank (None elsewhere, or when
    tracking is off): its seconds of imports and store setup then overlap the model load."""
    if not config.mlflow.enabled:
        return None
    uri = tracking_uri(config)  # every rank checks, so a bad URI stops every rank alike
    system_metrics = system_metrics_enabled(config)  # (a bad MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING too)
    if not is_main:
        return None
    if importlib.util.find_spec("mlflow") is None:
        log("warning: mlflow.enabled: MLflow is not installed, this run is not tracked "
            "(pip install 'ot_dist[tracking]', or set mlflow.enabled: false)")
        return None
    from ot_dist.tracking.mlflow_tracker import SenderProcess, outbox_path

    return SenderProcess(outbox_path(Path(config.output_dir).resolve()), uri, config.mlflow.shutdown_timeout_seconds,
                         system_metrics=system_metrics)


def start_tracking(config: TrainConfig, is_main: bool, world_size: int, run_id: str | None = None,
                   step_offset: int = 0, log=print, sender: SenderProcess | None = None,
                   resumed_at_step: int | None = None) -> Tracker:
    """The tracker of this process: MLflow on the main rank, a no-op elsewhere or with mlflow.enabled
    false. `run_id` continues an earlier run, whose steps continue after `step_offset` (a checkpoint
    resume numbers its own steps: offset 0, `resumed_at_step` its first); `sender`: the one
    `start_sender` started (else it starts now). Without `run_id`, a run the caller created and named in
    MLFLOW_RUN_ID (`mlflow run`, a job scheduler; as MLflow's own start_run takes it) is the one tracked."""
    sender = sender or start_sender(config, is_main, log)
    if sender is None:
        return Tracker()
    from ot_dist.tracking.facts import flat_params, run_tags
    from ot_dist.tracking.mlflow_tracker import MlflowTracker

    output_dir = Path(config.output_dir).resolve()
    callers_run = None if run_id is not None else os.environ.get("MLFLOW_RUN_ID") or None
    tracker = MlflowTracker(
        sender.uri,
        experiment_name(config),
        config.mlflow.run_name or output_dir.name,
        sender.outbox,
        run_id=run_id or callers_run,
        step_offset=step_offset,
        artifact_location=(output_dir / "mlartifacts").as_uri() if sender.uri == local_store_uri(output_dir) else None,
        shutdown_timeout=config.mlflow.shutdown_timeout_seconds,
        sender=sender,
    )
    config_yaml = config_text(config)
    params = {**flat_params(config), "mlflow.experiment": experiment_name(config)}  # the one the run went to
    if run_id is None:
        tracker.log_params(params)
        tracker.log_text(config_yaml, "config.yaml")
    else:
        # a resumed run has them (and MLflow params never change), unless it is not in the store any more
        tracker.log_params(params, new_run_only=True)
        at = step_offset if resumed_at_step is None else resumed_at_step
        tracker.log_text(config_yaml, f"config-resumed-at-step-{at}.yaml")
    tags = run_tags(config, world_size)
    if callers_run:  # its MLflow system tags (source, user) are the caller's: `mlflow run` names the project there
        tags = {key: value for key, value in tags.items() if not key.startswith("mlflow.")}
    tracker.set_tags(tags)
    return tracker


def config_text(config: TrainConfig) -> str:
    from ot_dist.config.load import dump_config

    return dump_config(config)
