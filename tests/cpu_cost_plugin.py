"""A pytest plugin that appends, per test, `NODEID<TAB>wall s<TAB>CPU s` to $CPU_COST_OUT (default cpu_cost.tsv): the
CPU of the test's whole process tree, so a test's cost can be compared on a loaded machine, where wall time says little.

    PYTHONPATH=tests CPU_COST_OUT=/tmp/cost.tsv .venv/bin/python -m pytest -q -p cpu_cost_plugin tests/test_cli.py

The tree is this process and the children it reaped, plus every live descendant (a fork server, its forked ranks,
their loader workers) with the children each of them reaped, read from /proc before and after the test. A process
that ends during the test moves from "live" into its parent's reaped total, so the difference still counts it.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None  # ended meanwhile


def tree_cpu_seconds() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    children: dict[int, list[tuple[int, list[str]]]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append((int(pid), fields))
    pending = [os.getpid()]
    while pending:
        for pid, fields in children.get(pending.pop(), []):
            # utime, stime, cutime, cstime (proc(5) fields 14-17; here counted from field 3, the state)
            total += sum(int(v) for v in fields[11:15]) / _TICKS_PER_SECOND
            pending.append(pid)
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.monotonic(), tree_cpu_seconds()
    yield
    wall, cpu = time.monotonic() - wall, tree_cpu_seconds() - cpu
    with open(os.environ.get("CPU_COST_OUT", "cpu_cost.tsv"), "a") as f:
        f.write(f"{item.nodeid}\t{wall:.1f}\t{cpu:.1f}\n")
