"""Background saves: the one save in flight, the snapshot it uploads, and the process it uploads from.

A background save copies the caller's data into a snapshot folder (so the caller may change it at once),
then uploads it on a thread of its own, from the manager's save process when there is one (see
:mod:`.saver`). With a save process, ``save()`` returns only once the save's request is in that process's pipe
(the :class:`Handover`), which it reads whole even if the trainer dies: a trainer killed after the return loses
nothing the process can finish. Its error is
kept until the next call of the manager, or reported at exit: never lost.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .._progress import NO_PROGRESS, Progress
from ..errors import CheckpointError, add_note, say_in_message
from ..format.codecs import Codec
from ..format.records import PAYLOAD_HASH, StepManifest
from ..payloads import Payload, registered_payloads
from ..storage import Location
from ..transfer import write_payload
from ..workspace import owned_folder, sweep_dead_folders
from .saver import (
    NICENESS,
    NotTransferable,
    OrphanPart,
    SaverProcess,
    SaverUnavailable,
    StagedJob,
    release_freed_memory,
)
from .snapshots import SnapshotCache, spool
from .staging import Segment, Stageable, sweep_dead_segments
from .staging_memory import StagingMemory

_log = logging.getLogger("taskpoint")


class BackgroundSave:
    """The one background save of a manager, and its error until someone has been told about it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._step = -1
        self._error: BaseException | None = None

    def start(self, step: int, upload: Callable[[], None]) -> None:
        def run() -> None:
            try:
                upload()
            except BaseException as exc:  # kept for the next call, or reported at exit: never lost
                self._error = exc
            finally:
                release_freed_memory()

        self._step, self._error = step, None
        # Not a daemon: an interpreter that exits without close() still finishes the upload first.
        self._thread = threading.Thread(target=run, name=f"taskpoint-save-step-{step}")
        self._thread.start()

    def settle(self, *, wait: bool, saver: SaverProcess | None = None) -> None:
        """Raise the error of a finished save; with ``wait``, first let it finish (``saver``, its save process,
        at the caller's priority meanwhile: :meth:`~.saver.SaverProcess.waited_on`)."""
        thread = self._thread
        if thread is None:
            return
        if wait and thread.is_alive():
            def joined(within: float) -> bool:
                thread.join(within)
                return not thread.is_alive()

            waited_on(saver, f"the background save of step {self._step}", joined)
        elif thread.is_alive():
            return
        with self._lock:
            if self._thread is not thread:
                return  # another caller settled it
            self._thread, error, self._error = None, self._error, None
        if error is not None:
            add_note(error, f"raised here because the background save of step {self._step} failed")
            say_in_message(error, f"background save of step {self._step}")
            raise error

    def report_unclaimed(self, directory: str) -> None:
        """At exit (or garbage collection): say so if a background error was never raised to anyone.

        The error's traceback holds the manager, so a manager with an unreported error lives until exit.
        """
        thread, error = self._thread, self._error
        if thread is not None and not thread.is_alive() and error is not None:
            warnings.warn(f"the background save of step {self._step} to {directory} failed and no later call "
                          f"reported it: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=1)


#: How long a wait for the save in flight goes unlogged, and then how often it is logged again while it lasts.
WAIT_LOG_SECONDS = 10.0


def waited_on(saver: SaverProcess | None, what: str, done: Callable[[float], bool]) -> None:
    """Wait until ``done(within)`` (which waits at most ``within`` seconds) is true, with ``saver``, the save
    process that does the work waited for, at this process's priority meanwhile; logged every
    :data:`WAIT_LOG_SECONDS` while it lasts. The wait's bound is the work's own: the store's retries and
    deadlines, and the save process's death, which ends the save with :class:`~.saver.SaverUnavailable`."""
    with contextlib.ExitStack() as stack:
        raised = saver is not None and stack.enter_context(saver.waited_on())
        began = time.monotonic()
        while not done(WAIT_LOG_SECONDS):
            _log.info("taskpoint: waited %.0f s so far for %s%s", time.monotonic() - began, what,
                      "" if saver is None else f" (save process pid {saver.pid}, " + (
                          "at this process's CPU priority meanwhile)" if raised else
                          f"left {NICENESS} lower in CPU priority: raising it is not permitted here)"))


#: Start of the names of background-save snapshot folders: ``taskpoint-snapshot-<host>-<pid>-<random>``.
SNAPSHOT_PREFIX = "taskpoint-snapshot-"


class Handover:
    """One background save's way to the save process: the request is sent from the save's thread while
    ``save()`` waits in :meth:`wait` until it is in the process's pipe (or it is clear that it never will be: the
    payload does not pickle, the process died, the save failed before its upload), so that the process can
    finish and commit the step if this process dies after ``save()`` returned.

    ``folders`` are the snapshot folders the process removes in that case: the snapshot's own and the one
    kept for the next snapshot (:class:`~.snapshots.SnapshotCache`). :meth:`finish`, once the save's thread
    is done with the step, tells the process that its commit is no longer needed.
    """

    def __init__(self, process: SaverProcess, folders: tuple[Path, ...]) -> None:
        self.process = process
        self._folders = tuple(str(folder) for folder in folders)
        self._taken = threading.Event()
        self._held = False  # the process stored the payload, and would commit it were this process to die
        #: The process wrote a staged save's segment and kept it, for the next staged save.
        self.kept = False

    def store_payload(self, location: Location, payload: Payload, codec: Codec, level: int | None,
                      commit: OrphanPart | None, progress: Progress, digest: str) -> tuple[int, str]:
        try:
            stored = self.process.store_payload(location, payload, codec, level, commit, progress, digest=digest,
                                                folders=self._folders, taken=self._taken.set)
        finally:
            self._taken.set()
        self._held = commit is not None
        return stored

    def store_staged(self, manifest: Location, segment: str, job: StagedJob, progress: Progress
                     ) -> tuple[dict[str, int], StepManifest]:
        try:
            stored = self.process.store_staged(manifest, segment, job, progress, taken=self._taken.set, keep=True)
        finally:
            self._taken.set()
        self._held = self.kept = True
        return stored

    def wait(self) -> None:
        waited_on(self.process, "the save process to take the request", self._taken.wait)

    def finish(self) -> None:
        """After the save's thread committed the step (or failed to): the process need not commit it."""
        self._taken.set()
        if self._held:
            self._held = False
            self.process.done()


def store_payload(location: Location, payload: Payload, codec: Codec, level: int | None,
                  saver: Handover | None = None,
                  commit: OrphanPart | None = None,
                  progress: Progress = NO_PROGRESS, digest: str = PAYLOAD_HASH) -> tuple[int, str]:
    """Write a step's payload to ``location``, its size and ``digest`` (hex; BLAKE3 unless a copy of an older
    step's object is checked by its sha256): from ``saver``'s process when given and it can reach the
    location (the manager starts one only for a directory other processes can reach), else from this thread.
    A save process that dies or cannot take the payload is never fatal: the payload (under its unique name)
    is written again from here; a killed process's partial object has no manifest and is swept like any
    leftover. ``commit`` is what the save process commits (or, for a shard, finishes) itself if this process dies
    before doing so."""
    if saver is not None:
        try:
            return saver.store_payload(location, payload, codec, level, commit, progress, digest)
        except NotTransferable:
            pass
        except SaverUnavailable as exc:
            warnings.warn(f"{exc}; taskpoint writes {location.uri} from this process instead", RuntimeWarning,
                          stacklevel=2)
    return write_payload(location, payload, codec, level, digest, progress=progress)


def store_staged(manifest: Location, segment: str, job: StagedJob, saver: Handover | None,
                 progress: Progress = NO_PROGRESS) -> tuple[dict[str, int], StepManifest]:
    """Write a staged save's objects from its ``segment``: by ``saver``'s process, which takes the segment over
    (and commits the step at ``manifest`` itself if this process dies before doing so), else from this thread
    (also when the job cannot be sent to the process, or the process exits before it is ready: a Python that
    cannot import this taskpoint); the sizes of the objects stored and the manifest that commits them.

    A save process that dies in the middle (the OOM killer, an operator's SIGKILL) fails the save with a
    CheckpointError saying how it ended: nothing is committed, the steps before stay as they were, and the next
    save starts a new process (the segment is freed as the save ends). It is not written from here instead: the
    segment, named for a dead process, is any sweep's to remove at any moment (so such a fallback failed or not
    by a race), and the write would add its memory to this process's where memory may be what killed the other."""
    if saver is not None:
        try:
            return saver.store_staged(manifest, segment, job, progress)
        except NotTransferable:
            pass
        except SaverUnavailable as exc:
            if saver.process.started:
                raise CheckpointError(f"{exc} while it wrote {manifest.uri.rsplit('/', 1)[0]}: the step is not "
                                      "committed, the steps before it are intact; save it again") from exc
            warnings.warn(f"{exc}; taskpoint writes {manifest.uri} from this process instead", RuntimeWarning,
                          stacklevel=2)
    found = Segment.find(segment)
    if found is None:
        raise CheckpointError(f"the staged state of {manifest.uri} is gone from {segment}: it was removed while the "
                              "save was in flight; save the step again")
    staged = Segment.adopt(found)
    try:
        return job.run(staged, progress)
    finally:
        staged.free()


class SavedBy(Protocol):
    """What the background machinery needs of the step kind that saves a payload."""

    name: str
    helper: bool


class Background:
    """The background machinery of one manager: snapshots, staging, the one save in flight, and the save
    process (started at once, on a thread, with ``prestart``: else by the first background save; with ``ahead``, the
    size of the state a save is expected to stage, its ready segment made then too: :meth:`.StagingMemory.prepare`)."""

    def __init__(self, directory: str, snapshot_dir: str | None, use_process: bool, *,
                 max_staging_bytes: int | None = None, prestart: bool = False,
                 ahead: Callable[[], int | None] | None = None) -> None:
        self._directory = directory
        self._snapshot_dir = snapshot_dir
        self.slot = BackgroundSave()
        #: The save process: None until started, or when off.
        self._saver: SaverProcess | None = None
        self._use_saver = use_process
        self._saver_lock = threading.Lock()
        #: The last snapshot of a directory, whose unchanged files the next one links instead of copying.
        self._snapshots = SnapshotCache()
        #: The staging memory this manager's background saves may hold (``max_staging_bytes``), and its ready
        #: segment.
        self.staging = StagingMemory(max_staging_bytes)
        self._ahead = ahead
        if use_process and prestart:  # the first background save then finds the process ready
            threading.Thread(target=self._prestart, name="taskpoint-saver-start", daemon=True).start()

    def _prestart(self) -> None:
        sweep_dead_segments()
        process = self.helper_process()
        modules = sorted({cls.staged_by for cls in registered_payloads() if cls.staged_by is not None})
        if process is not None and modules:
            process.warm(modules)
        if process is not None and self._ahead is not None:
            self.staging.prepare(self._ahead, process.owner)

    def start(self, step: int, payload: Payload, job: Callable[..., None], kind: SavedBy) -> None:
        """Snapshot ``payload`` (or stage a :class:`~.staging.Stageable` one in shared memory for the save process
        when its own ``kind``, the step kind that saves it, does), then run ``job(snapshot, handover)`` in the
        background, returning once the save process holds the save (``handover`` is None without one, or when
        ``kind.helper`` is False: a job that never uses it). A payload that cannot be snapshotted runs
        ``job(payload)`` here, with a warning.

        Handing the save over costs a write into a pipe (bytes are written into the snapshot folder for it, files
        and directories travel as their snapshot's path, staged states as their segment's name), and, on the first
        save without ``prestart``, the spawn of the process (not its start, which is not waited for);
        docs/manager.md has the figures."""
        helper = kind.helper
        if helper and self._use_saver and isinstance(payload, Stageable) and kind.name == payload.staged_kind:
            size = payload.staging_size()
            if size is not None:
                self._start_staged(step, payload, size, job)
                return
        scratch = owned_folder(SNAPSHOT_PREFIX, self._snapshot_dir)
        # Each snapshot is as large as the data it copied: those of killed processes must not pile up.
        sweep_dead_folders(scratch.parent, SNAPSHOT_PREFIX)
        try:
            snapshot = self._snapshots.take(payload, scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        if snapshot is None:
            shutil.rmtree(scratch, ignore_errors=True)
            warnings.warn(f"payloads of kind {payload.kind!r} cannot be snapshotted; step {step} is saved in "
                          "the foreground", stacklevel=3)
            job(payload)
            return
        try:
            process = self.helper_process() if helper else None
            if process is not None:
                snapshot = spool(snapshot, scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        kept = self._snapshots.kept
        handover = None if process is None else Handover(process, (scratch,) if kept is None else (scratch, kept))

        def tidy() -> None:
            if not self._snapshots.keep(scratch):  # a directory's snapshot is kept for the next one
                shutil.rmtree(scratch, ignore_errors=True)

        self._hand_over(step, job, snapshot, handover, tidy)

    def _start_staged(self, step: int, payload: Stageable, size: int, job: Callable[..., None]) -> None:
        """Copy ``payload`` into a segment of ``size`` bytes within the budget (the ready segment when there is one,
        :mod:`.staging_memory`; a state larger than the budget is saved here, blocking), named for the save process
        (so that it is that process's from the start), and hand it over; return once the request is in the
        process's pipe."""
        sweep_dead_segments()
        process = self.helper_process()
        segment = self.staging.take(size, step, None if process is None else process.owner)
        if segment is None:
            job(payload)
            return
        try:
            staged = payload.stage(segment)
        except BaseException:
            self.staging.give_back(segment, kept=False)
            raise
        handover = None if process is None else Handover(process, ())

        def tidy() -> None:  # the segment is freed, unless the save process wrote it and kept it for the next save
            self.staging.give_back(segment, kept=handover is not None and handover.kept)

        self._hand_over(step, job, staged, handover, tidy)

    def _hand_over(self, step: int, job: Callable[..., None], snapshot: Payload, handover: Handover | None,
                   tidy: Callable[[], None]) -> None:
        """Run ``job(snapshot, handover)`` as the save in flight, then ``tidy()``; return once the save's request
        is in the save process's pipe (at once without one)."""

        def upload() -> None:
            try:
                job(snapshot, handover)
            finally:
                if handover is not None:
                    handover.finish()
                tidy()

        self.slot.start(step, upload)
        if handover is not None:
            handover.wait()

    def settle(self, *, wait: bool) -> None:
        """Raise the error of a finished background save; with ``wait``, first let it finish."""
        self.slot.settle(wait=wait, saver=self._saver)

    def helper_process(self) -> SaverProcess | None:
        """The save process, started on first use; None when off or unavailable."""
        with self._saver_lock:
            if self._saver is not None and not self._saver.alive():
                saver, self._saver = self._saver, None  # it died (killed, out of memory): start a new one
                saver.close()
                if saver.failed_to_start():
                    self._unavailable(f"it exited with code {saver.exit_code} before it was ready")
            if self._saver is None and self._use_saver:
                try:
                    self._saver = SaverProcess()
                except SaverUnavailable as exc:
                    self._unavailable(str(exc))
            return self._saver

    def _unavailable(self, why: str) -> None:
        self._use_saver = False
        warnings.warn(f"taskpoint could not start its save process ({why}); background saves of {self._directory} "
                      "run in a thread of this process", RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """Stop the save process (after the request it may be serving); later saves use no process."""
        with self._saver_lock:
            saver, self._saver, self._use_saver = self._saver, None, False
        self.staging.close()
        if saver is not None:
            saver.close()
        self._snapshots.drop()

    @property
    def saver(self) -> SaverProcess | None:
        """The save process while one runs."""
        return self._saver
