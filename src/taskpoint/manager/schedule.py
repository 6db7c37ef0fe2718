"""When to save: every n-th step, and on the first step at or after each interval of wall time.

``CheckpointManager.should_save(step)`` asks :class:`SaveSchedule`. Time is measured with a monotonic clock (a
clock step of the system time neither hurries nor delays a save), from the last save this manager made, or
from its creation before the first. A loop that asks at every step saves on the first step whose start is at
or after the mark, so with variable step times a save lands within one step of each mark, and never twice
for one mark: the mark moves on with each save.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._checks import positive_or_none


def check_interval(interval: float | datetime.timedelta | None) -> float | None:
    """``save_interval`` in seconds (a timedelta or a number > 0), or None."""
    if interval is None:
        return None
    if isinstance(interval, datetime.timedelta):
        seconds = interval.total_seconds()
    elif isinstance(interval, (int, float)) and not isinstance(interval, bool):
        seconds = float(interval)
    else:
        raise TypeError(f"save_interval must be a datetime.timedelta or a number of seconds, not "
                        f"{type(interval).__name__}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"save_interval must be more than 0 seconds, got {interval!r}")
    return seconds


@dataclass(frozen=True)
class Schedule:
    """When :meth:`~taskpoint.CheckpointManager.should_save` says to save: ``CheckpointManager(path,
    schedule=Schedule(...))``; with neither rule, only at a preemption notice.

    Args:
        save_interval_steps: True on every step divisible by it.
        save_interval: True on the first step at or after each interval (a ``datetime.timedelta`` or seconds)
            since the manager's last save, measured on a monotonic clock.
    """

    save_interval_steps: int | None = None
    save_interval: float | datetime.timedelta | None = None

    def __post_init__(self) -> None:
        positive_or_none(self.save_interval_steps, "save_interval_steps")
        check_interval(self.save_interval)

    @property
    def seconds(self) -> float | None:
        """``save_interval`` in seconds (None: no time rule)."""
        return check_interval(self.save_interval)


class SaveSchedule:
    """The save decisions of one manager: ``every_steps`` (None: no step rule) and ``interval`` seconds (None:
    no time rule, both checked by :class:`Schedule`) on ``clock`` (``time.monotonic``; tests inject their own)."""

    def __init__(self, every_steps: int | None, interval: float | datetime.timedelta | None,
                 clock: Callable[[], float] | None = None) -> None:
        rules = Schedule(every_steps, interval)
        self.every_steps, self.interval = rules.save_interval_steps, rules.seconds
        self._clock = clock or time.monotonic
        self._last = self._clock()  # the time of the last save, or of the schedule's creation
        self._newest: int | None = None  # the newest step saved or restored here

    def now(self) -> float:
        return self._clock()

    def due(self, step: int, *, notice: bool = False) -> bool:
        """Whether ``step`` should be saved: a preemption ``notice`` is pending, ``step`` is a multiple of
        ``every_steps``, or the interval has passed since the last save. Never for a step at or before the newest
        step saved or restored here (it exists: a resumed loop does not save it again), unless a notice is
        pending."""
        if notice:
            return True
        if self._newest is not None and step <= self._newest:
            return False
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.interval is not None and self._clock() - self._last >= self.interval

    def saved(self, step: int, at: float) -> None:
        """A save of ``step``, begun at ``at`` (this clock), succeeded: the next interval counts from ``at``."""
        self._last = max(self._last, at)
        self.seen(step)

    def seen(self, step: int) -> None:
        """``step`` exists (saved or restored here): no decision says to save it, or an older one, again."""
        self._newest = step if self._newest is None else max(self._newest, step)
