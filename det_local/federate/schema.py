"""What each message on an authenticated peer link may hold.

Every message is a map with a str `t`; `check(msg)` returns None when it is well formed, else
one line saying what is wrong. Unknown keys are ignored (a newer peer may add some); unknown
types, missing fields and values of the wrong type or out of range are refused.

    hb     {free, total, kind, digest{queued, running, top[[priority, slots]...]}}
    peers  {list: [{node, host, port}...]}       the nodes this peer has a live link to
    leave  {}                                    a graceful stop: not dead, gone
    query  {id, what: jobs|slots, all?}          answered by reply{id, value | error}
    reply  {id, value?, error?}
    error  {error, id?}                          the answer to a message that was refused
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from det_local.federate.keys import valid_node_id

MAX_SLOTS = 4096
MAX_PEERS = 256
Check = Callable[[Any], bool]


def _int(lo: int, hi: int) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _str(n: int) -> Check:
    return lambda v: isinstance(v, str) and len(v) <= n


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _digest(v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    if not (_int(0, 10**9)(v.get("queued")) and _int(0, 10**9)(v.get("running"))):
        return False
    top = v.get("top")
    return (
        isinstance(top, list)
        and len(top) <= 5
        and all(
            isinstance(e, list)
            and len(e) == 2
            and _int(-(10**6), 10**6)(e[0])
            and _int(0, MAX_SLOTS)(e[1])
            for e in top
        )
    )


def _peer_list(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) <= MAX_PEERS
        and all(
            isinstance(e, dict)
            and valid_node_id(e.get("node"))
            and _str(255)(e.get("host"))
            and bool(e.get("host"))
            and _int(1, 65535)(e.get("port"))
            for e in v
        )
    )


_ID = _int(0, 2**53)

# type -> {field: (check, required)}
SCHEMAS: dict[str, dict[str, tuple[Check, bool]]] = {
    "hb": {
        "free": (_int(0, MAX_SLOTS), True),
        "total": (_int(0, MAX_SLOTS), True),
        "kind": (lambda v: v in ("gpu", "cpu"), True),
        "digest": (_digest, True),
    },
    "peers": {"list": (_peer_list, True)},
    "leave": {},
    "query": {
        "id": (_ID, True),
        "what": (lambda v: v in ("jobs", "slots"), True),
        "all": (_bool, False),
    },
    # policy: the error is the lender's lending policy (`lending.LendRefused`): refused for good
    "reply": {"id": (_ID, True), "error": (_str(1000), False), "policy": (_bool, False)},
    "error": {"error": (_str(1000), True), "id": (_ID, False)},
}


# ---------------------------------------------------------------------- gangs across machines
# (federate/gangs/): placement, launch, relay, faults. `gang` is "<owner node>:<job id>",
# `run` the owner's run id of the trial (it fences stale messages).
MAX_CONFIG_KEYS = 200


def _gang(v: Any) -> bool:
    if not isinstance(v, str) or len(v) > 100 or ":" not in v:
        return False
    node, _, job = v.rpartition(":")
    return valid_node_id(node) and job.isdigit() and len(job) <= 15


def _key(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) == 4
        and _int(-(10**6), 10**6)(v[0])
        and _int(0, 2**63)(v[1])
        and valid_node_id(v[2])
        and _ID(v[3])
    )


MAX_ARGV = 4096  # a command's arguments (and, below, bytes per argument and of its cwd)
MAX_ARG = 65536


def _command(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and set(v) == {"argv", "cwd"}
        and isinstance(v["argv"], list)
        and 0 < len(v["argv"]) <= MAX_ARGV
        and all(isinstance(a, str) and len(a) <= MAX_ARG for a in v["argv"])
        and isinstance(v["cwd"], str)
        and 0 < len(v["cwd"]) <= MAX_ARG
    )


def _spec(v: Any) -> bool:
    if isinstance(v, dict) and "command" in v:  # a command sent whole (`cmd run --anywhere`)
        return (
            set(v) == {"command", "size"}
            and _command(v["command"])
            and (_int(0, MAX_SLOTS)(v.get("size")))
        )
    return (
        isinstance(v, dict)
        and _ID(v.get("experiment_id"))
        and _ID(v.get("trial_id"))
        and _int(-(2**63), 2**63)(v.get("seed"))
        and isinstance(v.get("hparams"), dict)
        and isinstance(v.get("config"), dict)
        and len(v["config"]) <= MAX_CONFIG_KEYS
        and isinstance(v.get("digest"), str)
        and len(v["digest"]) == 64
        and all(c in "0123456789abcdef" for c in v["digest"])
        and _int(1, MAX_SLOTS)(v.get("size"))
    )


def _addrs(v: Any) -> bool:
    return isinstance(v, list) and 1 <= len(v) <= MAX_PEERS and all(_str(255)(a) and a for a in v)


def _ports(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and len(v) <= 8
        and all(_str(64)(k) and _int(1, 65535)(p) for k, p in v.items())
    )


def _frame(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("t"), str) and len(v["t"]) <= 40


def _bytes(n: int) -> Check:
    return lambda v: isinstance(v, bytes) and len(v) <= n


_RUN = _int(1, 2**31)
_OPT_ID = (_ID, False)
GANG_SCHEMAS: dict[str, dict[str, tuple[Check, bool]]] = {
    "has": {"id": (_ID, True), "digest": (_str(64), True)},
    "reserve": {
        "id": (_ID, True),
        "gang": (_gang, True),
        "run": (_RUN, True),
        "key": (_key, True),
        "slots": (_int(1, MAX_SLOTS), True),
        "user": (lambda v: _str(64)(v) and bool(v), True),
        "uid": (_int(0, 2**32 - 1), True),
        "priority": (_int(1, 99), True),
        "name": (_str(256), True),
        "hold_s": (lambda v: isinstance(v, (int, float)) and 0.1 <= v <= 600, False),
        "spec": (_spec, True),
    },
    "ready": {"id": (_ID, True), "gang": (_gang, True), "run": (_RUN, True)},
    "commit": {
        "id": (_ID, True),
        "gang": (_gang, True),
        "run": (_RUN, True),
        "node_rank": (_int(0, MAX_PEERS), True),
        "addrs": (_addrs, True),
        "slot_counts": (
            lambda v: isinstance(v, list) and all(_int(1, MAX_SLOTS)(n) for n in v),
            True,
        ),
        "ports": (_ports, True),
        "latest_checkpoint": (lambda v: v is None or _str(4096)(v), False),
        "steps_completed": (_int(0, 2**53), False),
    },
    "abort": {"id": _OPT_ID, "gang": (_gang, True), "run": (_RUN, True), "why": (_str(1000), True)},
    "share": {"id": (_ID, True), "gang": (_gang, True), "run": (_RUN, True)},
    "wounded": {"gang": (_gang, True), "run": (_RUN, True), "why": (_str(1000), True)},
    "yield": {"gang": (_gang, True), "run": (_RUN, True), "why": (_str(1000), True)},
    "member_exit": {
        "gang": (_gang, True),
        "run": (_RUN, True),
        "code": (_int(-255, 255), True),
        "lost": (_bool, False),
    },
    "relay": {"id": _OPT_ID, "gang": (_gang, True), "run": (_RUN, True), "frame": (_frame, True)},
    "down": {"gang": (_gang, True), "run": (_RUN, True), "frame": (_frame, True)},
    "log": {"gang": (_gang, True), "run": (_RUN, True), "data": (_bytes(256 * 1024), True)},
}
SCHEMAS.update(GANG_SCHEMAS)


def check(msg: dict[str, Any]) -> str | None:
    kind = msg.get("t")
    fields = SCHEMAS.get(str(kind))
    if fields is None:
        return f"unknown message type '{str(kind)[:40]}'"
    for name, (ok, required) in fields.items():
        if name not in msg:
            if required:
                return f"'{kind}' message without '{name}'"
            continue
        if not ok(msg[name]):
            return f"'{kind}' message with an invalid '{name}' ({str(msg[name])[:40]!r})"
    if kind == "hb" and msg["free"] > msg["total"]:
        return "'hb' message with more free slots than slots"
    return None


_JOB_FIELDS: dict[str, Check] = {
    "id": _int(0, 2**53),
    "kind": _str(32),
    "name": _str(256),
    "user": _str(64),
    "priority": _int(-(10**6), 10**6),
    "slots_needed": _int(0, MAX_SLOTS),
    "state": _str(32),
}


def check_jobs(value: Any) -> str | None:
    """A peer's answer to query{what: jobs}: a list of job maps."""
    if not isinstance(value, list) or len(value) > 10000:
        return "the job list is not a list"
    for job in value:
        if not isinstance(job, dict):
            return "a job in the list is not a map"
        for name, ok in _JOB_FIELDS.items():
            if not ok(job.get(name)):
                return f"a job with an invalid '{name}'"
        slots = job.get("slots")
        if not isinstance(slots, list) or not all(_int(0, MAX_SLOTS)(s) for s in slots):
            return "a job with invalid 'slots'"
        if "runs_on" in job and not _str(1024)(job["runs_on"]):
            return "a job with an invalid 'runs_on'"
    return None


