"""Which task attempt is running (None outside a task), for the manifests this layer writes.

The runtime layer's lookup is installed with :func:`set_attempt_source` by ``taskpoint/__init__.py``, so that
this layer never imports the runtime.
"""

from __future__ import annotations

from collections.abc import Callable


def _no_attempt() -> int | None:
    return None


_attempt_source: Callable[[], int | None] = _no_attempt


def set_attempt_source(source: Callable[[], int | None]) -> None:
    """Install the function that tells the running task attempt (``taskpoint/__init__.py`` does, once)."""
    global _attempt_source
    _attempt_source = source


def running_attempt() -> int | None:
    """The running task attempt, as the installed source tells it (None outside a task)."""
    return _attempt_source()
