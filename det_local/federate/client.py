"""The CLI's side of the cluster socket: one request, one answer, blocking, no asyncio."""

from __future__ import annotations

import socket
from typing import Any

from det_local.errors import DetLocalError
from det_local.store.paths import Paths

TIMEOUT_S = 15.0
MAX_ANSWER = 64 * 1024 * 1024


class NoDaemon(DetLocalError):
    pass


def request(paths: Paths, msg: dict[str, Any], timeout: float = TIMEOUT_S) -> Any:
    """Send `msg` to this home's daemon; its `value`, or DetLocalError with its one line."""
    from det_local.wire import rpc

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(paths.cluster_socket))
        except (FileNotFoundError, ConnectionRefusedError):
            raise NoDaemon(
                f"no det-local daemon is running for {paths.home} (`det-local daemon start`)"
            ) from None
        except PermissionError:
            raise DetLocalError(
                f"cannot open {paths.cluster_socket}: permission denied (run as the daemon's "
                "user, or as root)"
            ) from None
        rpc.send(sock, msg)
        try:
            answer = rpc.recv(sock)
        except (TimeoutError, OSError) as err:
            raise DetLocalError(f"the daemon did not answer ({err})") from None
    finally:
        sock.close()
    if answer is None:
        raise DetLocalError("the daemon closed the cluster socket without an answer")
    if answer.get("error"):
        raise DetLocalError(str(answer["error"]))
    return answer.get("value")
