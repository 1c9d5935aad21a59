"""What a process does before another of its threads ends it with os._exit (parallel/peer_failure.py: another rank
failed and this one, blocked in a collective, is ended). os._exit runs no atexit handler, so what must still happen
is registered here too: the tracker ends its MLflow run as failed. Kept free of torch: the tracker's modules import
it."""

from __future__ import annotations

import sys
import threading

_HOOK_SECONDS = 10.0  # the most the hooks below get: one that waits on a lock the blocked main thread holds must not
# keep the rank alive

# Called once each, from the watch's thread, while the main thread is blocked elsewhere.
before_forced_exit: list = []


def run_before_forced_exit() -> None:
    def run_all():
        for hook in list(before_forced_exit):
            try:
                hook()
            except Exception as err:  # noqa: BLE001 - the rank ends either way; say what did not happen
                print(f"ot-dist: before ending: {err}", file=sys.stderr, flush=True)

    hooks = threading.Thread(target=run_all, name="ot_dist-before-forced-exit", daemon=True)
    hooks.start()
    hooks.join(_HOOK_SECONDS)
