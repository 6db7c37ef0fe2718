"""The preemption notice: the first one recorded (:class:`Notice`, :func:`notify`), and the notices that come
over HTTP rather than as a signal, the clouds' spot and preemption notices (:class:`NoticePoller`).

A notice says which signal stands for it, when it arrived and the deadline it implies: the time the cloud
gives where it gives one, else the grace period after it (``TASKPOINT_GRACE_SECONDS``, 30 s by default, the
``terminationGracePeriodSeconds`` of Kubernetes). The first notice wins; later ones are counted. The signal
handlers of :mod:`taskpoint.preemption` record theirs here, and re-export what this module offers; this
module imports nothing of taskpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

#: Seconds from the notice to the platform's SIGKILL, when the environment does not say otherwise.
DEFAULT_GRACE_SECONDS = 30.0
ENV_GRACE_SECONDS = "TASKPOINT_GRACE_SECONDS"
#: A cloud whose spot or preemption notice to poll (``aws``, ``gcp``, ``azure``); see :class:`NoticePoller`.
ENV_SPOT = "TASKPOINT_SPOT_NOTICE"
#: The base URL of that cloud's metadata service, when not its usual one; and seconds between two polls.
ENV_SPOT_URL = "TASKPOINT_SPOT_NOTICE_URL"
ENV_SPOT_INTERVAL = "TASKPOINT_SPOT_NOTICE_INTERVAL"


@dataclass(frozen=True)
class Notice:
    """A preemption notice: which signal, when it arrived (``time.time()``), and the deadline it implies
    (``at`` plus ``TASKPOINT_GRACE_SECONDS``, default 30)."""

    signal: int
    at: float
    deadline: float

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.deadline - time.time()


_logger = logging.getLogger("taskpoint")
_notice: Notice | None = None
_count = 0


def grace_seconds() -> float:
    """``$TASKPOINT_GRACE_SECONDS`` as a float >= 0, else the default (30)."""
    raw = os.environ.get(ENV_GRACE_SECONDS, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_GRACE_SECONDS
    return value if value >= 0 else DEFAULT_GRACE_SECONDS


def notice() -> Notice | None:
    """The first notice since the process started (or since :func:`forget`), or None."""
    return _notice


def notices() -> int:
    """How many notices arrived (signals and :func:`notify` calls) since the process started or :func:`forget`."""
    return _count


def notify(signum: int = signal.SIGTERM, *, deadline: float | None = None) -> Notice:
    """Record a notice as if ``signum`` had arrived (for notices that come another way than a signal);
    ``deadline`` (``time.time()`` seconds) when the notice says when the process stops, else now plus the
    grace period."""
    global _notice, _count
    _count += 1
    if _notice is None:
        now = time.time()
        _notice = Notice(signal=int(signum), at=now, deadline=now + grace_seconds() if deadline is None else deadline)
    return _notice


def forget() -> None:
    """Forget the notice and the count (:func:`taskpoint.preemption.clear` also resets the signal handling)."""
    global _notice, _count
    _notice, _count = None, 0


# -- notices that come over HTTP: the clouds' spot and preemption notices ----------------------------------------

#: Each cloud's metadata service: its usual base URL, and how it says that the machine is being taken back.
_CLOUDS = {
    # EC2: IMDSv2 (a token, then the spot instance-action document: 404 until a notice, then its time)
    "aws": "http://169.254.169.254",
    # GCE: the instance's `preempted` value, TRUE once a preemption began (about 30 s before the stop)
    "gcp": "http://metadata.google.internal",
    # Azure: scheduled events; a Preempt event carries NotBefore, the time of the eviction
    "azure": "http://169.254.169.254",
}


class NoticePoller:
    """Polls a cloud's metadata service for a spot or preemption notice, every ``interval`` seconds on a daemon
    thread, and records a :class:`Notice` (as a ``SIGTERM``) when one appears, with the stop time the cloud
    gives where it gives one. ``provider`` is ``aws``, ``gcp`` or ``azure``; ``url`` replaces the service's
    base URL (a proxy, or a test server). A service that cannot be reached is polled again later: its failures
    are logged at DEBUG, never raised."""

    def __init__(self, provider: str, *, url: str | None = None, interval: float = 5.0, timeout: float = 2.0) -> None:
        if provider not in _CLOUDS:
            raise ValueError(f"unknown cloud {provider!r} for spot notices (expected one of {', '.join(_CLOUDS)})")
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.provider, self.base = provider, (url or _CLOUDS[provider]).rstrip("/")
        self.interval, self.timeout = float(interval), float(timeout)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NoticePoller:
        """Start polling (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"taskpoint-{self.provider}-notice", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.check() is not None:
                    return
            except Exception as exc:  # an unreachable or odd service: try again at the next interval
                _logger.debug("could not poll the %s preemption notice at %s: %s", self.provider, self.base, exc)
            self._stop.wait(self.interval)

    def check(self) -> Notice | None:
        """Ask once; the recorded notice when the cloud announced a stop, else None."""
        stop_at = getattr(self, f"_ask_{self.provider}")()
        if stop_at is None:
            return None
        return notify(signal.SIGTERM, deadline=None if stop_at is True else stop_at)

    def _get(self, path: str, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.base + path, headers=headers, method=method)
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy
        try:
            with direct.open(request, timeout=self.timeout) as answer:
                return int(answer.status), answer.read(1 << 20)
        except urllib.error.HTTPError as exc:
            return int(exc.code), b""

    def _ask_aws(self) -> float | bool | None:
        status, token = self._get("/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
        headers = {"X-aws-ec2-metadata-token": token.decode()} if status == 200 else {}
        status, body = self._get("/latest/meta-data/spot/instance-action", headers)
        if status != 200:
            return None  # 404: no notice
        return _timestamp(json.loads(body).get("time")) or True

    def _ask_gcp(self) -> float | bool | None:
        status, body = self._get("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        return True if status == 200 and body.strip().upper() == b"TRUE" else None

    def _ask_azure(self) -> float | bool | None:
        status, body = self._get("/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
        if status != 200:
            return None
        events = [e for e in json.loads(body).get("Events", []) if e.get("EventType") == "Preempt"]
        if not events:
            return None
        return _timestamp(events[0].get("NotBefore")) or True


def _timestamp(text: object) -> float | None:
    """``time.time()`` seconds of an ISO 8601 time (AWS's) or an HTTP date (Azure's); None when unreadable."""
    import email.utils
    from datetime import datetime

    if not isinstance(text, str) or not text:
        return None
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    with contextlib.suppress(TypeError, ValueError):
        return email.utils.parsedate_to_datetime(text).timestamp()
    return None


_poller: NoticePoller | None = None
_poller_lock = threading.Lock()


def poll_from_environment() -> NoticePoller | None:
    """Start the poller that ``$TASKPOINT_SPOT_NOTICE`` asks for (once per process); None when it asks none."""
    global _poller
    provider = os.environ.get(ENV_SPOT, "").strip().lower()
    if not provider:
        return None
    with _poller_lock:
        if _poller is None:
            raw = os.environ.get(ENV_SPOT_INTERVAL, "").strip()
            _poller = NoticePoller(provider, url=os.environ.get(ENV_SPOT_URL, "").strip() or None,
                                   interval=float(raw) if raw else 5.0).start()
    return _poller
