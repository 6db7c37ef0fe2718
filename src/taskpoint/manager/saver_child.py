"""The save process's own side (:func:`serve`): it takes requests from its parent over the pipe, writes each
payload, and, when the parent dies after the handover, finishes the upload and commits the step for it (see
:mod:`.saver` for the protocol and the guarantees)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import os
import pickle
import select
import shutil
import signal
import struct
import termios
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Any

from .. import _progress, preemption
from .._log import logger
from .._progress import NO_PROGRESS, Progress
from ..format.records import StepManifest
from ..storage import Location
from ..transfer import write_payload
from ..workspace import owner_tag
from .saver import (
    CLOSE,
    DONE,
    KEEP_FRESH_SECONDS,
    TAKEN,
    WARM,
    OrphanPart,
    StagedJob,
    StagedRequest,
    pickled,
    read_message,
    release_freed_memory,
    write_message,
)
from .segment_files import stored_size
from .staging import WAIT_LOG_SECONDS, Segment, free_owned_segments
from .step_commit import write_manifest

#: How long the next message waits for the imports ahead (``WARM``) under way before it is read beside them: far past
#: the seconds that importing torch takes, even on a loaded machine, so that only an import that hangs is not waited
#: out.
WARM_WAIT_SECONDS = 300.0
#: Where the child writes a staged save's manifest (which the save's job made whole) for a dead parent: the
#: location's URI, storage options and retry policy.
_Commit = tuple[str, Any, Any]


class _Duty:
    """What the child owes its parent: the message it reads or handles (``handling``), the request it serves
    (``busy`` until the parent said ``done``, or the child committed the step for it), the manifest to write if
    the parent dies first, and the snapshot folders to remove then. The main loop and the watchdog share it;
    :meth:`commit_for_dead_parent` runs once."""

    def __init__(self, requests: int) -> None:
        self._requests = requests
        self.handling = threading.Event()
        self.busy = threading.Event()
        self._lock = threading.Lock()
        self._commit: _Commit | OrphanPart | None = None
        self._stored: tuple[int, str] | StepManifest | None = None
        self.folders: tuple[str, ...] = ()
        #: The segment of the last staged save, kept for the parent's next one and still mapped here.
        self.kept: Segment | None = None

    def take(self, commit: _Commit | OrphanPart | None, folders: tuple[str, ...]) -> None:
        with self._lock:
            self.busy.set()
            self._commit, self._stored, self.folders = commit, None, folders

    def stored(self, stored: tuple[int, str] | StepManifest) -> None:
        """The payload is uploaded (its size and digest), or a staged save's objects are (the manifest that
        commits them): the step is committed by the parent, or else by this child."""
        with self._lock:
            if self._commit is None:
                self.busy.clear()  # nothing to finish here: the request is over
            else:
                self._stored = stored

    @property
    def uploaded(self) -> bool:
        return self._stored is not None

    def pending(self) -> bool:
        """Whether the child has work its parent gave it: bytes unread in the pipe (a request sent just before
        the parent died, which ``save()`` returned after), a message being read or handled, or a request whose
        step is not committed yet. Unread bytes are looked at first: the main loop marks a message ``handling``
        before it reads any of it, so that no moment shows neither."""
        return _unread(self._requests) > 0 or self.handling.is_set() or self.busy.is_set()

    def end(self) -> None:
        """The request is over (the parent committed its step, or it failed)."""
        with self._lock:
            self._commit = self._stored = None
            self.busy.clear()

    def commit_for_dead_parent(self, deadline: float) -> None:
        """The parent died: commit the step it did not say it committed (unless a manifest is there), or finish
        its part of a step of several ranks, by ``deadline``."""
        with self._lock:
            if self._commit is not None and self._stored is not None:
                with contextlib.suppress(Exception):  # nobody is left to tell; the payload stays a leftover
                    _commit_orphan(self._commit, self._stored, deadline)
            self._commit = self._stored = None
            self.busy.clear()

    def keep_fresh(self) -> None:
        now = time.time()
        for folder in self.folders:
            with contextlib.suppress(OSError):
                os.utime(folder, (now, now))

    def leave(self) -> None:
        """Remove the snapshot folders of the dead parent that the last request named, and the segments named for
        this process: that of a staged save not written yet, and one staged for a request never sent."""
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
        free_owned_segments(owner_tag(os.getpid()))


def _unread(fd: int) -> int:
    """The bytes waiting in pipe ``fd`` (0 where that cannot be asked)."""
    try:
        count: int = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        return count
    except OSError:
        return 0


def _die_with_parent(parent: int, duty: _Duty) -> None:
    """End this process when its parent dies: at once when idle, else once the requests the parent sent are
    served (the child commits their step itself) or the grace period has passed, whichever comes first; the
    snapshot folders of the last request and the segments named for this process are removed first.

    Polls the parent pid (re-parenting changes it) rather than using Linux's PR_SET_PDEATHSIG, which fires
    when the *thread* that started the child ends: here, the background save thread, after every save.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        deadline = time.monotonic() + preemption.grace_seconds()
        refreshed = -KEEP_FRESH_SECONDS
        while duty.pending() and time.monotonic() < deadline:
            if duty.uploaded:  # and then the requests still in the pipe (a ``done`` unread may precede one)
                duty.commit_for_dead_parent(deadline)
            elif time.monotonic() - refreshed >= KEEP_FRESH_SECONDS:
                duty.keep_fresh()
                refreshed = time.monotonic()
            time.sleep(0.02)
        duty.leave()
        os._exit(0)

    threading.Thread(target=watch, name="taskpoint-saver-watchdog", daemon=True).start()


