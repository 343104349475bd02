"""Who may run here: the lending machine's decision, never the peer's.

A keyed peer's `reserve` names a user (and carries the uid the owner's kernel gave the
submitter's spool file). Before anything is queued this machine checks, with its own account
database and its own daemon.yaml:

* the name is a plain user name (`USER_NAME`: no '/', '..', whitespace, control characters or a
  leading '-'), and an account of that name exists here;
* neither this machine's uid for the name nor the uid the owner claims is 0: root never runs
  work that came from another machine (Slurm runs root jobs only from root on the controller;
  HTCondor never does);
* this machine's uid for the name is an ordinary account: from UID_MIN to UID_MAX of
  /etc/login.defs (1000-60000 when the file does not say; not nobody);
* when `federation.lend_users` is set, the name is on it; when `federation.lend_peers` is set,
  the asking machine is on it; `federation.lend: false` lends to nobody.

Names are mapped, never uids: the peer's uid only adds refusals (0), it never grants anything.
A refusal is one `LendRefused` line naming the user, this machine and the setting that would
allow it; it ends in "[permanent]" (placing it again would not help).
"""

from __future__ import annotations

import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from det_local.errors import DetLocalError

LOGIN_DEFS = Path("/etc/login.defs")
DEFAULT_UID_MIN = 1000
DEFAULT_UID_MAX = 60000  # above: nobody (65534) and other special accounts
USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}\$?")


class LendRefused(DetLocalError):
    """A peer's work refused by this machine's lending policy (one line)."""


def uid_range(path: Path = LOGIN_DEFS) -> tuple[int, int]:
    """(UID_MIN, UID_MAX) of login.defs: ordinary accounts (1000 and 60000 when unset)."""
    found = {"UID_MIN": DEFAULT_UID_MIN, "UID_MAX": DEFAULT_UID_MAX}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in found and parts[1].isdigit():
            found[parts[0]] = max(1, int(parts[1]))
    return found["UID_MIN"], max(found["UID_MIN"], found["UID_MAX"])


def valid_user_name(name: object) -> bool:
    return isinstance(name, str) and USER_NAME.fullmatch(name) is not None and ".." not in name


@dataclass(frozen=True)
class LendPolicy:
    """This machine's lending settings (daemon.yaml `federation:`)."""

    node: str
    lend: bool = True
    users: frozenset[str] | None = None  # federation.lend_users (None: any ordinary account)
    peers: frozenset[str] | None = None  # federation.lend_peers (None: any keyed peer)
    uid_min: int = DEFAULT_UID_MIN
    uid_max: int = DEFAULT_UID_MAX

    def check(self, peer: str, user: object, claimed_uid: object) -> int:
        """The local uid `user` runs as here; LendRefused (one line) when this machine does
        not run `peer`'s work for that user."""
        me = self.node
        if not self.lend:
            raise LendRefused(
                f"{me} does not lend slots to other machines (federation.lend: false in "
                f"{me}'s daemon.yaml) [permanent]"
            )
        if self.peers is not None and peer not in self.peers:
            raise LendRefused(
                f"{me} does not run work from machine {peer}: it is not in "
                f"federation.lend_peers of {me}'s daemon.yaml (add it there to lend to it) "
                "[permanent]"
            )
        if not valid_user_name(user):
            raise LendRefused(
                f"{me} refused a user name {str(user)[:40]!r} from {peer}: not a valid user "
                "name (letters, digits, '.', '_', '-'; at most 32) [permanent]"
            )
        assert isinstance(user, str)
        if claimed_uid == 0:
            raise LendRefused(
                f"{me} does not run work of uid 0 (root, as {user!r}) from {peer}: root "
                "never runs work from other machines; submit as an ordinary user [permanent]"
            )
        try:
            local = pwd.getpwnam(user).pw_uid
        except KeyError:
            raise LendRefused(
                f"user {user!r} does not exist on {me}: create the account (same name) there "
                "to run its work there [permanent]"
            ) from None
        if local == 0:
            raise LendRefused(
                f"{me} does not run work of {user!r} (uid 0 on {me}) from {peer}: root never "
                "runs work from other machines; submit as an ordinary user [permanent]"
            )
        if not self.uid_min <= local <= self.uid_max:
            raise LendRefused(
                f"{me} does not run work of {user!r} from {peer}: uid {local} is a system "
                f"account on {me} (not within UID_MIN-UID_MAX {self.uid_min}-{self.uid_max} "
                "of /etc/login.defs); only ordinary accounts run work from other machines "
                "[permanent]"
            )
        if self.users is not None and user not in self.users:
            raise LendRefused(
                f"{me} does not run work of {user!r} from {peer}: not in "
                f"federation.lend_users of {me}'s daemon.yaml (add the user there to lend "
                "to it) [permanent]"
            )
        return local
