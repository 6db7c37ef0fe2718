"""Promotion: one local step copied to the remote tier, checked, and committed there (:mod:`.tiers` decides
which steps, and when).

The local payload object is copied byte for byte under its own name (from the save process when there is one),
its size and sha256 are checked against the local manifest, and only then is the local manifest written
remotely, which commits the step there as any step. A copy that does not match is removed and never committed,
so a torn local step is never promoted. When the trainer dies while the save process copies, the process
commits the copy itself (:class:`PromotionCommit`), under the same check. With several ranks each rank
promotes its own shard and rank 0 commits the remote step as any multi-rank step (:mod:`.tier_ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, CheckpointError
from ..format.records import ObjectRecord, StepManifest
from ..payloads import FilePayload, Payload
from ..storage import Location, RetryPolicy
from .background import Background, Handover, store_payload
from .commit import StepWriter
from .kinds import StepContext
from .kinds.payload import PAYLOAD, PayloadObject
from .kinds.sharded import Shards
from .protect import overwrite_lease
from .shards import ShardOrphan, ShardWriter, naming_rank
from .step_commit import Stored, commit, write_manifest
from .step_names import MANIFEST_NAME
from .steps import StepStore, best_effort
from .tier_ranks import RecordedKind, VerifiedShard


@dataclasses.dataclass(frozen=True)
class PromotionCommit:
    """What the save process commits for a trainer that died while it copied a step to the remote tier: the
    local manifest, written remotely only when the copy's size and sha256 are the ones it records (a torn local
    step is never committed), and never over a manifest already there."""

    uri: str
    storage_options: dict[str, Any]
    retry: RetryPolicy
    manifest: StepManifest

    def finish(self, size: int, digest: str, deadline: float) -> None:
        record = self.manifest.record
        if (size, digest) == (record.size, record.sha256):
            write_manifest(Location(self.uri, self.storage_options, self.retry), self.manifest, create=True,
                           action="promote, for a trainer that died, the checkpoint at")


class Promoter:
    """The promotions of one local tier's steps to the remote tier.

    ``local`` is the local manager's step store; ``parts``, ``writer`` and ``background`` are the remote
    manager's: a promotion commits through its step store, applies its retention, and hands its copy to its
    save process. ``on_commit`` is told of each step committed remotely.
    """

    def __init__(self, local: StepStore, parts: StepContext, writer: StepWriter, background: Background,
                 on_commit: Callable[[int, dict[str, Any]], None]) -> None:
        self._local = local
        self._parts, self._steps, self._writer, self._background = parts, parts.steps, writer, background
        self._on_commit, self._codec = on_commit, parts.codec
        self._ranks = parts.plan.ranks

    def promote(self, step: int, progress: Progress = NO_PROGRESS) -> None:
        """Copy the local ``step`` to the remote tier, check it against the local manifest, and commit it there.
        A copy that does not match is removed and CheckpointCorruptError raised: the local step is damaged."""
        manifest = self._local.manifest(step)
        if manifest is None:
            return  # deleted meanwhile
        if manifest.kind != PAYLOAD.name:
            raise CheckpointError(f"step {step} in {self._local.directory} is a {manifest.kind!r} step, which "
                                  "the local tier does not promote")
        content, record = manifest.content, manifest.record
        assert isinstance(content, PayloadObject)
        exists, replaced = self._steps.committed_objects(step)
        current = self._steps.manifest(step, tolerate_corrupt=True) if exists else None
        if current is not None and (current.record.save_id == record.save_id or self._ranks.distributed):
            return  # promoted already (several ranks: every rank sees the same commit, and skips it alike)
        source = Path(self._local.object(step, content.name).path)
        if self._ranks.distributed:
            with self._handed_over() as handover:
                clock = _log.Clock()
                size = self._promote_shard(step, manifest, source, handover, progress)
            _log.transferred("promote", self._steps.step_uri(step), record.kind, size, clock, step)
            return
        target, location = self._steps.object(step, content.name), self._steps.object(step, MANIFEST_NAME)
        orphan = PromotionCommit(location.uri, location.storage_options, location.retry, manifest)
        # Overwriting a remote step: other processes keep it while the promotion is in flight (its rule).
        held = overwrite_lease(self._steps, step, self._parts.grace) if exists else contextlib.nullcontext()
        with held, self._handed_over() as handover:
            clock = _log.Clock()
            size, _ = self._store_checked(target, source, record, handover, orphan, progress, f"step {step}")
            commit(self._steps, step, Stored(content, record, {content.name: size}), manifest.attempt,
                   manifest.metadata)
        for name in (replaced or set()) - {content.name}:
            best_effort(self._steps.object(step, name).remove)
        self._steps.committed(step)
        self._on_commit(step, manifest.metadata)
        _log.transferred("promote", self._steps.step_uri(step), record.kind, size, clock, step)
        self._writer.tidy()

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

    def _store_checked(self, target: Location, source: Path, record: ObjectRecord, handover: Handover | None,
                       orphan: Any, progress: Progress, what: str) -> tuple[int, str]:
        """Copy the local payload ``source`` to ``target`` and check the copy against the local manifest's
        ``record``: one that does not match is removed and CheckpointCorruptError raised naming ``what``."""
        stored = store_payload(target, FilePayload(source), self._codec, None, handover, orphan, progress)
        if stored != (record.size, record.sha256):
            best_effort(target.remove)
            raise CheckpointCorruptError(
                f"{what} in {self._local.directory} does not match its manifest (read {stored[0]} bytes, expected "
                f"{record.size}): it is damaged and was not promoted to {self._steps.directory}")
        return stored

    def _promote_shard(self, step: int, manifest: StepManifest, source: Path, handover: Handover | None,
                       progress: Progress) -> int:
        """Copy this rank's local shard of ``step`` to the remote tier, check it against its local manifest, and
        record it there (rank 0: commit the step once every rank's shard is recorded, then apply retention).
        A copy that does not match is removed and CheckpointCorruptError raised; the size stored."""
        record = manifest.record

        def store(target: Location, orphan: ShardOrphan) -> tuple[int, str]:
            checked = VerifiedShard(orphan, record.size or 0, record.sha256 or "")
            return self._store_checked(target, source, record, handover, checked, progress,
                                       f"rank {self._ranks.rank}'s shard of step {step}")

        writer = ShardWriter(self._steps, self._parts.plan, self._parts.grace, self._parts.waiting)
        with contextlib.ExitStack() as until_committed:
            stored = writer.write(step, manifest.metadata, manifest.attempt, cast(Payload, RecordedKind(record.kind)),
                                  record.codec, Shards, store, until_committed)
            if stored.content is not None:
                with naming_rank(self._ranks):
                    commit(self._steps, step, stored, manifest.attempt, manifest.metadata)
        if stored.content is not None:
            self._steps.committed(step)
            self._on_commit(step, manifest.metadata)
            self._writer.tidy()
        return stored.sent
