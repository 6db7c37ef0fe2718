"""Throttling: the answers by which a store says "slow down", told apart from other transient failures, counted
per store, and met with backoff that honours ``Retry-After`` and with fewer requests in flight.

A throttling answer is HTTP 429, or 503 (S3's ``SlowDown``, GCS's and Azure's "server busy"), or an error code
that names it (:data:`THROTTLE_CODES`). Each store (one endpoint) has one :class:`Pushback`, shared by every
location and thread of the process: the count of throttling answers (a save's log record reports how many came
while it ran), the share of its recent answers that throttled (which scales the pauses before retries: short
where a request in ten throttles, botocore's own where all do), the last ``Retry-After`` the store asked for, and
a cap on the requests one transfer keeps in flight there, lowered by half at each throttling answer and raised by
one per window of answers that passed (AIMD, as TCP does).

Where the backoff sits: one budget, the retry deadline of :class:`~taskpoint.storage.RetryPolicy`.

- Per request, the client's own retries absorb a throttling answer without restarting the operation (a part
  of a multipart upload, one ranged GET): botocore (s3fs), gcsfs and obstore retry 429 and 503 themselves,
  Azure's storage client 503 only (15 s before its first retry, by default). taskpoint watches the answers of
  botocore (a ``needs-retry`` handler: each answer counted, the pause before a retry drawn with full jitter
  from the store's throttled share, :meth:`Pushback.pause`, and never shorter than its ``Retry-After``), of
  Azure's client (:func:`watch_azure`: each answer heard, the pause of its retries of a throttling answer the
  same as botocore's) and of gcsfs (an aiohttp trace: each answer counted, its ``Retry-After`` kept for the
  policy; gcsfs's own pauses do not read it). obstore's retries are invisible and do not read ``Retry-After``,
  nor do its errors carry it: its requests that are a whole operation (records, small objects) make no retries
  of their own, so the policy counts each throttling answer (:data:`~taskpoint.storage._obstore.CLIENT_RETRIES`);
  what the retries of its large transfers give up on is counted by the policy too.
- Per operation, the retry policy retries what the client gave up on, the pause drawn with full jitter
  (between 0 and the exponential delay) and never shorter than the store's last ``Retry-After``; what no client
  retried first (obstore's whole operations) it paces as botocore's handler does (:meth:`Pushback.pause`); attempts
  that met throttling count against the deadline only (where there is one), not against its attempts.
- Every client call is given the time left before the deadline (:func:`~taskpoint.storage.deadline.bounded`),
  so the nested retries (botocore's attempts, s3fs's tries of ``SlowDown``, gcsfs's) end when it passes,
  instead of multiplying into minutes; the policy does not start a retry whose ``Retry-After`` ends past the
  deadline. Then :class:`~taskpoint.errors.StorageUnavailable` names the store and how many answers throttled.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import random
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from .errormap import chain, code_and_status
from .streams import RANGES_IN_FLIGHT

#: Error codes of throttling answers (S3, Azure, AWS services behind S3-compatible fronts).
THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestThrottled", "ServerBusy", "TooManyRequestsException",
})
#: HTTP statuses of throttling answers: Too Many Requests, and Service Unavailable (S3's SlowDown).
THROTTLE_STATUSES = frozenset({429, 503})
#: The cap on one transfer's requests in flight where the store never pushed back: the widest lane that asks
#: for it (ranged reads; a multipart upload's parts are fewer), so that the first throttling answer bites.
MAX_IN_FLIGHT = RANGES_IN_FLIGHT
#: The longest ``Retry-After`` taken as given (seconds): a larger one is this (the deadline cuts it anyway).
MAX_RETRY_AFTER = 300.0
#: The answers over which a store's throttled share (:attr:`Pushback.share`) is averaged.
SHARE_WINDOW = 16
#: The first pause before a retry of a throttling answer (seconds, doubling at each attempt, drawn with full
#: jitter) when every recent answer of the store throttled: botocore's own. It is scaled by the square of the
#: share of the store's recent answers that throttled (:meth:`Pushback.pause`): a store that throttles a request
#: in ten (a hot prefix, a burst) is asked again after a pause of about 17 ms on average, little beside the round
#: trip of its answer; one that throttles every request gets botocore's pauses, and fewer requests in flight
#: (:meth:`Pushback.cap`). Through the fault proxy on moto, 10 ms each way (``benchmarks/_throttle.py``: 30 saves
#: and restores of 64 KiB, 10% answered 503), a throttled request is sent again 46-61 ms after it came (20 ms of
#: it its answer's round trip); 73-85 ms with the first pause drawn from 0-100 ms whatever the share.
THROTTLE_MAX_DELAY = 1.0


def is_throttle(code: str | None, status: int | None) -> bool:
    """True for an answer with this error code or HTTP status that asks the client to slow down."""
    return code in THROTTLE_CODES or status in THROTTLE_STATUSES


def throttled(exc: BaseException) -> bool:
    """True when ``exc``, or an exception it was raised from, is a throttling answer of the store."""
    return any(is_throttle(*code_and_status(each)) for each in chain(exc))


def parse_retry_after(value: Any) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def _headers(exc: BaseException) -> Any:
    """The response headers a client attached to ``exc`` (botocore, azure-core, aiohttp), or None."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        return (response.get("ResponseMetadata") or {}).get("HTTPHeaders")
    if response is not None and getattr(response, "headers", None) is not None:  # azure-core
        return response.headers
    return getattr(exc, "headers", None)  # aiohttp's ClientResponseError


