"""The manager's side of preemption: whether a notice arrived, and the emergency save at the next safe point.

The manager passes its own operations down as callbacks (finish the save in flight, the next step, a
blocking save), so this module knows nothing of the orchestrator above it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .. import preemption
from ..errors import Preempted

_log = logging.getLogger("taskpoint")


class PreemptionPolicy:
    """``preemption`` (install the handlers, react to notices) and ``on_preemption`` (the state to save)."""

    def __init__(self, enabled: bool, on_preemption: Callable[[], Any] | None) -> None:
        if on_preemption is not None and not callable(on_preemption):
            raise TypeError(f"on_preemption must be a function returning the state to save, not "
                            f"{type(on_preemption).__name__}")
        self.enabled = bool(enabled)
        self.fn = on_preemption
        self._saving = False
        if self.enabled:
            preemption.install()  # only from the main thread; elsewhere it installs nothing

    def reached(self) -> bool:
        return self.enabled and preemption.notice() is not None

    def due(self, fn: Callable[[], Any] | None = None) -> bool:
        """True when the next safe point must save the emergency state (``fn``'s, else ``on_preemption``'s),
        and not while it is being saved."""
        return (fn or self.fn) is not None and not self._saving and self.reached()

    def run(self, settle: Callable[[], None], next_step: Callable[[], int],
            save: Callable[[Any, int, dict[str, Any]], str], fn: Callable[[], Any] | None = None) -> NoReturn:
        """Finish the save in flight, save ``fn()`` as the next step (blocking, to its commit), and raise
        :class:`Preempted`. Repeated signals meanwhile are only counted (:func:`preemption.emergency`)."""
        notice, fn = preemption.notice(), fn or self.fn
        assert notice is not None and fn is not None
        with preemption.emergency():
            self._saving = True
            try:
                try:
                    settle()
                except Exception as exc:  # the emergency state is newer: it is saved all the same
                    _log.warning("taskpoint: the background save in flight when %s arrived failed (%s: %s); "
                                 "saving the emergency state all the same", notice.name, type(exc).__name__, exc)
                step = next_step()
                data = fn()
                meta = {"preempted": {"signal": notice.name, "at": notice.at, "deadline": notice.deadline}}
                uri = save(data, step, meta)
                committed = time.time()
            finally:
                self._saving = False
        _log.warning("taskpoint: %s: the emergency save committed step %d at %s, %.2f s after the notice "
                     "(%.1f s before its deadline); ending the attempt", notice.name, step, uri,
                     committed - notice.at, notice.deadline - committed)
        raise Preempted(notice.signal, step, uri, committed)
