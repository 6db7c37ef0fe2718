"""tests/_once.py: a module fixture's result produced once per session, whoever asks for it and when.

Two askers here are two threads: each opens the lock file itself, and ``flock`` locks of two open files exclude each
other within one process as between the pytest-xdist workers.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from _once import shared_once
from helpers import wait_until


class Blocked:
    """A ``produce`` that says it started and returns only once released (at most 60 s later)."""

    def __init__(self, value: Any) -> None:
        self.value, self.calls = value, 0
        self.started, self.released = threading.Event(), threading.Event()

    def __call__(self) -> Any:
        self.calls += 1
        self.started.set()
        assert self.released.wait(60), "never released"
        return self.value


def asker(tmp_path_factory: pytest.TempPathFactory, name: str, produce: Any, within: float = 60.0
          ) -> tuple[threading.Thread, list[Any]]:
    """A thread asking for ``name``; what it got (or raised) is in the list once it has ended."""
    got: list[Any] = []

    def ask() -> None:
        try:
            got.append(shared_once(tmp_path_factory, name, produce, within))
        except Exception as error:  # handed to the test, which asserts on it
            got.append(error)

    thread = threading.Thread(target=ask, name=f"asker-{name}")
    thread.start()
    return thread, got


def test_the_first_asker_produces_and_one_that_waited_meanwhile_reads_its_very_values(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    name = f"once-{uuid.uuid4().hex}"
    first = Blocked({1: ("a", 2.5)})  # int keys and tuples: not JSON's, the result's own types
    second = Blocked({"never": "produced"})
    second.released.set()
    thread_a, got_a = asker(tmp_path_factory, name, first)
    assert first.started.wait(60)
    thread_b, got_b = asker(tmp_path_factory, name, second)
    printed: list[str] = []
    assert wait_until(lambda: printed.append(capsys.readouterr().out) or "waiting at most" in "".join(printed)), \
        printed  # the second asker found the first producing and waits, saying so
    first.released.set()
    for thread in (thread_a, thread_b):
        thread.join(60)
        assert not thread.is_alive()
    assert got_a == got_b == [{1: ("a", 2.5)}]
    assert (first.calls, second.calls) == (1, 0)
    assert shared_once(tmp_path_factory, name, second, 60) == {1: ("a", 2.5)}  # and any later asker
    assert second.calls == 0


def test_a_produce_that_raises_keeps_nothing_and_the_next_asker_produces(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    name = f"once-{uuid.uuid4().hex}"

    def fails() -> Any:
        raise ValueError("the job failed")

    with pytest.raises(ValueError, match="the job failed"):
        shared_once(tmp_path_factory, name, fails, 60)
    assert shared_once(tmp_path_factory, name, lambda: [3], 60) == [3]


def test_an_asker_waits_for_another_producing_at_most_its_bound(tmp_path_factory: pytest.TempPathFactory) -> None:
    name = f"once-{uuid.uuid4().hex}"
    first = Blocked("slow")
    thread_a, got_a = asker(tmp_path_factory, name, first)
    try:
        assert first.started.wait(60)
        thread_b, got_b = asker(tmp_path_factory, name, lambda: "not asked", within=0.5)
        thread_b.join(60)
        assert len(got_b) == 1 and isinstance(got_b[0], TimeoutError), got_b
        assert f"{name}: another worker held" in str(got_b[0]), got_b
    finally:
        first.released.set()
        thread_a.join(60)
    assert got_a == ["slow"]