def retry_after(exc: BaseException) -> float | None:
    """The ``Retry-After`` (seconds) of the answer behind ``exc``, where its client kept the headers."""
    for each in chain(exc):
        headers = _headers(each)
        if headers is not None:
            found = parse_retry_after(headers.get("Retry-After") or headers.get("retry-after"))
            if found is not None:
                return found
    return None


def full_jitter(delay: float, floor: float | None = None) -> float:
    """A pause drawn uniformly between 0 and ``delay`` (full jitter: throttled clients that back off together
    spread out), never shorter than ``floor`` (the store's ``Retry-After``)."""
    return max(random.uniform(0.0, delay), floor or 0.0)


class Pushback:
    """What one store said about its load: throttling answers counted, the share of its recent answers that
    throttled, the last ``Retry-After``, and the cap on one transfer's requests in flight (AIMD). Thread-safe;
    one per store and process (:func:`pushback_for`)."""

    def __init__(self, store: str) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._throttled = 0
        self._limit = float(MAX_IN_FLIGHT)
        self._retry_until = 0.0
        self._share = 0.0

    @property
    def throttled(self) -> int:
        """Throttling answers seen from this store in this process."""
        return self._throttled

    def throttle(self, wait: float | None = None) -> None:
        """One throttling answer (``wait``: its ``Retry-After``): counted, the cap on requests in flight halved."""
        with self._lock:
            self._throttled += 1
            self._share += (1.0 - self._share) / SHARE_WINDOW
            self._limit = max(1.0, self._limit / 2)
            if wait is not None:
                self._retry_until = max(self._retry_until, time.monotonic() + wait)

    def answered(self) -> None:
        """One answer that was no throttling: the cap grows by one per cap's worth of them."""
        with self._lock:
            self._share -= self._share / SHARE_WINDOW
            self._limit = min(float(MAX_IN_FLIGHT), self._limit + 1.0 / self._limit)

    def heard(self, code: str | None, status: int | None, retry_after: Any) -> bool:
        """One answer of the store, by its error code, HTTP status and ``Retry-After`` header (what a client watcher
        sees): True, counted by :meth:`throttle`, when it throttled; else :meth:`answered`."""
        if not is_throttle(code, status):
            self.answered()
            return False
        self.throttle(parse_retry_after(retry_after))
        return True

    def cap(self, width: int) -> int:
        """How many of ``width`` requests one transfer may have in flight now (at least 1)."""
        return max(1, min(width, int(self._limit)))

    @property
    def share(self) -> float:
        """The share of this store's recent answers that throttled (0 to 1): their mean over about
        :data:`SHARE_WINDOW` answers, each weighing less the older it is."""
        return self._share

    def pause(self, attempt: int, wait: float | None = None) -> float:
        """Seconds to pause before sending again a request whose ``attempt``-th try was throttled: full jitter
        from :data:`THROTTLE_MAX_DELAY` times the square of :attr:`share`, doubling with each attempt, never
        shorter than ``wait`` (its ``Retry-After``)."""
        return full_jitter(THROTTLE_MAX_DELAY * self._share ** 2 * 2 ** (attempt - 1), wait)

    def wait_asked(self) -> float | None:
        """Seconds left of the last ``Retry-After`` this store gave; None when none is pending."""
        left = self._retry_until - time.monotonic()
        return left if left > 0 else None


