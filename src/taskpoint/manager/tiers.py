"""The local tier: steps committed to fast local storage first, promoted to the remote directory in the background.

A manager given ``local_dir`` saves each step as a plain step of a second manager on ``local_dir`` (same layout,
manifest and sha256), and *promotes* every ``remote_every``-th step to its own directory: the local payload
object is copied byte for byte under its own name (from the save process when there is one), its size and
sha256 are checked against the local manifest, and only then is the local manifest written remotely, which
commits the step there as any step. A copy that does not match is removed and never committed, so a torn local
step is never promoted; a promotion killed midway leaves an uncommitted object that sweeps remove, and the next
promotion redoes every due local step newer than the remote's newest.

Reads see both tiers; a restore reads the local copy first, then the remote copy of the same step (with a
WARNING naming both), then older steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, CheckpointError
from ..format.codecs import Codec
from ..format.records import StepManifest
from ..payloads import FilePayload
from ..storage import Location, RetryPolicy
from ._checks import positive_or_none
from .background import Background, Handover, store_payload
from .commit import StepWriter
from .kinds.payload import PAYLOAD, PayloadObject
from .restore import StepReader, candidates
from .steps import MANIFEST_NAME, StepStore, quietly


class LocalManager(Protocol):
    """What the tier uses of its local manager (a :class:`~taskpoint.CheckpointManager` on ``local_dir``; this
    module sits below the manager's, so it names the manager by what it does)."""

    _steps: StepStore
    _reader: StepReader

    @property
    def directory(self) -> str: ...
    def steps(self, tier: str | None = None) -> list[int]: ...
    def save(self, data: Any, step: int, *, metadata: dict[str, Any] | None = None, overwrite: bool = False,
             blocking: bool | None = None, progress: Any = None) -> str: ...
    def wait_until_finished(self) -> None: ...
    def delete(self, step: int, *, force: bool = False) -> None: ...
    def close(self) -> None: ...
    def gc(self, grace_seconds: float | None = None, *, dry_run: bool = False) -> list[str]: ...

#: The names ``steps(tier=...)`` accepts (None: both tiers).
TIERS = ("local", "remote")


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
        location = Location(self.uri, self.storage_options, self.retry)
        if (size, digest) != (record.size, record.sha256) or location.exists():
            return
        location.write_small(self.manifest.to_bytes(), action="promote, for a trainer that died, the checkpoint at")


def check_tier(tier: str | None) -> str | None:
    """``tier`` when it names a tier (or is None); ValueError otherwise."""
    if tier is not None and tier not in TIERS:
        raise ValueError(f"tier must be 'local', 'remote' or None (both), not {tier!r}")
    return tier


class LocalTier:
    """The local tier of one manager: the local manager, and the promotions of its steps to the remote tier.

    ``steps``, ``writer`` and ``background`` are the remote manager's: promotions commit through its step store,
    apply its retention, and run as its one background job (so the next save waits for the promotion in flight,
    and local retention never removes a step being promoted).
    """

    def __init__(self, local: LocalManager, remote_every: int, steps: StepStore, writer: StepWriter,
                 background: Background, on_commit: Callable[[int, dict[str, Any]], None], codec: Codec) -> None:
        self.local = local
        self.remote_every = remote_every
        self._steps, self._writer, self._background = steps, writer, background
        self._on_commit, self._codec = on_commit, codec

    @classmethod
    def open(cls, make: Callable[..., LocalManager], local_dir: Any, local_keep: int, remote_every: int,
             options: dict[str, Any], remote: tuple[StepStore, StepWriter, Background, Callable[..., None], Codec]
             ) -> LocalTier:
        """Check the tier's arguments and open its local manager with ``options`` (the remote manager's)."""
        positive_or_none(local_keep, "local_keep")
        if positive_or_none(remote_every, "remote_every") is None:
            raise TypeError("remote_every must be an int >= 1, not None")
        if options.pop("dedup"):
            raise ValueError("dedup=True cannot be combined with local_dir: a deduplicated step is a set of chunks "
                             "shared with other steps, which a promotion cannot copy as one verified object; save "
                             "without dedup, or without local_dir")
        if options.pop("world_size") != 1:
            raise ValueError("local_dir supports one rank only: each rank's shard would be committed on the remote "
                             "tier by rank 0, which cannot see the other nodes' local tiers")
        local = make(local_dir, keep=local_keep, preemption=False, rank=0, world_size=1, **options)
        if not local._steps.root.is_local:
            local.close()
            raise ValueError(f"local_dir must be a local path (the node's disk or RAM disk), not {local_dir!r}")
        return cls(local, remote_every, *remote)

    # -- reads ---------------------------------------------------------------------------------------------

    def union(self, remote: list[int], tier: str | None) -> list[int]:
        """The committed steps of ``tier`` (both when None), oldest first, given the remote tier's."""
        if tier == "remote":
            return remote
        local = self.local.steps()
        return local if tier == "local" else sorted(set(local) | set(remote))

    def manifest(self, step: int) -> StepManifest | None:
        """The local manifest of ``step`` (None when the local tier lacks it)."""
        return self.local._steps.manifest(step)

    def restore(self, step: int | None, reader: StepReader, into: Path | None, *, fallback: bool,
                progress: Progress = NO_PROGRESS, paths: Sequence[str] | None = None) -> tuple[int, Path]:
        """Restore ``step`` (None: the newest step that verifies on either tier, older steps tried in turn), and
        where it landed: each step from its local copy first, then from its remote copy (read by ``reader``) with
        a WARNING naming both; then older steps when ``step`` is None or ``fallback``. A requested step on
        neither tier is FileNotFoundError at once. ``paths``: only these files and folders (normalized)."""
        remote = {step for step, folder in self._steps.scan().items() if folder.committed}
        local = set(self.local.steps())
        tried = candidates(local | remote, step, fallback)
        fallback = fallback or step is None
        if step is not None and step not in local | remote:
            raise FileNotFoundError(f"step {step} exists on neither tier ({self.local.directory}, "
                                    f"{self._steps.directory})")
        first_error: Exception | None = None
        with progress:
            for number in tried:
                sources = [(self.local._reader, self.local.directory)] if number in local else []
                sources += [(reader, self._steps.directory)] if number in remote else []
                for source, (copy, where) in enumerate(sources):
                    try:
                        progress.rewind()
                        return number, copy.read(number, into, progress, paths)
                    except (CheckpointCorruptError, FileNotFoundError) as exc:
                        first_error = first_error or exc
                        then = (f"restoring its copy in {sources[source + 1][1]}" if source + 1 < len(sources)
                                else "trying the next older step" if fallback else "giving up")
                        _log.logger.warning("step %d in %s could not be restored (%s); %s", number,
                                            _log.safe_uri(where), exc, then)
                if not fallback and sources:
                    break
        if first_error is None:
            raise FileNotFoundError(f"there is no committed checkpoint in {self.local.directory} or "
                                    f"{self._steps.directory}")
        raise first_error

    # -- writes --------------------------------------------------------------------------------------------

    def save(self, data: Any, step: int, metadata: dict[str, Any] | None, *, overwrite: bool, background: bool,
             progress: Any) -> str:
        """Commit ``step`` to the local tier (in the background when ``background``), then start its promotion
        when it is due; the URI of the local step. Called under the manager's lock, with no job in flight."""
        if not overwrite and self._steps.committed_objects(step)[0]:
            raise FileExistsError(f"step {step} already exists in {self._steps.directory}; pass overwrite=True to "
                                  "replace it, or save under a new step")
        uri = self.local.save(data, step, metadata=metadata, overwrite=overwrite, blocking=not background,
                              progress=progress)
        if step % self.remote_every == 0:
            self._background.slot.start(step, functools.partial(self._promote_due, step))
        return uri

    def settle(self) -> None:
        """Wait for the local tier's background save, raising its error."""
        self.local.wait_until_finished()

    def _promote_due(self, saved: int) -> None:
        """Promote the ``saved`` step and every due local step newer than the remote tier's newest, oldest
        first (one killed before its promotion is redone here)."""
        self.local.wait_until_finished()
        remote = [step for step, folder in self._steps.scan().items() if folder.committed]
        newest = max(remote, default=-1)
        failed: list[CheckpointCorruptError] = []
        for step in self.local.steps():
            if step == saved or (step > newest and step % self.remote_every == 0):
                try:
                    self.promote(step)
                except CheckpointCorruptError as exc:  # a damaged local step stays local; the others go on
                    _log.logger.warning("%s", exc)
                    failed.append(exc)
        if failed:
            raise failed[0]

    def promote(self, step: int, progress: Progress = NO_PROGRESS) -> None:
        """Copy the local ``step`` to the remote tier, check it against the local manifest, and commit it there.
        A copy that does not match is removed and CheckpointCorruptError raised: the local step is damaged."""
        manifest = self.manifest(step)
        if manifest is None:
            return  # deleted meanwhile
        if manifest.kind != PAYLOAD.name:
            raise CheckpointError(f"step {step} in {self.local.directory} is a {manifest.kind!r} step, which "
                                  "the local tier does not promote")
        content, record = manifest.content, manifest.record
        assert isinstance(content, PayloadObject)
        exists, replaced = self._steps.committed_objects(step)
        current = self._steps.manifest(step, tolerate_corrupt=True) if exists else None
        if current is not None and current.record.save_id == record.save_id:
            return  # promoted already
        source = Path(self.local._steps.object(step, content.name).path)
        target, commit = self._steps.object(step, content.name), self._steps.object(step, MANIFEST_NAME)
        process = self._background.helper_process()
        handover = None if process is None else Handover(process, ())
        orphan = PromotionCommit(commit.uri, commit.storage_options, commit.retry, manifest)
        clock = _log.Clock()
        try:
            stored = store_payload(target, FilePayload(source), self._codec, None, handover, orphan, progress)
            if stored != (record.size, record.sha256):
                quietly(target.remove)
                raise CheckpointCorruptError(
                    f"step {step} in {self.local.directory} does not match its manifest (read {stored[0]} bytes, "
                    f"expected {record.size}): it is damaged and was not promoted to {self._steps.directory}")
            self._steps.check_stored(step, {content.name: stored[0]})
            commit.write_small(manifest.to_bytes(), action="promote the checkpoint to")
        finally:
            if handover is not None:
                handover.finish()
        for name in (replaced or set()) - {content.name}:
            quietly(self._steps.object(step, name).remove)
        self._steps.committed(step)
        self._on_commit(step, manifest.metadata)
        _log.transferred("promote", self._steps.step_uri(step), record.kind, stored[0], clock, step)
        self._writer.tidy()

    def delete(self, step: int, *, force: bool) -> bool:
        """Delete the local copy of ``step``; whether there was one."""
        if step not in self.local.steps():
            return False
        self.local.delete(step, force=force)
        return True

    def close(self) -> None:
        """Close the local manager (waiting for its background save)."""
        self.local.close()

