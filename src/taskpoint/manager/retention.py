"""Retention: which committed steps a manager keeps after each save."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ._checks import positive_or_none


@dataclass(frozen=True)
class KeepPolicy:
    """Keep the ``keep`` newest committed steps, and also every step divisible by ``keep_every``.

    ``keep=None`` keeps everything (``keep_every`` then changes nothing). A policy only chooses: the manager
    deletes, skipping steps that are being restored.
    """

    keep: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        positive_or_none(self.keep, "keep")
        positive_or_none(self.keep_every, "keep_every")

    def to_delete(self, committed: Iterable[int]) -> list[int]:
        """The steps among ``committed`` that this policy lets go, oldest first."""
        if self.keep is None:
            return []
        steps = sorted(committed)
        kept = set(steps[-self.keep:])
        if self.keep_every is not None:
            kept.update(step for step in steps if step % self.keep_every == 0)
        return [step for step in steps if step not in kept]
