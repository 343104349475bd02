"""Per-allocation ports: the rendezvous and side-channel ports of one multi-process trial.

Determined's master hands every allocation its own ``DTRAIN_SSH_PORT``,
``INTER_TRAIN_PROCESS_COMM_PORT_1/_2`` and ``C10D_PORT`` so that two multi-slot trials on one
agent never collide. det-local's engine calls :func:`allocate_ports` when it starts a trial and
puts the result in the trial's environment (and its launch plan).

How: pick candidates at random *below the kernel's ephemeral range*
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default) and keep each one that can be
bound on every interface, holding the sockets until all are chosen so the ports are distinct.

Why below that range: between this function closing its sockets and the trial binding the ports
(a second or two later: torchrun's store on C10D_PORT, the chief's hub on
INTER_TRAIN_PROCESS_COMM_PORT_1) another process could take one. The kernel hands out ephemeral
ports to every ``bind(("", 0))`` and outgoing ``connect()`` on the machine -- gloo alone binds a
few per rank while a trial starts -- so a port the kernel chose for us and we released can be
handed straight to the next caller. A port outside the range is taken only by a program that
asks for that exact number. ``in_use`` lets the engine exclude the ports of trials it is still
running. Should a collision still happen, the trial fails at start with a message naming the
port ("cannot listen on 127.0.0.1:N" / "the rendezvous port C10D_PORT=N is in use") and is
restarted with fresh ports like any other failed start (max_restarts). Where the ephemeral range
leaves too little room below it, the kernel picks (port 0), as before.

``python3 -m det_local.launch.ports`` prints ``export NAME=PORT`` lines for a shell, chosen the
same way on the machine it runs on: a Slurm job's batch shell runs it on the allocation's first
node (the chief), since the ports the daemon chose are free on the daemon's machine, not
necessarily there (`slurm/script.py`); srun hands them to the other nodes.
"""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Collection
from pathlib import Path

#: the environment variables a trial's launchers read, in Determined's names
PORT_VARS = (
    "C10D_PORT",
    "INTER_TRAIN_PROCESS_COMM_PORT_1",
    "INTER_TRAIN_PROCESS_COMM_PORT_2",
    "DTRAIN_SSH_PORT",
)

#: Determined's fixed defaults (used when a launcher runs without det-local's ports)
DEFAULTS = {
    "C10D_PORT": 29400,
    "INTER_TRAIN_PROCESS_COMM_PORT_1": 12360,
    "INTER_TRAIN_PROCESS_COMM_PORT_2": 12376,
    "DTRAIN_SSH_PORT": 12350,
}

_ATTEMPTS = 256
#: the lowest port handed out: above the registered services most labs run (and Determined's
#: fixed defaults sit in DEFAULTS, which are skipped too)
_LOWEST = 15000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (low, high); Linux's default where it cannot be read."""
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _candidates(avoid: set[int]) -> list[int] | None:
    """Ports to try, in random order, below the ephemeral range; None if it leaves no room."""
    low, _ = ephemeral_range()
    if low - _LOWEST < 1024:
        return None
    span = range(_LOWEST, low)
    picks = random.SystemRandom().sample(span, min(len(span), _ATTEMPTS + len(avoid)))
    return [port for port in picks if port not in avoid][:_ATTEMPTS]


def _try_bind(host: str, port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def allocate_ports(in_use: Collection[int] = (), host: str = "0.0.0.0") -> dict[str, int]:
    """Four distinct free TCP ports, as {variable name: port} (see the module docstring).

    ``in_use``: ports to avoid (e.g. those of the trials the engine is running). ``host``: where
    each candidate must be bindable; the default, every interface, also rejects a port that some
    program holds on one address only."""
    held: list[socket.socket] = []
    ports: list[int] = []
    avoid = set(in_use) | set(DEFAULTS.values())
    candidates = _candidates(avoid) or [0] * _ATTEMPTS  # 0: the kernel picks
    try:
        for candidate in candidates:
            if len(ports) == len(PORT_VARS):
                break
            sock = _try_bind(host, candidate)
            if sock is None:
                continue
            held.append(sock)
            port = sock.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
        if len(ports) < len(PORT_VARS):
            raise OSError(f"could not find {len(PORT_VARS)} free TCP ports on {host}")
    finally:
        for sock in held:
            sock.close()
    return dict(zip(PORT_VARS, ports, strict=True))


def free_port() -> int:
    """One free TCP port, chosen as :func:`allocate_ports` chooses (below the ephemeral range)."""
    return allocate_ports()["C10D_PORT"]


def port_env(ports: dict[str, int]) -> dict[str, str]:
    """The ports as environment variables (strings)."""
    return {name: str(port) for name, port in ports.items()}


def main() -> int:
    """Print the four ports, chosen here, as shell ``export`` lines; 1 with one error line (the
    caller keeps the ports it had)."""
    try:
        ports = allocate_ports()
    except OSError as err:
        print(f"det-local: cannot choose ports on this machine: {err}", file=sys.stderr)
        return 1
    for name, port in ports.items():
        print(f"export {name}={port}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
