"""The manager's side of preemption: whether a notice arrived, and the emergency save at the next safe point.

The manager passes its own operations down as callbacks (finish the save in flight, the next step, a
blocking save, the wait for rank 0's commit), so this module knows nothing of the orchestrator above it. With
several ranks the answer comes from the :class:`~.agreement.Agreement`: every rank stops at the same step,
and no rank ends before rank 0 settled it (a launcher such as torchrun tears down the job when one rank exits).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .. import preemption
from ..errors import Preempted, StepAbandonedError
from .agreement import Agreement, NoAgreement

_log = logging.getLogger("taskpoint")


class PreemptionPolicy:
    """``preemption`` (install the handlers, react to notices) and ``on_preemption`` (the state to save);
    ``agreement`` decides the step where every rank stops."""

    def __init__(self, enabled: bool, on_preemption: Callable[[], Any] | None, agreement: Agreement) -> None:
        if on_preemption is not None and not callable(on_preemption):
            raise TypeError(f"on_preemption must be a function returning the state to save, not "
                            f"{type(on_preemption).__name__}")
        self.enabled = bool(enabled)
        self.fn = on_preemption
        self.agreement = agreement
        self._saving = False
        if self.enabled:
            preemption.install()  # only from the main thread; elsewhere it installs nothing

    @property
    def saving(self) -> bool:
        """Whether the emergency save is running (with a local tier it goes to the remote tier)."""
        return self._saving

    def reached(self, step: int | None = None, resume: Callable[[], int | None] | None = None) -> bool:
        """Whether this safe point stops: a notice arrived (with several ranks: on any rank, and every rank
        reached the agreed step). A failed agreement ends the attempt without an emergency step."""
        if not self.enabled or self._saving:
            return self.enabled and preemption.notice() is not None
        try:
            return self.agreement.reached(step)
        except NoAgreement as exc:
            self.agreement.close()
            if self.agreement.commits:
                self.agreement.forget()
            newest = None
            with contextlib.suppress(Exception):  # only for the message
                newest = resume() if resume is not None else None
            signal = self.agreement.signal or 15
            preemption.ending("taskpoint: %s; ending the attempt without an emergency step: the newest committed "
                              "step (%s) stays the resume point", exc, newest)
            raise Preempted(signal) from exc

    def due(self, fn: Callable[[], Any] | None = None, step: int | None = None,
            resume: Callable[[], int | None] | None = None) -> bool:
        """True when this safe point must save the emergency state (``fn``'s, else ``on_preemption``'s), and
        not while it is being saved."""
        return (fn or self.fn) is not None and not self._saving and self.reached(step, resume)

    def run(self, settle: Callable[[], None], next_step: Callable[[], int],
            save: Callable[[Any, int, dict[str, Any]], str], settled: Callable[[int], str],
            fn: Callable[[], Any] | None = None, step: int | None = None) -> NoReturn:
        """Finish the save in flight, save ``fn()`` as the agreed ``step`` (with one rank, or without one: the
        next step; blocking, to its commit; a rank > 0 then waits with ``settled`` until rank 0 committed or
        abandoned it, :func:`~.shards.await_commit`), and raise :class:`Preempted`. Repeated signals meanwhile
        are only counted (:func:`preemption.emergency`). A step abandoned by rank 0 (a rank's shard never came)
        ends the attempt all the same, with no emergency step."""
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
                number = next_step()
                if self.agreement.distributed and step is not None:
                    number = max(step, number)  # the agreed step; after it when this rank saved it already
                data = fn()
                meta = {"preempted": {"signal": notice.name, "at": notice.at, "deadline": notice.deadline}}
                try:
                    uri = save(data, number, meta)
                except StepAbandonedError as exc:
                    preemption.ending("taskpoint: %s: the emergency step %d was not committed (%s); ending the "
                                      "attempt without it", notice.name, number, exc)
                    raise Preempted(notice.signal) from exc
                outcome = "committed" if not self.agreement.distributed or self.agreement.commits else settled(
                    number)
                committed = time.time()
            finally:
                self._saving = False
        if self.agreement.commits:
            self.agreement.forget()
        self.agreement.close()
        if outcome != "committed":
            preemption.ending("taskpoint: %s: this rank stored its shard of the emergency step %d at %s, but rank 0 "
                              "did not commit it (%s); ending the attempt: the newest committed step stays the "
                              "resume point", notice.name, number, uri, outcome)
            raise Preempted(notice.signal)
        preemption.ending("taskpoint: %s: the emergency save committed step %d at %s, %.2f s after the notice "
                          "(%.1f s before its deadline); ending the process with status %d", notice.name, number,
                          uri, committed - notice.at, notice.deadline - committed, 128 + notice.signal)
        raise Preempted(notice.signal, number, uri, committed)
