"""Retention: which committed steps a manager keeps after each save (the newest, every n-th, the best by a metric).

A policy only chooses among the committed steps it is shown; which steps are *protected* from any deletion (the
newest that verifies, the one a restore is reading, ...) is :mod:`.protect`'s, and the manager deletes the
policy's choice less those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._checks import positive_or_none

MODES = ("min", "max")


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` committed steps with the best value of ``metric``, read from each step's metadata
    (``save(..., metadata={"val_loss": 0.31})``): the lowest with ``mode="min"``, the highest with ``"max"``.

    A step whose metadata lacks the metric, or holds a value that is not a finite number (NaN, a string, a
    bool), is never among the best. Of steps with equal values the newer is better. Passed as :class:`Retention`'s
    ``keep_best=``; retention then keeps these ``k`` steps as well as what ``keep`` and ``keep_every`` keep.
    """

    metric: str
    mode: str = "min"
    k: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise TypeError(f"KeepBest's metric must be the name of a metadata key (a non-empty str), not "
                            f"{self.metric!r}")
        if self.mode not in MODES:
            raise ValueError(f"KeepBest's mode must be 'min' or 'max', not {self.mode!r}")
        if positive_or_none(self.k, "KeepBest's k") is None:
            raise TypeError("KeepBest's k must be an int >= 1, not None")

    def value(self, metadata: dict[str, Any] | None) -> float | None:
        """The metric in ``metadata`` when it is a finite number; None otherwise (never among the best)."""
        value = (metadata or {}).get(self.metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def best(self, values: dict[int, float | None]) -> list[int]:
        """The (at most) ``k`` best steps of ``values`` (step -> metric value), best first."""
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted((step for step, value in values.items() if value is not None),
                        key=lambda step: (sign * values[step], -step))  # type: ignore[operator]
        return ranked[:self.k]


@dataclass(frozen=True)
class Retention:
    """Which committed steps a manager keeps after each save: ``CheckpointManager(path, retention=Retention(...))``.

    Args:
        keep: keep the ``keep`` newest committed steps and delete older ones after each save; None (the default)
            keeps everything.
        keep_every: also keep every step divisible by ``keep_every`` (with ``keep`` or ``keep_best``).
        keep_best: a :class:`~taskpoint.KeepBest`: also keep the ``k`` steps with the best value of a metric of
            their metadata; without ``keep``, only those (as Lightning's ``save_top_k``).

    With neither ``keep`` nor ``keep_best`` everything is kept (``keep_every`` then changes nothing). Retention
    never deletes a protected step (the newest that verifies, the one the manager restored from, one being
    restored or committed elsewhere): see docs/manager.md, "What to keep".
    """

    keep: int | None = None
    keep_every: int | None = None
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        positive_or_none(self.keep, "keep")
        positive_or_none(self.keep_every, "keep_every")
        if self.keep_best is not None and not isinstance(self.keep_best, KeepBest):
            raise TypeError(f"keep_best must be a taskpoint.KeepBest or None, not {type(self.keep_best).__name__}")

    @property
    def deletes(self) -> bool:
        """Whether this policy ever lets a step go."""
        return self.keep is not None or self.keep_best is not None

    def to_delete(self, committed: Iterable[int], metric: Callable[[int], float | None] | None = None) -> list[int]:
        """The steps among ``committed`` that this policy lets go, oldest first. ``metric(step)`` gives a step's
        value for ``keep_best`` (asked only when there is one; None: no value)."""
        if not self.deletes:
            return []
        steps = sorted(committed)
        kept = set(steps[-self.keep:]) if self.keep is not None else set()
        if self.keep_every is not None:
            kept.update(step for step in steps if step % self.keep_every == 0)
        if self.keep_best is not None:
            lookup = metric or (lambda step: None)
            kept.update(self.keep_best.best({step: lookup(step) for step in steps}))
        return [step for step in steps if step not in kept]
