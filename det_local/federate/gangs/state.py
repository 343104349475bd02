"""The state every gang concern shares (`GangBook`): the gangs this node owns, the shares of
other nodes' gangs it runs, what a restart lost; and the few link helpers each concern uses
(send, request, who is alive or gone). The timings of the protocol are here too."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.federate.peers import Peer, peer_state
from det_local.sched.gangseam import REATTACH_S

if TYPE_CHECKING:
    from det_local.federate.lending import LendPolicy
    from det_local.federate.settings import FederationSettings
    from det_local.federate.transport import Me
    from det_local.sched.extensions import EngineView
    from det_local.sched.life.experiments import TrialRun

HOLD_S = 30.0  # a RESERVED member without a commit goes back to the queue after this long
REQUEST_S = 10.0  # a reserve/commit/abort/has request without an answer: the peer is gone
END_WAIT_S = 10.0  # the owner's ranks exited: how long members get to finish theirs
LOG_EVERY_S = 0.25  # how often a member sends its ranks' new log lines to the owner
LOG_CHUNK = 256 * 1024
ANYWHERE_WAIT_S = 10.0  # a trial sent whole to a peer, not started there by then: back here
BACKLOG_MAX = 100_000  # frames a member holds for its owner while the owner's daemon restarts


@dataclass
class Share:
    """One node's part of a gang, as its owner tracks it."""

    node: str
    rank: int
    ready: bool = False
    committed: bool = False
    exited: bool = False
    code: int | None = None
    confirmed: bool = True  # False after this daemon restarted, until its node says it runs
    asked: float | None = None  # since when its node (back again) is asked whether it runs
    refused: bool = False  # its node answered the reserve with a refusal: nothing held there
    by_policy: bool = False  # ... by its lending policy (`lending.LendRefused`): for good


@dataclass
class OwnerGang:
    """A gang this node owns (its trial's job is `job_id`)."""

    gang: str
    job_id: int
    trial_id: int
    experiment_id: int
    run: int
    key: list[Any]
    per_node: int
    local: int
    shares: dict[str, Share] = field(default_factory=dict)  # peer node -> its share
    state: str = "reserving"  # reserving, committed, ending, settling
    local_code: int | None = None
    failed_at: float | None = None  # when a rank of the gang was first seen failing
    trial_run: TrialRun | None = None
    failure: str | None = None  # a member's failure, when one ended the gang
    lost: str | None = None  # a machine lost
    timer: asyncio.TimerHandle | None = None
    anywhere: bool = False  # a job that fits here, sent whole to an idle peer
    # since when its members have been this daemon's to watch (a restart starts it again)
    since: float = field(default_factory=time.monotonic)
    command: bool = False  # that job is a command (`cmd run --anywhere`), not a trial
    log_bytes: int = 0  # log bytes its members relayed (capped: federation.max_log_mb)


@dataclass
class MemberGang:
    """A share of another node's gang run here (its JobKind.MEMBER job)."""

    gang: str
    owner: str
    job_id: int
    run: int
    hold_timer: asyncio.TimerHandle | None = None
    log_task: asyncio.Task[None] | None = None
    log_offset: int = 0
    since: float = field(default_factory=time.monotonic)  # as OwnerGang.since
    # frames for the owner while its link is down (its daemon restarting): sent once it is up
    backlog: list[tuple[dict[str, Any], asyncio.Future[Any] | None]] = field(default_factory=list)


class PeerRefused(DetLocalError):
    """A peer answered a request with an error (one line); ``policy``: its lending policy
    refused it, for good."""

    def __init__(self, line: str, policy: bool = False) -> None:
        super().__init__(line)
        self.policy = policy


class GangsHost(Protocol):
    """What the gangs use of their federation service (`federate/service.py`): this node, its
    peers, the lending policy, and a way to ask a peer and to run a task on the loop."""

    view: EngineView
    settings: FederationSettings | None
    me: Me | None
    peers: dict[str, Peer]
    lending: LendPolicy
    lend_priority_offset: int

    def spawn(self, coro: Awaitable[Any]) -> None: ...

    async def request(self, node: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]: ...


