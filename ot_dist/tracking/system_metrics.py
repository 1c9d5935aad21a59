"""MLflow's system metrics (system/cpu_utilization_percentage, system/gpu_0_utilization_percentage, ...), sampled
in the sender process: the training process spends nothing on them.

MLflow's own SystemMetricsMonitor collects and aggregates (CPU, memory, disk, network; NVIDIA GPUs through pynvml,
AMD through pyrsmi) and honours MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL, _SAMPLES_BEFORE_LOGGING and _NODE_ID; but
its thread sends each sample once and stops for good at the first failure (a server outage). Here its collectors are
driven by a thread of ours that only queues the samples; the sender delivers them with its retries, so an outage
delays them instead of ending them. Samples queued when the sender ends undelivered are lost (they are not in the
outbox: the training process never wrote them)."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

MAX_QUEUED = 10_000  # samples kept while the server is away (a day at the default 10 s)


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver on this machine (without importing torch or pynvml)."""
    try:
        return any(Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return False


class SystemMetrics:
    def __init__(self, run_id: str, uri: str, resumed: bool, notify):
        """`resumed`: the run existed before; its system metrics continue after its last step (as MLflow's
        resume_logging), instead of writing steps 0, 1, ... again."""
        import logging
        import sys

        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
        from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.ERROR)
        self.monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=uri)
        # its next step (MLflow reads the run's last system/ step in the constructor when resuming)
        self.step = self.monitor._logging_step
        has_gpu = any(isinstance(m, (GPUMonitor, ROCMMonitor)) for m in self.monitor.monitors)
        if not has_gpu and nvidia_gpu_present():
            why = ("nvidia-ml-py is not installed: pip install nvidia-ml-py" if "pynvml" not in sys.modules
                   else "NVML did not start")
            notify(f"MLflow system metrics: no GPU metrics ({why}); CPU, memory, disk and network are logged")
        prefix = "system/" + (f"{self.monitor.node_id}/" if self.monitor.node_id else "")
        self.prefix = prefix
        self.queued: collections.deque = collections.deque(maxlen=MAX_QUEUED)  # (step, timestamp_ms, {name: value})
        self._lock = threading.Lock()  # the sampling thread appends, the sender takes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="ot_dist-system-metrics", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        monitor = self.monitor
        while not self._stop.is_set():
            for _ in range(monitor.samples_before_logging):
                monitor.collect_metrics()
                if self._stop.wait(monitor.sampling_interval):
                    return
            values = monitor.aggregate_metrics()
            for collector in monitor.monitors:
                collector.clear_metrics()
            with self._lock:
                self.queued.append((self.step, int(time.time() * 1000),
                                    {self.prefix + k: v for k, v in values.items()}))
            self.step += 1

    def deliver(self, client, run_id: str) -> None:
        """Send what was sampled (a failure raises and keeps the rest for the next attempt)."""
        from mlflow.entities import Metric

        from ot_dist.tracking.outbox import METRICS_PER_REQUEST

        while True:
            with self._lock:
                queued = list(self.queued)
            if not queued:
                return
            batch, count = [], 0
            for step, timestamp, values in queued:
                if batch and count + len(values) > METRICS_PER_REQUEST:
                    break
                batch.append((step, timestamp, values))
                count += len(values)
            metrics = [Metric(k, float(v), timestamp, step) for step, timestamp, values in batch for k, v in values.items()]
            client.log_batch(run_id, metrics=metrics, synchronous=True)
            with self._lock:
                for _ in batch:
                    self.queued.popleft()

    def stop(self) -> None:
        """No more samples (the one being taken, if any, is queued before this returns)."""
        self._stop.set()
        self._thread.join(5)
