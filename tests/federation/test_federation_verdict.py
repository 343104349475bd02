"""A gang's failed exit: a rank's own failure, or a machine lost (federate/verdict.py)."""

from __future__ import annotations

from det_local.federate.peers import DEAD_S
from det_local.federate.verdict import ANSWER_S, CONFIRM_S, Seen, Verdict, failed_gang

T = 1000.0  # when the gang was first seen failing


def test_every_machine_heard_from_after_the_failure_is_a_rank_failure() -> None:
    heard = [Seen("n2", "alive", T + CONFIRM_S + 0.1, True), Seen("n3", "alive", T + 2, True)]
    assert failed_gang(T, T + 2.1, heard) == (Verdict.FAILED, "")


def test_a_dead_machine_is_a_machine_lost_even_after_it_reported_its_ranks() -> None:
    # n2's daemon reported its ranks' exit (heard at T + 0.2), then died
    seen = [Seen("n3", "alive", T + 3, True), Seen("n2", "dead", T + 0.2, False)]
    assert failed_gang(T, T + 5.3, seen) == (Verdict.LOST, "n2")
    assert failed_gang(T, T + 1, [Seen("n2", "gone", 0.0, False)]) == (Verdict.LOST, "n2")


def test_not_known_yet_waits() -> None:
    # heard only just after the failure (its member_exit), or its link dropped: not settled
    assert failed_gang(T, T + 0.5, [Seen("n2", "alive", T + 0.3, True)])[0] == Verdict.WAIT
    assert failed_gang(T, T + 3, [Seen("n2", "suspect", T - 0.1, False)])[0] == Verdict.WAIT
    # linked and heard late enough, but another machine's link dropped: still waiting
    seen = [Seen("n2", "alive", T + 2, True), Seen("n3", "alive", T + 2, False)]
    assert failed_gang(T, T + 2, seen)[0] == Verdict.WAIT


def test_the_wait_is_bounded_by_the_death_time() -> None:
    late = T + DEAD_S + CONFIRM_S + 1.5
    assert failed_gang(T, late, [Seen("n2", "alive", T + 0.3, False)]) == (Verdict.FAILED, "")


def test_a_machine_that_came_back_is_asked_before_a_failure_is_decided() -> None:
    """Its link is up again and it was heard after the failure, but its ranks may have died
    with its daemon: the verdict waits (bounded) for its answer to `share`, so a lost share is
    never taken for the ranks' own failure (issue 26)."""
    back = Seen("n2", "alive", T + 12, True, asked=T + 11.5)
    assert failed_gang(T, T + 12, [back]) == (Verdict.WAIT, "")
    assert failed_gang(T, T + 11.5 + ANSWER_S, [back]) == (Verdict.FAILED, "")  # no answer
    answered = Seen("n2", "alive", T + 12, True)  # it said its share still runs
    assert failed_gang(T, T + 12, [answered]) == (Verdict.FAILED, "")
    gone_again = Seen("n2", "dead", T + 12, False, asked=T + 11.5)
    assert failed_gang(T, T + 20, [gone_again]) == (Verdict.LOST, "n2")