class GangBook:
    """The gangs' shared state, one per federation service, and the link helpers on it."""

    def __init__(self, fed: GangsHost) -> None:
        self.fed = fed
        self.view = fed.view
        self.owned: dict[str, OwnerGang] = {}  # gang -> a gang this node owns
        self.members: dict[str, MemberGang] = {}  # gang -> this node's share of it
        # shares whose ranks died with this daemon: owner node -> member_exit{lost} to send
        # once its link is up; (gang, run) -> why, for its `share` question
        self.lost_reports: dict[str, list[dict[str, Any]]] = {}
        self.died: dict[tuple[str, int], str] = {}
        # jobs that may run anywhere which a peer's lending policy refused (root's work, a user
        # or machine it does not lend to): job id -> those peers; not offered to them again
        # until the peer's link comes up again or its lending switches (`forget_refusals`)
        self.refused: dict[int, set[str]] = {}

    @property
    def node(self) -> str:
        return self.fed.me.node if self.fed.me is not None else "local"

    def live(self) -> dict[str, Peer]:
        now = time.monotonic()
        return {
            n: p
            for n, p in self.fed.peers.items()
            if p.link is not None and not p.link.closed and peer_state(p, now) == "alive"
        }

    def linked(self, node: str) -> bool:
        peer = self.fed.peers.get(node)
        return peer is not None and peer.link is not None and not peer.link.closed

    def gone(self, node: str, since: float, now: float, window: float = REATTACH_S) -> bool:
        """Whether `node` counts as lost for a gang watched since `since`: not heard for
        `window` (a daemon restarting inside it keeps the gang's running ranks)."""
        peer = self.fed.peers.get(node)
        if peer is not None and self.linked(node) and peer_state(peer, now) == "alive":
            return False
        if window <= 0.0:
            return peer is None or peer_state(peer, now) == "dead"
        heard = max(since, peer.last_heard if peer is not None else 0.0)
        return now - heard >= window

    def send(self, node: str, msg: dict[str, Any]) -> bool:
        peer = self.fed.peers.get(node)
        if peer is None or peer.link is None or peer.link.closed:
            return False
        try:
            peer.link.session.send_now(msg)
        except (OSError, ConnectionError, ValueError) as err:
            self.view.log(f"federation: cannot send {msg.get('t')} to {node}: {err}")
            return False
        return True

    async def request(self, node: str, msg: dict[str, Any], timeout: float = REQUEST_S) -> Any:
        """Send a request and wait for its reply's value; PeerRefused with the peer's line."""
        answer = await self.fed.request(node, msg, timeout)
        if answer.get("error"):
            raise PeerRefused(f"{node}: {answer['error']}", answer.get("policy") is True)
        return answer.get("value")

    def dist_secret(self, gang: str, run: int) -> str:
        assert self.fed.me is not None
        return hmac.new(self.fed.me.key, f"dist|{gang}|{run}".encode(), hashlib.sha256).hexdigest()

    # ---------------------------------------------------------------- owned gangs
    def abort_members(self, og: OwnerGang, why: str) -> None:
        for s in og.shares.values():
            if not s.exited and not s.refused:  # a node that refused holds nothing of it
                self.send(s.node, {"t": "abort", "gang": og.gang, "run": og.run, "why": why})

    def refused_for_good(self, og: OwnerGang) -> None:
        """The peers that refused `og`'s reserve for good are not offered its job again (the
        entries of jobs no longer waiting here go at the same time)."""
        waiting = {j.id for j in self.view.active_jobs()}
        self.refused = {j: n for j, n in self.refused.items() if j in waiting}
        nodes = {s.node for s in og.shares.values() if s.by_policy}
        self.refused.setdefault(og.job_id, set()).update(nodes)

    def forget_refusals(self, node: str) -> None:
        """Something changed at `node` (a new link: its daemon restarted, maybe with another
        policy; its lending switched): what it refused for good may be offered to it again."""
        for nodes in self.refused.values():
            nodes.discard(node)

    def forget_owned(self, og: OwnerGang) -> None:
        if og.timer is not None:
            og.timer.cancel()
        if self.owned.get(og.gang) is og:
            del self.owned[og.gang]

    def owned_by_trial(self, trial_id: int, run_id: int) -> OwnerGang | None:
        for og in self.owned.values():
            if og.trial_id == trial_id and og.run == run_id:
                return og
        return None

    def owned_job(self, job_id: int) -> OwnerGang | None:
        """The gang of this node's job `job_id`, while it is placed or runs."""
        return self.owned.get(f"{self.node}:{job_id}")
