"""Background saves in a helper process, so that the save never competes with the caller for its GIL.

A background save thread in the caller's process reads, archives, compresses, hashes and uploads while the
training loop runs. The heavy lifting happens in C with the GIL released, but the save's Python glue still
takes the GIL thousands of times per GiB, and a training step that calls into native kernels (numpy, torch)
needs it between every two calls: measured here, a 1 GiB background save slowed such a loop's work by about
2x while it ran, although a core stood free. PyTorch's distributed checkpoint offers a process for its async
saves for the same reason.

:class:`SaverProcess` runs :func:`serve` in a plain child process (``python -c``) (not ``multiprocessing``:
its spawn mode would import the caller's ``__main__`` again, running an unguarded training script twice).
It writes payloads as :func:`taskpoint.transfer.write_payload` does, one request at a time, over a pipe of
length-prefixed pickles. Only the payload's bytes travel this way: while it lives the manager still commits
(writes the manifest) and applies retention in its own process, where it knows which steps are being
restored. The child runs at a lower CPU priority, and exits when the pipe closes.

A background save is *handed over* before ``save()`` returns: the helper acknowledges each request (one
reply on the pipe) as soon as it holds it, so that it holds everything it needs to finish and commit the step
(the payload, or the path of its snapshot on local disk; the destination; the codec; the manifest to write)
the moment the trainer may die. The ack costs a pipe round trip, not an upload (measured in docs/manager.md).

When the parent dies (SIGKILL, the OOM killer) after the handover, the child outlives it: it finishes the
upload and commits the step itself, with the manifest the parent sent along with the request (completed with
the size and digest it computed), unless a manifest for that step exists already (the parent committed it
before dying, or a writer of the same step got there first: never overwritten). For a shard of a step of
several ranks it writes the rank's record instead, and rank 0's child commits the step once every rank's
record is there (:class:`OrphanPart`). Its duty for a step ends
when the parent says it has committed it (the ``done`` message), so no moment is left where neither writes
the manifest. It does so within ``$TASKPOINT_GRACE_SECONDS`` (default 30) of noticing the death (it looks
every 0.2 s, and the pipe closing tells it at once); when the upload cannot finish in time it exits and leaves
only an uncommitted payload, which no reader sees and a later save or ``gc()`` sweeps. The snapshot folders a
request names are then the child's: it keeps them fresh (so no sweep of a dead process's folders takes them
meanwhile) and removes them before it exits. An idle child exits at once (removing the snapshot folders the
last request named, which the dead parent kept for its next snapshot). It ignores the preemption signals
(``SIGTERM`` by default), which a platform may send to every process of the job: the trainer decides, and
the child ends with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import IO, Any, Protocol

from .. import _progress, preemption
from .._progress import NO_PROGRESS, Progress
from ..errors import add_note
from ..format.codecs import Codec
from ..format.records import StepManifest
from ..payloads import Payload
from ..storage import Location
from ..transfer import write_payload

_LENGTH = struct.Struct("<Q")
#: What the child runs (not ``-m taskpoint.manager.saver``: the package imports this module, and runpy would
#: then run a second copy of it).
_CHILD = "import sys; from taskpoint.manager.saver import serve; serve(int(sys.argv[1]))"
#: How much lower the child's CPU priority is than its parent's (``nice``): a training loop keeps its core.
NICENESS = 10
#: The child's reply once it holds a request (before it uploads anything).
TAKEN = "taken"
#: The parent's message once it has committed (or failed to commit) the step of the last request: the child's
#: duty for that step ends.
DONE = "done"
#: The parent's last message, from a manager that closes: the child exits, leaving the snapshot folders (which
#: a pipe closed without it, by the parent's death, makes the child remove).
CLOSE = "close"
#: How often a child whose parent died refreshes the modification time of the snapshot folders it took over:
#: far below the age (LEFTOVER_GRACE_SECONDS, 15 min) after which a sweep removes a dead process's folder.
KEEP_FRESH_SECONDS = 60.0


def _pickle(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _send(stream: IO[bytes], data: bytes) -> None:
    """One message: its length, then its pickled bytes."""
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the pipe closed")
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the pipe closed in the middle of a message")
    return pickle.loads(data)


class OrphanPart(Protocol):
    """A part of a step that the child finishes for a parent that died once the payload was stored (a shard's
    record, or rank 0's commit of a step of several ranks: :class:`~taskpoint.manager.shards.ShardOrphan`),
    by ``deadline`` (``time.monotonic()``)."""

    def finish(self, size: int, digest: str, deadline: float) -> None: ...


#: What the child finishes for a dead parent: a single payload's manifest (its location, and the manifest with
#: size and digest to fill in), or a part of a step of several ranks.
Orphan = tuple[Location, StepManifest] | OrphanPart


class SaveProcessTraceback(Exception):
    """The traceback, in the save process, of an error that the save process raised (set as its cause)."""


class SaverUnavailable(RuntimeError):
    """The helper process could not start or died; the caller saves in its own process instead."""


class NotTransferable(SaverUnavailable):
    """This payload cannot be pickled to the helper process; the caller writes it itself (no warning)."""


class SaverProcess:
    """The caller's end of one helper process. One request at a time (the manager has one save in flight)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        # The child imports this same taskpoint (an editable install, a path added at run time...).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
        # Two malloc arenas (unless the caller chose): each save runs new pool threads, and with an arena per
        # thread glibc kept their freed buffers; measured over five 1 GiB saves to S3, the process's peak RSS
        # grew 238 -> 323 MiB without this and 233 -> 261 MiB with it (RSS between saves 134-203 vs 64-86).
        env.setdefault("MALLOC_ARENA_MAX", "2")
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as exc:
            raise SaverUnavailable(f"could not start {sys.executable}: {exc}") from exc
        self._lock = threading.Lock()
        try:
            hello = _receive(self._process.stdout)  # type: ignore[arg-type]
        except Exception as exc:
            self.close()
            raise SaverUnavailable(f"the save process did not start: {exc}") from exc
        if hello != "ready":
            self.close()
            raise SaverUnavailable(f"the save process answered {hello!r} instead of 'ready'")

    @property
    def pid(self) -> int:
        return self._process.pid

    def store_payload(self, location: Location, payload: Payload, codec: Codec, level: int | None,
                      commit: Orphan | None = None,
                      progress: Progress = NO_PROGRESS, *, folders: tuple[str, ...] = (),
                      taken: Callable[[], None] | None = None) -> tuple[int, str]:
        """What :func:`taskpoint.transfer.write_payload` does, done by the helper process.

        ``commit`` is the manifest's location and the manifest (its size and digest still to fill in) that the
        child writes itself if this process dies before it has called :meth:`done` (see the module's
        docstring); ``folders`` are the snapshot folders the child removes then. ``taken`` is called once the
        child holds the request, before it uploads. The child reports its progress as
        ``("progress", "size" | "update", n)`` messages before its answer; they go to ``progress``.

        Raises what the child raised (with its traceback as a note), or SaverUnavailable when the request
        cannot be sent (the payload does not pickle) or the child died; nothing was committed then.
        """
        try:
            orphan = commit if commit is None or not isinstance(commit, tuple) else (
                commit[0].uri, commit[0].storage_options, commit[0].retry, commit[1])
            request = _pickle((location.uri, location.storage_options, location.retry, payload, codec, level,
                               orphan, progress.active, folders))
        except Exception as exc:
            raise NotTransferable(f"this payload cannot be sent to the save process ({exc})") from exc
        with self._lock:
            stdin, stdout = self._process.stdin, self._process.stdout
            assert stdin is not None and stdout is not None
            try:
                _send(stdin, request)
                answer = _receive(stdout)
                if answer != TAKEN:
                    raise SaverUnavailable(f"the save process (pid {self.pid}) answered {answer!r} instead of "
                                           f"{TAKEN!r}")
                if taken is not None:
                    taken()
                answer = _receive(stdout)
                while answer[0] == "progress":
                    _, what, n = answer
                    if what == "size":
                        progress.set_total(n)
                    else:
                        progress.update(n)
                    answer = _receive(stdout)
                status, value, caught = answer
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                code = self._process.poll()
                raise SaverUnavailable(f"the save process (pid {self.pid}) died"
                                       + (f" with exit code {code}" if code is not None else "")) from exc
        for category, message in caught:
            warnings.warn(message, category, stacklevel=2)
        if status == "ok":
            size, digest, payload.written_index = value
            return size, digest
        error, remote_traceback = value
        where = f"raised in taskpoint's save process (pid {self.pid})"
        if error.__cause__ is None:  # never set: a cause does not survive pickling
            # As ProcessPoolExecutor does: the child's traceback as the cause, which every Python version
            # prints (notes are not printed before 3.11).
            error.__cause__ = SaveProcessTraceback(f"{where}; its traceback there:\n{remote_traceback}")
            add_note(error, f"{where}; its traceback there is the cause shown above")
        else:
            add_note(error, f"{where}:\n{remote_traceback}")
        raise error

    def done(self) -> None:
        """Tell the child that the step of its last request (stored with a ``commit``) is committed, or that
        committing it failed here: it no longer commits it itself. A child that died needs no telling."""
        with self._lock:
            stdin = self._process.stdin
            assert stdin is not None
            with contextlib.suppress(OSError):
                _send(stdin, _pickle(DONE))

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        """Close the pipe; the child exits after any request in progress. Killed if it hangs."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                _send(self._process.stdin, _pickle(CLOSE))
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def release_freed_memory() -> None:
    """Hand memory that a finished save freed back to the OS.

    Each save runs its pools on new threads, and glibc gives threads their own malloc arenas, whose freed
    buffers (upload parts and gzip members of several MiB) it keeps. In the benchmark's S3 training loop of
    background saves in threads, peak RSS reached 280 MiB, against 187 MiB for one save. A no-op where the C
    library has no ``malloc_trim``.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


# -- the child --------------------------------------------------------------------------------------------


class _Duty:
    """What the child owes its parent: the request it serves (``busy`` until the parent said ``done``, or the
    child committed the step for it), the manifest to write if the parent dies first, and the snapshot folders
    to remove then. The main loop and the watchdog share it; :meth:`commit_for_dead_parent` runs once."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self._lock = threading.Lock()
        self._commit: tuple[str, Any, Any, StepManifest] | OrphanPart | None = None
        self._stored: tuple[int, str] | None = None
        self.folders: tuple[str, ...] = ()

    def take(self, commit: tuple[str, Any, Any, StepManifest] | OrphanPart | None, folders: tuple[str, ...]) -> None:
        with self._lock:
            self.busy.set()
            self._commit, self._stored, self.folders = commit, None, folders

    def stored(self, size: int, digest: str) -> None:
        """The payload is uploaded: the step is committed by the parent, or else by this child."""
        with self._lock:
            if self._commit is None:
                self.busy.clear()  # nothing to finish here: the request is over
            else:
                self._stored = (size, digest)

    @property
    def uploaded(self) -> bool:
        return self._stored is not None

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
                    _commit_orphan(self._commit, *self._stored, deadline)
            self._commit = self._stored = None
            self.busy.clear()

    def keep_fresh(self) -> None:
        now = time.time()
        for folder in self.folders:
            with contextlib.suppress(OSError):
                os.utime(folder, (now, now))

    def leave(self) -> None:
        """Remove the snapshot folders of the dead parent that the last request named."""
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent(parent: int, duty: _Duty) -> None:
    """End this process when its parent dies: at once when idle, else once the request in progress ends (the
    child commits the step itself) or the grace period has passed, whichever comes first; the snapshot folders
    of the last request are removed first.

    Polls the parent pid (re-parenting changes it) rather than using Linux's PR_SET_PDEATHSIG, which fires
    when the *thread* that started the child ends: here, the background save thread, after every save.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        deadline = time.monotonic() + preemption.grace_seconds()
        refreshed = -KEEP_FRESH_SECONDS
        while duty.busy.is_set() and time.monotonic() < deadline:
            if duty.uploaded:
                duty.commit_for_dead_parent(deadline)
                break
            if time.monotonic() - refreshed >= KEEP_FRESH_SECONDS:
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


def _commit_orphan(commit: tuple[str, Any, Any, StepManifest] | OrphanPart, size: int, digest: str,
                   deadline: float | None = None) -> None:
    """Write the manifest of the step whose payload this child just uploaded for a parent that died; never
    over a manifest already there (another writer committed the step first). A part of a step of several
    ranks finishes itself by ``deadline`` (default: the grace period from now)."""
    if not isinstance(commit, tuple):
        commit.finish(size, digest, time.monotonic() + preemption.grace_seconds() if deadline is None else deadline)
        return
    uri, options, retry, pending = commit
    manifest = dataclasses.replace(pending, record=dataclasses.replace(pending.record, size=size, sha256=digest))
    location = Location(uri, options, retry)
    if location.exists():
        return
    location.write_small(manifest.to_bytes(), action="commit, for a trainer that died, the checkpoint at")


def _relayed(replies: IO[bytes]) -> Progress:
    """The child's progress: each count sent to the parent as a message before the answer (which is sent only
    after this progress is closed, so messages never interleave)."""

    def send(what: str, n: int) -> None:
        with contextlib.suppress(OSError):  # a parent that died hears nothing; the upload goes on
            _send(replies, _pickle(("progress", what, n)))

    return _progress.relay(send)


def serve(parent: int) -> None:
    """The child's loop: answer write requests until the pipe closes."""
    duty = _Duty()
    _die_with_parent(parent, duty)
    with contextlib.suppress(OSError, AttributeError):
        os.nice(NICENESS)
    # The pipe to the parent is a private copy of stdout; fd 1 now points at stderr, so a stray print from
    # some library cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    _send(replies, _pickle("ready"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is for the parent to handle
    with contextlib.suppress(ValueError):  # and so are preemption notices: the child ends with its parent
        for sig in preemption.configured_signals():
            signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            message = _receive(requests)
        except EOFError:  # the parent died (a closing manager says CLOSE first)
            duty.commit_for_dead_parent(time.monotonic() + preemption.grace_seconds())
            duty.leave()
            return
        if message == CLOSE:
            return
        if message == DONE:
            duty.end()
            continue
        uri, options, retry, payload, codec, level, orphan, report, folders = message
        duty.take(orphan, folders)
        with contextlib.suppress(OSError):  # a parent dead already: the step is done all the same
            _send(replies, _pickle(TAKEN))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value: Any
            try:
                with _relayed(replies) if report else NO_PROGRESS as progress:
                    value = write_payload(Location(uri, options, retry), payload, codec, level,
                                          progress=progress)
                duty.stored(*value)
                value = (*value, payload.written_index)  # the archive's index goes into the parent's manifest
                status = "ok"
            except BaseException as exc:
                duty.end()
                status, value = "error", (_portable_error(exc), traceback.format_exc())
        with contextlib.suppress(OSError):  # the parent died meanwhile: EOF or the watchdog commits
            _send(replies, _pickle((status, value, [(w.category, str(w.message)) for w in caught])))
        message = payload = value = None  # the payload (bytes can be large) is not kept until the next request
        release_freed_memory()