def _portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


def _commit_orphan(commit: _Commit | OrphanPart, stored: tuple[int, str] | StepManifest,
                   deadline: float | None = None) -> None:
    """Write the manifest of the step whose payload (or staged objects) this child just stored for a parent
    that died; never over a manifest already there (another writer committed the step first). A payload's
    ``commit`` finishes itself (a part of a step of several ranks by ``deadline``, default: the grace period from
    now)."""
    if isinstance(stored, StepManifest):
        assert isinstance(commit, tuple)
        write_manifest(Location(*commit), stored, create=True,
                       action="commit, for a trainer that died, the checkpoint at")
        return
    assert not isinstance(commit, tuple)
    size, digest = stored
    commit.finish(size, digest, time.monotonic() + preemption.grace_seconds() if deadline is None else deadline)


def _relayed(replies: IO[bytes]) -> Progress:
    """The child's progress: each count sent to the parent as a message before the answer (which is sent only
    after this progress is closed, so messages never interleave)."""

    def send(what: str, n: int) -> None:
        with contextlib.suppress(OSError):  # a parent that died hears nothing; the upload goes on
            write_message(replies, pickled(("progress", what, n)))

    return _progress.relay(send)


def _serve_staged(request: StagedRequest, duty: _Duty, replies: IO[bytes]) -> None:
    """Take a staged save's segment over, say so, then run its job, free the segment (or keep it, when the
    request asks and the job succeeded), and answer the job's sizes and manifest (or its error)."""
    value: Any
    kept, duty.kept = duty.kept, None
    try:
        segment = _adopt(request.segment, kept)
    except (OSError, ValueError) as exc:  # gone (removed by hand), or not a segment: the parent saves itself
        with contextlib.suppress(OSError):
            write_message(replies, pickled(("error", (_portable_error(exc), traceback.format_exc()), [])))
        return
    duty.take(request.manifest, ())
    with contextlib.suppress(OSError):  # a parent dead already: the step is done all the same
        write_message(replies, pickled(TAKEN))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            job: StagedJob = pickle.loads(request.job)
            with _relayed(replies) if request.report else NO_PROGRESS as progress:
                sizes, manifest = job.run(segment, progress)
            if request.keep:  # the parent's next save copies into it; a dead parent's goes as this process leaves
                duty.kept = segment
            else:
                segment.free()
            duty.stored(manifest)
            status, value = "ok", (sizes, manifest)
        except BaseException as exc:
            segment.free()
            duty.end()
            status, value = "error", (_portable_error(exc), traceback.format_exc())
    with contextlib.suppress(OSError):  # the parent died meanwhile: EOF or the watchdog commits
        write_message(replies, pickled((status, value, [(w.category, str(w.message)) for w in caught])))


def _adopt(name: str, kept: Segment | None) -> Segment:
    """The segment at ``name``, taken over: ``kept`` (the last one, still mapped here) when it is that file at the
    same size, so that its pages need not be mapped again (0.05-0.13 s for 256 MiB here), else mapped anew."""
    if kept is not None:
        with contextlib.suppress(OSError):
            if str(kept.path) == name and stored_size(Path(name)) == kept.size:
                return kept
        kept.unmap()
    return Segment.adopt(name)


