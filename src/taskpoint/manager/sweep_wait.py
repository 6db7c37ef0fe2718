"""A deduplicated save's wait for the sweeps of the chunk store in flight: bounded by their heartbeats, logged.

A save reads the chunk epoch, then lists the leases, and starts over while a fresh sweep lock is there
(docs/manager.md argues why). A sweep renews its lock every few seconds (:class:`.leases.Heartbeat`); a lock
whose body stays unchanged for :data:`.leases.DEAD_BEATS` of its periods, by the save's own clock, belongs to a
sweep that died or is stopped, and the save fences it off (the epoch rewritten: a stopped sweep, continued,
removes nothing more once it sees that) and removes the lock. A lock without a heartbeat (an older taskpoint's)
is waited for until it is older than the grace.
"""

from __future__ import annotations

import time

from .. import _log
from ..group import poll
from .chunks import ChunkStore
from .leases import DEAD_BEATS, Silence, recorded_beat
from .steps import best_effort

#: How often a save waiting for a sweep looks again (seconds).
POLL = 0.2


def settled_epoch(chunks: ChunkStore, grace: float, directory: str) -> bytes | None:
    """The epoch, read before a listing of the leases that shows no sweep in flight (waiting for those it shows,
    or fencing them off once their heartbeat stopped). A sweep that starts after that listing sees the save's
    lease; if it takes it for stale (the save was stopped), it rewrites the epoch before its first removal, and
    the save's commit sees the change. The wait is :func:`.group.poll`, logged: a warning when it begins, then
    its progress every :data:`.group.SAY_EVERY` seconds."""
    silence = Silence()
    met: list[tuple[dict[str, float | None], dict[str, bytes | None], float]] = []  # the sweeps of the last look

    def look() -> tuple[bytes | None] | None:
        epoch = chunks.read_epoch()
        now = time.time()
        sweeps = {name: mtime for name, mtime in chunks.leases().items()
                  if name.startswith("gc-") and chunks.alive(name, mtime, now, grace)}
        if not sweeps:
            return (epoch,)
        bodies = {name: chunks.read_lease(name) for name in sweeps}
        dead = [name for name in sweeps if silence.dead(name, bodies[name])]
        if dead:
            _fence_off(chunks, directory, dead, bodies, silence)
            return None  # the next look lists the leases again
        if not met:
            _say_waiting(directory, grace, sweeps, bodies, now, silence, waited=None)
        met[:] = [(sweeps, bodies, now)]
        return None

    def say(waited: float) -> None:
        for sweeps, bodies, now in met:
            _say_waiting(directory, grace, sweeps, bodies, now, silence, waited=waited)

    began = time.monotonic()
    (epoch,) = poll(f"a deduplicated save to {_log.safe_uri(directory)}", look, None, pauses=(POLL, POLL), say=say)
    if met:
        _log.logger.info("a deduplicated save to %s goes on after waiting %.1f s for a sweep",
                         _log.safe_uri(directory), time.monotonic() - began)
    return epoch


def _say_waiting(directory: str, grace: float, sweeps: dict[str, float | None], bodies: dict[str, bytes | None],
                 now: float, silence: Silence, *, waited: float | None) -> None:
    """Log what the save waits for: a warning when the wait begins (``waited`` None), then its progress."""
    where = _log.safe_uri(directory)
    for name, mtime in sorted(sweeps.items()):
        age = "unknown" if mtime is None else f"{max(0.0, now - mtime):.1f} s"
        beat = recorded_beat(bodies[name])
        bound = (f"taken for dead once not renewed for {DEAD_BEATS * beat:g} s" if beat is not None else
                 f"no heartbeat (an older taskpoint): waited for until older than the grace of {grace:g} s")
        if waited is None:
            _log.logger.warning("a deduplicated save to %s waits for the sweep whose lock is leases/%s (last "
                                "written %s ago; %s)", where, name, age, bound)
        else:
            _log.logger.info("a deduplicated save to %s still waits for the sweep leases/%s after %.0f s (last "
                             "written %s ago, unchanged for %.1f s; %s)", where, name, waited, age,
                             silence.silent_for(name, bodies[name]), bound)


def _fence_off(chunks: ChunkStore, directory: str, dead: list[str], bodies: dict[str, bytes | None],
               silence: Silence) -> None:
    """Take the sweeps of the ``dead`` locks for dead: rewrite the epoch (a sweep that was only stopped stops
    removing once it sees that), then remove their locks, so that later saves do not wait for them again."""
    chunks.fence_epoch()
    for name in dead:
        _log.logger.warning("a deduplicated save to %s takes the sweep leases/%s for dead: its lock was not renewed "
                            "for %.1f s (%d of its %g s periods); the chunk epoch is rewritten so that it removes "
                            "nothing more if it was only stopped", _log.safe_uri(directory), name,
                            silence.silent_for(name, bodies[name]), DEAD_BEATS, recorded_beat(bodies[name]) or 0.0)
        best_effort(lambda name=name: chunks.remove_lease(name))  # type: ignore[misc]
    silence.forget(dead)
