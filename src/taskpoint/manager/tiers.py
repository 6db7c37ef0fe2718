"""The local tier: steps committed to fast local storage first, promoted to the remote directory in the background.

A manager given ``local_dir`` saves each step as a plain step of a second manager on ``local_dir`` (same layout,
manifest and sha256), and *promotes* every ``remote_every``-th step to its own directory (:mod:`.promotion`:
a byte copy checked against the local manifest, then the local manifest written remotely, which commits the
step there as any step; a torn local step is never promoted). A promotion killed midway leaves an uncommitted
object that sweeps remove, and the next promotion redoes every due local step newer than the remote's newest.

Reads see both tiers; a restore reads the local copy first, then the remote copy of the same step (with a
WARNING naming both), then older steps. The remote manifest is the truth: a local copy of a step the remote tier
also holds is read only when it is the committed step's (the same size and sha256); one that is not (a save
never promoted, whose step number another node committed since) is removed, with a WARNING, and the remote
copy read. A step on the local tier alone is read from it (it is the newest state, not yet promoted).
"""

from __future__ import annotations

import functools
import io
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError
from ..format.records import StepContent, StepManifest
from ..group import TorchGroup
from ..storage import Location
from .background import Background
from .commit import StepWriter
from .kinds import StepContext
from .kinds.sharded import own_record
from .options import BackgroundSaves, Shards, Tier
from .promotion import Promoter
from .restore import StepReader, candidates
from .retention import Retention
from .steps import StepStore, best_effort
from .tier_ranks import common_steps, everyone
from .verify import StepDescription


class LocalManager(Protocol):
    """What the tier uses of its local manager's methods (a :class:`~taskpoint.CheckpointManager` on
    ``local_dir``; this module sits below the manager's, so it names the manager by what it does). The local
    manager's step store and reader come beside it, from the function that opens it (:meth:`LocalTier.open`)."""

    @property
    def directory(self) -> str: ...
    def steps(self, tier: str | None = None) -> list[int]: ...
    def open(self, step: int, path: str) -> io.BufferedReader: ...
    def commit(self, step: int, content: StepContent, *, metadata: dict[str, Any] | None = None) -> str: ...
    def describe(self, step: int | None = None) -> StepDescription: ...
    def save(self, data: Any, step: int, *, metadata: dict[str, Any] | None = None, overwrite: bool = False,
             blocking: bool | None = None, progress: Any = None) -> str: ...
    def wait_until_finished(self) -> None: ...
    def delete(self, step: int, *, force: bool = False) -> None: ...
    def close(self) -> None: ...
    def gc(self, grace_seconds: float | None = None, *, dry_run: bool = False) -> list[str]: ...


#: What opens a tier's local manager: called with the local manager's arguments, it returns the manager, its step
#: store, its reader and its writer.
OpenLocal = Callable[..., tuple[LocalManager, StepStore, StepReader]]

#: Why a step that the ranks of another package's writer store together (a DCP checkpoint) has no local tier.
RANKS_WRITER_REFUSED = ("its ranks write one step together, and a rank's load reads files that other ranks wrote (DCP "
                        "writes a replicated tensor once, by one rank, and a resharded load reads any rank's files), "
                        "so no node's local tier could restore its rank's state alone")
#: The names ``steps(tier=...)`` accepts (None: both tiers).
TIERS = ("local", "remote")
#: The share of the time left before a preemption notice's deadline that the emergency save gives the
#: promotion in flight; the rest is the emergency step's own (which goes to the same remote store).
PROMOTION_SHARE_OF_GRACE = 0.5


def check_tier(tier: str | None) -> str | None:
    """``tier`` when it names a tier (or is None); ValueError otherwise."""
    if tier is not None and tier not in TIERS:
        raise ValueError(f"tier must be 'local', 'remote' or None (both), not {tier!r}")
    return tier


