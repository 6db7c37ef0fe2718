"""Leases: small objects that say "a writer is alive and may still name what it stored", judged by age.

A lease is written before its writer relies on anything a sweep could remove, renewed every quarter of its
grace while the writer works, and removed after the commit. Its body records the writer's grace, and a lease is
fresh while younger than the longer of that grace and the judge's own, so that a sweep run with a shorter
grace (``taskpoint gc DIR --grace 1``) never takes a live writer's lease for a dead one's. Age alone cannot tell
a stopped process from a dead one: what a writer does when its lease may have lapsed is its own (the chunk
store's epoch, the check of what a commit names), argued in docs/manager.md.

A sweep's lock also carries a heartbeat (:class:`Heartbeat`): renewed every :data:`SWEEP_BEAT` seconds
whatever the grace, the period recorded in its body. A judge that sees such a body unchanged for
:data:`DEAD_BEATS` of those periods by its own monotonic clock takes the sweep for dead (:class:`Silence`), so a
killed sweep costs the next save seconds, not the grace; and the sweep stops acting once its own last renewal is
:data:`SAFE_BEATS` periods old, well before anyone can take it for dead. Judging by change, not by modification
time, needs no agreement between clocks.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from ..errors import NewerFormatError
from ..format.documents import LEASE_FORMAT, read_small_document, small_document

#: How much earlier than its write a modification time listed in whole seconds may be: S3 lists ``LastModified``
#: so (AWS, moto and SeaweedFS alike), and a lease written at 10.9 s is listed as written at 10 s.
MTIME_RESOLUTION = 1.0
#: How often a sweep renews its lock (seconds), whatever its grace: the unit its liveness is judged in.
SWEEP_BEAT = 2.0
#: A sweep's lock whose body stays unchanged for this many of its recorded periods is taken for dead: what bounds
#: a save's wait for a killed sweep (10 s by default, far below the grace of 900 s).
DEAD_BEATS = 5
#: A sweep removes nothing once its last successful renewal is this many periods old by its own clock: three
#: periods inside :data:`DEAD_BEATS`, the margin for a renewal landing late and for a judge's poll.
SAFE_BEATS = 2


def fresh(mtime: float | None, now: float, grace: float) -> bool:
    """Whether something written at ``mtime`` (None: unknown, taken as fresh) is fresh at ``now`` for a judge of
    ``grace``; with ``grace`` 0, nothing is. A time in whole seconds is taken as truncated: up to
    :data:`MTIME_RESOLUTION` early."""
    if grace <= 0:
        return False
    if mtime is None:
        return True
    return now - mtime < grace + (MTIME_RESOLUTION if mtime == int(mtime) else 0.0)


def lease_body(grace: float, beat: float | None = None) -> bytes:
    """The body of a lease written now by a writer of ``grace`` (renewed every ``beat`` seconds, when it has a
    heartbeat), a :data:`~taskpoint.format.documents.LEASE_FORMAT` document. Every renewal's body differs from the
    last: it records the time of writing."""
    body: dict[str, float] = {"written": time.time(), "grace": grace}
    if beat is not None:
        body["beat"] = beat
    return small_document(LEASE_FORMAT, body)


def _recorded(data: bytes | None, field: str) -> float | None:
    """A finite number >= 0 that a lease's body records under ``field``; None when it records none (written by
    an older taskpoint), cannot be read, or is of a newer version."""
    try:
        value = read_small_document(data, LEASE_FORMAT)[field] if data else None
    except (ValueError, TypeError, KeyError, NewerFormatError):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def recorded_grace(data: bytes | None) -> float | None:
    """The grace a lease's body records; None when it records none or cannot be read."""
    return _recorded(data, "grace")


def recorded_beat(data: bytes | None) -> float | None:
    """The renewal period of the heartbeat a lease's body records (positive); None when it has none."""
    beat = _recorded(data, "beat")
    return beat if beat else None


def alive(mtime: float | None, now: float, grace: float, body: Callable[[], bytes | None]) -> bool:
    """Whether a lease written at ``mtime`` is fresh for a judge of ``grace``: by that grace, or by the longer
    one its writer recorded (``body`` is read only when the judge's own grace would not do)."""
    if fresh(mtime, now, grace):
        return True
    recorded = recorded_grace(body()) if mtime is not None else None
    return recorded is not None and recorded > grace and fresh(mtime, now, recorded)


