"""Reading trials' and commands' logs: what `trial logs`, `cmd logs` and the dashboard's log
pages show (the files the daemon writes, read as the caller)."""

from __future__ import annotations

from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from det_local.store.db import Store
from det_local.store.states import State

if TYPE_CHECKING:
    pass
from det_local.api import open_store, paths


def trial_logs(
    trial_id: int,
    out: IO[bytes],
    *,
    follow: bool = False,
    rank: int | None = None,
    tail: int | None = None,
) -> None:
    """Write a trial's output to `out`: every run and rank (rank N's lines start with
    `[rank=N] `), or only rank `rank`'s; with `tail`, only the last N of those lines. With
    `follow`, keep writing new lines until the trial is PAUSED or has ended (its state is
    re-read from the store whenever no new output has come), then what is left."""
    from det_local.store.logtail import LogTail
    from det_local.store.logtail import follow as follow_until

    store = open_store()
    trial = store.get_trial(trial_id)
    prefix = None if rank is None else f"[rank={rank}] ".encode()
    path = paths().trial_log(trial.experiment_id, trial_id)
    if trial.state.terminal and not path.exists():
        _logs_removed(store, trial.experiment_id, trial_id)
    log = LogTail(path, prefix=prefix, last=tail)

    def pump() -> bool:
        if log.pump(out.write):
            out.flush()
            return True
        return False

    def done() -> bool:
        state = store.get_trial(trial_id).state
        return state.terminal or state is State.PAUSED

    try:
        if follow:
            follow_until(pump, done, poll=0.02, max_poll=0.1)
        else:
            log.pump(out.write)
    except PermissionError as err:
        from det_local.client.attach import logs_private

        raise logs_private(err, store.get_experiment(trial.experiment_id)) from None
    out.write(log.rest())
    out.flush()


def _logs_removed(store: Store, experiment_id: int, trial_id: int) -> None:
    """An ended trial without its log: say so when its retention policy removed it."""
    import time

    exp = store.get_experiment(experiment_id)
    days = (exp.config.get("retention_policy") or {}).get("log_retention_days")
    if (
        isinstance(days, int)
        and days >= 0
        and exp.ended_at is not None
        and exp.ended_at + days * 86400 <= time.time()
    ):
        from det_local.errors import NotFoundError

        raise NotFoundError(
            f"trial {trial_id}'s logs were removed: experiment {experiment_id} ended more than "
            f"{days} day{'s' if days != 1 else ''} ago (retention_policy.log_retention_days); "
            "its metrics and checkpoints remain"
        )


def command_exit_status(job: Any) -> int:
    """The exit status for an ended command's job, as a shell reports it."""
    from det_local.client.follow import command_exit_status as status

    return status(job)


def trial_log_chunk(
    trial_id: int, *, offset: int | None = None, tail: int | None = None, limit: int = 1 << 20
) -> dict[str, Any]:
    """A trial's output from byte `offset` (or its last `tail` lines), whole lines only, at
    most about `limit` bytes: {"trial_id", "offset" (where the next chunk starts), "lines",
    "state"}. What a web view polls or streams; `trial logs` follows the same files."""
    from det_local.store.logtail import LogTail

    store = open_store()
    trial = store.get_trial(trial_id)
    path = paths().trial_log(trial.experiment_id, trial_id)
    log = LogTail(path, start=offset or 0, last=tail if offset is None else None)
    chunks: list[bytes] = []
    size = 0

    def keep(data: bytes) -> None:
        nonlocal size
        chunks.append(data)
        size += len(data)

    try:
        if offset is not None and offset > _size(path):  # truncated, or a wrong offset
            log = LogTail(path)
        log.pump(keep)
    except PermissionError as err:
        from det_local.client.attach import logs_private

        raise logs_private(err, store.get_experiment(trial.experiment_id)) from None
    data = b"".join(chunks)
    end = log.resume_offset
    if len(data) > limit:  # the rest comes with the next chunk
        cut = data.rfind(b"\n", 0, limit) + 1 or len(data)
        end -= len(data) - cut
        data = data[:cut]
    text = data.decode("utf-8", errors="replace")
    return {
        "trial_id": trial_id,
        "offset": end,
        "lines": text.splitlines(),
        "state": trial.state.value,
    }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def open_trial_log(trial_id: int) -> tuple[str, IO[bytes] | None]:
    """(a file name for it, the trial's whole output opened for reading, None before it
    wrote any): what a raw log download streams. Unreadable logs are LogsPrivate (one line)."""
    store = open_store()
    trial = store.get_trial(trial_id)
    path = paths().trial_log(trial.experiment_id, trial_id)
    name = f"experiment-{trial.experiment_id}-trial-{trial_id}.log"
    try:
        return name, open(path, "rb")  # noqa: SIM115 (the caller streams and closes it)
    except FileNotFoundError:
        return name, None
    except PermissionError as err:
        from det_local.client.attach import logs_private

        raise logs_private(err, store.get_experiment(trial.experiment_id)) from None
