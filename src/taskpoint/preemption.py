"""Noticing preemption: signal handlers that record a notice and chain whatever handler was there before.

A platform about to stop a process says so with a signal: Kubernetes and most clouds send ``SIGTERM`` and
``SIGKILL`` a grace period later (``terminationGracePeriodSeconds``, 30 s by default); Slurm sends the
signal of ``--signal=USR1@90`` before the time limit. :func:`install` puts a handler on each signal that
records a :class:`Notice` (the first one wins; later ones are counted) and then calls the handler that was
installed before it, so torchelastic's, Lightning's or the user's own handler still runs.

What a signal whose previous disposition was the default (terminate) does: the notice is recorded and the
program carries on to its next safe point (a ``CheckpointManager.save`` or ``ctx().checkpoint_if_preempted()``),
which saves and ends the process. A program that reaches none still ends by the signal: at the deadline
(``TASKPOINT_GRACE_SECONDS`` after the notice) a watchdog thread delivers it again, and a *second* such
signal while no emergency save runs restores the default and delivers it once more. During an emergency
save further signals are only counted and the deadline waits (the save runs to its commit, then the
process ends; the platform's ``SIGKILL`` remains the hard limit); the count is logged once the save ends.
Once the emergency save committed and the process ends (:func:`ending`), a repeated signal is absorbed too:
a launcher that signals every process again when one of them exits (torchrun's agent does, SIGKILL 30 s
later) must leave the exit status 128 + signal. The signal is then ignored (``SIG_IGN``, from the main thread):
the interpreter's exit puts the default disposition back before it unloads the modules (with torch loaded,
a second or more), and the default would end the process by the signal instead (status -15, not 143). Off
the main thread the handler absorbs it until the deadline. :func:`clear` puts the handler back.
``SIG_IGN`` stays ignored (the notice is still recorded).

Handlers are installed only from the main thread (Python's rule), once per signal, and work under asyncio and
trio: both run Python-level handlers installed with :func:`signal.signal` from the main thread. The handler
only assigns module globals (no locks: it runs between two bytecodes of the main thread, which may hold any
lock). This module imports nothing of taskpoint: the manager and the runtime both use it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

#: Seconds from the notice to the platform's SIGKILL, when the environment does not say otherwise.
DEFAULT_GRACE_SECONDS = 30.0
ENV_GRACE_SECONDS = "TASKPOINT_GRACE_SECONDS"
#: Comma-separated signal names (``TERM,USR1``) that replace the default set, ``SIGTERM``.
ENV_SIGNALS = "TASKPOINT_PREEMPTION_SIGNALS"
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)
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


Handler = Callable[[int, FrameType | None], Any] | int | None

_logger = logging.getLogger("taskpoint")
_previous: dict[int, Handler] = {}
_notice: Notice | None = None
_count = 0
_signalled = 0
_saving = 0
#: Signals only counted because an emergency save ran or the process was ending after one.
_absorbed = 0
#: Set by :func:`ending`: the emergency save committed and the process is ending with 128 + signal.
_ending = False
#: The signals :func:`ending` set to ``SIG_IGN`` (our handler goes back on them at :func:`clear`).
_ignored: set[int] = set()
_install_lock = threading.Lock()
#: Set by the handler when a signal with the default disposition arrived: the watchdog's deadline starts.
_armed = threading.Event()
_watchdog: threading.Thread | None = None


def grace_seconds() -> float:
    """``$TASKPOINT_GRACE_SECONDS`` as a float >= 0, else the default (30)."""
    raw = os.environ.get(ENV_GRACE_SECONDS, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_GRACE_SECONDS
    return value if value >= 0 else DEFAULT_GRACE_SECONDS


def configured_signals() -> tuple[signal.Signals, ...]:
    """The signals from ``$TASKPOINT_PREEMPTION_SIGNALS`` (``TERM,USR1``), else ``SIGTERM``."""
    raw = os.environ.get(ENV_SIGNALS, "").strip()
    if not raw:
        return DEFAULT_SIGNALS
    return tuple(_signal(name) for name in raw.split(",") if name.strip())


def _signal(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    text = name.strip().upper()
    try:
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except KeyError:
        raise ValueError(f"unknown signal {name!r} (expected a name such as TERM, USR1 or SIGUSR2)") from None


def install(signals: Iterable[str | int] | None = None) -> bool:
    """Install the notice handler on ``signals`` (default :func:`configured_signals`); True when it is
    installed on all of them, or was once. Off the main thread it installs nothing and returns False. A
    signal it was installed on is left as it is: installing twice chains nothing twice, and a handler
    installed over ours later (which may chain to ours) is not replaced, which would make each call the
    other forever."""
    if threading.current_thread() is not threading.main_thread():
        return False
    wanted = configured_signals() if signals is None else tuple(_signal(s) for s in signals)
    with _install_lock:
        for sig in wanted:
            if sig in _previous:
                continue
            previous = signal.signal(sig, _handle)
            # Never chain to ourselves (our handler put back by someone who saved it, after an uninstall):
            # that would call this handler forever.
            _previous[sig] = signal.SIG_DFL if previous is _handle else previous
        global _watchdog
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="taskpoint-preemption-deadline", daemon=True)
            _watchdog.start()
    if os.environ.get(ENV_SPOT, "").strip():
        poll_from_environment()
    return True


def _watch() -> None:
    """At the deadline of a notice whose signal had the default disposition, deliver the signal again (our
    handler then ends the process with it), unless the notice was cleared; never during an emergency save."""
    while True:
        _armed.wait()
        _armed.clear()
        armed = _notice
        while armed is not None and _notice is armed and (time.time() < armed.deadline or _saving):
            time.sleep(0.05)
        if armed is not None and _notice is armed:
            os.kill(os.getpid(), armed.signal)


def uninstall() -> None:
    """Put back the handlers :func:`install` replaced, where ours is still the one installed (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _install_lock:
        for sig, previous in list(_previous.items()):
            if signal.getsignal(sig) is _handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            del _previous[sig]


def installed() -> tuple[int, ...]:
    """The signals the handler is installed on."""
    return tuple(sig for sig in _previous if signal.getsignal(sig) is _handle)


def notice() -> Notice | None:
    """The first notice since the process started (or since :func:`clear`), or None."""
    return _notice


def notices() -> int:
    """How many notices arrived (signals and :func:`notify` calls) since the process started or :func:`clear`."""
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


def clear() -> None:
    """Forget the notice (a new attempt in the same process after an emergency save)."""
    global _notice, _count, _signalled, _absorbed, _ending
    _notice, _count, _signalled, _absorbed, _ending = None, 0, 0, 0, False
    if threading.current_thread() is threading.main_thread():
        for sig in list(_ignored):
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, _handle)
            _ignored.discard(sig)


