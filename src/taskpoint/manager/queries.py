"""The read-only side of a manager: its committed steps, their metadata, and its policies' answers (should a step
be saved, which step is the best, which are protected), read without any payload; and the reads of a step where it
lies (a file of it, or its folder in place)."""

from __future__ import annotations

import functools
import io
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio.to_thread
from fsspec.callbacks import Callback

from .. import _log, _progress
from ..errors import CheckpointError
from ..storage import RetryPolicy
from ._checks import check_step
from .background import Background
from .inventory import StepSummary, inventory
from .kinds import KINDS, StepContext, partial_kind
from .protect import Guard
from .restore import StepReader
from .schedule import SaveSchedule
from .shards import RankPlan
from .steps import StepStore
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
    """Queries of :class:`~taskpoint.CheckpointManager` (its base class): what is committed, and its metadata.

    The manager provides :attr:`_steps`, its background save and whether it is closed, which
    :meth:`_ready` checks before each query (open, and a finished background save's error raised first).
    """

    _steps: StepStore
    _parts: StepContext
    _reader: StepReader
    restored_step: int | None
    _plan: RankPlan
    _guard: Guard
    _schedule: SaveSchedule
    _tier: LocalTier | None
    _background: Background
    _closed: bool
    #: The count of the store's throttling answers so far, for the figures of a save or restore.
    _throttles: Callable[[], int]

    def open(self, step: int, path: str) -> io.BufferedReader:
        """A read-only binary file (``read``, ``readinto``, ``seek``, ``tell``) of the file ``path`` of ``step``,
        read on demand: only the compressed members or chunks that hold the bytes asked for are fetched, each
        verified before its bytes are returned (``torch.load(manager.open(step, "model.pt"))``). A step saved
        without an index restores that one file into a temporary folder first. KeyError when the step has no such
        file; FileNotFoundError when there is no such step. Reads fail once the step is deleted. With a local
        tier: the committed step of the remote tier, else a step the local tier alone holds, from there."""
        self._ready()
        step = check_step(step)
        manifest = self._steps.manifest(step)
        if manifest is None and self._tier is not None and step in self._tier.local.steps():
            return self._tier.local.open(step, path)
        if manifest is None:
            raise self._steps.missing(step)
        kind = KINDS.kind(manifest.kind, self._steps.step_uri(step))
        return partial_kind(kind).open_file(self._parts, step, manifest, path)

    @contextmanager
    def restore_in_place(self, step: int | None = None, *, broadcast: bool = False,
                         progress: bool | Callback | None = None) -> Iterator[Path]:
        """:meth:`restore` for reading inside a ``with`` block, without a copy where the step's kind allows it
        (``taskpoint.jax``'s PyTree steps on local disk): a folder of the step's own, every file checked against
        its sha256 first, which the block must only read. The step stays held against retention and
        :meth:`delete` (here, and by a lease elsewhere) until the block exits. Other steps, and steps on an
        object store or a local tier, are restored into the manager's folder as :meth:`restore` does.
        ``progress``: as for :meth:`restore` (the bytes checked in place, or those restored). ``broadcast``: as for
        :meth:`restore`; the ranks' local copy is then read in place, and removed when the block exits."""
        tracker = _progress.resolve(progress, "restore")
        self._ready()
        clock = _log.Clock(self._throttles)
        if self._tier is not None:
            number, folder = self._tier.restore(None if step is None else check_step(step), self._reader, None,
                                                fallback=False, clock=clock, progress=tracker)
            self._restored(number)
            yield folder
            return
        number = self._newest() if step is None else check_step(step)
        with self._reader.in_place(number, clock, tracker, broadcast) as folder:
            self._restored(number)
            yield folder

    def _restored(self, step: int) -> None:
        """A restore returned ``step``: it is :attr:`restored_step`, protected until a newer step is committed."""
        self.restored_step = step
        self._guard.restored_from(step)
        self._schedule.seen(step)

    @property
    def directory(self) -> str:
        """The URI of the directory that holds the steps."""
        return self._steps.directory

    @property
    def storage_options(self) -> dict[str, Any]:
        """The storage options the manager was given (passed to fsspec)."""
        return self._steps.root.storage_options

    @property
    def retry(self) -> RetryPolicy:
        """How the manager retries storage failures."""
        return self._steps.root.retry

    @property
    def rank(self) -> int:
        """This manager's rank (0 with one rank)."""
        return self._plan.ranks.rank

    @property
    def world_size(self) -> int:
        """How many ranks save each step together (1 by default)."""
        return self._plan.ranks.world_size

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager for {self.directory} is closed; create a new one")

    def _ready(self) -> None:
        """Before a query: the manager is open, and a finished background save's error is raised."""
        self._check_open()
        self._background.settle(wait=False)

    def reached_preemption(self, step: int | None = None) -> bool:
        raise NotImplementedError

    def should_save(self, step: int) -> bool:
        """Whether the loop should save ``step`` now: True on every ``save_interval_steps``-th step, on the first
        step at or after each ``save_interval`` since this manager's last save (on a monotonic clock), and
        whenever a preemption notice is pending; False for a step at or before the newest this manager saved or
        restored. No storage request: ``if mgr.should_save(step): mgr.save(state, step)`` costs nothing per step.
        """
        step = check_step(step)
        return self._schedule.due(step, notice=self.reached_preemption(step))

    def best_step(self) -> int | None:
        """The committed step with the best value of ``keep_best``'s metric (ties: the newer), or None when
        there is no ``keep_best`` or no committed step has a finite value. Reads each manifest once."""
        best = self._guard.policy.best
        if best is None:
            return None
        ranked = best.best({step: self._guard.metric(step) for step in self.steps("remote")})
        return ranked[0] if ranked else None

    def protected_steps(self) -> dict[int, str]:
        """The committed steps that retention never deletes (nor :meth:`delete` without ``force``), each with
        the rule that protects it."""
        self._ready()
        folders = {step: folder for step, folder in self._steps.scan().items() if folder.committed}
        newest = self._guard.newest_verified(set(folders))
        rules = {step: self._guard.rule(step, newest, folder) for step, folder in sorted(folders.items())}
        return {step: rule for step, rule in rules.items() if rule is not None}

    def steps(self, tier: str | None = None) -> list[int]:
        """The committed steps, oldest first. A background save appears once it has committed. With a local
        tier: the steps on either tier, or those of one (``tier="local"`` or ``"remote"``)."""
        self._ready()
        if check_tier(tier) == "local" and self._tier is None:
            raise ValueError(f"the manager of {self.directory} has no local tier (no local_dir)")
        remote = [] if tier == "local" else sorted(step for step, folder in self._steps.scan().items()
                                                   if folder.committed)
        return remote if self._tier is None else self._tier.union(remote, tier)

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step (on ``tier``, as for :meth:`steps`), or None when there is none."""
        steps = self.steps(tier)
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
        if manifest is None and self._tier is not None:
            manifest = self._tier.manifest(step)
        if manifest is None:
            raise self._steps.missing(step, self._tier.local.steps() if self._tier is not None else ())
        return manifest.metadata

    def _newest(self) -> int:
        latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"there is no committed checkpoint in {self.directory}")
        return latest

    def verify(self, step: int | None = None, *, progress: object = None) -> Verification:
        """Read every byte of ``step`` (every committed step when None) against the checksums of its manifest,
        keeping nothing; ``progress`` as for :meth:`restore`. With ``step``: its :class:`~taskpoint.StepVerification`
        is healthy, or CheckpointCorruptError says what is damaged, FileNotFoundError that it does not exist, and
        CheckpointError that another writer overwrote or deleted it meanwhile. Without: each step's result, damage
        and changes included; FileNotFoundError when there is no committed step."""
        if step is not None:
            self._ready()
            return Verification(self.directory, (verify_step(self._parts, KINDS, check_step(step), progress),))
        listed = self.steps("remote")
        if not listed:
            raise FileNotFoundError(f"there is no committed checkpoint in {self.directory}")
        return verify_steps(self._parts, KINDS, listed, progress)

    def describe(self, step: int | None = None) -> StepDescription:
        """What ``step``'s manifest (the newest step's when None) says: its kind, commit record, attempt,
        metadata and the kind's own details; no payload is read. FileNotFoundError when it does not exist."""
        if step is None:
            step = self._newest()
        else:
            self._ready()
        return describe_step(self._parts, KINDS, check_step(step))

    def inventory(self) -> list[StepSummary]:
        """Every ``ckpt-N`` folder, oldest first, with its state judged from one listing and the manifests
        (``taskpoint ls``): listed sizes are compared and chunks looked up, no byte of the data is read (that is
        :meth:`verify`'s)."""
        self._ready()
        return inventory(self._parts, KINDS)

    # -- async twins ---------------------------------------------------------------------------------------

    metadata_async = _in_thread(metadata)
    steps_async = _in_thread(steps)
    latest_step_async = _in_thread(latest_step)
    list_checkpoints_async = _in_thread(list_checkpoints)
    verify_async = _in_thread(verify)
    describe_async = _in_thread(describe)
    inventory_async = _in_thread(inventory)