class _Warmer:
    """The modules the parent asks this process to import ahead of the requests that need them (``WARM``), imported
    on a thread of their own, which the next message waits for (:meth:`wait`): two threads importing modules that
    import each other (torch and numpy) trip Python's import-deadlock detection, which hands one of them a partly
    initialised module (``cannot import name ... from partially initialized module``, or torch's ``cannot load
    module more than once per process``), and reading a request imports the modules of its payload or job. A module
    that fails here is imported (and fails) again by the request that needs it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, modules: list[str]) -> None:
        self._thread = threading.Thread(target=_import_quietly, args=(modules,), name="taskpoint-saver-warm",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the imports ahead are done: logged every :data:`WAIT_LOG_SECONDS`, and given up (logged) after
        :data:`WARM_WAIT_SECONDS`, as an import that long has hung."""
        thread, self._thread = self._thread, None
        began = time.monotonic()
        while thread is not None and thread.is_alive():
            thread.join(WAIT_LOG_SECONDS)
            waited = time.monotonic() - began
            if not thread.is_alive():
                return
            if waited >= WARM_WAIT_SECONDS:
                logger.warning("the save process reads its next message beside imports ahead that ran %.0f s", waited)
                return
            logger.info("the save process waits for its imports ahead before it reads a message, since %.0f s",
                        waited)


def _import_quietly(modules: list[str]) -> None:
    """Import ``modules`` ahead of the requests that need them; one that fails is imported (and fails) again there."""
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def serve(parent: int) -> None:
    """The child's loop: answer write requests until the pipe closes."""
    requests = io.FileIO(0, "rb", closefd=False)  # unbuffered: what is not read stays in the pipe, for pending()
    duty = _Duty(requests.fileno())
    warmer = _Warmer()
    _die_with_parent(parent, duty)
    # The pipe to the parent is a private copy of stdout; fd 1 now points at stderr, so a stray print from
    # some library cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    with contextlib.suppress(OSError):  # a parent dead already (it does not wait for this): its requests are served
        write_message(replies, pickled("ready"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is for the parent to handle
    with contextlib.suppress(ValueError):  # and so are preemption notices: the child ends with its parent
        for sig in preemption.configured_signals():
            signal.signal(sig, signal.SIG_IGN)
    while True:
        select.select([requests], [], [])  # until a message, or the end of the pipe, is there to read
        duty.handling.set()  # before a byte is read: pending() sees the message in the pipe or being handled
        try:
            warmer.wait()  # unpickling a request imports the modules of its payload or job
            try:
                message = read_message(requests)
            except EOFError:  # the parent died (a closing manager says CLOSE first)
                duty.commit_for_dead_parent(time.monotonic() + preemption.grace_seconds())
                duty.leave()
                return
            if message == CLOSE:
                return
            _handle(message, duty, replies, warmer)
        finally:
            duty.handling.clear()
        release_freed_memory()


def _handle(message: Any, duty: _Duty, replies: IO[bytes], warmer: _Warmer) -> None:
    """One message of the parent's: ``done``, modules to import ahead, or a request to serve."""
    if message == DONE:
        duty.end()
    elif isinstance(message, tuple) and message[0] == WARM:
        warmer.start(message[1])
    elif isinstance(message, StagedRequest):
        _serve_staged(message, duty, replies)
    else:
        _serve_payload(message, duty, replies)


def _serve_payload(request: tuple[Any, ...], duty: _Duty, replies: IO[bytes]) -> None:
    """Say that the payload's request is read, write the payload, and answer its size, digest and index (or its
    error)."""
    uri, options, retry, payload, codec, level, digest, orphan, report, folders = request
    duty.take(orphan, folders)
    with contextlib.suppress(OSError):  # a parent dead already: the step is done all the same
        write_message(replies, pickled(TAKEN))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value: Any
        try:
            with _relayed(replies) if report else NO_PROGRESS as progress:
                value = write_payload(Location(uri, options, retry), payload, codec, level, digest, progress=progress)
            duty.stored(value)
            value = (*value, payload.written_index)  # the archive's index goes into the parent's manifest
            status = "ok"
        except BaseException as exc:
            duty.end()
            status, value = "error", (_portable_error(exc), traceback.format_exc())
    with contextlib.suppress(OSError):  # the parent died meanwhile: EOF or the watchdog commits
        write_message(replies, pickled((status, value, [(w.category, str(w.message)) for w in caught])))