def check_slots(value: Any) -> str | None:
    """A peer's answer to query{what: slots}: rows of `slots --json`."""
    if not isinstance(value, list) or len(value) > MAX_SLOTS:
        return "the slot list is not a list"
    for row in value:
        if not isinstance(row, dict) or not _int(0, MAX_SLOTS)(row.get("index")):
            return "a slot row without an index"
        for key, val in row.items():
            if not isinstance(key, str) or not (
                val is None or isinstance(val, (int, float, str, bool))
            ):
                return "a slot row with a value that is not a scalar"
            if isinstance(val, str) and len(val) > 256:
                return "a slot row with a value over 256 characters"
    return None


# -- blob {digest, off, total, data, last}: a chunk of a context tar (federate/blobs.py) -------
BLOB_CHUNK_MAX = 1024 * 1024  # data per chunk; the 1 MiB session frame makes it 1023 KiB
BLOB_TOTAL_MAX = 2 * 95 * 1024 * 1024  # blobs.tar_cap(MAX_CONTEXT_BYTES): content + headers


def _sha256_hex(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _blob_data(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) <= BLOB_CHUNK_MAX


SCHEMAS["blob"] = {
    "digest": (_sha256_hex, True),
    "off": (_int(0, BLOB_TOTAL_MAX), True),
    "total": (_int(1, BLOB_TOTAL_MAX), True),
    "data": (_blob_data, True),
    "last": (_bool, True),
}
SCHEMAS["blob"]["id"] = (_ID, False)  # the last chunk is a request: its reply says verified
