"""Run a test helper script as N gloo ranks, forked from a process that has already imported the libraries.

What torchrun gives a rank is its environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and a process of its own; the rank then imports torch, diffusers, transformers, DeepSpeed and peft:
8-9 s of a CPU core per rank, paid twice per launch plus torchrun's own start, on a 2-core CI machine. Here the
ranks are forked from a `multiprocessing` fork server that imported those libraries once per test process (and
did nothing else: no threads, no computation), so a launch costs what the script itself does. Each rank is still
a real process with its own gloo process group over TCP. Tests of the launchers themselves (`ot-dist launch`,
torchrun's restarts and failure summary, the k8s pods) keep spawning torchrun.

Like torchrun, the launch ends when every rank has ended; when one fails, the others are killed after a grace
period (they would otherwise wait in a collective until the process-group timeout). Before a rank is killed its
Python stacks are written to its stderr (faulthandler on SIGUSR1), and a failed launch's stderr ends with a summary
of every rank (exit code, last line of output, the end of its stderr): tests keep the last few thousand characters
of the output, which would otherwise show one rank's side of a hang only."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ot_dist.ports import free_port

# Imported once by the fork server. Everything a helper script imports that is not here is imported by each rank.
PRELOAD = [
    "torch", "torch.distributed.fsdp", "diffusers", "diffusers.models.unets.unet_2d_condition",
    "diffusers.models.autoencoders.autoencoder_kl", "diffusers.models.transformers.transformer_flux",
    "diffusers.models.transformers.transformer_sd3", "transformers", "transformers.models.clip.modeling_clip",
    "transformers.models.t5.modeling_t5", "peft", "deepspeed", "safetensors.torch", "ot_dist.train.trainer",
    "ot_dist.cli",
    "frozen_preload",  # last: freezes what the imports above left (tests/frozen_preload.py)
]
_GRACE_SECONDS = 10  # after one rank failed, time the others get to write their own error before they are killed
_DUMP_SECONDS = 2  # after SIGUSR1, time a rank gets to write its stacks before it is killed
_SUMMARY_CHARS = 1500  # of each rank's stderr in a failed launch's summary


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # The server starts with one intra-op thread, as torchrun starts ranks (OMP_NUM_THREADS=1), and never
    # computes; this test process keeps its own setting. It finds frozen_preload (beside this file) on PYTHONPATH:
    # Python 3.11's fork server is handed the parent's sys.path and does not use it.
    server_env = {"OMP_NUM_THREADS": "1",
                  "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    saved = {name: os.environ.get(name) for name in server_env}
    os.environ.update(server_env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return context


def _rank_main(command: list[str], env: dict[str, str], log_prefix: str, cwd: str | None) -> None:
    """In the forked rank: the environment torchrun would set, output to the rank's log, the script (or `-m`
    module) as __main__."""
    import runpy

    os.setpgid(0, 0)  # the rank and its loader workers: one group, killed together
    # A process torchrun starts has the platform's default start method (fork on Linux with Python 3.11), not the
    # fork server's that multiprocessing gave this child: its loader workers are forked from it.
    multiprocessing.set_start_method("fork", force=True)
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(f"{log_prefix}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    for stream in (sys.stdout, sys.stderr):  # what a killed rank printed is kept
        stream.reconfigure(line_buffering=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # where a hung rank is, before its kill
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if command[0] == "-m":
        sys.argv = command[1:]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        sys.path.insert(0, str(Path(command[0]).parent))
        runpy.run_path(command[0], run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()


def run_ranks(*command: str | Path, nproc: int = 2, env: dict[str, str] | None = None, cwd: str | Path | None = None,
              timeout: float = 900, nnodes: int = 1, fork: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC COMMAND` (NPROC 1: `python COMMAND`), COMMAND being `SCRIPT ARGS` or
    `-m MODULE ARGS`, with the ranks forked from
    the preloaded server. The result holds the ranks' stdout and stderr (each rank's under a `[rank R]` header when
    there are several) and the first failing rank's exit code. NNODES > 1: the environment of `torchrun --nnodes
    NNODES --nproc-per-node NPROC` on each of NNODES "nodes" (NNODES x NPROC ranks, all on this machine).
    FORK False: each rank in a fresh interpreter, for ranks that use CUDA: the server's imports query the devices
    (DeepSpeed's among them), and a child forked after that cannot initialise CUDA ("CUDA error: initialization
    error", on a GPU lease 2026-11-28)."""
    context = _context() if fork else None
    base_env = {**os.environ, **(env or {})}
    world = nproc * nnodes
    if world > 1:  # one process is started as `python SCRIPT` would be: no process-group environment
        base_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
                         "LOCAL_WORLD_SIZE": str(nproc)})
    if not base_env.get("OMP_NUM_THREADS"):
        base_env["OMP_NUM_THREADS"] = "1"
    argv = [str(a) for a in command]
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        ranks = []
        for rank in range(world):
            rank_env = {**base_env, **({"RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "GROUP_RANK": str(rank // nproc),
                                        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world)} if world > 1 else {})}
            if fork:
                process = context.Process(target=_rank_main, args=(argv, rank_env, f"{logs}/rank-{rank}",
                                                                    None if cwd is None else str(cwd)))
                process.start()
            else:
                process = _FreshRank(argv, rank_env, f"{logs}/rank-{rank}", cwd)
            ranks.append(process)
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.exitcode is None for p in ranks):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in ranks):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + _GRACE_SECONDS):
                _kill_with_stacks([p for p in ranks if p.exitcode is None])
            for p in ranks:
                p.join(timeout=0.05)
        codes = [p.exitcode for p in ranks]
        for p in ranks:  # loader workers a killed rank left behind
            _kill_group(p.pid)
        stdout, stderr = (_joined(logs, world, stream) for stream in ("stdout", "stderr"))
        rank_outputs = [(_read(logs, r, "stdout"), _read(logs, r, "stderr")) for r in range(world)]
    if time.monotonic() > deadline:
        stderr += f"\nlaunch killed after {timeout} s\n"
    returncode = next((c for c in codes if c != 0), 0)
    if returncode != 0 and world > 1:
        stderr += _summary(rank_outputs, codes)
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


