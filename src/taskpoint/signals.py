"""Signal handlers that never cut taskpoint's steps in half: for programs whose handlers raise.

Python runs a signal's handler in the main thread between two bytecodes, so a handler that raises (a
command line's SIGTERM, Ctrl-C's ``KeyboardInterrupt``) can land anywhere: after a staging folder is made and
before the ``try`` that removes it, in the middle of that removal, between two renames of a publish, or after
the request that starts an upload and before its id is kept for the abort. taskpoint runs such steps inside
:func:`uninterrupted`; a handler wrapped with :func:`deferrable` whose signal arrives meanwhile runs when the
outermost section ends (at once, and never lost). Sections are short: a ``mkdtemp``, an ``rmtree``, a few
renames, one request. What a signal still kept from its removal (a load's staging folder, when the signal
landed as its block ended) is removed by :func:`remove_leftovers`, and at the latest when the process exits::

    signal.signal(signal.SIGTERM, taskpoint.signals.deferrable(my_raising_handler))
    try:
        run_the_work()
    finally:
        taskpoint.signals.remove_leftovers()

The ``taskpoint`` command line does exactly this for SIGTERM and Ctrl-C. A handler that does not raise (the
preemption notice of :mod:`taskpoint.preemption`, which only records the signal) needs none of it.

Signals are process-wide and their handlers run in the main thread, so the state is too: the depth of the main
thread's sections and the handler calls held meanwhile, as module globals that only the main thread touches
(the handler runs between two of its bytecodes, which may be inside any lock: no locks here). Elsewhere a
section is nothing: no handler can interrupt another thread. This module imports nothing of taskpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import FrameType

#: A Python signal handler, as :func:`signal.signal` takes it.
Handler = Callable[[int, "FrameType | None"], object]

_depth = 0  # the main thread's open sections
_held: list[tuple[Handler, int, FrameType | None]] = []  # handler calls that wait for the outermost section's end


class _Section:
    """One :func:`uninterrupted` block; a class, not a generator, so that nothing runs between the count going
    up and the block starting (a generator's ``__enter__`` is a call, after which a signal may land)."""

    def __init__(self) -> None:
        self._counted = False

    def __enter__(self) -> None:
        global _depth
        if threading.current_thread() is threading.main_thread():
            _depth += 1
            self._counted = True

    def __exit__(self, *exc: object) -> None:
        global _depth
        if not self._counted:
            return
        _depth -= 1
        if _depth == 0:
            while _held:
                handler, signum, frame = _held.pop(0)
                handler(signum, frame)


def uninterrupted() -> _Section:
    """Within the block (in the main thread), the handlers made :func:`deferrable` wait; when the outermost
    block ends, those held run, in the order their signals came (a raising one raises from the block's end)."""
    return _Section()


def deferrable(handler: Handler) -> Handler:
    """``handler``, made to wait for the end of the :func:`uninterrupted` sections it lands in."""

    def run(signum: int, frame: FrameType | None) -> object:
        if _depth:
            _held.append((handler, signum, frame))
            return None
        return handler(signum, frame)

    return run


_leftover_removers: list[Callable[[], None]] = []


def register_leftovers(remove: Callable[[], None]) -> None:
    """Have :func:`remove_leftovers` call ``remove`` (once registered, always: a module registers its remover
    when it first keeps something). The library's own use: the staging folders of loads."""
    if remove not in _leftover_removers:
        _leftover_removers.append(remove)


def remove_leftovers() -> None:
    """Remove what a signal kept from its removal in this process (the staging folders of loads that a
    :func:`deferrable` handler ended as their blocks ended). Idempotent; also run at the process's exit."""
    for remove in list(_leftover_removers):
        remove()
