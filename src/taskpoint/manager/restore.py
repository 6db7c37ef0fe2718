"""Restoring one step: verified against its manifest, following a writer that overwrites it meanwhile."""

from __future__ import annotations

import shutil
import threading
import warnings
from pathlib import Path

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, CheckpointError, add_note
from ..format.records import FILESET_CODEC, ObjectRecord, StepManifest
from ..payloads import Payload, payload_class
from ..ranks import Ranks
from ..transfer import read_payload
from ..workspace import Workspace
from .claims import Claims
from .dedup import Dedup
from .protect import restore_lease
from .rebuild import MissingChunk, Rebuilder
from .steps import StepStore

#: How often restore follows a step that another writer overwrites while it is being read.
RESTORE_ATTEMPTS = 5


#: What removes an object a committed step names. taskpoint's own retention and sweeps never do: a save that a
#: sweep took for dead fails before (or takes back) its commit, and a sweep reads the manifests again after its
#: epoch. A taskpoint without those checks could, for a save stalled past the grace period.
GONE_HOW = (", which taskpoint's retention and sweeps never do: by hand, by a bucket lifecycle rule, or by a "
            "sweep of a taskpoint without these checks while the save was stalled")

class StepReader:
    """Reads steps of one directory into a folder of the caller's, or into a workspace of its own."""

    def __init__(self, steps: StepStore, claims: Claims, dedup: Dedup, ranks: Ranks | None = None,
                 grace: float = 0.0) -> None:
        self._steps = steps
        self._grace = grace  # of the lease a restore holds on its step (other processes' retention keeps it)
        self._ranks = ranks or Ranks()
        self._rebuilder = Rebuilder(dedup.steps, dedup.chunks, dedup.workers)
        self._claims = claims
        self._lock = threading.Lock()  # restores into the reader's own workspace
        self._workspace: Workspace | None = None

    @property
    def directory(self) -> str:
        return self._steps.directory

    def close(self) -> None:
        """Delete the reader's own workspace (and the results in it)."""
        if self._workspace is not None:
            self._workspace.close()

    def read_first(self, candidates: list[int], into: Path | None, *, fallback: bool, requested: bool,
                   clock: _log.Clock | None = None, progress: Progress = NO_PROGRESS) -> tuple[int, Path]:
        """The first of ``candidates`` that restores, and where. Without ``fallback`` only the first is tried;
        with it, a damaged or vanished step is skipped with a warning, but a ``requested`` step that does not
        exist is an error at once, and storage errors are raised, never skipped. ``progress`` counts the step
        being read, and starts again from zero for the next candidate."""
        with progress:
            return self._read_first(candidates, into, fallback, requested, clock, progress)

    def _read_first(self, candidates: list[int], into: Path | None, fallback: bool, requested: bool,
                    clock: _log.Clock | None, progress: Progress) -> tuple[int, Path]:
        first_error: Exception | None = None
        for index, candidate in enumerate(candidates):
            try:
                progress.rewind()
                result = self.read(candidate, into, progress)
                if clock is not None:
                    self._log_restore(candidate, clock)
                return candidate, result
            except (CheckpointCorruptError, FileNotFoundError) as exc:
                missing_request = index == 0 and requested and isinstance(exc, FileNotFoundError)
                if not fallback or missing_request:
                    raise
                first_error = first_error or exc
                warnings.warn(f"step {candidate} in {self.directory} could not be restored ({exc}); trying the "
                              "next older step", stacklevel=3)
        assert first_error is not None
        add_note(first_error, "no older step could be restored either")
        raise first_error

    def _log_restore(self, step: int, clock: _log.Clock) -> None:
        """The INFO record of a restore; the size and kind come from the step's manifest (read again, and
        only when the record is wanted: a concurrent overwrite may have changed it since)."""
        if _log.logger.isEnabledFor(_log.INFO):
            manifest = self._steps.manifest(step, tolerate_corrupt=True)
            record = manifest.record if manifest is not None else None
            _log.transferred("load", self._steps.step_uri(step), record.kind if record else "unknown",
                             record.size if record else None, clock, step)

    def read(self, step: int, into: Path | None, progress: Progress = NO_PROGRESS) -> Path:
        """Restore ``step`` into ``into``, or into ``<own workspace>/ckpt-<step>`` when None."""
        if not self._claims.start_restore(step):
            raise FileNotFoundError(f"step {step} in {self.directory} is being deleted")
        try:
            with restore_lease(self._steps, step, self._grace):
                return self._read_held(step, into, progress)
        finally:
            self._claims.end_restore(step)

    def _read_held(self, step: int, into: Path | None, progress: Progress) -> Path:
        if into is not None:
            return self._read_step(step, into, progress)
        with self._lock:
            if self._workspace is None:
                self._workspace = Workspace(None)
            folder = self._workspace.path / f"ckpt-{step}"
            shutil.rmtree(folder, ignore_errors=True)
            try:
                return self._read_step(step, folder, progress)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise

    def _read_step(self, step: int, workspace: Path, progress: Progress) -> Path:
        """Stream the payload the manifest names into ``workspace``, following concurrent overwrites."""
        manifest = self._steps.manifest(step)
        for _ in range(RESTORE_ATTEMPTS):
            if manifest is None:
                raise FileNotFoundError(f"step {step} does not exist in {self.directory} (or was just deleted)")
            if manifest.record.codec == FILESET_CODEC:
                raise CheckpointError(
                    f"step {step} in {self.directory} is a PyTorch Distributed Checkpoint: load it with "
                    f"dcp.load(state, storage_reader=taskpoint.torch.Reader.for_step(manager, {step}))")
            progress.rewind()  # a manifest followed after an overwrite: its payload is counted from zero
            result = self._read_payload(step, manifest, workspace, progress)
            if result is not None:
                return result
            now = self._steps.manifest(step)
            if manifest.same_save(now):
                raise CheckpointCorruptError(
                    f"step {step} in {self.directory} is committed but its payload {self._part(step, manifest)[0]} "
                    f"is missing: it was removed after the commit{GONE_HOW}. Restore an older step (fallback=True), "
                    "or delete this one.")
            manifest = now  # overwritten or deleted while we read: follow it
        raise CheckpointError(f"step {step} in {self.directory} kept being overwritten while it was restored; "
                              "try again once the other writer has finished")

    def _part(self, step: int, manifest: StepManifest) -> tuple[str, ObjectRecord]:
        """The payload object this rank restores, and its record: its own shard of a step of several ranks."""
        if manifest.shards is None:
            return manifest.payload, manifest.record  # the same payload for every rank
        world = len(manifest.shards)
        if world != self._ranks.world_size:
            raise CheckpointError(
                f"step {step} in {self.directory} was saved by {world} ranks and holds one shard per rank; this "
                f"manager is rank {self._ranks.rank} of {self._ranks.world_size}. Restore it with {world} ranks "
                "(for another number of ranks, save through taskpoint.torch, whose checkpoints reshard).")
        shard = manifest.shards[self._ranks.rank]
        return shard.payload, shard.record

    def _read_payload(self, step: int, manifest: StepManifest, workspace: Path, progress: Progress) -> Path | None:
        if manifest.tree is not None:  # a deduplicated step: its chunks, each verified
            try:
                return self._rebuilder.restore(step, manifest, workspace, progress)
            except MissingChunk as missing:
                if not manifest.same_save(self._steps.manifest(step)):
                    return None  # overwritten or deleted while we read: follow it
                raise CheckpointCorruptError(
                    f"step {step} in {self.directory} is damaged: {missing} (removed after the commit{GONE_HOW}). "
                    "Restore an older step (fallback=True), or save it again.") from None
        name, record = self._part(step, manifest)
        src = self._steps.object(step, name)

        def choose(head: bytes, size: int | None) -> type[Payload]:
            return payload_class(record.kind, src.uri)

        def verify(kind: str, size: int, digest: str) -> None:
            if (kind, size, digest) != (record.kind, record.size, record.sha256):
                raise CheckpointCorruptError(
                    f"step {step} in {self.directory} does not match the sha256 recorded when it was saved "
                    f"(read {size} bytes, expected {record.size}); it is damaged. Restore an older step "
                    "(fallback=True), or save it again.")

        try:
            return read_payload(src, workspace, choose, verify, size_hint=record.size, progress=progress)
        except FileNotFoundError:  # deleted under a streaming read (object stores): check the manifest
            return None
        except CheckpointCorruptError as exc:
            if f"step {step} " in str(exc):
                raise
            raise type(exc)(f"step {step} in {self.directory} is damaged: {exc}") from exc