_registry_lock = threading.Lock()
_registry: dict[str, Pushback] = {}


def store_key(url: str | None, protocol: str) -> str:
    """The name of a store: ``scheme://host:port`` of its endpoint, or the protocol (the provider's own)."""
    if not url:
        return protocol
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


def pushback_for(key: str) -> Pushback:
    """The process's :class:`Pushback` of the store ``key`` (:func:`store_key`)."""
    with _registry_lock:
        found = _registry.get(key)
        if found is None:
            found = _registry[key] = Pushback(key)
        return found


# -- watching the clients' own retries -----------------------------------------------------------------------

#: botocore's attempts of one request in its default (legacy) mode, where the client's configuration and
#: ``AWS_MAX_ATTEMPTS`` say nothing else.
BOTOCORE_ATTEMPTS = 5


def botocore_attempts(fs: Any) -> int:
    """How many attempts ``fs``'s botocore client makes of one request: its ``config_kwargs["retries"]``
    (``total_max_attempts``, or ``max_attempts`` retries), else ``AWS_MAX_ATTEMPTS``, else
    :data:`BOTOCORE_ATTEMPTS`."""
    retries = (getattr(fs, "config_kwargs", None) or {}).get("retries") or {}
    if retries.get("total_max_attempts"):
        return int(retries["total_max_attempts"])
    if retries.get("max_attempts") is not None:
        return int(retries["max_attempts"]) + 1
    return int(os.environ.get("AWS_MAX_ATTEMPTS") or BOTOCORE_ATTEMPTS)


def s3fs_events(fs: Any) -> list[Any]:
    """The botocore event emitters of ``fs`` (an s3fs filesystem) that a handler is registered on: its session's,
    from which its clients are made (the session made here, as s3fs would, where it has none yet), and that of
    a client already made."""
    if fs.session is None:
        import aiobotocore.session

        fs.session = aiobotocore.session.AioSession(**fs.kwargs)  # what s3fs would make, with our handlers on it
    return [fs.session.get_component("event_emitter"), *([fs._s3.meta.events] if fs._s3 else [])]


def watch_s3fs(fs: Any, pushback: Pushback) -> None:
    """Count each answer of ``fs``'s botocore client into ``pushback``, and pause before each retry of a
    throttling answer as long as the store's pushback says (:meth:`Pushback.pause`), never shorter than its
    ``Retry-After``, within the client's attempts (:func:`botocore_attempts`). Registered on the session the
    clients are made from (and on a client already made), once per filesystem (fsspec caches them)."""
    if getattr(fs, "_taskpoint_pushback", None) is pushback:
        return
    attempts_allowed = botocore_attempts(fs)

    def needs_retry(response: Any = None, attempts: int = 1, **_: Any) -> float | None:
        if response is None:
            return None  # no answer (a connection error): botocore decides
        http, parsed = response
        code = (parsed.get("Error") or {}).get("Code") if isinstance(parsed, dict) else None
        if not pushback.heard(code, http.status_code, http.headers.get("retry-after")) or attempts >= attempts_allowed:
            return None  # not throttled (botocore decides), or its attempts are spent: s3fs or the policy go on
        return pushback.pause(attempts, parse_retry_after(http.headers.get("retry-after")))

    for events in s3fs_events(fs):
        events.register_first("needs-retry.s3", needs_retry)
    fs._taskpoint_pushback = pushback  # fsspec shares the instance: one handler per filesystem


