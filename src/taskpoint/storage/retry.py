"""How storage operations that failed transiently are retried: bounded in attempts and in time, with jittered
exponential backoff."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .._log import logger, safe_uri
from ..errors import StorageUnavailable
from .errormap import describe, is_transient

T = TypeVar("T")

#: Default of :attr:`RetryPolicy.deadline`, in seconds.
DEFAULT_DEADLINE = 120.0
#: Client timeouts (seconds) that a retry deadline shorter than this lowers, so that one attempt cannot outlast
#: it by much (botocore's connect and read timeouts are 60 s by default; obstore's are set to the same).
CLIENT_TIMEOUT = 60.0

_running = threading.local()


def time_left() -> float | None:
    """Seconds left before the deadline of the retried operation running in this thread (negative once it has
    passed); None outside one, or without a deadline. Backends pass it to the client as the timeout of a call."""
    end: float | None = getattr(_running, "end", None)
    return None if end is None else end - time.monotonic()


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a storage operation that failed transiently.

    Attributes:
        attempts: how many times an operation runs at most.
        initial_delay, max_delay, multiplier: the pause before each retry (jittered, growing exponentially).
        deadline: seconds, measured from the start of an operation's first attempt, after which no new attempt
            starts (a retry whose pause would end after it is not made either); then
            :class:`~taskpoint.errors.StorageUnavailable` names the deadline. None: no deadline. Single calls
            of the async clients (s3fs, gcsfs, adlfs: checks, record reads, listings) are given the time left
            and cancelled when it runs out; a streaming transfer cannot be interrupted from Python, and is
            bounded only by the client's own timeouts (lowered to the deadline when it is under 60 s, see
            :func:`~taskpoint.storage.location.client_timeouts`). Each of obstore's requests (``s3_client="obstore"``)
            lasts at most the deadline of the policy the location was made with. Default 120 s.
    """

    attempts: int = 4
    initial_delay: float = 0.25
    max_delay: float = 8.0
    multiplier: float = 2.0
    deadline: float | None = DEFAULT_DEADLINE

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if self.deadline is not None and not self.deadline > 0:
            raise ValueError("RetryPolicy.deadline must be a positive number of seconds, or None")

    def call(self, fn: Callable[[], T], *, action: str, uri: str) -> T:
        """Run ``fn``; retry transient failures with jittered exponential backoff, then raise
        :class:`~taskpoint.errors.StorageUnavailable` (after :attr:`attempts` attempts, or once
        :attr:`deadline` has passed). Other failures are raised at once, unchanged."""
        started = time.monotonic()
        outer: float | None = getattr(_running, "end", None)
        if self.deadline is not None:
            end = started + self.deadline
            _running.end = end if outer is None else min(end, outer)
        try:
            return self._attempts(fn, action, uri, started)
        finally:
            _running.end = outer

    def _attempts(self, fn: Callable[[], T], action: str, uri: str, started: float) -> T:
        delay = self.initial_delay
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except BaseException as exc:
                if not is_transient(exc):
                    raise
                pause = delay * random.uniform(0.5, 1.0)
                if attempt == self.attempts:
                    raise StorageUnavailable(
                        f"could not {action} {uri}: storage kept failing after {attempt} attempts "
                        f"({describe(exc)}). Check the network and the storage service, then "
                        "run again; no checkpoint was lost or reported missing."
                    ) from exc
                if self.deadline is not None and time.monotonic() - started + pause >= self.deadline:
                    raise StorageUnavailable(
                        f"could not {action} {uri}: storage kept failing until the retry deadline of "
                        f"{self.deadline:g} s passed ({attempt} attempts; last: {describe(exc)}). Check the "
                        "network and the storage service (an endpoint that accepts connections and never "
                        "answers looks like this), then run again; no checkpoint was lost or reported missing."
                    ) from exc
                logger.debug("retrying %s %s in %.2f s (attempt %d of %d failed: %s)", action, safe_uri(uri), pause,
                             attempt, self.attempts, describe(exc))
                time.sleep(pause)
                delay = min(delay * self.multiplier, self.max_delay)
        raise AssertionError("unreachable")  # pragma: no cover
