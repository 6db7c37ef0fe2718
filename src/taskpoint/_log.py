"""The ``taskpoint`` logger and the figures of one save or load (the bottom layer, beside :mod:`.errors`).

The package never configures logging: the logger has a ``NullHandler``, so nothing is printed unless the
application adds a handler (``logging.basicConfig(level=logging.INFO)`` shows one line per save and load).
Records carry the figures as ``record.transfer`` (a :class:`TransferStats`). URIs are logged without user
information and query strings (``user:password@``, SAS tokens); storage options are never logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

INFO = logging.INFO
logger = logging.getLogger("taskpoint")
logger.addHandler(logging.NullHandler())


@dataclass(frozen=True)
class TransferStats:
    """One save or load: what moved, how much, how long the caller waited and how long it took in all."""

    #: ``"save"`` or ``"load"``.
    operation: str
    #: Where (without user information or query string).
    uri: str
    #: The payload kind (``bytes``, ``file``, ``directory``, ...).
    kind: str
    #: Bytes of the stored object (compressed, for directories): what crossed the wire.
    bytes: int
    #: Seconds the calling thread was blocked (a background save returns after its snapshot).
    blocked_seconds: float
    #: Seconds from the call to the end of the transfer (for a background save: to its commit).
    total_seconds: float
    #: The manager step, where it applies.
    step: int | None = None
    #: Answers by which the store asked to slow down (429, 503 SlowDown) while it ran, all retried: requests
    #: of other operations on the same store at the same time are counted too.
    throttled: int = 0

    @property
    def mb_per_s(self) -> float:
        """Stored megabytes (10**6 bytes) per second of the whole transfer."""
        return self.bytes / 1e6 / self.total_seconds if self.total_seconds > 0 else 0.0


def safe_uri(uri: str) -> str:
    """``uri`` without ``user:password@`` and without a query string or fragment (tokens live there)."""
    if "://" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri.partition("://")[0] + "://<unparsable>"
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def short_name(uri: str) -> str:
    """The last part of ``uri``'s path (never user information or a query string): a progress bar's label."""
    return safe_uri(uri).rstrip("/").rpartition("/")[2] or safe_uri(uri)


class Clock:
    """Started when an operation is called; :meth:`release` marks when the caller got control back.
    ``throttles``: the count of the store's throttling answers so far (:meth:`Location.throttles
    <taskpoint.storage.Location.throttles>`), whose growth the figures report."""

    def __init__(self, throttles: Callable[[], int] | None = None) -> None:
        self._throttles = throttles
        self._throttled_before = 0 if throttles is None else throttles()
        self.start = time.perf_counter()
        #: When the call returned while the work goes on elsewhere (a background save); None until then.
        self.released: float | None = None

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` out of the operation's time: the import of the extra that reads a payload's kind
        (torch, for a state dict: seconds, once per process), which is not the transfer's."""
        self.start += seconds

    def release(self) -> None:
        """The call returns now; work still running (a background save) reports this as the blocked time."""
        self.released = time.perf_counter()

    def stats(self, operation: str, uri: str, kind: str, size: int | None, step: int | None = None
              ) -> TransferStats:
        total = time.perf_counter() - self.start
        blocked = total if self.released is None else min(total, self.released - self.start)
        throttled = 0 if self._throttles is None else self._throttles() - self._throttled_before
        return TransferStats(operation, safe_uri(uri), kind, int(size or 0), blocked, total, step, throttled)


def log_transfer(stats: TransferStats) -> TransferStats:
    """One INFO record for a finished save or load; returns ``stats``."""
    if logger.isEnabledFor(INFO):
        where = "" if stats.step is None else f" step {stats.step}"
        verb = "saved" if stats.operation == "save" else "loaded"
        pushed = f", {stats.throttled} throttled answers retried" if stats.throttled else ""
        logger.info("%s %s%s (%s, %d bytes) in %.3f s (caller blocked %.3f s), %.1f MB/s%s", verb, stats.uri, where,
                    stats.kind, stats.bytes, stats.total_seconds, stats.blocked_seconds, stats.mb_per_s, pushed,
                    extra={"transfer": stats})
    return stats


def transferred(operation: str, uri: str, kind: str, size: int | None, clock: Clock,
                step: int | None = None) -> TransferStats:
    """The figures of an operation timed by ``clock``, logged at INFO."""
    return log_transfer(clock.stats(operation, uri, kind, size, step))