class _FreshRank:
    """A rank in a fresh interpreter, read as run_ranks reads a forked one (pid, exitcode, join), in a process group
    of its own as _rank_main makes one, so that a kill reaches its loader workers."""

    def __init__(self, argv: list[str], env: dict[str, str], log_prefix: str, cwd: str | Path | None):
        with open(f"{log_prefix}.stdout", "w") as out, open(f"{log_prefix}.stderr", "w") as err:
            self._popen = subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=out, stderr=err,
                                           process_group=0)
        self.pid = self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class ForkedCommand:
    """What a test reads of `subprocess.Popen([python, *COMMAND])` (pid, poll, send_signal, communicate, returncode)
    for one process forked from the preloaded server: a command the test signals or watches while it runs, without
    the 8-9 s of imports a fresh interpreter pays. Made by `start_command`."""

    def __init__(self, process, logs: tempfile.TemporaryDirectory, argv: list[str]):
        self.process, self.logs, self.args = process, logs, argv
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        self.process.join(timeout=0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the end (TimeoutExpired after `timeout`, the process killed with its stacks in its stderr),
        then returns its stdout and stderr, as Popen's with text=True."""
        self.process.join(timeout)
        expired = self.process.exitcode is None
        if expired:
            _kill_with_stacks([self.process])
            self.process.join()
        _kill_group(self.pid)  # loader workers it left behind
        output = (_read(self.logs.name, 0, "stdout"), _read(self.logs.name, 0, "stderr"))
        self.logs.cleanup()
        if expired:
            raise subprocess.TimeoutExpired(self.args, timeout, *output)
        return output


def start_command(*command: str | Path, env: dict[str, str] | None = None,
                  cwd: str | Path | None = None) -> ForkedCommand:
    """`subprocess.Popen([sys.executable, *COMMAND])`, COMMAND being `SCRIPT ARGS` or `-m MODULE ARGS`, forked from
    the preloaded server (run_ranks' `nproc=1`, not waited for)."""
    context = _context()
    process_env = {**os.environ, **(env or {})}
    if not process_env.get("OMP_NUM_THREADS"):
        process_env["OMP_NUM_THREADS"] = "1"
    argv = [str(a) for a in command]
    logs = tempfile.TemporaryDirectory(prefix="command-")
    process = context.Process(target=_rank_main,
                              args=(argv, process_env, f"{logs.name}/rank-0", None if cwd is None else str(cwd)))
    process.start()
    return ForkedCommand(process, logs, argv)


def _kill_with_stacks(ranks: list) -> None:
    """SIGUSR1 (each rank's faulthandler writes its Python stacks to its stderr), then the rank's whole group."""
    for p in ranks:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(_DUMP_SECONDS)
    for p in ranks:
        _kill_group(p.pid)


def _summary(rank_outputs: list[tuple[str, str]], codes: list) -> str:
    """Every rank's exit code (-9: killed by the launch, its stacks are in its stderr), last line of output and
    the end of its stderr: the one part of a failed launch the tests' assertion messages keep."""
    parts = ["\n== failed launch: every rank"]
    for rank, ((out, err), code) in enumerate(zip(rank_outputs, codes)):
        last = next((line for line in reversed(out.splitlines()) if line.strip()), "")
        parts.append(f"[rank {rank}] exit {code}; last output line: {last!r}\n{err[-_SUMMARY_CHARS:]}")
    return "\n".join(parts) + "\n"


def _read(logs: str, rank: int, stream: str) -> str:
    return Path(logs, f"rank-{rank}.{stream}").read_text(errors="replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _joined(logs: str, nproc: int, stream: str) -> str:
    texts = [_read(logs, r, stream) for r in range(nproc)]
    return texts[0] if nproc == 1 else "".join(f"[rank {r}]\n{text}\n" for r, text in enumerate(texts))
