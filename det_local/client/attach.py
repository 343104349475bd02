"""Coming back to an experiment from any shell: `experiment logs [-f]` and `experiment wait`.

Both read the store as a client (read-only) and the trials' log files; neither needs the engine
that runs the experiment to be this process, nor any engine at all to print what was written.

- `print_logs`: every trial's output so far, trial by trial, each line `[trial N] ...`.
- `follow_logs`: the same, then new output of every trial (trials created meanwhile too) with
  the `[search]` progress line of a search (`client/follow.py`'s Follower), until the experiment
  is COMPLETED, CANCELED or ERROR. A pause does not end it: the experiment's trials write again
  once it is activated.
- `wait`: until the experiment is COMPLETED, CANCELED or ERROR (a pause does not end it either:
  Determined's `det e wait` waits for a terminal state), polling the store with a short
  bounded interval. The exit code is `det-local run`'s for that state.

A log its owner keeps private (system mode, umask 077) is one line naming who may read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO

from det_local.errors import DetLocalError
from det_local.store.db import Store
from det_local.store.logtail import LogTail
from det_local.store.paths import Paths
from det_local.store.records import ExperimentRecord
from det_local.store.states import State

WAIT_POLL_S = (0.05, 0.5)  # the store is read again after this long: first, at most
FOLLOW_POLL_S = (0.02, 0.2)  # the logs are looked at again after this long idle: first, most


class LogsPrivate(DetLocalError):
    pass


def exit_code(state: State) -> int:
    """`det-local run`'s exit code for an experiment's state (COMPLETED 0, ERROR 1,
    CANCELED 2, PAUSED 3)."""
    from det_local.client.embedded import EXIT_CODES

    return EXIT_CODES.get(state, 1)


def logs_private(err: PermissionError, exp: ExperimentRecord) -> LogsPrivate:
    """The one line for a trial log the caller may not read."""
    return LogsPrivate(
        f"permission denied: cannot read {err.filename or 'the trial logs'}: experiment "
        f"{exp.id}'s logs belong to {exp.user}, who keeps them private; only they, root or "
        "a member of the daemon's admin group may read them"
    )


def print_logs(store: Store, paths: Paths, experiment_id: int, out: IO[str]) -> None:
    """Every trial's output so far, trial after trial, each line prefixed `[trial N] `."""
    exp = store.get_experiment(experiment_id)
    try:
        for t in store.list_trials(experiment_id):
            tail = LogTail(paths.trial_log(experiment_id, t.id))

            def write(data: bytes, trial_id: int = t.id) -> None:
                text = data.decode("utf-8", "replace")
                out.write("".join(f"[trial {trial_id}] {ln}\n" for ln in text.splitlines()))

            tail.pump(write)
            if rest := tail.rest():
                write(rest)
            out.flush()
    except PermissionError as err:
        raise logs_private(err, exp) from None


def follow_logs(
    store: Store, paths: Paths, experiment_id: int, out: IO[str], note: Callable[[str], None]
) -> State:
    """print_logs, then what every trial writes next (and the `[search]` line of a search)
    until the experiment is COMPLETED, CANCELED or ERROR; returns that state. Ctrl-C
    (KeyboardInterrupt) propagates: the caller says what it means."""
    from det_local.client.follow import Follower
    from det_local.store.logtail import follow

    exp = store.get_experiment(experiment_id)
    follower = Follower(store, paths, experiment_id, out, prefix_all=True)
    notes = EngineNotes(paths, experiment_id, note)
    final: list[State] = []

    def done() -> bool:  # asked only when no trial wrote anything since the last look
        state = store.get_experiment(experiment_id).state
        if state.terminal:
            final.append(state)
            return True
        notes.check(state)
        return False

    try:
        follow(follower.pump, done, poll=FOLLOW_POLL_S[0], max_poll=FOLLOW_POLL_S[1])
    except PermissionError as err:
        raise logs_private(err, exp) from None
    follower.write_rest()
    return final[0]


def wait(store: Store, paths: Paths, experiment_id: int, note: Callable[[str], None]) -> State:
    """Block until the experiment is COMPLETED, CANCELED or ERROR; returns that state.
    `note` gets one line when it is (or becomes) paused, and when no engine runs to make
    progress."""
    notes = EngineNotes(paths, experiment_id, note)
    delay = WAIT_POLL_S[0]
    while True:
        state = store.get_experiment(experiment_id).state
        if state.terminal:
            return state
        notes.check(state)
        time.sleep(delay)
        delay = min(delay * 2, WAIT_POLL_S[1])


class EngineNotes:
    """What a waiting person is told once each: the experiment is paused (it waits for
    `activate`), or no det-local engine is running (nothing will change until one starts)."""

    CHECK_ENGINE_S = 2.0

    def __init__(self, paths: Paths, experiment_id: int, note: Callable[[str], None]) -> None:
        self.paths = paths
        self.experiment_id = experiment_id
        self.note = note
        self.said_paused = False
        self.said_no_engine = False
        self.next_engine_check = 0.0

    def check(self, state: State) -> None:
        exp = self.experiment_id
        if state is State.PAUSED and not self.said_paused:
            self.said_paused = True
            self.note(
                f"experiment {exp} is paused; waiting until it ends "
                f"(`det-local experiment activate {exp}` resumes it)"
            )
        if self.said_no_engine or time.monotonic() < self.next_engine_check:
            return
        self.next_engine_check = time.monotonic() + self.CHECK_ENGINE_S
        from det_local.sched.enginelock import lock_free

        if state is not State.PAUSED and lock_free(self.paths):
            self.said_no_engine = True
            self.note(
                f"no det-local engine is running for {self.paths.home}: experiment {exp} "
                "makes no progress until one starts (`det-local daemon start`)"
            )