@contextlib.contextmanager
def emergency() -> Iterator[None]:
    """While inside, a repeated signal is only counted: the emergency save runs to its commit. On the way out
    a line at WARNING says how many were absorbed, if any."""
    global _saving
    before = _absorbed
    _saving += 1
    try:
        yield
    finally:
        _saving -= 1
        if _absorbed > before:
            name = _notice.name if _notice is not None else "the signal"
            _logger.warning("taskpoint: %s arrived %d more time(s) during the emergency save; absorbed, so that "
                            "the save ran to its end", name, _absorbed - before)


def ending(message: str, *args: object) -> None:
    """The process is about to end with 128 + signal after its emergency save: log ``message % args`` at
    WARNING, also on stderr when the application configured no logging (the package's own ``NullHandler``
    would swallow it: a preempted process must say what it saved and where), and absorb repeated signals from
    now on (see the module's docstring)."""
    global _ending
    _ending = True
    if threading.current_thread() is threading.main_thread():
        with _install_lock:
            for sig, previous in _previous.items():
                if previous in (signal.SIG_DFL, None) and signal.getsignal(sig) is _handle:
                    signal.signal(sig, signal.SIG_IGN)
                    _ignored.add(sig)
    if not _logger.isEnabledFor(logging.WARNING):
        return
    _logger.warning(message, *args, stacklevel=2)
    if not _shown(_logger) and logging.lastResort is not None:
        logging.lastResort.handle(_logger.makeRecord(_logger.name, logging.WARNING, "", 0, message, args, None))


def _shown(logger: logging.Logger) -> bool:
    """Whether a handler other than a ``NullHandler`` on ``logger`` or its ancestors takes WARNING records."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and h.level <= logging.WARNING for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _handle(signum: int, frame: FrameType | None) -> None:
    global _signalled, _absorbed
    _signalled += 1
    first = _signalled == 1
    notify(signum)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    elif first:
        _armed.set()  # the default would have ended the process: it ends at the deadline at the latest
    elif _saving or (_ending and _notice is not None and time.time() < _notice.deadline):
        _absorbed += 1  # the emergency save runs to its end; the process ends with 128 + signal after it
    else:
        # The default disposition, signalled again with no emergency save running: end as it would have.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


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


def poll_from_environment() -> NoticePoller | None:
    """Start the poller that ``$TASKPOINT_SPOT_NOTICE`` asks for (once per process); None when it asks none."""
    global _poller
    provider = os.environ.get(ENV_SPOT, "").strip().lower()
    if not provider:
        return None
    with _install_lock:
        if _poller is None:
            raw = os.environ.get(ENV_SPOT_INTERVAL, "").strip()
            _poller = NoticePoller(provider, url=os.environ.get(ENV_SPOT_URL, "").strip() or None,
                                   interval=float(raw) if raw else 5.0).start()
    return _poller
