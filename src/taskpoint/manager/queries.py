"""The read side of a manager, composed into it: its committed steps, their metadata and its policies' answers
(which step is the best, which are protected), read without any payload; and the restores, of a step or of a file
of it, or its folder in place. Also the async twins' wrapper of the manager's methods (:func:`_in_thread`)."""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio.to_thread
from fsspec.callbacks import Callback

from .. import _log, _progress
from ..errors import CheckpointError
from ..format.index import normalize_paths
from ..storage import normalize_uri
from ._checks import check_step
from .background import Background
from .inventory import StepSummary, inventory
from .kinds import KINDS, StepContext, partial_kind
from .protect import Guard
from .restore import StepReader, candidates
from .schedule import SaveSchedule
from .tiers import LocalTier, check_tier
from .verify import StepDescription, Verification, describe_step, verify_step, verify_steps

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M")


def _in_thread(method: Callable[Concatenate[M, P], R]) -> Callable[Concatenate[M, P], Awaitable[R]]:
    """The async twin of a blocking method: the same call, run in a worker thread (asyncio and trio)."""

    async def twin(self: M, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await anyio.to_thread.run_sync(functools.partial(method, self, *args, **kwargs))

    twin.__name__ = twin.__qualname__ = f"{method.__name__}_async"
    twin.__doc__ = f"Async twin of :meth:`{method.__name__}`: the same call, run in a worker thread."
    return twin


class StepQueries:
    """The read side of one :class:`~taskpoint.CheckpointManager`, composed into it: what is committed, its
    metadata, the policies' answers, and the restores. The manager documents each method; these bodies answer.

    Each query checks first that the manager is open (:attr:`closed`, set by its close) and raises the error of
    a finished background save (:meth:`ready`).
    """

    def __init__(self, context: StepContext, reader: StepReader, guard: Guard, schedule: SaveSchedule,
                 tier: LocalTier | None, background: Background) -> None:
        self._context, self._steps, self._guard = context, context.steps, guard
        #: The manager's verified reads (a tier's local manager lends its own to the tier).
        self.reader = reader
        self._schedule, self._tier, self._background = schedule, tier, background
        #: The step the last successful restore returned (the manager's ``restored_step``).
        self.restored_step: int | None = None
        #: Whether the manager is closed (its close sets it).
        self.closed = False

    def open(self, step: int, path: str) -> io.BufferedReader:
        self.ready()
        step = check_step(step)
        manifest = self._steps.manifest(step)
        if manifest is None and self._tier is not None and step in self._tier.local.steps():
            return self._tier.local.open(step, path)
        if manifest is None:
            raise self._steps.missing(step)
        kind = KINDS.kind(manifest.kind, self._steps.step_uri(step))
        return partial_kind(kind).open_file(self._context, step, manifest, path)

    def restore(self, step: int | None, into: str | os.PathLike[str] | None, *, paths: Iterable[str] | None,
                fallback: bool, broadcast: bool, progress: bool | Callback | None) -> Path:
        selected = None if paths is None else normalize_paths(paths)
        clock, tracker = _log.Clock(self._steps.root.throttles), _progress.resolve(progress, "restore")
        target = None if into is None else Path(normalize_uri(into, "into"))
        self.ready()
        step = None if step is None else check_step(step)
        if self._tier is not None:  # the newest step that verifies on either tier, local copies first
            restored, result = self._tier.restore(step, self.reader, target, fallback=fallback, progress=tracker,
                                                  paths=selected, clock=clock)
        else:
            tried = candidates(self.steps() if step is None or fallback else (), step, fallback)
            if not tried:
                raise FileNotFoundError(f"there is no committed checkpoint in {self._steps.directory}")
            restored, result = self.reader.read_first(tried, target, fallback=fallback, requested=step is not None,
                                                       clock=clock, progress=tracker, paths=selected,
                                                       broadcast=broadcast)
        self.restored(restored)
        return result

    @contextmanager
    def restore_in_place(self, step: int | None, *, broadcast: bool, progress: bool | Callback | None
                         ) -> Iterator[Path]:
        tracker = _progress.resolve(progress, "restore")
        self.ready()
        clock = _log.Clock(self._steps.root.throttles)
        if self._tier is not None:
            number, folder = self._tier.restore(None if step is None else check_step(step), self.reader, None,
                                                fallback=False, clock=clock, progress=tracker)
            self.restored(number)
            yield folder
            return
        number = self.newest() if step is None else check_step(step)
        with self.reader.in_place(number, clock, tracker, broadcast) as folder:
            self.restored(number)
            yield folder

    def restored(self, step: int) -> None:
        """A restore returned ``step``: it is :attr:`restored_step`, protected until a newer step is committed."""
        self.restored_step = step
        self._guard.restored_from(step)
        self._schedule.seen(step)

    def check_open(self) -> None:
        if self.closed:
            raise CheckpointError(f"the CheckpointManager for {self._steps.directory} is closed; create a new one")

    def ready(self) -> None:
        """Before a query: the manager is open, and a finished background save's error is raised."""
        self.check_open()
        self._background.settle(wait=False)

    def best_step(self) -> int | None:
        best = self._guard.policy.keep_best
        if best is None:
            return None
        ranked = best.best({step: self._guard.metric(step) for step in self.steps("remote")})
        return ranked[0] if ranked else None

    def protected_steps(self) -> dict[int, str]:
        self.ready()
        folders = {step: folder for step, folder in self._steps.scan().items() if folder.committed}
        newest = self._guard.newest_verified(set(folders))
        rules = {step: self._guard.rule(step, newest, folder) for step, folder in sorted(folders.items())}
        return {step: rule for step, rule in rules.items() if rule is not None}

    def steps(self, tier: str | None = None) -> list[int]:
        self.ready()
        if check_tier(tier) == "local" and self._tier is None:
            raise ValueError(f"the manager of {self._steps.directory} has no local tier (no local_dir)")
        remote = [] if tier == "local" else sorted(step for step, folder in self._steps.scan().items()
                                                   if folder.committed)
        return remote if self._tier is None else self._tier.union(remote, tier)

    def latest_step(self, tier: str | None = None) -> int | None:
        steps = self.steps(tier)
        return steps[-1] if steps else None

    def metadata(self, step: int | None) -> dict[str, Any]:
        if step is None:
            step = self.newest()
        else:
            self.ready()
        manifest = self._steps.manifest(check_step(step))
        if manifest is None and self._tier is not None:
            manifest = self._tier.manifest(step)
        if manifest is None:
            raise self._steps.missing(step, self._tier.local.steps() if self._tier is not None else ())
        return manifest.metadata

    def newest(self) -> int:
        """The newest committed step; FileNotFoundError when there is none."""
        latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"there is no committed checkpoint in {self._steps.directory}")
        return latest

    def verify(self, step: int | None, progress: object) -> Verification:
        if step is not None:
            self.ready()
            return Verification(self._steps.directory, (verify_step(self._context, KINDS, check_step(step), progress),))
        listed = self.steps("remote")
        if not listed:
            raise FileNotFoundError(f"there is no committed checkpoint in {self._steps.directory}")
        return verify_steps(self._context, KINDS, listed, progress)

    def describe(self, step: int | None) -> StepDescription:
        if step is None:
            step = self.newest()
        else:
            self.ready()
        step = check_step(step)
        if self._tier is not None and self._steps.manifest(step) is None and step in self._tier.local.steps():
            return self._tier.local.describe(step)  # a step on the local tier alone, as open() reads it
        return describe_step(self._context, KINDS, step)

    def inventory(self) -> list[StepSummary]:
        self.ready()
        return inventory(self._context, KINDS)
