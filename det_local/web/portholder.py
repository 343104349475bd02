"""Who holds a TCP port: the listening sockets on it (/proc/net/tcp and tcp6: address, owner's
uid, inode) and the processes whose descriptors name those inodes (/proc/<pid>/fd ->
socket:[inode]). The dashboard's supervisor says it when its child cannot bind (another user
may squat the port while the dashboard restarts), `det-local dashboard` says it in its "cannot
listen" line, and `det-local dashboard --url` will not print the login address of a port that
someone else holds.

Reads are bounded (at most `MAX_PIDS` processes, only those of the socket's owner, 200
characters of a command line) and blocking: the daemon calls them off its loop. A process of
another user whose /proc is not readable (a daemon not run as root) is reported by its user
alone. Imports nothing of Starlette (the daemon imports it).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

LISTEN = "0A"
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
MAX_PIDS = 65536
MAX_COMMAND = 200


@dataclass(frozen=True)
class Listener:
    address: str  # "127.0.0.1", "::", ...
    port: int
    uid: int
    inode: int


@dataclass(frozen=True)
class Holder:
    listener: Listener
    pid: int | None  # None: no readable process holds it (another user's, not root here)
    uid: int  # the process's (the socket's when its pid is not readable)
    command: str

    @property
    def user(self) -> str:
        return user_name(self.uid)

    def collides(self, host: str) -> bool:
        """Whether this socket may be what a browser reaches at host:port (same address,
        either a wildcard, or host a name such as localhost, which may resolve to any)."""
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return True
        return self.listener.address == host.strip("[]") or any(
            _unspecified(a) for a in (self.listener.address, host)
        )

    def describe(self) -> str:
        """ "pid 1234 of user bob (python3 -m http.server 8080)" or "a process of user bob
        (its pid is not readable here)"."""
        if self.pid is None:
            return f"a process of user {self.user} (its pid is not readable to this user)"
        return f"pid {self.pid} of user {self.user} ({self.command})"


def user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _unspecified(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    except ValueError:  # a name: not a wildcard
        return False


def _address(hexed: str) -> str:
    raw = bytes.fromhex(hexed)
    # the kernel prints each 32-bit word in host order (little-endian here)
    flipped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(flipped))


def listeners(port: int) -> list[Listener]:
    """The listening TCP sockets on `port`, any address."""
    out: list[Listener] = []
    for table in TABLES:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            addr, _, hex_port = fields[1].partition(":")
            try:
                if int(hex_port, 16) != port:
                    continue
                out.append(Listener(_address(addr), port, int(fields[7]), int(fields[9])))
            except ValueError:
                continue
    return out


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4 * MAX_COMMAND)
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    shown = "".join(c if c.isprintable() else "?" for c in text)  # a line of a log: no escapes
    return shown[:MAX_COMMAND] + ("..." if len(shown) > MAX_COMMAND else "") or "?"


def _pid_of(listener: Listener) -> tuple[int, int] | None:
    """(pid, its uid) of a process holding the socket: its creator's processes first (a
    socket's uid is its creator's; a process may since have switched user)."""
    want = f"socket:[{listener.inode}]"
    owners: dict[int, int] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()][:MAX_PIDS]
    except OSError:
        return None
    for pid in pids:
        try:
            owners[pid] = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue  # gone meanwhile
    for pid in sorted(owners, key=lambda p: owners[p] != listener.uid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                    return pid, owners[pid]
            except OSError:
                continue
    return None


def holders(port: int, host: str | None = None) -> list[Holder]:
    """Who listens on `port`: on `host` or a wildcard address first (those are the ones a
    bind of host:port collides with), then any other address."""

    def rank(item: Listener) -> int:
        if host is None:
            return 0
        return 0 if item.address == host or _unspecified(item.address) else 1

    found = sorted(listeners(port), key=rank)
    out = []
    for item in found:
        held = _pid_of(item)
        if held is None:
            out.append(Holder(item, None, item.uid, ""))
        else:
            out.append(Holder(item, held[0], held[1], _command(held[0])))
    return out


def held_by(port: int, host: str | None = None) -> str:
    """One clause naming who holds `port` ("" when nobody listens on it)."""
    found = holders(port, host)
    if not found:
        return ""
    first = found[0].describe()
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return f"{first}{more} holds it"