class LocalTier:
    """The local tier of one manager: the local manager, and the promotions of its steps to the remote tier.

    ``context``, ``writer`` and ``background`` are the remote manager's: promotions commit through its step store,
    apply its retention, and run as its one background job (so the next save waits for the promotion in flight,
    and local retention never removes a step being promoted). With several ranks each rank's local tier holds
    its own shard, and promotions commit the remote step as any multi-rank step (:mod:`.tier_ranks`).
    """

    def __init__(self, local: LocalManager, local_steps: StepStore, local_reader: StepReader, remote_every: int,
                 context: StepContext, writer: StepWriter, background: Background,
                 on_commit: Callable[[int, dict[str, Any]], None]) -> None:
        self.local, self._local_steps, self._local_reader = local, local_steps, local_reader
        self.remote_every = remote_every
        self._steps, self._background = context.steps, background
        self._ranks = context.plan.ranks
        self._promoter = Promoter(local_steps, context, writer, background, on_commit)
        self._idle = threading.Event()  # no promotion in flight
        self._idle.set()
        self._cut = False  # the emergency save stopped waiting: promote no further step in this attempt

    @classmethod
    def open(cls, make: OpenLocal, tier: Tier, background: BackgroundSaves, options: dict[str, Any],
             remote: tuple[StepContext, StepWriter, Background, Callable[..., None]]) -> LocalTier:
        """Open the local manager of ``tier`` with ``make``, with the remote manager's ``background`` snapshots
        and ``options`` (codec, level, retry, grace_seconds, dedup): one rank, no preemption handlers, and
        ``local_keep`` steps kept. With several ranks, each rank's local step is its part of the remote step."""
        if options.pop("dedup"):
            raise ValueError("dedup=True cannot be combined with local_dir: a deduplicated step is a set of chunks "
                             "shared with other steps, which a promotion cannot copy as one verified object; save "
                             "without dedup, or without local_dir")
        local, steps, reader = make(
            tier.local_dir, retention=Retention(keep=tier.local_keep), preemption=False,
            shards=Shards(rank=0, world_size=1), background=BackgroundSaves(
                snapshot_dir=background.snapshot_dir, background_process=background.background_process), **options)
        if not steps.root.is_local:
            local.close()
            raise ValueError(f"local_dir must be a local path (the node's disk or RAM disk), not {tier.local_dir!r}")
        return cls(local, steps, reader, tier.remote_every, *remote)

    # -- reads ---------------------------------------------------------------------------------------------

    def union(self, remote: list[int], tier: str | None) -> list[int]:
        """The committed steps of ``tier`` (both when None), oldest first, given the remote tier's."""
        if tier == "remote":
            return remote
        local = self.local.steps()
        return local if tier == "local" else sorted(set(local) | set(remote))

    def manifest(self, step: int) -> StepManifest | None:
        """The local manifest of ``step`` (None when the local tier lacks it)."""
        return self._local_steps.manifest(step)

    def restore(self, step: int | None, reader: StepReader, into: Path | None, *, fallback: bool,
                progress: Progress = NO_PROGRESS, paths: Sequence[str] | None = None,
                clock: _log.Clock | None = None) -> tuple[int, Path]:
        """Restore ``step`` (None: the newest step that verifies on either tier, older steps tried in turn), and
        where it landed: each step from its local copy first, then from its remote copy (read by ``reader``) with
        a WARNING naming both; then older steps when ``step`` is None or ``fallback``. A requested step on
        neither tier is FileNotFoundError at once. ``paths``: only these files and folders (normalized). The INFO
        record of the restore (timed by ``clock``) names the copy read.

        With several ranks every rank calls it together and all return the same step (:mod:`.tier_ranks`): a
        local copy serves a remote step when it is this rank's shard of it, and a step on the local tiers alone
        is tried only through a process group, when every rank holds it; a resume (``step`` None) then drops
        the local steps newer than the one restored, which the job saves again."""
        remote = self._steps.committed_steps()
        local = set(self.local.steps())
        vote = TorchGroup.of_initialized(None, "a restore from the local tier") if self._ranks.distributed else None
        agreed = (common_steps(vote, local) if vote is not None else set()) if self._ranks.distributed else local
        if step is not None and step not in agreed | remote:
            raise FileNotFoundError(f"step {step} exists on neither tier ({self.local.directory}, "
                                    f"{self._steps.directory})")
        tried = candidates(agreed | remote, step, fallback)
        fallback = fallback or step is None
        first_error: Exception | None = None
        with progress:
            for number in tried:
                serves = number in local and self._serves(number, number in remote, number in agreed)
                sources = [(self._local_reader, self.local.directory)] if serves else []
                sources += [(reader, self._steps.directory)] if number in remote else []
                result, error = _read_first(number, sources, into, progress, paths, fallback, clock)
                first_error = first_error or error
                if vote is not None and not everyone(vote, result is not None):
                    first_error = first_error or CheckpointCorruptError(
                        f"step {number}: another rank could not restore its shard from either tier")
                    continue
                if result is not None:
                    if vote is not None and step is None:
                        self._drop_newer(number, vote)
                    return number, result
        if first_error is None:
            raise FileNotFoundError(f"there is no committed checkpoint in {self.local.directory} or "
                                    f"{self._steps.directory}")
        raise first_error

    def _serves(self, step: int, on_remote: bool, agreed: bool) -> bool:
        """Whether this rank's local copy of ``step`` may be read for it. A step on the local tier alone: when
        every rank holds it (``agreed``; always with one rank), as the tier's point is. A step on the remote
        tier too: only when the local copy is the committed step's (this rank's shard of it, with several
        ranks), by the size and digest the remote manifest records: the remote manifest is the truth. A local
        copy that is not (a save never promoted, whose step number another node committed since) is removed,
        with a WARNING; one whose remote manifest cannot be read is left alone, unread (the remote read then
        says why the step does not restore)."""
        if not on_remote:
            return agreed
        copy = self.manifest(step)
        try:
            committed = self._steps.manifest(step)
        except CheckpointCorruptError:
            return False
        if copy is None or committed is None:
            return False
        expected = own_record(committed, self._ranks.rank) if self._ranks.distributed else committed.record
        if expected is not None and (expected.size, expected.digest) == (copy.record.size, copy.record.digest):
            return True
        _log.logger.warning("the local copy of step %d in %s is not the committed step (the manifest in %s records "
                            "another %s): a save never promoted, whose step number was committed since by "
                            "another save; reading the remote copy, and removing the local one", step,
                            _log.safe_uri(self.local.directory), _log.safe_uri(self._steps.directory),
                            "shard for this rank" if self._ranks.distributed else "step")
        best_effort(functools.partial(self.local.delete, step, force=True))
        return False

    def _drop_newer(self, step: int, vote: TorchGroup) -> None:
        """After every rank resumed from ``step``: delete this rank's local steps newer than it (not every rank
        could restore them), then wait for every rank to have done so, before any rank saves those steps again
        (a rank's old copy would otherwise pass for a shard of the new save)."""
        for number in self.local.steps():
            if number > step:
                self.local.delete(number, force=True)
        everyone(vote, True)

    # -- writes --------------------------------------------------------------------------------------------

    def folder(self, step: int, *, reading: bool) -> Location:
        """The folder of ``step`` that another package's writer stores its objects in (``reading`` False: on the
        local tier, which :meth:`commit` commits and promotes), or that its reader reads (``reading``: the local
        copy when it may be read for the step, as a restore chooses it, else the remote one). ValueError for a
        writer with several ranks, the writer's construction (:data:`RANKS_WRITER_REFUSED`)."""
        if reading:
            on_remote = self._steps.manifest(step) is not None
            local = step in self.local.steps() and self._serves(step, on_remote, agreed=not self._ranks.distributed)
            return (self._local_steps if local else self._steps).folder(step)
        if self._ranks.distributed:
            raise ValueError(f"a DCP checkpoint (Writer.for_step) cannot be saved with local_dir and world_size "
                             f"{self._ranks.world_size}: {RANKS_WRITER_REFUSED}; use a manager without local_dir "
                             "for it")
        return self._local_steps.folder(step)

    def commit(self, step: int, content: StepContent, metadata: dict[str, Any] | None) -> str:
        """Commit ``step``, whose objects another package's writer stored in its :meth:`folder`, to the local tier,
        then start its promotion when it is due, as :meth:`save` does; the URI of the local step. Called under the
        manager's lock, with no job in flight."""
        uri = self.local.commit(step, content, metadata=metadata)
        self._promote_if_due(step)
        return uri

    def save(self, data: Any, step: int, metadata: dict[str, Any] | None, *, overwrite: bool, background: bool,
             progress: Any) -> str:
        """Commit ``step`` to the local tier (in the background when ``background``), then start its promotion
        when it is due; the URI of the local step. Called under the manager's lock, with no job in flight. With
        several ranks a local step of this number that is not on the remote tier is replaced: no restore chose
        it (a job without a process group resumed from an older remote step), and the job saves it again."""
        if not overwrite and self._steps.committed_objects(step)[0]:
            raise FileExistsError(f"step {step} already exists in {self._steps.directory}; pass overwrite=True to "
                                  "replace it, or save under a new step")
        uri = self.local.save(data, step, metadata=metadata, overwrite=overwrite or self._ranks.distributed,
                              blocking=not background, progress=progress)
        self._promote_if_due(step)
        return uri

    def _promote_if_due(self, step: int) -> None:
        """Start the promotion of the local ``step`` in the background when it is due (every ``remote_every``-th)."""
        if step % self.remote_every == 0:
            self._idle.clear()
            self._background.slot.start(step, functools.partial(self._promote_due, step))

    def settle(self) -> None:
        """Wait for the local tier's background save, raising its error."""
        self.local.wait_until_finished()

    @property
    def promoting(self) -> bool:
        """Whether a promotion is in flight."""
        return not self._idle.is_set()

    def settle_within(self, deadline: float, now: Callable[[], float] = time.time) -> None:
        """Before the emergency save of a notice due at ``deadline`` (``now()`` seconds): wait for the local
        save, then for the promotion in flight for at most :data:`PROMOTION_SHARE_OF_GRACE` of the time left
        (raising its error when it ended). One still running then goes on in the background, no further step is
        promoted in this attempt, and the emergency save does not wait for it (:attr:`promoting`): the emergency
        step, newer, is the resume point, and a copy cut short by the end of the process is never committed."""
        self.settle()
        if self._idle.wait(max(0.0, (deadline - now()) * PROMOTION_SHARE_OF_GRACE)):
            self._background.settle(wait=True)
            return
        self._cut = True
        _log.logger.warning("the promotion to %s in flight at the preemption notice did not finish within its "
                            "share of the grace period; the emergency step does not wait for it (it commits "
                            "whole later, or never)", _log.safe_uri(self._steps.directory))

    def _promote_due(self, saved: int) -> None:
        """Promote the ``saved`` step and every due local step newer than the remote tier's newest, oldest
        first (one killed before its promotion is redone here). With several ranks only ``saved``: a step one
        rank redid alone would hold rank 0 until its commit timeout. Once the emergency save stopped waiting,
        no further step."""
        try:
            self._promote_steps(saved)
        finally:
            self._idle.set()

    def _promote_steps(self, saved: int) -> None:
        self.local.wait_until_finished()
        if self._ranks.distributed:
            self.promote(saved)
            return
        newest = max(self._steps.committed_steps(), default=-1)
        failed: list[CheckpointCorruptError] = []
        for step in self.local.steps():
            if self._cut:
                break
            if step == saved or (step > newest and step % self.remote_every == 0):
                try:
                    self.promote(step)
                except CheckpointCorruptError as exc:  # a damaged local step stays local; the others go on
                    _log.logger.warning("%s", exc)
                    failed.append(exc)
        if failed:
            raise failed[0]

    def promote(self, step: int, progress: Progress = NO_PROGRESS) -> None:
        """Promote the local ``step`` to the remote tier (:meth:`.promotion.Promoter.promote`)."""
        self._promoter.promote(step, progress)

    def delete(self, step: int, *, force: bool) -> bool:
        """Delete the local copy of ``step``; whether there was one."""
        if step not in self.local.steps():
            return False
        self.local.delete(step, force=force)
        return True

    def close(self) -> None:
        """Close the local manager (waiting for its background save)."""
        self.local.close()


def _read_first(number: int, sources: list[tuple[StepReader, str]], into: Path | None, progress: Progress,
                paths: Sequence[str] | None, fallback: bool, clock: _log.Clock | None
                ) -> tuple[Path | None, Exception | None]:
    """Read ``number`` from the first of ``sources`` whose copy verifies (a WARNING for each that does not,
    naming the next source); the path (None when none did) and the first error met."""
    first_error: Exception | None = None
    for source, (copy, where) in enumerate(sources):
        try:
            return copy.read_logged(number, into, progress, paths, clock), first_error
        except (CheckpointCorruptError, FileNotFoundError) as exc:
            first_error = first_error or exc
            then = (f"restoring its copy in {sources[source + 1][1]}" if source + 1 < len(sources)
                    else "trying the next older step" if fallback else "giving up")
            _log.logger.warning("step %d in %s could not be restored (%s); %s", number, _log.safe_uri(where), exc,
                                then)
    return None, first_error
