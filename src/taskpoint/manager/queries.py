"""The read-only side of a manager: its committed steps and their metadata, read without any payload."""

from __future__ import annotations

from typing import Any

from ._checks import check_step
from .shards import RankPlan
from .steps import StepStore


class StepQueries:
    """Queries of :class:`~taskpoint.CheckpointManager` (its base class): what is committed, and its metadata.

    The manager provides :attr:`_steps`, :attr:`directory` and :meth:`_ready` (open, and a finished background
    save's error raised first).
    """

    _steps: StepStore
    _plan: RankPlan

    @property
    def directory(self) -> str:
        """The URI of the directory that holds the steps."""
        return self._steps.directory

    @property
    def rank(self) -> int:
        """This manager's rank (0 with one rank)."""
        return self._plan.ranks.rank

    @property
    def world_size(self) -> int:
        """How many ranks save each step together (1 by default)."""
        return self._plan.ranks.world_size

    def _ready(self) -> None:
        raise NotImplementedError

    def steps(self) -> list[int]:
        """The committed steps, oldest first. A background save appears once it has committed."""
        self._ready()
        return sorted(step for step, folder in self._steps.scan().items() if folder.committed)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_uri(self, step: int) -> str:
        """The URI of ``step``'s folder (whether or not it exists)."""
        return self._steps.step_uri(check_step(step))

    def list_checkpoints(self) -> dict[int, str]:
        """Each committed step with the URI of its folder, oldest first."""
        return {step: self._steps.step_uri(step) for step in self.steps()}

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with ``step`` (the newest when None), read without downloading the payload."""
        if step is None:
            step = self._newest()
        else:
            self._ready()
        manifest = self._steps.manifest(check_step(step))
        if manifest is None:
            raise FileNotFoundError(f"step {step} does not exist in {self.directory}")
        return manifest.metadata

    def _newest(self) -> int:
        latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"there is no committed checkpoint in {self.directory}")
        return latest
