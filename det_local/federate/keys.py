"""The cluster key, join tokens, the cluster id and node ids.

The key is 32 random bytes in DET_LOCAL_HOME/cluster.key, mode 0600, owned by the daemon's
user. A join token is that key in one line (`dl1-` plus base64url); whoever holds it is a
member of the cluster, so it is handled like a password. The cluster id (8 hex characters of
HMAC(key, "cluster-id")) is what mDNS announces, so that clusters on one LAN ignore each other
without revealing the key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
import re
import socket
import stat
from pathlib import Path

from det_local.errors import DetLocalError

KEY_BYTES = 32
TOKEN_PREFIX = "dl1-"
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class KeyError_(DetLocalError):
    """The cluster key is missing, malformed or not private."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def token_for(key: bytes) -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(key).decode().rstrip("=")


def key_from_token(token: str) -> bytes:
    token = token.strip()
    what = "the join token"
    if not token.startswith(TOKEN_PREFIX):
        raise KeyError_(
            f"{what} does not start with '{TOKEN_PREFIX}': copy the whole line that "
            "`det-local cluster init` printed"
        )
    body = token[len(TOKEN_PREFIX) :]
    try:
        key = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise KeyError_(f"{what} is not valid base64: copy the whole line") from None
    if len(key) != KEY_BYTES:
        raise KeyError_(f"{what} holds {len(key)} bytes, not {KEY_BYTES}: copy the whole line")
    return key


def cluster_id(key: bytes) -> str:
    return hmac.new(key, b"cluster-id", hashlib.sha256).hexdigest()[:8]


def write_key(path: Path, key: bytes) -> None:
    """Atomically, created 0600 (never readable by others, not even for a moment)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_key(path: Path) -> bytes | None:
    """The key, or None when there is none. KeyError_ (one line) for a key that is not
    private (group/other bits, another owner), not a regular file, or not 32 bytes."""
    from det_local.store.safe_open import UnsafeFile, read_bounded_stat

    try:
        data, st = read_bounded_stat(path, 4096, what="the cluster key")
    except FileNotFoundError:
        return None
    except UnsafeFile as err:
        raise KeyError_(f"{err}; federation is off") from None
    if st.st_uid != os.geteuid():
        raise KeyError_(
            f"{path} is owned by uid {st.st_uid}, not by the daemon's user ({os.geteuid()}); "
            "federation is off"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise KeyError_(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, readable by others: "
            f"`chmod 600 {path}` (and consider a new key: `det-local cluster init --force`); "
            "federation is off"
        )
    if len(data) != KEY_BYTES:
        raise KeyError_(
            f"{path} holds {len(data)} bytes, not {KEY_BYTES}: run `det-local cluster join "
            "TOKEN` again; federation is off"
        )
    return data


def default_node_id() -> str:
    """hostname plus 8 hex characters of sha256(/etc/machine-id): stable across restarts,
    distinct for two hosts with one name (but not for a cloned VM: regenerate its id)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0] or "host")[:40]
    try:
        machine = Path("/etc/machine-id").read_bytes().strip()
    except OSError:
        machine = socket.gethostname().encode()
    return f"{host}-{hashlib.sha256(machine).hexdigest()[:8]}"


def stored_node_id(path: Path) -> str:
    """This home's node id: read from `path`, or made once (hostname plus 8 random hex
    characters) and stored there, so that cloned machines (one hostname, one machine-id) and
    two homes on one host differ. A home this process cannot write keeps the derived id."""
    try:
        text = path.read_text().strip()
        if valid_node_id(text):
            return text
        path.unlink()  # not an id (edited by hand?): a new one
    except OSError:
        pass
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0] or "host")[:40]
    node = f"{host}-{os.urandom(4).hex()}"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(node + "\n")
        os.chmod(tmp, 0o644)
        os.link(tmp, path)  # never replaces an id another process stored first
    except FileExistsError:
        with contextlib.suppress(OSError):
            text = path.read_text().strip()
            if valid_node_id(text):
                return text
        return default_node_id()
    except OSError:
        return default_node_id()
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return node


def valid_node_id(value: object) -> bool:
    return isinstance(value, str) and bool(NODE_ID_RE.match(value))
