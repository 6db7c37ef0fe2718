"""Promotion: one local step copied to the remote tier, checked, and committed there (:mod:`.tiers` decides
which steps, and when).

A step of any kind is promoted alike, knowing no kind: the objects its local manifest names (the kind's
``objects()``) are copied byte for byte under their own names (from the save process when there is one), each
checked against the size and digest (BLAKE3, or an older step's sha256) the manifest records (a kind that records
no digest of an object has its copy read back by its own verify), and only then is the remote step committed with
the local manifest's content (:func:`.step_commit.commit`). A copy that does not match is removed and never
committed, so a torn local step is never promoted. When the trainer dies while the save process copies a step of
one object, the process commits the copy itself (:class:`~.step_commit.OrphanCommit`), under the same check. With
several ranks each rank promotes its own part (its local step, of any kind) and rank 0 commits the remote step as
any multi-rank step (:mod:`.tier_ranks`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError
from ..format.pieces import PAYLOAD_PIECES, pieces_damage, split_pieces
from ..format.records import PAYLOAD_HASH, Shard, StepManifest
from ..payloads import FilePayload
from ..storage import Location
from .background import Background, Handover, store_payload
from .commit import StepWriter
from .kinds import StepContext, step_kind
from .kinds.sharded import commit_parts, rank_part
from .protect import overwrite_lease
from .shards import ShardWriter, naming_rank
from .step_commit import OrphanCommit, Stored, commit
from .step_names import MANIFEST_NAME
from .steps import StepStore, best_effort


class Promoter:
    """The promotions of one local tier's steps to the remote tier.

    ``local`` is the local manager's step store; ``context``, ``writer`` and ``background`` are the remote
    manager's: a promotion commits through its step store, applies its retention, and hands its copy to its
    save process. ``on_commit`` is told of each step committed remotely.
    """

    def __init__(self, local: StepStore, context: StepContext, writer: StepWriter, background: Background,
                 on_commit: Callable[[int, dict[str, Any]], None]) -> None:
        self._local = local
        self._context, self._steps, self._writer, self._background = context, context.steps, writer, background
        self._on_commit, self._codec = on_commit, context.codec
        self._ranks = context.plan.ranks

    def promote(self, step: int, progress: Progress = NO_PROGRESS) -> None:
        """Copy the local ``step`` to the remote tier, check it against the local manifest, and commit it there.
        A copy that does not match is removed and CheckpointCorruptError raised: the local step is damaged."""
        manifest = self._local.manifest(step)
        if manifest is None:
            return  # deleted meanwhile
        record = manifest.record
        exists, replaced = self._steps.committed_objects(step)
        current = self._steps.manifest(step, tolerate_corrupt=True) if exists else None
        if current is not None and (current.record.save_id == record.save_id or self._ranks.distributed):
            return  # promoted already (several ranks: every rank sees the same commit, and skips it alike)
        if self._ranks.distributed:
            clock = _log.Clock()
            size = self._promote_shard(step, manifest, progress)
            _log.transferred("promote", self._steps.step_uri(step), record.kind, size, clock, step)
            return
        # Overwriting a remote step: other processes keep it while the promotion is in flight (its rule).
        held = overwrite_lease(self._steps, step, self._context.grace) if exists else contextlib.nullcontext()
        with held, self._handed_over() as handover:
            clock = _log.Clock()
            sizes = self._copy_checked(step, manifest, handover, progress)
            commit(self._steps, step, Stored(manifest.content, record, sizes), manifest.attempt, manifest.metadata)
        for name in (replaced or set()) - sizes.keys():
            best_effort(self._steps.object(step, name).remove)
        self._steps.committed(step)
        self._on_commit(step, manifest.metadata)
        _log.transferred("promote", self._steps.step_uri(step), record.kind, sum(sizes.values()), clock, step)
        self._writer.tidy()

    def _copy_checked(self, step: int, manifest: StepManifest, handover: Handover | None, progress: Progress
                      ) -> dict[str, int]:
        """Copy every object of its folder that the local manifest of ``step`` names (its kind's
        :meth:`~.kinds.StepKind.objects`), whatever its kind, to the remote step's folder (:meth:`_copy`); when
        the manifest records no digest of some object, the copies are then read back whole by the kind's own
        verify against the manifest. The sizes stored. A copy that does not match is removed with the others,
        and CheckpointCorruptError raised: the local step is damaged, and is never committed remotely. A step of
        one object whose digest the record holds is committed by the save process if this process dies while it
        copies (:class:`~.step_commit.OrphanCommit`); another step's promotion cut short is redone by the next
        one."""
        named, record = self._local.named(step, manifest), manifest.record
        location, sole = self._steps.object(step, MANIFEST_NAME), next(iter(named.files), None)
        orphan = (OrphanCommit.at(location, manifest, fill=False)
                  if len(named.files) == 1 and named.digests.get(sole or "") == record.digest else None)
        sizes: dict[str, int] = {}
        try:
            for name, size in named.files.items():
                sizes[name] = self._copy(step, name, self._steps.object(step, name), size, named.digests.get(name),
                                         handover, orphan, progress)[0]
            if not named.digests.keys() >= named.files.keys():
                try:
                    step_kind(manifest.kind, self._local.step_uri(step)).verify(self._context, step, manifest, False)
                except (CheckpointCorruptError, FileNotFoundError) as exc:
                    raise self._damaged(step, str(exc)) from exc
        except CheckpointCorruptError:
            for name in sizes:
                best_effort(self._steps.object(step, name).remove)
            raise
        return sizes

    def _copy(self, step: int, name: str, target: Location, size: int | None, digest: tuple[str, str] | None,
              handover: Handover | None, orphan: Any, progress: Progress) -> tuple[int, str]:
        """Copy the local object ``name`` of ``step`` to ``target``, in the remote step's folder (from the save
        process when there is one, which finishes ``orphan`` if this process dies first); its size and digest
        (hex), checked as it streams against the ``size`` and ``digest`` (hash, hex) the local manifest records
        (None: it records none; the copy is then hashed by BLAKE3). A copy that does not match is removed and
        CheckpointCorruptError raised."""
        try:
            source = FilePayload(Path(self._local.object(step, name).path))
        except FileNotFoundError:
            raise self._damaged(step, f"its {name} is missing") from None
        hash_name = PAYLOAD_HASH if digest is None else digest[0]
        found, hexdigest = store_payload(target, source, self._codec, None, handover, orphan, progress, hash_name)
        if size not in (None, found) or digest not in (None, (hash_name, hexdigest)):
            best_effort(target.remove)
            where = (pieces_damage(f"step {step} in {self._local.directory}", split_pieces(digest[1]), hexdigest, found,
                                   size, name) if digest is not None and hash_name == PAYLOAD_PIECES and size else None)
            if where is not None:  # an object recorded by pieces: the piece, or the count of them, that differs
                raise CheckpointCorruptError(f"{where}; it was not promoted to {self._steps.directory}")
            raise self._damaged(step, f"read {found} bytes of {name}, expected {size}")
        return found, hexdigest

    def _damaged(self, step: int, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"step {step} in {self._local.directory} does not match its manifest ({why}): "
                                      f"it is damaged and was not promoted to {self._steps.directory}")

    @contextlib.contextmanager
    def _handed_over(self) -> Iterator[Handover | None]:
        """The promotion's way to the save process (None without one), finished when the block ends: the
        process commits the copy if this process dies first, and only then."""
        process = self._background.helper_process()
        handover = None if process is None else Handover(process, ())
        try:
            yield handover
        finally:
            if handover is not None:
                handover.finish()

    def _promote_shard(self, step: int, manifest: StepManifest, progress: Progress) -> int:
        """Copy this rank's local ``step`` (its part of the remote step, of any kind) to the remote tier as any
        promotion copies a step (:meth:`_copy_checked`, in this process: the save process would commit it as a
        step of its own), and record it there (rank 0: commit the step once every rank's part is recorded, then
        apply retention); the size stored. A promotion cut short is redone by the next one."""
        steps = self._steps

        def part() -> tuple[Shard, int]:
            sizes = self._copy_checked(step, manifest, None, progress)
            return rank_part(self._ranks.rank, manifest), sum(sizes.values())

        writer = ShardWriter(steps, self._context.plan, self._context.grace, self._context.waiting)
        with contextlib.ExitStack() as until_committed:
            stored = writer.write(step, manifest.attempt, part, functools.partial(commit_parts, steps, step),
                                  until_committed)
            if stored.content is not None:
                with naming_rank(self._ranks):
                    commit(self._steps, step, stored, manifest.attempt, manifest.metadata)
        if stored.content is not None:
            self._steps.committed(step)
            self._on_commit(step, manifest.metadata)
            self._writer.tidy()
        return stored.sent
