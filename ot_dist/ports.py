"""A free TCP port for a rendezvous. Its own module, free of torch: `ot-dist launch` picks the port in a process
that only waits for its workers, and importing torch there (through ot_dist.parallel) cost every launch ~2.6 s of
CPU."""

from __future__ import annotations

from pathlib import Path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous the launcher or a test sets up).

    Drawn at random below the kernel's ephemeral range: a port from that range (what binding port 0 returns) can be
    handed to any outgoing connection on the machine (gloo's and NCCL's connections, other runs' ranks) between
    this check and the rendezvous server's bind, which then fails with EADDRINUSE; a port below it is only ever
    taken by an explicit bind."""
    import random
    import socket

    lowest_ephemeral = _ephemeral_ports()[0]
    candidates = random.Random().sample(range(20000, lowest_ephemeral), 50) if lowest_ephemeral > 21000 else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no port free below the range (or no room): let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; elsewhere the IANA range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535
