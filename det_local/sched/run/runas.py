"""Who a job runs as: a Unix user's ids for a LaunchPlan, by uid or by name, and back."""

from __future__ import annotations

import os
import pwd
from typing import Any


def identity(uid: int) -> dict[str, Any]:
    """uid/gid/groups for a LaunchPlan: the job's user when the daemon runs as root; {} (the
    daemon's own user) otherwise, or for root's own jobs."""
    if os.geteuid() != 0 or uid == 0:
        return {}
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return {"uid": uid, "gid": uid, "groups": []}
    return {"uid": uid, "gid": pw.pw_gid, "groups": os.getgrouplist(pw.pw_name, pw.pw_gid)}


def uid_of(user: str) -> int:
    """The uid of a user name; this process's own uid for a name with no passwd entry."""
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return os.getuid()


def user_name(uid: int, unknown: str = "uid {uid}") -> str:
    """A uid's user name for messages; `unknown` (formatted with the uid) when it has no
    passwd entry."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return unknown.format(uid=uid)
