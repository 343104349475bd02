"""The trial side keeps its frames within the daemon's session limit (rpc.SESSION_MAX_FRAME):
metric batches are split, a report too large for any frame is dropped with a warning, and a
request too large is refused with a one-line error before anything is sent."""

from __future__ import annotations

import pytest

from det_local.trial import session as session_mod
from det_local.trial.session import Session, SessionError
from det_local.wire import rpc


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
    assert "training metrics at steps_completed=2 take" in err and "not recorded" in err
    assert err.count("\n") == 1


def test_a_request_over_the_limit_is_refused_before_sending() -> None:
    s = Session.__new__(Session)  # no connection: the size is checked before any is made
    with pytest.raises(SessionError, match="'checkpoint' message of .* byte limit"):
        s._send_frame({"t": "checkpoint", "resources": {"f": "x" * rpc.SESSION_MAX_FRAME}})
