"""How storage operations that failed transiently are retried: bounded in attempts and in time, with jittered
exponential backoff; throttling answers with full jitter, honouring the store's ``Retry-After``
(:mod:`.throttle` says where this backoff sits beside the clients' own)."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from .._log import logger, safe_uri
from ..errors import StorageUnavailable
from .deadline import NO_DEADLINE, Deadline
from .errormap import SYMPTOM_ADVICE, Symptom, describe, is_transient, strongest, symptom
from .stalls import STALL_TIMEOUT
from .throttle import Pushback, full_jitter, retry_after, throttled

T = TypeVar("T")

#: Default of :attr:`RetryPolicy.deadline`, in seconds.
DEFAULT_DEADLINE = 120.0
#: Client timeouts (seconds) that a retry deadline shorter than this lowers, so that one attempt cannot outlast
#: it by much (botocore's connect and read timeouts are 60 s by default; obstore's are set to the same).
CLIENT_TIMEOUT = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a storage operation that failed transiently.

    Attributes:
        attempts: how many times an operation runs at most. Attempts that met throttling (the store asked to
            wait: 429, 503 SlowDown) do not count where a deadline bounds the operation: then the deadline is
            the budget, and a store that throttles a share of the requests costs time, not the operation.
        initial_delay, max_delay, multiplier: the pause before each retry (jittered, growing exponentially).
        deadline: seconds, measured from the start of an operation's first attempt, after which no new attempt
            starts (a retry whose pause would end after it is not made either); then
            :class:`~taskpoint.errors.StorageUnavailable` names the deadline. None: no deadline. Default 120 s.
        stall_timeout: seconds after which one transfer (a part of an upload, a ranged read of a large object)
            that made no progress is abandoned and sent again, within the deadline; once the deadline passes,
            StorageUnavailable names the object and the part or byte range (:mod:`~taskpoint.storage.stalls`).
            Default 60 s.

    What the deadline bounds: the operation is handed a :class:`~taskpoint.storage.deadline.Deadline` (the earlier
    of its own and that of an operation it runs inside), which it passes down to each call, also to those it hands
    to pool threads. Single calls of the async clients (s3fs, gcsfs, adlfs: checks, record reads and writes,
    listings, deletes, uploads of GCS and Azure objects of one part, each ranged GET of a large object, each part of
    an S3 upload) are given the time left and cancelled when it runs out. What it does not bound: a streaming
    transfer through a client's file object (GCS and Azure uploads larger than one part, the readahead stream of
    objects the ranged reader does not take) cannot be interrupted from Python, and is bounded only by the client's
    own timeouts (lowered to the deadline when it is under 60 s, see
    :func:`~taskpoint.storage.clients.client_timeouts`); obstore's requests (``s3_client="obstore"``) each last at
    most the deadline of the policy the location was made with, not the time left; local disk is not bounded; the
    work between calls (hashing, inflating, writing to local disk) is not interrupted, the next call starts with
    what is left.
    """

    attempts: int = 4
    initial_delay: float = 0.25
    max_delay: float = 8.0
    multiplier: float = 2.0
    deadline: float | None = DEFAULT_DEADLINE
    stall_timeout: float = STALL_TIMEOUT

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if not self.stall_timeout > 0:
            raise ValueError("RetryPolicy.stall_timeout must be a positive number of seconds")
        if self.deadline is not None and not self.deadline > 0:
            raise ValueError("RetryPolicy.deadline must be a positive number of seconds, or None")

    def call(self, fn: Callable[[Deadline], T], *, action: str, uri: str, endpoint: str | None = None,
             outer: Deadline = NO_DEADLINE, pushback: Pushback | None = None, count: bool = False) -> T:
        """Run ``fn(deadline)``, ``deadline`` being this call's (:attr:`deadline` from now, or ``outer`` when it
        comes first: the operation this one runs inside), which ``fn`` passes to the calls it makes; retry
        transient failures with jittered exponential backoff, then raise
        :class:`~taskpoint.errors.StorageUnavailable` (after :attr:`attempts` attempts, or once that deadline
        has passed), whose advice says whether the connections were refused or unanswered
        (``endpoint``: the store's URL, connected to once when the failures do not say). Other failures are
        raised at once, unchanged.

        A throttling answer (:mod:`~taskpoint.storage.throttle`) is retried after a pause drawn with full
        jitter and never shorter than the store's ``Retry-After`` (``pushback``: the store's, which also keeps
        the last one its client saw); ``count``: the client does not report its answers, so each one that
        reaches here is counted into ``pushback``, and is paced by it (:meth:`Pushback.pause
        <taskpoint.storage.throttle.Pushback.pause>`, at most :attr:`max_delay` unless the store asked for longer):
        no client retried it first. When the store throttled, StorageUnavailable names it."""
        return self._attempts(fn, action, uri, endpoint, Deadline.from_seconds(self.deadline).min(outer),
                              pushback, count)

    def _attempts(self, fn: Callable[[Deadline], T], action: str, uri: str, endpoint: str | None,
                  deadline: Deadline, pushback: Pushback | None, count: bool) -> T:
        delay = self.initial_delay
        seen: set[Symptom] = set()  # what the failures said about the endpoint, over every attempt
        before = pushback.throttled if pushback is not None else 0
        spent = 0  # the attempts that count against self.attempts
        attempt = 0
        while True:
            attempt += 1
            if deadline.stopped:
                raise _stopped(action, uri, attempt - 1)
            try:
                result = fn(deadline)
            except BaseException as exc:
                if not is_transient(exc):
                    raise
                found = symptom(exc)
                if found is not None:
                    seen.add(found)
                slow_down = throttled(exc)
                if slow_down and count and pushback is not None:
                    pushback.throttle(retry_after(exc))
                if slow_down:
                    asked = [w for w in (retry_after(exc), None if pushback is None else pushback.wait_asked())
                             if w is not None]
                    floor = max(asked, default=None)
                    if count and pushback is not None:  # no client retried it first (obstore's whole operations):
                        # paced as botocore's handler paces its own retries, short while the store throttles a
                        # request now and then (Pushback.pause), at most max_delay unless the store asked longer
                        pause = min(pushback.pause(attempt, floor), max(self.max_delay, floor or 0.0))
                    else:
                        pause = full_jitter(delay, floor)
                else:
                    pause = delay * random.uniform(0.5, 1.0)
                counted = not (slow_down and deadline.end is not None)
                spent += counted
                if spent == self.attempts:
                    raise StorageUnavailable(
                        f"could not {action} {uri}: storage kept failing after {attempt} attempts "
                        f"({describe(exc)}). {_why(pushback, before, seen, endpoint)}") from exc
                left = deadline.time_left()
                if left is not None and left <= pause:
                    raise StorageUnavailable(
                        f"could not {action} {uri}: storage kept failing until the retry deadline of "
                        f"{deadline.seconds:g} s passed ({attempt} attempts; last: {describe(exc)})."
                        f" {_why(pushback, before, seen, endpoint)}") from exc
                if counted:
                    logger.debug("retrying %s %s in %.2f s (attempt %d of %d failed: %s)", action, safe_uri(uri),
                                 pause, spent, self.attempts, describe(exc))
                else:
                    logger.debug("retrying %s %s in %.2f s (attempt %d throttled, which counts against the deadline "
                                 "only: %s)", action, safe_uri(uri), pause, attempt, describe(exc))
                if deadline.pause(pause):
                    raise _stopped(action, uri, attempt) from exc
                delay = min(delay * self.multiplier, self.max_delay)
            else:
                if count and pushback is not None:
                    pushback.answered()
                return result


