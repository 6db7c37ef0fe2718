"""Background saves in a helper process, so that the save never competes with the caller for its GIL.

A background save thread in the caller's process reads, archives, compresses, hashes and uploads while the
training loop runs. The heavy lifting happens in C with the GIL released, but the save's Python glue still
takes the GIL thousands of times per GiB, and a training step that calls into native kernels (numpy, torch)
needs it between every two calls: measured here, a 1 GiB background save slowed such a loop's work by about
2x while it ran, although a core stood free. PyTorch's distributed checkpoint offers a process for its async
saves for the same reason.

:class:`SaverProcess` runs :func:`~.saver_child.serve` in a plain child process (``python -c``) (not
``multiprocessing``: its spawn mode would import the caller's ``__main__`` again, running an unguarded training
script twice). It writes payloads as :func:`taskpoint.transfer.write_payload` does, one request at a time, over a
pipe of length-prefixed pickles. Only the payload's bytes travel this way: while it lives the manager still
commits (writes the manifest) and applies retention in its own process, where it knows which steps are being
restored. The child runs at a lower CPU priority, and exits when the pipe closes.

A background save is *handed over* before ``save()`` returns: its request is in the pipe, which holds
everything the helper needs to finish and commit the step (the payload, or the path of its snapshot on local
disk, or the name of its staging segment; the destination; the codec; the manifest to write) the moment the
trainer may die. ``save()`` does not wait for the helper to read it: a request in the pipe outlives the trainer,
and the helper reads every request the pipe holds before it exits (its watchdog waits while bytes are unread,
:func:`~.saver_child.serve`). The helper still acknowledges each request (``taken``) as it reads it, for the
save's thread, which then relays its progress and answer.

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
import os
import pickle
import struct
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from .._progress import NO_PROGRESS, Progress
from ..errors import add_note
from ..format.codecs import Codec
from ..format.records import PAYLOAD_HASH, StepManifest
from ..payloads import Payload
from ..storage import Location
from ..workspace import how_it_ended, owner_gone, owner_tag, process_start
from .staging import Segment

_LENGTH = struct.Struct("<Q")
#: What the child runs (not ``-m taskpoint.manager.saver``: the package imports this module, and runpy would
#: then run a second copy of it).
_CHILD = "import sys; from taskpoint.manager.saver_child import serve; serve(int(sys.argv[1]))"
#: How much lower the child's CPU priority is than its parent's (``nice``): a training loop keeps its core.
NICENESS = 10
#: The child's reply once it has read a request (before it uploads anything).
TAKEN = "taken"
#: The parent's message once it has committed (or failed to commit) the step of the last request: the child's
#: duty for that step ends.
DONE = "done"
#: The parent's last message, from a manager that closes: the child exits, leaving the snapshot folders (which
#: a pipe closed without it, by the parent's death, makes the child remove).
CLOSE = "close"
#: The parent's message naming modules the child imports on a thread of its own, ahead of the requests that need
#: them (``("warm", names)``).
WARM = "warm"
#: How often a child whose parent died refreshes the modification time of the snapshot folders it took over:
#: far below the age (LEFTOVER_GRACE_SECONDS, 15 min) after which a sweep removes a dead process's folder.
KEEP_FRESH_SECONDS = 60.0
#: How long a save process whose pipe closed is waited for, to say how it ended (a bound: it is ending).
EXIT_WAIT_SECONDS = 10.0


def pickled(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def write_message(stream: IO[bytes], data: bytes) -> None:
    """One message: its length, then its pickled bytes."""
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    """``n`` bytes, fewer only at the end of the stream (an unbuffered pipe's read may return a part)."""
    parts = []
    while n:
        part = stream.read(n)
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def read_message(stream: IO[bytes]) -> Any:
    head = _read_exactly(stream, _LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the pipe closed")
    (length,) = _LENGTH.unpack(head)
    data = _read_exactly(stream, length)
    if len(data) < length:
        raise EOFError("the pipe closed in the middle of a message")
    return pickle.loads(data)


class OrphanPart(Protocol):
    """What the child finishes for a parent that died once the payload was stored, given the payload's size and
    digest, by ``deadline`` (``time.monotonic()``): the manifest of a step of one payload object
    (:class:`~taskpoint.manager.step_commit.OrphanCommit`), a shard's record, or rank 0's commit of a step of
    several ranks (:class:`~taskpoint.manager.shards.ShardOrphan`)."""

    def finish(self, size: int, digest: str, deadline: float) -> None: ...


class StagedJob(Protocol):
    """The save process's part of a staged save (a step kind's, e.g. ``taskpoint.torch``'s state dict): write
    the step's objects from the segment and return their sizes and the manifest that commits them."""

    def run(self, segment: Segment, progress: Progress) -> tuple[dict[str, int], StepManifest]: ...


@dataclass(frozen=True)
class StagedRequest:
    """A staged save sent to the save process: the segment it takes over before it answers, the pickled
    :class:`StagedJob` (unpickled only after that answer, as it may import torch), where the step's manifest
    goes, whether the parent listens to its progress, and whether it keeps the segment once written (for the
    parent's next save: :mod:`.staging_memory`) instead of removing it."""

    segment: str
    job: bytes
    manifest: tuple[str, Any, Any]
    report: bool
    keep: bool = False


class SaveProcessTraceback(Exception):
    """The traceback, in the save process, of an error that the save process raised (set as its cause)."""


class SaverUnavailable(RuntimeError):
    """The helper process could not start or died; the caller saves in its own process instead."""


class NotTransferable(SaverUnavailable):
    """This payload cannot be pickled to the helper process; the caller writes it itself (no warning)."""


class SaverProcess:
    """The caller's end of one helper process. One request at a time (the manager has one save in flight).

    Made without waiting for the child to start (a Python start and taskpoint's import, about 0.5 CPU-s): its
    pipe takes requests at once, and its ``ready`` is read on the save's thread before its first answer, so that
    the first background save of a manager that did not start its process ahead blocks for a spawn, not for a
    Python start."""

    def __init__(self) -> None:
        env = dict(os.environ)
        # The child imports this same taskpoint (an editable install, a path added at run time...).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
        # Two malloc arenas (unless the caller chose): the shared pools' threads (taskpoint.executors) each get
        # an arena of their own, in which glibc keeps the freed parts and members. Measured with the shared
        # pools, five 256 MiB folder saves and loads to S3 in one process: peak RSS 285 MiB without this and
        # 232 MiB with it (before the shared pools, 362 and 240: new pool threads each save, RSS growing).
        env.setdefault("MALLOC_ARENA_MAX", "2")
        # It writes staged arrays from host memory (taskpoint.jax._staged): jax there must not claim an accelerator,
        # whose memory it would take from the trainer.
        env["JAX_PLATFORMS"] = "cpu"
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as exc:
            raise SaverUnavailable(f"could not start {sys.executable}: {exc}") from exc
        # Lowered here, before the child starts a thread (its threads inherit it), not by the child itself: a child
        # slow to start would lower it after a wait of this process's had raised it (:meth:`waited_on`).
        self._renice(os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)
        self._lock = threading.Lock()
        #: Whether the child said it is ready (read before its first answer).
        self.started = False
        #: Who owns a segment named for this process (:func:`~.staging.owner_tag`): a staged save's segment is
        #: made under it, so that it is the save process's from the start.
        self.owner = owner_tag(self.pid)
        self._start = max(process_start(self.pid), 0)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exit_code(self) -> int | None:
        """The child's exit code once it exited (negative: the signal that killed it), else None."""
        return self._process.poll()

    def failed_to_start(self) -> bool:
        """Whether the child exited with an error before it said it is ready (a Python that cannot import this
        taskpoint): another one would fail alike."""
        code = self.exit_code
        return not self.started and code is not None and code > 0

    def store_payload(self, location: Location, payload: Payload, codec: Codec, level: int | None,
                      commit: OrphanPart | None = None,
                      progress: Progress = NO_PROGRESS, *, digest: str = PAYLOAD_HASH, folders: tuple[str, ...] = (),
                      taken: Callable[[], None] | None = None) -> tuple[int, str]:
        """What :func:`taskpoint.transfer.write_payload` does (hashing by ``digest``), done by the helper process.

        ``commit`` is what the child finishes itself (the step's manifest, with the size and digest it computed)
        if this process dies before it has called :meth:`done` (see the module's docstring); ``folders`` are the
        snapshot folders the child removes then. ``taken`` is called once the request is in the pipe (the child
        reads it even if this process dies then), before the child uploads. The child reports its progress as
        ``("progress", "size" | "update", n)`` messages before its answer; they go to ``progress``.

        Raises what the child raised (with its traceback as a note), or SaverUnavailable when the request
        cannot be sent (the payload does not pickle) or the child died; nothing was committed then.
        """
        try:
            request = pickled((location.uri, location.storage_options, location.retry, payload, codec, level, digest,
                               commit, progress.active, folders))
        except Exception as exc:
            raise NotTransferable(f"this payload cannot be sent to the save process ({exc})") from exc
        size, digest, payload.written_index = self._exchange(request, progress, taken)
        return size, digest

    def store_staged(self, manifest: Location, segment: str, job: StagedJob, progress: Progress = NO_PROGRESS, *,
                     taken: Callable[[], None] | None = None, keep: bool = False
                     ) -> tuple[dict[str, int], StepManifest]:
        """Hand the staged save ``job`` and its ``segment`` (named for the helper process: :attr:`owner`) to the
        helper process (``taken`` is called once the request is in the pipe), which maps the segment, runs the
        job, frees the segment (unmaps it only, with ``keep``, when the job succeeded), and answers the sizes of
        the objects it stored and the manifest to write at ``manifest`` (which it writes itself if this process
        dies before :meth:`done`). Errors as :meth:`store_payload`."""
        try:
            request = pickled(StagedRequest(segment, pickled(job), (manifest.uri, manifest.storage_options,
                                                                   manifest.retry), progress.active, keep))
        except Exception as exc:
            raise NotTransferable(f"this staged save cannot be sent to the save process ({exc})") from exc
        sizes, written = self._exchange(request, progress, taken)
        return sizes, written

    def _exchange(self, request: bytes, progress: Progress, taken: Callable[[], None] | None) -> Any:
        """Send ``request`` (then call ``taken``: the request is in the pipe, which the child reads whole even if
        this process dies now), wait for the child's acknowledgement, relay its progress, and return its answer's
        value or raise its error."""
        with self._lock:
            stdin, stdout = self._process.stdin, self._process.stdout
            assert stdin is not None and stdout is not None
            try:
                write_message(stdin, request)
                if taken is not None:
                    taken()
                if not self.started:
                    hello = read_message(stdout)
                    if hello != "ready":
                        raise SaverUnavailable(f"the save process (pid {self.pid}) answered {hello!r} instead of "
                                               "'ready'")
                    self.started = True
                answer = read_message(stdout)
                if answer != TAKEN:
                    raise SaverUnavailable(f"the save process (pid {self.pid}) answered {answer!r} instead of "
                                           f"{TAKEN!r}")
                answer = read_message(stdout)
                while answer[0] == "progress":
                    _, what, n = answer
                    if what == "size":
                        progress.set_total(n)
                    else:
                        progress.update(n)
                    answer = read_message(stdout)
                status, value, caught = answer
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                ended = how_it_ended(self._process, EXIT_WAIT_SECONDS)
                raise SaverUnavailable(f"the save process (pid {self.pid}) died: {ended}") from exc
        for category, message in caught:
            warnings.warn(message, category, stacklevel=3)
        if status == "ok":
            return value
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

    def warm(self, modules: list[str]) -> None:
        """Have the child import ``modules`` in the background (the extras that write staged saves: torch takes
        seconds to import), so that the first staged save's write does not wait for them."""
        with self._lock:
            stdin = self._process.stdin
            assert stdin is not None
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile (the manager closed, or it died)
                write_message(stdin, pickled((WARM, modules)))

    def done(self) -> None:
        """Tell the child that the step of its last request (stored with a ``commit``) is committed, or that
        committing it failed here: it no longer commits it itself. A child that died needs no telling."""
        with self._lock:
            stdin = self._process.stdin
            assert stdin is not None
            with contextlib.suppress(OSError):
                write_message(stdin, pickled(DONE))

    def alive(self) -> bool:
        """Whether the child runs: it has not exited, nor is it ending. A killed child's main thread ends first (a
        zombie in ``/proc``, which :func:`~taskpoint.workspace.owner_gone` counts as gone and a sweep of dead owners'
        segments acts on) while ``poll()`` waits for its other threads, which take a while on a loaded machine: a
        segment named for it then would be swept under the save that uses it."""
        return self.exit_code is None and not owner_gone(self.pid, self._start)

    @contextlib.contextmanager
    def waited_on(self) -> Iterator[bool]:
        """While the trainer waits for the child (the next save, or the emergency one, waits for the save in
        flight), the child runs at the trainer's own CPU priority, not :data:`NICENESS` lower: its lower priority
        only yields a core the trainer would use, and a trainer that waits uses none. Else any other work on the
        machine at the trainer's priority starves the save the trainer waits for: on the 2-core machine at load
        15-20, a training loop's next ``save()`` waited over 120 s for its save process's import of torch (which
        the first staged save needs), the trainer in this wait and the child in that import (py-spy). Yields
        whether the priority was raised: lowering a niceness needs ``CAP_SYS_NICE`` (or ``RLIMIT_NICE``), without
        which the child stays where it is. Lowered again afterwards, which needs no privilege."""
        own = os.getpriority(os.PRIO_PROCESS, 0)
        raised = self._renice(own)
        try:
            yield raised
        finally:
            if raised:
                self._renice(own + NICENESS)

    def _renice(self, niceness: int) -> bool:
        """Set the niceness of every thread of the child (Linux keeps one per thread: ``os.nice`` in the child
        set it for the threads it starts after); False when not permitted or the child is gone."""
        tasks = Path(f"/proc/{self.pid}/task")
        try:
            ids = [int(task.name) for task in tasks.iterdir()] if tasks.is_dir() else [self.pid]
            for task in ids:
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    os.setpriority(os.PRIO_PROCESS, task, niceness)
        except (PermissionError, FileNotFoundError, ProcessLookupError):
            return False
        return True

    def close(self) -> None:
        """Close the pipe; the child exits after any request in progress. Killed if it hangs."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                write_message(self._process.stdin, pickled(CLOSE))
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            with self.waited_on():
                self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def release_freed_memory() -> None:
    """Hand memory that a finished save freed back to the OS.

    glibc gives the shared pools' threads (taskpoint.executors) their own malloc arenas, and keeps the freed
    buffers (upload parts and gzip members of several MiB) in them. Measured with the shared pools, five
    256 MiB folder saves and loads to S3 in one process: RSS after each 168-223 MiB without a trim, 107-120 MiB
    with it, 67-70 MiB with it and two arenas (the save process's setting). A no-op where the C library has no
    ``malloc_trim``.
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
