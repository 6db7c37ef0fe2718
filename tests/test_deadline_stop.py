"""A deadline cut short (:meth:`Deadline.cut_short`): the retried operation running by it starts no new attempt,
even mid-pause, and ends with an error that says it was stopped; an operation inside it stops with it."""

from __future__ import annotations

import threading

import pytest

from taskpoint import RetryPolicy, StorageUnavailable
from taskpoint.storage import Deadline
from taskpoint.storage.deadline import NO_DEADLINE

#: A pause before the retry far longer than the test's timeout: only the stop can end it.
LONG_PAUSE = 600.0
#: Bound of the wait for the first attempt (seconds).
WAIT_BOUND = 60.0


@pytest.mark.timeout(120)
def test_an_operation_cut_short_in_its_pause_sends_no_further_attempt():
    deadline = NO_DEADLINE.stoppable()
    policy = RetryPolicy(attempts=5, initial_delay=LONG_PAUSE, max_delay=LONG_PAUSE, deadline=None)
    attempts: list[Deadline] = []
    tried = threading.Event()

    def fail(given: Deadline) -> None:
        attempts.append(given)
        tried.set()
        raise ConnectionResetError("the connection was reset")

    def cut() -> None:
        assert tried.wait(WAIT_BOUND), "the first attempt never came"
        deadline.cut_short()

    cutter = threading.Thread(target=cut)
    cutter.start()
    try:
        with pytest.raises(StorageUnavailable, match=r"could not check s3://b/k: stopped after 1 attempts") as raised:
            policy.call(fail, action="check", uri="s3://b/k", outer=deadline)
    finally:
        cutter.join(WAIT_BOUND)
    assert len(attempts) == 1
    assert attempts[0].stopped  # the attempt's own deadline (the policy's, or the outer one) carries the stop
    assert isinstance(raised.value.__cause__, ConnectionResetError)


def test_a_deadline_already_cut_short_starts_no_attempt():
    deadline = Deadline.from_seconds(30.0).stoppable()
    deadline.cut_short()
    called: list[Deadline] = []
    with pytest.raises(StorageUnavailable, match="stopped after 0 attempts"):
        RetryPolicy().call(called.append, action="read", uri="s3://b/k", outer=deadline)
    assert called == []
    assert deadline.expired


def test_the_earlier_of_two_deadlines_keeps_the_stop_of_either():
    outer = Deadline.from_seconds(600.0).stoppable()
    inner = Deadline.from_seconds(1.0)
    first = inner.min(outer)
    assert first.end == inner.end and first.stop is outer.stop
    assert outer.min(inner).stop is outer.stop
    outer.cut_short()
    assert first.stopped and first.pause(LONG_PAUSE)  # a pause ends at once once stopped


def test_a_deadline_without_a_stop_cannot_be_cut_short():
    with pytest.raises(ValueError, match="stoppable"):
        Deadline.from_seconds(1.0).cut_short()
    with pytest.raises(ValueError, match="one stop"):
        NO_DEADLINE.stoppable().min(NO_DEADLINE.stoppable())
