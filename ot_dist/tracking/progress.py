"""Progress on screen (rank 0): a tqdm bar on a terminal; periodic plain lines otherwise (CI,
Kubernetes logs), where a redrawn bar would be one endless line."""

from __future__ import annotations

import math
import os
import sys
import time

# Used when the terminal reports no size (0 columns: some container ttys, `kubectl exec -t` before the first
# resize): tqdm would take it literally, width -1 and height -1, and draw nothing.
FALLBACK_SIZE = (120, 24)


def format_number(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def rates_text(metrics: dict[str, float]) -> str:
    parts = [f"{key}={value:.3g}" for key, value in metrics.items() if key.startswith("lr/")]
    parts += [f"d*lr/{key[5:]}={value:.3g}" for key, value in metrics.items() if key.startswith("d_lr/")]
    return " ".join(parts)


def reports_no_size(stream) -> bool:
    """The terminal answers with 0 columns or rows (one that does not answer leaves tqdm unbounded, which works)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, AttributeError, ValueError):
        return False
    return size.columns <= 0 or size.lines <= 0


class Progress:
    def __init__(self, total_steps: int, epochs: int, log=print, stream=None, enabled: bool = True, first_step: int = 0):
        self.total_steps, self.epochs, self.log = total_steps, epochs, log
        self.first_step, self.started = first_step, time.perf_counter()
        stream = stream or sys.stdout
        self.bar = None
        if enabled and stream.isatty():
            from tqdm import tqdm

            size = dict(zip(("ncols", "nrows"), FALLBACK_SIZE)) if reports_no_size(stream) else {"dynamic_ncols": True}
            self.bar = tqdm(total=total_steps, initial=first_step, file=stream, unit="step", desc=f"epoch 1/{epochs}",
                            **size)

    def step(self, step: int) -> None:
        """Every optimizer step: moves the bar (and its ETA); no device values needed."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def window(self, step: int, epoch: int, loss: float, metrics: dict[str, float], samples_per_s: float) -> None:
        """At each log point: loss (mean over the window), learning rates, throughput."""
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch + 1}/{self.epochs}", refresh=False)
            self.bar.set_postfix_str(f"loss {format_number(loss)} {rates_text(metrics)} {samples_per_s:.2f} samples/s")
            self.step(step)
            return
        self.log(
            f"step {step}/{self.total_steps} epoch {epoch + 1}/{self.epochs} loss {format_number(loss)} "
            f"(mean since last line) {rates_text(metrics)} {samples_per_s:.2f} samples/s eta {self.eta(step)}"
        )

    def eta(self, step: int) -> str:
        done = step - self.first_step
        if done <= 0:
            return "?"
        remaining = (time.perf_counter() - self.started) / done * max(self.total_steps - step, 0)
        minutes, seconds = divmod(int(remaining), 60)
        return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"

    def write(self, message: str) -> None:
        """A message that must not tear the bar."""
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.log(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
