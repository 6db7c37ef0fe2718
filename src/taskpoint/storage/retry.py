"""How storage operations that failed transiently are retried: bounded in attempts and in time, with jittered
exponential backoff."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import StorageUnavailable
from .errormap import describe, is_transient

T = TypeVar("T")

#: Default of :attr:`RetryPolicy.deadline`, in seconds.
DEFAULT_DEADLINE = 120.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a storage operation that failed transiently.

    Attributes:
        attempts: how many times an operation runs at most.
        initial_delay, max_delay, multiplier: the pause before each retry (jittered, growing exponentially).
        deadline: seconds, measured from the start of an operation's first attempt, after which no new attempt
            starts (a retry whose pause would end after it is not made either); then
            :class:`~taskpoint.errors.StorageUnavailable` names the deadline. None: no deadline. A running
            attempt cannot be interrupted from Python; each is bounded by the client's own timeouts (taskpoint
            sets S3's connect and read timeouts to at most the deadline, see
            :class:`~taskpoint.storage.Location`). Default 120 s.
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
        delay = self.initial_delay
        started = time.monotonic()
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
                time.sleep(pause)
                delay = min(delay * self.multiplier, self.max_delay)
        raise AssertionError("unreachable")  # pragma: no cover
