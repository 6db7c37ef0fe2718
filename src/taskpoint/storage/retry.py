"""How storage operations that failed transiently are retried: bounded, with jittered exponential backoff."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .._log import logger, safe_uri
from ..errors import StorageUnavailable
from .errormap import describe, is_transient

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a storage operation that failed transiently."""

    attempts: int = 4
    initial_delay: float = 0.25
    max_delay: float = 8.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")

    def call(self, fn: Callable[[], T], *, action: str, uri: str) -> T:
        """Run ``fn``; retry transient failures with jittered exponential backoff, then raise
        :class:`~taskpoint.errors.StorageUnavailable`. Other failures are raised at once, unchanged."""
        delay = self.initial_delay
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except BaseException as exc:
                if not is_transient(exc):
                    raise
                if attempt == self.attempts:
                    raise StorageUnavailable(
                        f"could not {action} {uri}: storage kept failing after {attempt} attempts "
                        f"({describe(exc)}). Check the network and the storage service, then "
                        "run again; no checkpoint was lost or reported missing."
                    ) from exc
                pause = delay * random.uniform(0.5, 1.0)
                logger.debug("retrying %s %s in %.2f s (attempt %d of %d failed: %s)", action, safe_uri(uri), pause,
                             attempt, self.attempts, describe(exc))
                time.sleep(pause)
                delay = min(delay * self.multiplier, self.max_delay)
        raise AssertionError("unreachable")  # pragma: no cover
