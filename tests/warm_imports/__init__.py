"""Two modules that import each other, for the test of a request the save process serves while it imports modules
ahead (tests/e2e/test_saver_warm.py): :mod:`.first` (imported ahead) and :mod:`.second` (whose ``Job`` the request
unpickles). Where ``$TASKPOINT_TEST_WARM_MARKERS`` names a folder, each waits (bounded) until the other's import is
under way, so that two threads importing them at once meet inside them, as torch's and numpy's imports do; where it
is unset they import at once. Imported on one thread, :mod:`.first` goes first."""

from __future__ import annotations

import importlib._bootstrap
import os
import time
from pathlib import Path

#: How long one of the modules waits for the other's import to be under way before it goes on alone.
MEET_SECONDS = 2.0


def _markers() -> Path | None:
    folder = os.environ.get("TASKPOINT_TEST_WARM_MARKERS")
    return Path(folder) if folder else None


def announce(what: str) -> None:
    """Say that ``what`` happened (a file in the markers folder)."""
    folder = _markers()
    if folder is not None:
        (folder / what).touch()


def announced(what: str) -> bool:
    folder = _markers()
    return folder is not None and (folder / what).exists()


def await_(what: str) -> None:
    """Wait until ``what`` was announced, or :data:`MEET_SECONDS` passed."""
    folder = _markers()
    deadline = time.monotonic() + MEET_SECONDS
    while folder is not None and not (folder / what).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def await_blocked(module: str) -> None:
    """Wait until another thread waits for ``module``'s import lock (CPython's record of blocked imports), or
    :data:`MEET_SECONDS` passed: the import this thread makes next then closes a cycle of import locks."""
    deadline = time.monotonic() + MEET_SECONDS
    while _markers() is not None and not _blocked_on(module) and time.monotonic() < deadline:
        time.sleep(0.01)


def _blocked_on(module: str) -> bool:
    for held in list(getattr(importlib._bootstrap, "_blocking_on", {}).values()):
        locks = held if isinstance(held, list) else [held]  # a list of locks per thread since Python 3.12
        if any(getattr(lock, "name", None) == module for lock in locks):
            return True
    return False