def gcs_trace() -> Any:
    """An aiohttp ``TraceConfig`` that counts each answer of a GCS client into its store's :class:`Pushback`
    (throttling answers and their ``Retry-After``), for gcsfs's ``session_kwargs``. One per process, so that
    fsspec's instance cache, which keys on the options, still finds the filesystem."""
    global _gcs_trace
    with _registry_lock:
        if _gcs_trace is None:
            import aiohttp

            async def on_end(session: Any, context: Any, params: Any) -> None:
                pushback = pushback_for(store_key(str(params.url), "gs"))
                pushback.heard(None, params.response.status, params.response.headers.get("Retry-After"))

            trace = aiohttp.TraceConfig()
            trace.on_request_end.append(on_end)
            trace.freeze()
            _gcs_trace = trace
        return _gcs_trace


_gcs_trace: Any = None


#: The options of an ``az://`` filesystem that bound each request of its client (seconds): the wait for a connection,
#: and for each read of the answer. The service client is made with them: adlfs hands them only to its whole-object
#: calls (``pipe_file``, ``cat_file``, ``put_file``, ``get_file``), not to its checks, listings and file uploads (each
#: block, the commit), nor do taskpoint's record reads and writes: each of those waited the SDK's 60 s for an
#: endpoint that accepts connections and never answers, whatever the options said (measured on 127.0.0.1 with
#: ``read_timeout=2``: a HEAD, a record's GET and PUT held 60 s each; a small file upload 324 s, four tries of 60 s).
AZURE_CLIENT_TIMEOUTS = ("connection_timeout", "read_timeout")


def watch_azure(fs: Any, pushback: Pushback) -> None:
    """Count each answer of ``fs``'s Azure client (adlfs's service client) into ``pushback``, and pause before
    each of the client's own retries of a throttling answer (503 ``ServerBusy``, which the SDK retries; it does
    not retry 429) as the store's pushback says, never shorter than its ``Retry-After``: the SDK's own
    :class:`~azure.storage.blob.aio.ExponentialRetry` waits 18 s, then 24 s, then 42 s (each +-3 s), whatever was asked.
    adlfs hands no options to the client it makes, so the service client is made again from its public URL and
    credential, with the SDK's public ``retry_policy`` (that class, whose pause of a throttling answer is ours) and
    ``raw_response_hook`` (called with every answer, each retry's too), and with the filesystem's
    ``connection_timeout`` and ``read_timeout`` (:data:`AZURE_CLIENT_TIMEOUTS`). Once per filesystem (fsspec caches
    them)."""
    if getattr(fs, "_taskpoint_pushback", None) is pushback:
        return
    from azure.storage.blob.aio import BlobServiceClient, ExponentialRetry
    from fsspec.asyn import sync

    class PacedRetry(ExponentialRetry):
        """The SDK's retries, paused by the store's pushback where the answer was a throttling one."""

        def get_backoff_time(self, settings: dict[str, Any]) -> float:
            history = settings.get("history") or []
            answer = history[-1].http_response if history else None
            if answer is None or not is_throttle(answer.headers.get("x-ms-error-code"), answer.status_code):
                return float(super().get_backoff_time(settings))
            return pushback.pause(settings["count"], parse_retry_after(answer.headers.get("Retry-After")))

    def heard(response: Any) -> None:
        answer = response.http_response
        pushback.heard(answer.headers.get("x-ms-error-code"), answer.status_code, answer.headers.get("Retry-After"))

    made = fs.service_client
    timeouts = {name: fs.storage_options[name] for name in AZURE_CLIENT_TIMEOUTS
                if fs.storage_options.get(name) is not None}
    fs.service_client = BlobServiceClient(account_url=made.url, credential=made.credential, retry_policy=PacedRetry(),
                                          raw_response_hook=heard, **timeouts)
    with contextlib.suppress(Exception):  # the client adlfs made: its connections, where it opened any
        sync(fs.loop, made.close)
    fs._taskpoint_pushback = pushback