def _stopped(action: str, uri: str, attempts: int) -> StorageUnavailable:
    """The error of an operation whose deadline was cut short (:meth:`Deadline.cut_short`) before it was done."""
    logger.debug("stopped %s %s after %d attempts: its answer is no longer needed", action, safe_uri(uri), attempts)
    return StorageUnavailable(f"could not {action} {uri}: stopped after {attempts} attempts, its answer no longer "
                              "needed (the request it ran beside failed)")


def _why(pushback: Pushback | None, before: int, seen: set[Symptom], endpoint: str | None) -> str:
    """What to check: when the store throttled during the operation (its count was ``before``), the store's
    name and how often, since the connections' symptoms then only say that the answers were refusals;
    otherwise the :func:`_advice` of the symptoms."""
    if pushback is None or pushback.throttled == before:
        return _advice(seen, endpoint)
    return (f"The store {safe_uri(pushback.store)} answered {pushback.throttled - before} requests with "
            "throttling (429, or 503 SlowDown) and did not let up before the retries ran out: lower the request "
            "rate (fewer ranks saving at once, fewer and larger objects), or ask the provider to raise the limit. "
            f"{_AGAIN}")


def _advice(seen: set[Symptom], endpoint: str | None) -> str:
    """What to check, from what the failures said about the endpoint; when they say only that no answer came,
    from one TCP connection to ``endpoint`` (where it is known), which tells refused from silent."""
    found = strongest(seen)
    if found is Symptom.NO_ANSWER and endpoint is not None:
        found = probe(endpoint) or found
    check = SYMPTOM_ADVICE[found] if found is not None else "Check the network and the storage service"
    return f"{check}. {_AGAIN}"


_AGAIN = "Then run again; no checkpoint was lost or reported missing."


#: How long :func:`probe` waits for a TCP connection (seconds).
PROBE_TIMEOUT = 1.0
_DEFAULT_PORTS = {"http": 80, "https": 443}


def probe(endpoint: str) -> Symptom | None:
    """What one TCP connection to the host and port of the URL ``endpoint`` meets: REFUSED, UNREACHABLE (no
    answer within :data:`PROBE_TIMEOUT`) or SILENT (it connects: the endpoint accepts connections, and the
    requests went unanswered); None when the URL names no host or the connection fails otherwise."""
    parts = urlsplit(endpoint)
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    try:
        with socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT):
            return Symptom.SILENT
    except ConnectionRefusedError:
        return Symptom.REFUSED
    except TimeoutError:
        return Symptom.UNREACHABLE
    except OSError:
        return None
