"""The trial side keeps its frames within the daemon's session limit (rpc.SESSION_MAX_FRAME):
metric batches are split, a report too large for any frame is dropped with a warning, and a
request too large is refused with a one-line error before anything is sent."""

from __future__ import annotations

import pytest

from det_local.trial import session as session_mod
from det_local.trial.session import Session, SessionError
from det_local.wire import rpc
from det_local.wire.budget import TRIAL_SESSION


def _report(steps: int, size: int) -> tuple[object, ...]:
    return ("training", steps, {"loss": 0.5, "blob": "x" * size}, 1.0, None)


def test_metric_batches_are_split_below_the_daemon_limit() -> None:
    batch = [_report(i, 1 << 20) for i in range(40)]  # about 40 MiB in one batch
    frames = session_mod._metric_frames(batch)
    assert len(frames) > 2
    assert all(len(data) - rpc.HEADER.size <= rpc.SESSION_MAX_FRAME for _, data in frames)
    assert [r for part, _ in frames for r in part] == batch  # every report, in order
    for part, data in frames:
        assert rpc.unpack(data[rpc.HEADER.size :])["reports"] == [list(r) for r in part]
    small = [_report(i, 10) for i in range(1000)]
    assert len(session_mod._metric_frames(small)) == 1


def test_a_report_larger_than_any_frame_is_dropped_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    batch = [_report(1, 10), _report(2, rpc.SESSION_MAX_FRAME), _report(3, 10)]
    frames = session_mod._metric_frames(batch)
    assert [r[1] for part, _ in frames for r in part] == [1, 3]
    err = capsys.readouterr().err
    assert "training metrics at steps_completed=2 are over the daemon's limit" in err
    assert "not recorded" in err and err.count("\n") == 1


def test_metric_batches_are_split_below_the_daemons_value_and_map_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 34: the daemon counts maps and arrays (TRIAL_SESSION); a batch small in bytes but
    with many batch_metrics maps is split to fit it, so nothing a trial reports is refused."""
    per_batch = [{"loss": 0.5, "acc": 0.25} for _ in range(1000)]  # ~1,000 maps a report
    batch = [("training", i, {"loss": 0.5}, 1.0, per_batch) for i in range(60)]
    frames = session_mod._metric_frames(batch)
    assert len(frames) >= 6  # 60,000 maps: over the 10,000 of one frame
    assert [r for part, _ in frames for r in part] == batch
    for _, data in frames:
        assert session_mod.over_budget(data) is None
        rpc.unpack(data[rpc.HEADER.size :], TRIAL_SESSION)  # what the daemon decodes
    # one report with more batch maps than any frame may hold: dropped, said once
    huge = [("training", 7, {"loss": 0.5}, 1.0, [{"x": 1} for _ in range(12_000)])]
    assert session_mod._metric_frames(huge) == []
    err = capsys.readouterr().err
    assert err.strip() == (
        "det-local: warning: training metrics at steps_completed=7 are over the daemon's limit "
        f"for one frame ({rpc.SESSION_MAX_FRAME} bytes: message holds more than 10,000 maps "
        "and arrays (at byte 40,039)); not recorded (report fewer or smaller batch_metrics)"
    )


def test_a_request_over_the_limit_is_refused_before_sending() -> None:
    s = Session.__new__(Session)  # no connection: the size is checked before any is made
    with pytest.raises(SessionError, match="'checkpoint' message of .* byte limit"):
        s._send_frame({"t": "checkpoint", "resources": {"f": "x" * rpc.SESSION_MAX_FRAME}})
    files = {f"f{i}": 1 for i in range(100_001)}  # 100,001 keys: over the map limit
    with pytest.raises(SessionError) as info:
        s._send_frame({"t": "checkpoint", "resources": files})
    assert str(info.value) == (
        "'checkpoint' message is over the det-local daemon's budget: a map of 100,001 keys is "
        "over the limit of 100,000 (at byte 24) (a checkpoint of too many files, or metadata "
        "too large?)"
    )
