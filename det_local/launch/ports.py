"""Per-allocation ports: the rendezvous and side-channel ports of one multi-process trial.

Determined's master hands every allocation its own ``DTRAIN_SSH_PORT``,
``INTER_TRAIN_PROCESS_COMM_PORT_1/_2`` and ``C10D_PORT`` so that two multi-slot trials on one
agent never collide. det-local's engine calls :func:`allocate_ports` when it starts a trial and
puts the result in the trial's environment (and its launch plan).

How: bind port 0 on 127.0.0.1 once per port (the kernel picks a free one), holding every socket
until all are chosen so the ports are distinct, then close them and return the numbers.

The race, and why it is acceptable: between this function closing its sockets and the trial
binding the ports (a second or two later: torchrun's store on C10D_PORT, the chief's hub on
INTER_TRAIN_PROCESS_COMM_PORT_1) another process may take one of them. The kernel hands out
ephemeral ports in rotation, so reuse within seconds is unlikely, and ``in_use`` lets the engine
exclude the ports of trials it is still running (which are bound for the life of the trial, so
the kernel would not hand them out anyway, but may be between runs). If it does happen, the
trial fails at start with a message naming the port ("cannot listen on 127.0.0.1:N" /
torchrun's "address already in use") and is restarted with fresh ports like any other failed
start (max_restarts).
"""

from __future__ import annotations

import socket
from collections.abc import Collection

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

_ATTEMPTS = 64


def allocate_ports(in_use: Collection[int] = (), host: str = "127.0.0.1") -> dict[str, int]:
    """Four distinct free TCP ports, as {variable name: port} (see the module docstring).

    ``in_use``: ports to avoid (e.g. those of the trials the engine is running)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    avoid = set(in_use)
    try:
        for _ in range(_ATTEMPTS):
            if len(ports) == len(PORT_VARS):
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
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


def port_env(ports: dict[str, int]) -> dict[str, str]:
    """The ports as environment variables (strings)."""
    return {name: str(port) for name, port in ports.items()}
