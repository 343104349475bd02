"""What a gang's failed exit means: a rank's own failure, or a machine lost.

When a machine of a gang dies, the gang's surviving ranks often fail on their own first: gloo
sees the dead peer's connections reset and raises, well before the heartbeats declare the
machine dead. A member's daemon may even report its ranks' deaths just before it dies itself.
So a non-zero exit is not decided at once: it waits until every other machine of the gang has
been heard from `CONFIRM_S` after the first failure (it is alive: the ranks failed), or one of
them is dead (a machine was lost: requeue, not counted toward `max_restarts`). The wait is
bounded by the heartbeats' death time (`peers.DEAD_S`): a machine silent that long is dead.

A machine that came back (its link up again) while the gang's failure waits is alive, but its
ranks may have died with its daemon: while the owner asks it whether its share still runs
(`asked`, at most ANSWER_S), the verdict waits for that answer instead of calling it a failure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from det_local.federate.peers import DEAD_S

CONFIRM_S = 1.0  # a machine heard from this long after the gang's first failure is alive
# how long a machine that came back gets to say whether its share still runs (longer than a
# request's wait for its answer, federate/gangs/state.REQUEST_S)
ANSWER_S = 12.0


class Verdict(enum.Enum):
    FAILED = "failed"  # every machine is alive: the ranks failed (max_restarts applies)
    LOST = "lost"  # a machine of the gang died: requeue without using max_restarts
    WAIT = "wait"  # not known yet: ask again at the next tick


@dataclass(frozen=True)
class Seen:
    """What this node knows of one of the gang's other machines."""

    node: str
    state: str  # peers.peer_state: alive, suspect, dead (or "gone": no such peer)
    last_heard: float  # time.monotonic() of its last message
    linked: bool  # its link is open
    asked: float | None = None  # since when it is asked whether its share runs (it came back)


def failed_gang(failed_at: float, now: float, machines: list[Seen]) -> tuple[Verdict, str]:
    """The verdict on a gang whose ranks exited non-zero, first seen failing at `failed_at`;
    with the lost machine's node id (LOST) or an empty string."""
    for m in machines:
        if m.state in ("dead", "gone"):
            return Verdict.LOST, m.node
    if any(m.asked is not None and now - m.asked < ANSWER_S for m in machines):
        return Verdict.WAIT, ""  # a machine came back: did its ranks survive its restart?
    if all(m.linked and m.last_heard >= failed_at + CONFIRM_S for m in machines):
        return Verdict.FAILED, ""
    if now - failed_at > DEAD_S + CONFIRM_S + 1.0:  # no heartbeat logic can leave it open
        return Verdict.FAILED, ""
    return Verdict.WAIT, ""
