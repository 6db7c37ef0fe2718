"""The deadline of a retried storage operation, as a value passed down to every call the operation makes,
including those it hands to pool threads (ranged reads, part uploads), which a thread-local would not reach."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fsspec.asyn import AsyncFileSystem

#: The shortest timeout given to a call when a deadline is near or past (the call then fails at once, as
#: transient, and the retry policy reports the deadline).
MIN_CALL_TIMEOUT = 0.5


@dataclass(frozen=True, slots=True)
class Deadline:
    """A moment on the monotonic clock (``end``, None: never) after which an operation starts no new attempt
    and its calls are cancelled; ``seconds``, how long it was when it was set, names it in messages. ``stop``,
    where its owner can cut it short (:meth:`stoppable`): once set, the operation starts no new attempt either
    (a request in flight ends at its own bound), as for a request beside a write that failed, whose answer is no
    longer needed."""

    end: float | None = None
    seconds: float | None = None
    stop: threading.Event | None = field(default=None, compare=False)

    @classmethod
    def from_seconds(cls, seconds: float | None) -> Deadline:
        """The deadline ``seconds`` from now (None: none)."""
        return NO_DEADLINE if seconds is None else cls(time.monotonic() + seconds, seconds)

    def stoppable(self) -> Deadline:
        """This deadline, with a stop of its own that :meth:`cut_short` sets."""
        return replace(self, stop=threading.Event())

    def cut_short(self) -> None:
        """Stop the operations running by this deadline: each starts no new attempt (:attr:`stopped`)."""
        if self.stop is None:
            raise ValueError("this deadline cannot be cut short: make it with Deadline.stoppable()")
        self.stop.set()

    @property
    def stopped(self) -> bool:
        """True once :meth:`cut_short` was called."""
        return self.stop is not None and self.stop.is_set()

    def pause(self, seconds: float) -> bool:
        """Sleep ``seconds``, or until the deadline is cut short: then True."""
        if self.stop is None:
            time.sleep(seconds)
            return False
        return self.stop.wait(seconds)

    def time_left(self) -> float | None:
        """Seconds left (negative once it has passed); None without a deadline."""
        return None if self.end is None else self.end - time.monotonic()

    @property
    def expired(self) -> bool:
        """True once the deadline has passed or was cut short."""
        return self.stopped or (self.end is not None and time.monotonic() >= self.end)

    def min(self, other: Deadline) -> Deadline:
        """The one of the two that comes first, with the stop of either: an operation inside another ends by the
        outer one's deadline, and stops with it. (One operation has one stop: two different ones are refused.)"""
        if self.stop is not None and other.stop is not None and self.stop is not other.stop:
            raise ValueError("an operation can be cut short by one stop only")
        first = self if other.end is None or (self.end is not None and self.end <= other.end) else other
        stop = self.stop or other.stop
        return first if first.stop is stop else replace(first, stop=stop)


#: No deadline: calls last as long as the client's own timeouts let them.
NO_DEADLINE = Deadline()


def bounded(fs: Any, deadline: Deadline) -> dict[str, Any]:
    """``timeout=`` for one call of an async fsspec client: the time left before ``deadline``. fsspec's sync
    wrappers cancel the call when it runs out. Nothing for other filesystems, or without a deadline."""
    if deadline.end is None or not isinstance(fs, AsyncFileSystem):
        return {}
    return {"timeout": max(deadline.end - time.monotonic(), MIN_CALL_TIMEOUT)}
