"""A rank whose work is done must exit with its code even when library teardown at interpreter exit aborts
(gloo / DeepSpeed did, now and then, after successful 2-rank runs: SIGABRT, and torchrun failed the run).
The teardown abort is stood in for by an atexit handler that aborts the process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, os, sys
from ot_dist.parallel.runtime import exit_process, start_runtime
runtime = start_runtime(1, needs_group={needs_group})
atexit.register(os.abort)  # a teardown that crashes after the work is done
print("work done")  # block-buffered into the pipe: must still arrive
{ending}
exit_process(7)
"""


def run(needs_group: bool, ending: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "0"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-c", SCRIPT.format(needs_group=needs_group, ending=ending)],
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_process_that_had_a_group_exits_with_its_code_past_a_crashing_teardown():
    done = run(needs_group=True, ending="runtime.shutdown()")
    assert done.returncode == 7, done.stderr[-2000:]
    assert done.stdout == "work done\n"


def test_a_process_without_a_group_exits_normally():
    # No process group, no skipped finalization: atexit handlers run (here the stand-in abort).
    done = run(needs_group=False)
    assert done.returncode == -6, done.stderr[-2000:]


@pytest.mark.parametrize("argv, code", [(["nosuch"], 2), (["--help"], 0)])
def test_the_command_keeps_its_exit_codes(argv, code):
    done = subprocess.run([sys.executable, "-m", "ot_dist", *argv], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]


def test_a_free_port_is_outside_the_range_outgoing_connections_take():
    """The rendezvous port is chosen below the kernel's ephemeral range: a port from that range can be taken by any
    outgoing connection (other runs' gloo connections) before the rendezvous server binds it (EADDRINUSE)."""
    import socket

    from ot_dist.ports import _ephemeral_ports, free_port

    low, high = _ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(not low <= port <= high for port in ports), (sorted(ports), low, high)
    assert len(ports) > 10  # drawn at random: concurrent launches do not all pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
