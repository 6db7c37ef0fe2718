"""Restoring one step: verified against its manifest, following a writer that overwrites it meanwhile."""

from __future__ import annotations

import shutil
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from .. import _log
from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointCorruptError, CheckpointError, StorageAccessDenied, add_note
from ..format.records import StepManifest
from ..workspace import Workspace
from .broadcast import Exchange, shared_reads
from .in_use import InUse
from .kinds import Gone, StepContext, StepKind, StepKinds, in_place_folder, partial_kind
from .protect import RestoreLease
from .shards import naming_rank

#: How often restore follows a step that another writer overwrites while it is being read.
RESTORE_ATTEMPTS = 5

T = TypeVar("T")


def candidates(committed: Iterable[int], step: int | None, fallback: bool) -> list[int]:
    """The steps a restore tries, in order: ``step``, then with ``fallback`` the older of ``committed`` newest
    first; every step of ``committed`` newest first when ``step`` is None."""
    older = sorted((number for number in committed if step is None or number < step), reverse=True)
    return older if step is None else [step, *older] if fallback else [step]


class StepReader:
    """Reads steps of one directory into a folder of the caller's, or into a workspace of its own."""

    def __init__(self, context: StepContext, in_use: InUse, kinds: StepKinds) -> None:
        self._context, self._kinds = context, kinds
        self._steps = context.steps
        self._grace = context.grace  # of the lease a restore holds on its step (other processes' retention keeps it)
        self._in_use = in_use
        self._lock = threading.Lock()  # restores into the reader's own workspace
        self._workspace: Workspace | None = None
        self._lease_denied = False  # a restore lease was refused for want of permission: warned once
        self._lease_lock = threading.Lock()  # (the refusal may be heard on a lease's own thread)

    @property
    def directory(self) -> str:
        return self._steps.directory

    def close(self) -> None:
        """Delete the reader's own workspace (and the results in it)."""
        if self._workspace is not None:
            self._workspace.close()

    def read_first(self, candidates: list[int], into: Path | None, *, fallback: bool, requested: bool,
                   clock: _log.Clock | None = None, progress: Progress = NO_PROGRESS,
                   paths: Sequence[str] | None = None, broadcast: bool = False) -> tuple[int, Path]:
        """The first of ``candidates`` that restores, and where. Without ``fallback`` only the first is tried;
        with it, a damaged or vanished step is skipped with a warning, but a ``requested`` step that does not
        exist is an error at once, and storage errors are raised, never skipped. ``progress`` counts the step
        being read, and starts again from zero for the next candidate. ``paths``: only these (normalized).
        ``broadcast``: each step read once among the ranks of the process group (:mod:`.broadcast`). With several
        ranks, an error names this rank."""
        with progress, naming_rank(self._context.plan.ranks), \
                shared_reads(broadcast, self._context.plan.commit_timeout) as exchange:
            return self._read_first(candidates, into, fallback, requested, clock, progress, paths, exchange)

    def _read_first(self, candidates: list[int], into: Path | None, fallback: bool, requested: bool,
                    clock: _log.Clock | None, progress: Progress, paths: Sequence[str] | None,
                    exchange: Exchange | None) -> tuple[int, Path]:
        first_error: Exception | None = None
        for index, candidate in enumerate(candidates):
            try:
                return candidate, self.read_logged(candidate, into, progress, paths, clock, exchange)
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

    def read_logged(self, step: int, into: Path | None, progress: Progress, paths: Sequence[str] | None,
                    clock: _log.Clock | None, exchange: Exchange | None = None) -> Path:
        """:meth:`read` with ``progress`` counted from zero, then the load's INFO record (when ``clock`` is given:
        a restore the caller asked for, not a read inside another operation)."""
        progress.rewind()
        result = self.read(step, into, progress, paths, exchange)
        if clock is not None:
            self._log_restore(step, clock)
        return result

    def _log_restore(self, step: int, clock: _log.Clock) -> None:
        """The INFO record of a restore; the size and kind come from the step's manifest (read again, and
        only when the record is wanted: a concurrent overwrite may have changed it since)."""
        if _log.logger.isEnabledFor(_log.INFO):
            manifest = self._steps.manifest(step, tolerate_corrupt=True)
            record = manifest.record if manifest is not None else None
            _log.transferred("load", self._steps.step_uri(step), record.kind if record else "unknown",
                             record.size if record else None, clock, step)

    def read(self, step: int, into: Path | None, progress: Progress = NO_PROGRESS,
             paths: Sequence[str] | None = None, exchange: Exchange | None = None) -> Path:
        """Restore ``step`` (only ``paths`` when given) into ``into``, or into ``<own workspace>/ckpt-<step>``."""
        with self._held(step):
            return self._read_held(step, into, progress, paths, exchange)

    @contextmanager
    def in_place(self, step: int, clock: _log.Clock, progress: Progress = NO_PROGRESS,
                 broadcast: bool = False) -> Iterator[Path]:
        """A folder of ``step`` to read until the block exits: its own, verified where it lies by its kind
        (:class:`~.kinds.InPlaceKind`), else a copy as :meth:`read` makes. The step is held against retention and
        ``delete`` (here, and elsewhere by a lease) for the whole block, not only while it is verified.
        ``progress`` counts the bytes verified (or copied). With ``broadcast``, the step is read once among the
        ranks into a local copy (:mod:`.broadcast`), read in place there until the block exits."""
        with self._held(step), shared_reads(broadcast, self._context.plan.commit_timeout) as exchange:
            with progress:
                folder = self._follow(step, progress, lambda kind, manifest, context: in_place_folder(
                    kind, context, step, manifest, progress), exchange) \
                    if self._steps.root.is_local or exchange is not None else None
                if folder is None:
                    progress.restart()
                    folder = self._read_held(step, None, progress, None, exchange)
            self._log_restore(step, clock)
            yield folder

    @contextmanager
    def _held(self, step: int) -> Iterator[None]:
        """Hold ``step`` while it is read: retention and ``delete`` of this process skip it, and a restore lease in
        its folder keeps other processes' retention off it. FileNotFoundError when it is being deleted here."""
        if not self._in_use.start_restore(step):
            raise FileNotFoundError(f"step {step} in {self.directory} is being deleted")
        try:
            with RestoreLease(self._steps, step, self._grace, self._lease_refused).held():
                yield
        finally:
            self._in_use.end_restore(step)

    def _lease_refused(self, failure: Exception) -> None:
        """Warn, once per reader, that a store refused a restore lease for want of permission (other failures
        leave a restore without its lease quietly, as a store that is briefly down would)."""
        if not isinstance(failure, StorageAccessDenied):
            _log.logger.debug("restored without a restore lease: %s", failure)
            return
        with self._lease_lock:
            if self._lease_denied:
                return
            self._lease_denied = True
        warnings.warn(f"taskpoint restores steps of {self.directory} without restore leases: it may not write there "
                      f"({failure}). Other processes' retention may then delete a step while this process reads it "
                      "(the read fails, it never returns other bytes); this warning is given once per manager.",
                      RuntimeWarning, stacklevel=2)

    def _read_held(self, step: int, into: Path | None, progress: Progress, paths: Sequence[str] | None,
                   exchange: Exchange | None) -> Path:
        if into is not None:
            return self._read_step(step, into, progress, paths, exchange)
        with self._lock:
            if self._workspace is None:
                self._workspace = Workspace(None)
            folder = self._workspace.path / f"ckpt-{step}"
            shutil.rmtree(folder, ignore_errors=True)
            try:
                return self._read_step(step, folder, progress, paths, exchange)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise

    def _read_step(self, step: int, workspace: Path, progress: Progress, paths: Sequence[str] | None,
                   exchange: Exchange | None) -> Path:
        """Restore the save the manifest commits into ``workspace`` through its kind, following concurrent
        overwrites."""
        def restore(kind: StepKind, manifest: StepManifest, context: StepContext) -> Path:
            if paths is None:
                return kind.restore(context, step, manifest, workspace, progress)
            return partial_kind(kind).restore_paths(context, step, manifest, workspace, paths, progress)

        return self._follow(step, progress, restore, exchange)

    def _follow(self, step: int, progress: Progress, read: Callable[[StepKind, StepManifest, StepContext], T],
                exchange: Exchange | None) -> T:
        """``read`` the save the manifest of ``step`` commits through its kind (with ``exchange``, from the local
        copy the ranks made of it); when an object it names is gone, follow the manifest if another writer
        overwrote or deleted the step meanwhile, else report damage."""
        manifest = self._steps.manifest(step)
        if manifest is None:
            raise self._steps.missing(step)
        for _ in range(RESTORE_ATTEMPTS):
            if manifest is None:
                raise FileNotFoundError(f"step {step} was deleted from {self.directory} while it was restored")
            kind = self._kinds.kind(manifest.kind, self._steps.step_uri(step))
            progress.rewind()  # a manifest followed after an overwrite: its payload is counted from zero
            try:
                return read(kind, manifest, self._context if exchange is None else
                            exchange.mirror(self._context, kind, step, manifest))
            except Gone as gone:
                now = self._steps.manifest(step)
                if manifest.same_save(now):
                    raise CheckpointCorruptError(gone.message) from None
                manifest = now  # overwritten or deleted while we read: follow it
        raise CheckpointError(f"step {step} in {self.directory} kept being overwritten while it was restored; "
                              "try again once the other writer has finished")
