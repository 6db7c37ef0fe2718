"""The deadline of a retried storage operation, as a value passed down to every call the operation makes,
including those it hands to pool threads (ranged reads, part uploads), which a thread-local would not reach."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fsspec.asyn import AsyncFileSystem

#: The shortest timeout given to a call when a deadline is near or past (the call then fails at once, as
#: transient, and the retry policy reports the deadline).
MIN_CALL_TIMEOUT = 0.5


@dataclass(frozen=True, slots=True)
class Deadline:
    """A moment on the monotonic clock (``end``, None: never) after which an operation starts no new attempt
    and its calls are cancelled; ``seconds``, how long it was when it was set, names it in messages."""

    end: float | None = None
    seconds: float | None = None

    @classmethod
    def from_seconds(cls, seconds: float | None) -> Deadline:
        """The deadline ``seconds`` from now (None: none)."""
        return NO_DEADLINE if seconds is None else cls(time.monotonic() + seconds, seconds)

    def time_left(self) -> float | None:
        """Seconds left (negative once it has passed); None without a deadline."""
        return None if self.end is None else self.end - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def min(self, other: Deadline) -> Deadline:
        """The one of the two that comes first: an operation inside another ends by the outer one's deadline."""
        if other.end is None or (self.end is not None and self.end <= other.end):
            return self
        return other


#: No deadline: calls last as long as the client's own timeouts let them.
NO_DEADLINE = Deadline()


def bounded(fs: Any, deadline: Deadline) -> dict[str, Any]:
    """``timeout=`` for one call of an async fsspec client: the time left before ``deadline``. fsspec's sync
    wrappers cancel the call when it runs out. Nothing for other filesystems, or without a deadline."""
    if deadline.end is None or not isinstance(fs, AsyncFileSystem):
        return {}
    return {"timeout": max(deadline.end - time.monotonic(), MIN_CALL_TIMEOUT)}