@contextlib.contextmanager
def renewing(renew: Callable[[], None], grace: float, name: str) -> Iterator[None]:
    """Call ``renew`` every quarter of ``grace`` on a thread of its own while the block runs (not at all with
    ``grace`` 0). A renewal that fails is skipped: the lease then ages, which its writer learns of otherwise."""
    if grace <= 0:
        yield
        return

    def quietly() -> None:
        with contextlib.suppress(Exception):
            renew()

    with _every_on_thread(grace / 4, quietly, name):
        yield


def every(period: float | None, call: Callable[[], None], stop: threading.Event) -> None:
    """Call ``call`` every ``period`` seconds on the calling thread until ``stop`` is set (with ``period`` None,
    only wait for it): the one timer of the leases and locks that are renewed while something runs."""
    while not stop.wait(period):
        call()


@contextlib.contextmanager
def _every_on_thread(period: float, call: Callable[[], None], name: str) -> Iterator[None]:
    """:func:`every` on a thread named ``name`` while the block runs; joined after it."""
    stop = threading.Event()
    thread = threading.Thread(target=every, args=(period, call, stop), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Heartbeat:
    """A lock renewed every ``beat`` seconds on a thread of its own (:func:`heartbeat`), and whether its writer
    may still act on it: :meth:`current` holds while the last successful renewal began less than
    :data:`SAFE_BEATS` periods ago by this process's monotonic clock. Once that lapses (the process was paused,
    or the store refused renewals), it never holds again and renewals stop: a judge may already have taken the
    lock for dead, and renewing it would only hide that."""

    def __init__(self, renew: Callable[[], None], beat: float) -> None:
        self._renew = renew
        self.beat = beat
        # The writer wrote the lock just before: its write began earlier by that write's latency, far inside the
        # margin of DEAD_BEATS - SAFE_BEATS periods.
        self._last = time.monotonic()
        self._lapsed = False

    def current(self) -> bool:
        """Whether the lock is surely still taken for alive (see the class)."""
        if not self._lapsed and time.monotonic() - self._last >= SAFE_BEATS * self.beat:
            self._lapsed = True
        return not self._lapsed

    def renew(self) -> None:
        """One renewal, skipped (and the lock let lapse) once :meth:`current` no longer holds."""
        began = time.monotonic()  # a judge sees the new body no earlier than this
        if not self.current():
            return
        with contextlib.suppress(Exception):
            self._renew()
            self._last = began


@contextlib.contextmanager
def heartbeat(renew: Callable[[], None], beat: float, name: str) -> Iterator[Heartbeat]:
    """A :class:`Heartbeat` whose lock (written just before) is renewed every ``beat`` seconds while the block
    runs."""
    pulse = Heartbeat(renew, beat)
    with _every_on_thread(beat, pulse.renew, name):
        yield pulse


class Silence:
    """What a judge saw of the bodies of heartbeat locks, to take one for dead once its body has stayed the same
    for :data:`DEAD_BEATS` of its recorded periods, by the judge's own monotonic clock."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[bytes, float]] = {}  # name -> (body, when it was first seen so)

    def silent_for(self, name: str, body: bytes | None) -> float:
        """How long (seconds) lock ``name``, whose body now reads ``body``, has been seen unchanged."""
        now = time.monotonic()
        if body is None:
            return 0.0
        seen = self._seen.get(name)
        if seen is None or seen[0] != body:
            self._seen[name] = (body, now)
            return 0.0
        return now - seen[1]

    def dead(self, name: str, body: bytes | None) -> bool:
        """Whether lock ``name`` (its body now ``body``) has a heartbeat that stopped: unchanged for
        :data:`DEAD_BEATS` periods. A lock without a heartbeat (an older taskpoint's) is never dead by this."""
        beat = recorded_beat(body)
        return beat is not None and self.silent_for(name, body) >= DEAD_BEATS * beat

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self._seen.pop(name, None)
