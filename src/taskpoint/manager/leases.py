"""Leases: small objects that say "a writer is alive and may still name what it stored", judged by age.

A lease is written before its writer relies on anything a sweep could remove, renewed every quarter of its
grace while the writer works, and removed after the commit. Its body records the writer's grace, and a lease is
fresh while younger than the longer of that grace and the judge's own, so that a sweep run with a shorter
grace (``taskpoint gc DIR --grace 1``) never takes a live writer's lease for a dead one's. Age alone cannot tell
a stopped process from a dead one: what a writer does when its lease may have lapsed is its own (the chunk
store's epoch, the check of what a commit names), argued in docs/manager.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator

#: How much earlier than its write a modification time listed in whole seconds may be: S3 lists ``LastModified``
#: so (AWS, moto and SeaweedFS alike), and a lease written at 10.9 s is listed as written at 10 s.
MTIME_RESOLUTION = 1.0


def fresh(mtime: float | None, now: float, grace: float) -> bool:
    """Whether something written at ``mtime`` (None: unknown, taken as fresh) is fresh at ``now`` for a judge of
    ``grace``; with ``grace`` 0, nothing is. A time in whole seconds is taken as truncated: up to
    :data:`MTIME_RESOLUTION` early."""
    if grace <= 0:
        return False
    if mtime is None:
        return True
    return now - mtime < grace + (MTIME_RESOLUTION if mtime == int(mtime) else 0.0)


def lease_body(grace: float) -> bytes:
    """The body of a lease written now by a writer of ``grace``."""
    return json.dumps({"written": time.time(), "grace": grace}).encode()


def recorded_grace(data: bytes | None) -> float | None:
    """The grace a lease's body records (a finite number >= 0); None when it records none (written by a
    taskpoint before leases recorded it) or cannot be read."""
    try:
        grace = json.loads(data)["grace"] if data else None
    except (ValueError, TypeError, KeyError):
        return None
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace < 0:
        return None
    return float(grace)


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
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(grace / 4):
            with contextlib.suppress(Exception):
                renew()

    thread = threading.Thread(target=beat, name=name, daemon=True) if grace > 0 else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()
