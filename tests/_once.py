"""A module fixture's result produced once per pytest session, not once in each pytest-xdist worker that needs it.

``make test`` runs ``-n 3 --dist worksteal``: an idle worker takes the tail of another's queue, so a module's tests
may run in two or three workers, and the conftest's slow-first order already puts a module's slow tests apart from
its others. Each such run sets the module's fixtures up again: a torchrun job, a wheel build, an uninterrupted
training run. :func:`shared_once` lets the first process that asks produce the result under a lock in the session's
temp folder (the one every worker's ``tmp_path_factory`` folder is in) and keep it there, pickled; a process that
finds the lock held waits for it (bounded, with a line on stdout), then reads the result: the very values the tests
assert on, not a record that they passed. A ``produce`` that raises keeps nothing, so the next process that asks
produces it again (and fails the same way).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import pytest

T = TypeVar("T")
#: How often a waiting process tries the lock again.
POLL = 1.0


def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str, produce: Callable[[], T], within: float) -> T:
    """``produce()``, produced once per session under ``name``: under pytest-xdist in the folder its workers share,
    else in this session's own temp folder. A process that finds another producing it waits at most ``within``
    seconds (then ``TimeoutError``). Paths in the result must stay valid for the session: the workers'
    ``tmp_path_factory`` folders do."""
    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    result, lock = folder / f"{name}.pickle", folder / f"{name}.lock"
    with lock.open("a") as held:
        _take(held, name, lock, within)
        try:
            if result.exists():
                print(f"{name}: produced by another worker; reading {result}", flush=True)
                with result.open("rb") as stored:
                    produced: T = pickle.load(stored)
                return produced
            produced = produce()
            partial = result.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(produced))
            partial.rename(result)
            return produced
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _take(held: IO[str], name: str, lock: Path, within: float) -> None:
    """Take the lock ``held`` is open on, waiting at most ``within`` seconds for the process that holds it."""
    deadline = time.monotonic() + within
    waiting = False
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not waiting:
                print(f"{name}: another worker is producing it; waiting at most {within:g} s", flush=True)
                waiting = True
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: another worker held {lock} for more than {within:g} s") from None
            time.sleep(POLL)
