"""Run the worker group of `ot-dist launch` (accelerate -> torchrun's agent -> one worker per rank) so that a
signal to the launcher stops the run the way a signal to `ot-dist train` does, and nothing is left behind.

The agent runs in its own session, so a terminal's Ctrl-C reaches only the launcher (torchrun's agent
would otherwise catch it too, give the workers 30 s, kill them and exit 1 with a SignalException
traceback). On the first SIGTERM / SIGINT the launcher sends that signal to every worker (the agent's
children; torchrun starts each in a session of its own, so only a direct signal reaches them): each
finishes its optimizer step, saves the checkpoint, exits 0, the agent then exits 0 and so does the
launcher, with one line. A second signal kills the group at once (exit 130). Workers that appear after
a stop was asked for (a restart under --max-restarts) end the agent. When the launcher returns for any
reason the agent and every worker it saw are gone; if the launcher itself is killed, the agent gets
SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops its workers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

POLL_SECONDS = 0.2
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from /proc; None when it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def children(pid: int) -> dict[int, int]:
    """pid -> start time of the live children of `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat and stat[0] == pid:
                found[int(entry.name)] = stat[1]
    return found


def _send(pid: int, started: int, sig: int) -> None:
    stat = _stat(pid)
    if stat and stat[1] == started:  # still that process, not a new one with the same pid
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_worker_group(command: list[str], env: dict, log=print) -> int:
    received: list[int] = []

    def record(signum, _frame) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in SIGNALS}
    agent = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    workers: dict[int, int] = {}  # every worker seen: pid -> start time
    signalled: set[int] = set()
    handled = 0
    try:
        while True:
            try:
                code = agent.wait(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            current = children(agent.pid)
            workers.update(current)
            if len(received) > handled:
                handled = len(received)
                if handled == 1:
                    name = signal.Signals(received[0]).name
                    log(f"ot-dist launch: {name}: asking the {len(current)} worker(s) to finish their step and save")
                    for pid, started in current.items():
                        _send(pid, started, received[0])
                    signalled |= set(current)
                    if not current:  # nothing trains yet: nothing to save
                        agent.terminate()
                else:
                    log("ot-dist launch: interrupted again: stopping the workers now")
                    _kill_all(agent, workers)
            elif handled and set(current) - signalled:  # restarted after the stop: do not train on
                agent.terminate()
                signalled |= set(current)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _kill_all(agent, workers, grace=10)
    if not received:
        return code
    name = signal.Signals(received[0]).name
    if len(received) > 1:
        return 130
    if code == 0:
        log(f"ot-dist launch: stopped by {name}; the workers saved a checkpoint (continue with --resume auto)")
        return 0
    log(f"ot-dist launch: stopped by {name}, but the worker group exited with {code}")
    return code


def _kill_all(agent: subprocess.Popen, workers: dict[int, int], grace: float = 0) -> None:
    """End the agent (SIGTERM, then SIGKILL after `grace` seconds) and every worker seen that is still alive."""
    if agent.poll() is None:
        if grace:
            agent.terminate()
            try:
                agent.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    deadline = time.monotonic() + grace
    for pid, started in workers.items():
        while grace and _stat(pid) and _stat(pid)[1] == started and time.monotonic() < deadline:
            time.sleep(0.1)
        _send(pid, started, signal.SIGKILL)
