"""What a trial's exit means (Determined's rules), as a pure function of what was observed."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.Enum):
    COMPLETED = "completed"  # exit 0 without a preemption acknowledgement: done training
    INVALID_HP = "invalid_hp"  # the trial raised InvalidHP
    STOPPED = "stopped"  # the searcher stopped it early (0.38 ASHA): done
    PAUSED = "paused"  # preempted for a pause; resumes from its latest checkpoint
    REQUEUE = "requeue"  # preempted by the scheduler; runs again from its latest checkpoint
    CANCELED = "canceled"  # killed on request
    RESTART = "restart"  # failed, restarts left
    ERROR = "error"  # failed, no restarts left


@dataclass(frozen=True)
class ExitFacts:
    exit_code: int
    kill_requested: bool
    pause_requested: bool
    stop_requested: bool
    preempt_acknowledged: bool
    invalid_hp: bool
    restarts_done: int
    max_restarts: int
    requeue_requested: bool = False  # the scheduler preempted it for more important work
    peer_lost: bool = False  # a gang across machines lost one of them (not the trial's fault)
    peer_requeues_left: bool = True  # federation.max_peer_requeues not reached


def decide(f: ExitFacts) -> Outcome:
    if f.kill_requested:
        return Outcome.CANCELED
    if f.invalid_hp and f.exit_code == 0:
        return Outcome.INVALID_HP
    if f.stop_requested:
        return Outcome.STOPPED
    if f.pause_requested:
        return Outcome.PAUSED
    if f.requeue_requested and (f.exit_code != 0 or f.preempt_acknowledged):
        return Outcome.REQUEUE  # it checkpointed and left, or was stopped after the timeout
    if f.preempt_acknowledged and f.exit_code == 0:
        return Outcome.REQUEUE
    if f.peer_lost and f.exit_code != 0:  # a machine went away: max_restarts is not used up
        return Outcome.REQUEUE if f.peer_requeues_left else Outcome.ERROR
    if f.exit_code == 0:
        return Outcome.COMPLETED
    if f.restarts_done < f.max_restarts:
        return Outcome.RESTART
    return Outcome.ERROR


def describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    if code > 128:  # a shell entrypoint reports its command's death by signal N as 128+N
        import signal

        try:
            return f"exited with code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exited with code {code}"
