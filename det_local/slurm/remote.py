"""A Slurm pool whose compute nodes are not the daemon's host: its two settings.

```yaml
resource_pools:
  hpc:
    slurm:
      partition: batch
      channel:                       # trials report over TCP (det_local/wire/channel.py)
        listen: 0.0.0.0:7461         # where the daemon listens (host:port)
        advertise: login01           # how compute nodes reach it: host or host:port
      stage_dir: /shared/det-local   # where runs get their context copy, log and info files
```

Without ``channel`` a pool's trials report over the daemon's unix socket (the compute node must
be the daemon's host); without ``stage_dir`` their context, log and info directory are the
daemon's own paths (which the compute nodes must see at the same paths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from det_local.errors import ConfigError

_CHANNEL_KEYS = {"listen", "advertise"}


@dataclass(frozen=True)
class Channel:
    host: str  # listened on ("" or 0.0.0.0: every interface)
    port: int
    advertise: str  # host:port the compute nodes connect to

    @property
    def url(self) -> str:
        return f"tcp://{self.advertise}"


def _host_port(text: str, default_port: int | None) -> tuple[str, int] | None:
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), "" if default_port is None else str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def parse_channel(where: str, raw: Any, source: str) -> Channel | None:
    if raw is None:
        return None
    from det_local.suggest import check_section_keys

    where = f"{where}.channel"
    if not isinstance(raw, dict) or "listen" not in raw:
        raise ConfigError(
            f"{where} in {source}: expected a mapping such as "
            "{listen: 0.0.0.0:7461, advertise: login01}, found " + repr(raw)
        )
    check_section_keys(f"{where}.", raw, _CHANNEL_KEYS, source)
    listen = raw["listen"]
    parsed = _host_port(listen, None) if isinstance(listen, str) else None
    if parsed is None:
        raise ConfigError(
            f"{where}.listen in {source}: expected host:port (e.g. 0.0.0.0:7461), found {listen!r}"
        )
    host, port = parsed
    advertise = raw.get("advertise")
    if advertise is None:
        if host in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"{where}.advertise is missing in {source}: the daemon listens on every "
                f"interface ({listen}); name the host compute nodes reach it by, e.g. "
                "'advertise: login01'"
            )
        advertise = host
    shown = _host_port(advertise, port) if isinstance(advertise, str) else None
    if shown is None:
        raise ConfigError(
            f"{where}.advertise in {source}: expected host or host:port, found {advertise!r}"
        )
    return Channel(host, port, f"{shown[0]}:{shown[1]}")


def parse_stage_dir(where: str, raw: Any, source: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw.startswith("/"):
        raise ConfigError(
            f"{where}.stage_dir in {source}: expected an absolute path on the filesystem the "
            f"compute nodes share (e.g. /shared/det-local), found {raw!r}"
        )
    return raw.rstrip("/") or "/"
