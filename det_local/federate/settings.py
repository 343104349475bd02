"""The `federation:` section of daemon.yaml and its environment variables.

```yaml
federation:
  port: 47800            # TCP port of the peer link (DET_LOCAL_FED_PORT)
  node_id: gpu1          # default: made once per home and kept in <home>/node-id (hostname
                         # plus 8 random hex); DET_LOCAL_NODE_ID wins
  mdns: true             # announce and browse with mDNS (DET_LOCAL_MDNS=0 turns it off)
  peers: ["10.0.0.5:47800", "gpu2.lab"]   # dialled as well (DET_LOCAL_PEERS=host:port,...)
  interfaces: [eth0]     # where mDNS runs; default: private IPv4 interfaces, no docker*,
                         # virbr*, veth*, loopback (DET_LOCAL_FED_INTERFACES=eth0,eth1)
  listen: 0.0.0.0        # address the peer link listens on (DET_LOCAL_FED_LISTEN)
  lend: true             # run shares of other machines' work here (ordinary accounts only)
  lend_users: [alice]    # only these users' work from peers (default: any uid >= UID_MIN)
  lend_peers: [gpu2]     # only these machines' work (default: any holder of the key)
  contexts_max_mb: 2048  # contexts shipped here, all peers together (least recently used go)
  contexts_peer_mb: 1024 # of which one peer may hold at most
  max_log_mb: 64         # log bytes a peer may relay into one job's log (then it is cut)
```
The environment wins over daemon.yaml.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_local.errors import ConfigError
from det_local.federate.keys import stored_node_id, valid_node_id
from det_local.suggest import check_section_keys

DEFAULT_PORT = 47800
NODE_ID_FILE = "node-id"  # in the home, next to daemon.yaml: made once (keys.stored_node_id)
_KEYS = {
    "port",
    "node_id",
    "mdns",
    "peers",
    "interfaces",
    "listen",
    "lend",
    "lend_priority_offset",
    "max_peer_requeues",
    "lend_users",
    "lend_peers",
    "contexts_max_mb",
    "contexts_peer_mb",
    "max_log_mb",
}


@dataclass(frozen=True)
class FederationSettings:
    port: int = DEFAULT_PORT
    node_id: str = ""
    mdns: bool = True
    peers: tuple[tuple[str, int], ...] = ()
    interfaces: tuple[str, ...] | None = None  # None: the private IPv4 interfaces
    listen: str = "0.0.0.0"
    lend: bool = True  # run shares of other machines' trials here
    lend_priority_offset: int = 0  # added to a lent share's priority (higher: less important)
    max_peer_requeues: int = 5  # requeues of a trial for lost machines (not max_restarts)
    lend_users: frozenset[str] | None = None  # None: any ordinary account (uid >= UID_MIN)
    lend_peers: frozenset[str] | None = None  # None: any machine that holds the key
    contexts_max_mb: int = 2048  # fed/contexts, every peer's together
    contexts_peer_mb: int = 1024  # fed/contexts, one peer's
    max_log_mb: int = 64  # relayed log bytes per job


def parse_peer(text: str, where: str) -> tuple[str, int]:
    text = text.strip()
    host, sep, port_s = text.rpartition(":")
    if not sep:
        host, port_s = text, str(DEFAULT_PORT)
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"{where}: '{text}' is not host:port") from None
    if not host or not 0 < port < 65536:
        raise ConfigError(f"{where}: '{text}' is not host:port with a port in 1-65535")
    return host.strip("[]"), port


def _port(value: Any, where: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{where}: expected a TCP port in 1-65535, found {value!r}")
    return value


def _flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where}: expected true or false, found {value!r}")


def _whole(value: Any, lo: int, hi: int, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(
            f"federation.{name} in {source}: expected a whole number from {lo} to {hi}, "
            f"found {value!r}"
        )
    return value


def _names(raw: dict[str, Any], name: str, source: str) -> frozenset[str] | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"federation.{name} in {source}: expected a list of names")
    if name == "lend_users":
        from det_local.federate.lending import valid_user_name

        bad = [v for v in value if not valid_user_name(v)]
        if bad:
            raise ConfigError(
                f"federation.lend_users in {source}: {bad[0][:40]!r} is not a valid user name"
            )
    return frozenset(value)


def load(settings_path: Path, env: dict[str, str] | None = None) -> FederationSettings:
    env = dict(os.environ) if env is None else env
    raw: dict[str, Any] = {}
    source = str(settings_path)
    if settings_path.exists():
        import yaml

        from det_local.config.limits import read_settings_text

        try:
            doc = yaml.safe_load(read_settings_text(settings_path)) or {}
        except yaml.YAMLError:
            raise ConfigError(f"{source} is not valid YAML") from None
        section = doc.get("federation") if isinstance(doc, dict) else None
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"federation in {source}: expected a mapping")
        raw = section or {}
    check_section_keys("federation.", raw, _KEYS, source)
    port = _port(raw.get("port", DEFAULT_PORT), f"federation.port in {source}")
    if env.get("DET_LOCAL_FED_PORT"):
        port = _port(env["DET_LOCAL_FED_PORT"], "DET_LOCAL_FED_PORT")
    node = (
        env.get("DET_LOCAL_NODE_ID")
        or raw.get("node_id")
        or stored_node_id(settings_path.with_name(NODE_ID_FILE))
    )
    if not valid_node_id(node):
        raise ConfigError(
            f"node id {node!r} (federation.node_id / DET_LOCAL_NODE_ID): expected 1-63 letters, "
            "digits, '.', '_' or '-'"
        )
    mdns = _flag(raw.get("mdns", True), f"federation.mdns in {source}")
    if env.get("DET_LOCAL_MDNS") is not None and env.get("DET_LOCAL_MDNS") != "":
        mdns = _flag(env["DET_LOCAL_MDNS"], "DET_LOCAL_MDNS")
    peers_raw = raw.get("peers") or []
    if not isinstance(peers_raw, list):
        raise ConfigError(f"federation.peers in {source}: expected a list of host:port")
    peers = [parse_peer(str(p), f"federation.peers in {source}") for p in peers_raw]
    if env.get("DET_LOCAL_PEERS"):
        peers += [
            parse_peer(p, "DET_LOCAL_PEERS") for p in env["DET_LOCAL_PEERS"].split(",") if p.strip()
        ]
    interfaces: tuple[str, ...] | None = None
    if raw.get("interfaces") is not None:
        if not isinstance(raw["interfaces"], list):
            raise ConfigError(f"federation.interfaces in {source}: expected a list of names")
        interfaces = tuple(str(i) for i in raw["interfaces"])
    if env.get("DET_LOCAL_FED_INTERFACES"):
        interfaces = tuple(i.strip() for i in env["DET_LOCAL_FED_INTERFACES"].split(",") if i)
    listen = str(env.get("DET_LOCAL_FED_LISTEN") or raw.get("listen") or "0.0.0.0")
    lend = _flag(raw.get("lend", True), f"federation.lend in {source}")
    offset = _whole(raw.get("lend_priority_offset", 0), -98, 98, "lend_priority_offset", source)
    requeues = _whole(raw.get("max_peer_requeues", 5), 0, 1000, "max_peer_requeues", source)
    lend_users = _names(raw, "lend_users", source)
    lend_peers = _names(raw, "lend_peers", source)
    if lend_peers is not None:
        bad = sorted(n for n in lend_peers if not valid_node_id(n))
        if bad:
            raise ConfigError(
                f"federation.lend_peers in {source}: {bad[0]!r} is not a node id (1-63 "
                "letters, digits, '.', '_' or '-')"
            )
    ctx_max = _whole(raw.get("contexts_max_mb", 2048), 1, 10**7, "contexts_max_mb", source)
    ctx_peer = _whole(raw.get("contexts_peer_mb", 1024), 1, 10**7, "contexts_peer_mb", source)
    log_mb = _whole(raw.get("max_log_mb", 64), 1, 10**6, "max_log_mb", source)
    return FederationSettings(
        lend_users=lend_users,
        lend_peers=lend_peers,
        contexts_max_mb=ctx_max,
        contexts_peer_mb=min(ctx_peer, ctx_max),
        max_log_mb=log_mb,
        lend=lend,
        lend_priority_offset=offset,
        max_peer_requeues=requeues,
        port=port,
        node_id=str(node),
        mdns=mdns,
        peers=tuple(dict.fromkeys(peers)),
        interfaces=interfaces,
        listen=listen,
    )
