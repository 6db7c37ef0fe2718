"""Steps that a signal does not cut in half: a handler made :func:`deferrable` waits for their end.

Python runs a signal's handler in the main thread between two bytecodes, so a handler that raises (the CLI's
SIGTERM, Ctrl-C) can land anywhere: after a staging folder is made and before the ``try`` that removes it, in
the middle of that removal, between two renames of a publish, or after the request that starts an upload and
before its id is kept for the abort. Such steps run inside :func:`uninterrupted`; a :func:`deferrable` handler
whose signal arrives meanwhile runs when the outermost section ends (at once, and never lost). Sections are
short: a ``mkdtemp``, an ``rmtree``, a few renames, one request.

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
