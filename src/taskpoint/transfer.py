"""Moving one payload between the local machine and one storage object, hashing every byte on the way.

``write_payload`` streams a payload into an object atomically and returns its size and digest;
``read_payload`` streams an object back into a workspace, staging it until the caller's check of the size
and digest passes. The checkpoint record protocol (:mod:`taskpoint.checkpoint`) and the versioned manager
(:mod:`taskpoint.manager`) are both built on these two functions; the manager's save process calls
``write_payload`` too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from ._progress import NO_PROGRESS, Progress
from .digests import DIGESTS, pieces_of_file, streaming_hash
from .errors import CheckpointCorruptError, CheckpointError
from .executors import CPU
from .extraction import Verifier as Verifier  # checks a streamed object (kind, size, hex digest)
from .extraction import extract_file, extract_stream
from .format.codecs import BLOCK_SIZE, Codec, holds_tar
from .format.pieces import PAYLOAD_PIECES
from .format.space import check_room
from .payloads import BytesPayload, DirectoryPayload, Payload
from .signals import uninterrupted
from .storage import WRITE_PIECE, Deadline, Location, copy_fd_in_kernel, digest_by_reading
from .storage.backends import WriteHooks
from .storage.localio import digest_of_fd
from .storage.streams import ConcurrentRangeReader, read_up_to
from .workspace import Staging

_HEAD_SIZE = 1024

#: Picks the payload class of an object from its first bytes and its size (None when unknown).
KindChooser = Callable[[bytes, "int | None"], type[Payload]]


class _SourceFailure(CheckpointError):
    """Reading the data to save failed (not storage): report the original error, do not retry. A
    CheckpointError so that the storage error map passes it through untouched."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


class SourceIsFolder(CheckpointError):
    """The source is a folder (local disk) or a prefix with objects under it, not one object. A checkpoint
    loads it as a directory checkpoint (:func:`taskpoint.folders.load_folder`); it is never read as an empty
    payload. A CheckpointError, so that retries and the storage error map pass it through."""

    def __init__(self, uri: str) -> None:
        super().__init__(f"{uri} is a folder (or a prefix with objects under it), not one stored object")
        self.uri = uri


class _Hashed:
    """What both directions share: the bytes that passed are counted, hashed (sha256 on a thread of its own,
    overlapping the I/O) and reported to ``progress``. ``digest``: a :data:`~taskpoint.digests.DIGESTS` name, or
    a hasher of one's own (``update``, ``hexdigest``), kept as :attr:`hasher`."""

    def __init__(self, digest: str | Any, progress: Progress) -> None:
        self.hasher = self._hash = streaming_hash(digest) if isinstance(digest, str) else digest
        self._progress = progress
        self.size = 0

    def _passed(self, data: Any) -> int:
        self._hash.update(data)
        n = memoryview(data).nbytes
        self.size += n
        self._progress.update(n)
        return n

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())


class HashingWriter(_Hashed):
    """Passes bytes to a sink, counting and hashing them (and reporting them to ``progress``); remembers
    whether the sink itself failed."""

    def __init__(self, sink: IO[bytes], digest: str | Any = "sha256", progress: Progress = NO_PROGRESS) -> None:
        super().__init__(digest, progress)
        self._sink = sink
        self.failed = False

    def write(self, b: bytes) -> int:
        try:
            self._sink.write(b)
        except BaseException:
            self.failed = True
            raise
        return self._passed(b)

    def flush(self) -> None:
        pass


class HashingReader(_Hashed):
    """Reads a storage stream, hashing every byte (and reporting it to ``progress``), with a peek at the head
    to pick the payload kind."""

    def __init__(self, source: IO[bytes], digest: str = "sha256", progress: Progress = NO_PROGRESS) -> None:
        super().__init__(digest, progress)
        self._source = source
        self._head = b""

    def peek_head(self, n: int) -> bytes:
        if len(self._head) < n:
            self._head += read_up_to(self._source, n - len(self._head))
        return self._head

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n < 0 or n >= len(self._head):
                data, self._head = self._head, b""
                if n < 0:
                    data += self._source.read()
            else:
                data, self._head = self._head[:n], self._head[n:]
        else:
            data = self._source.read(n)
        self._passed(data)
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self.read(BLOCK_SIZE):
            pass

    def close(self) -> None:
        """The storage stream is closed by its owner, not by the codec reading through this wrapper."""


def write_payload(dest: Location, payload: Payload, codec: Codec, level: int | None,
                  digest: str = "sha256",
                  before_commit: Callable[[int, str, Deadline], None] | None = None,
                  on_partial: Callable[[Deadline], None] | None = None,
                  progress: Progress = NO_PROGRESS) -> tuple[int, str]:
    """Stream ``payload`` into ``dest`` atomically; return the stored size and its ``digest`` (hex).
    The writer is told the stored size where :meth:`Payload.size <taskpoint.payloads.Payload.size>` knows it
    (a small object of known size is one request, which obstore's path retries whole, counting its throttling).

    ``before_commit(size, digest, deadline)`` runs once every byte is written and hashed and none is visible
    yet (the checkpoint record is written there, so that every visible object has a digest); ``on_partial
    (deadline)`` when a killed writer could leave parts behind; ``deadline`` is the write attempt's, which
    their own storage calls end by (``Location.within``). Transient storage failures are retried by rewriting the whole
    object; a failure to read the data being saved is raised as it is, without retrying; other storage
    failures become the matching StorageError. ``progress`` counts the stored bytes, or the source bytes for
    kinds that count their own (:attr:`Payload.counts_source <taskpoint.payloads.Payload.counts_source>`).
    """
    progress.set_total(payload.progress_size() if progress.active else None)

    def write(deadline: Deadline) -> tuple[int, str]:
        done: list[tuple[int, str]] = []
        progress.restart()

        def commit(deadline: Deadline) -> None:
            if before_commit is not None:
                before_commit(*done[0], deadline)

        hooks = WriteHooks(before_commit=commit, on_partial=on_partial or WriteHooks().on_partial)
        with dest.open_write(size_hint=payload.size(), hooks=hooks, deadline=deadline) as f:
            local_source = payload.local_file() if dest.is_local else None
            if local_source is not None:
                done.append(_copy_local(local_source, f, payload.size(), digest, progress))
            else:
                out = HashingWriter(f, digest, NO_PROGRESS if payload.counts_source else progress)
                try:
                    if payload.counts_source:  # such kinds count the source bytes they read themselves
                        on_read = progress.update if progress.active else None
                        payload.write(out, codec, level, on_read=on_read)  # type: ignore[arg-type, call-arg]
                    else:
                        payload.write(out, codec, level)  # type: ignore[arg-type]
                except BaseException as exc:
                    if out.failed or not isinstance(exc, Exception):
                        raise
                    raise _SourceFailure(exc) from exc
                done.append((out.size, out.hexdigest()))
        return done[0]

    try:
        return dest.run(write, action="save a checkpoint to", writing=True)
    except _SourceFailure as failure:
        raise failure.original from None


def _copy_local(source: Path, sink: Any, expected: int | None, digest: str, progress: Progress
                ) -> tuple[int, str]:
    """A file saved to local disk: copied by the kernel, then the written copy itself is hashed (through memory
    maps). Hashing beside the copy was slower here (512 MiB by BLAKE3, paired rounds on 2 shared cores: the source
    hashed on a second thread 1.12-1.22x, the copy hashed trailing the kernel's pieces 1.07-1.35x the time of
    copy-then-hash), and only this way is the digest that of the bytes written."""
    sink.flush()
    fd = sink.raw.fileno()
    start = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        src = open(source, "rb")  # noqa: SIM115 - closed below; a failure here is the source's, not storage's
    except OSError as exc:
        raise _SourceFailure(exc) from exc
    with src:  # a failure while copying may be the destination's (a full disk): the storage error map decides
        size = copy_fd_in_kernel(src.fileno(), fd, on_copied=progress.update if progress.active else None)
    if expected is not None and size != expected:
        raise _SourceFailure(RuntimeError(f"{source} changed size while it was being saved ({expected} -> "
                                          f"{size} bytes); save it again once it is complete"))
    hasher = digest_of_fd(fd, start + size, DIGESTS[digest]())
    return size, str(hasher.hexdigest())


def read_payload(src: Location, workspace: Path, choose: KindChooser, verify: Verifier,
                 digest: str = "sha256", size_hint: int | None = None,
                 progress: Progress = NO_PROGRESS, max_expand: int | None = None,
                 only: Sequence[str] | None = None, hashed: bool = False) -> Path | None:
    """Stream ``src`` into ``workspace`` and return what load returns; None when the object does not exist.

    Nothing reaches the workspace until ``verify`` accepted the whole object; transient failures restart
    the download. ``size_hint``: the size the caller expects (a small remote object comes in one request).
    ``progress`` counts the stored bytes read (for an archive, its compressed bytes). ``max_expand``: the most
    bytes the load may write (None: the file system's free space, and for archives
    :data:`~taskpoint.format.extract.MAX_EXPAND`). ``only``: restore just these paths of a directory archive
    (streaming the whole object, keeping those entries: :func:`~taskpoint.format.extract.extract_tar`); a
    ValueError for an object that is no directory. ``hashed``: ``digest`` is cryptographic and ``verify`` refuses
    every object that does not match it (a manager step's), so the archive's codec may leave out its own checks
    of the same bytes (:meth:`Codec.reader <taskpoint.format.codecs.Codec.reader>`).
    """
    progress.set_total(size_hint)
    return src.run(lambda deadline: _read_once(src, workspace, choose, verify, digest, size_hint, progress,
                                               max_expand, only, hashed, deadline), action="load the checkpoint from")


def _read_once(src: Location, workspace: Path, choose: KindChooser, verify: Verifier, digest: str,
               size_hint: int | None, progress: Progress, max_expand: int | None,
               only: Sequence[str] | None, hashed: bool, deadline: Deadline) -> Path | None:
    progress.restart()
    try:
        raw = src.open_read(size_hint, deadline)
    except (FileNotFoundError, NotADirectoryError):  # not there, or a parent is a file: absent
        return None
    except IsADirectoryError as exc:  # a folder or prefix: the caller loads it as a folder checkpoint
        raise SourceIsFolder(src.uri) from exc
    with raw:
        if progress.active and isinstance(raw, ConcurrentRangeReader):
            raw.on_received = progress.update  # ranges counted as they arrive, several in flight
            reader = HashingReader(raw, digest)
        else:
            reader = HashingReader(raw, digest, progress)
        head = reader.peek_head(_HEAD_SIZE)
        stored_size = object_size(raw)
        progress.set_total(stored_size)
        cls = choose(head, stored_size)
        if only is not None and not cls.archived:
            raise ValueError(f"the checkpoint at {src.uri} holds {cls.kind}, not a directory: paths= selects "
                             "files and folders inside a saved directory")
        workspace.mkdir(parents=True, exist_ok=True)
        with Staging(workspace) as staging:
            if not cls.archived and stored_size is not None:
                # StorageFull before a raw object fills the disk
                check_room(staging, stored_size, src.uri, max_expand)
            if cls.archived and src.is_local and hashed and stored_size is not None and extract_file(
                    cls, raw.fileno(), stored_size, head, staging, src.uri, max_expand, only, digest, verify, progress):
                with uninterrupted():  # a signal waits until every entry has landed
                    return cls.publish(staging, workspace)
            if cls.archived:
                def judge() -> None:
                    reader.drain()
                    verify(cls.kind, reader.size, reader.hexdigest())

                extract_stream(cls, reader, head, staging, src.uri, max_expand, only,  # type: ignore[arg-type]
                               judge if hashed else None)
            elif src.is_local:
                # A raw checkpoint on local disk: copied by the kernel while a second thread hashes the
                # stored object. Both read the same open file, whose inode saves never write into (they
                # replace it by rename), so the hash covers the bytes copied; a short read or copy (the file
                # truncated by someone else meanwhile) fails the size check.
                fd = raw.fileno()
                size = os.fstat(fd).st_size
                hasher = DIGESTS[digest]()
                with CPU.lane(1) as pool, \
                        open(staging / cls.result_name, "xb", buffering=0) as out:
                    hashing = pool.submit(digest_by_reading, fd, size, hasher)
                    copied = copy_fd_in_kernel(fd, out.fileno(), size,
                                               on_copied=progress.update if progress.active else None)
                    if hashing.result() != copied:
                        raise CheckpointCorruptError(f"{src.uri} changed while it was being loaded; load it again")
                verify(cls.kind, copied, str(hasher.hexdigest()))
                with uninterrupted():  # a signal waits until every entry has landed
                    return cls.publish(staging, workspace)
            else:
                cls.materialize(reader, staging, src.uri)  # type: ignore[arg-type]
            reader.drain()
            verify(cls.kind, reader.size, reader.hexdigest())
            with uninterrupted():  # a signal waits until every entry has landed
                return cls.publish(staging, workspace)


def object_size(raw: IO[bytes]) -> int | None:
    """The size of an open storage object when the reader knows it."""
    size = getattr(raw, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(raw.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return None


def guess_kind(head: bytes) -> type[Payload]:
    """Kind of an object with no record (written by Flyte or by hand): a tar archive is a directory."""
    return DirectoryPayload if holds_tar(head) else BytesPayload


class _Discard(Payload):
    """Reads stored bytes through :func:`read_payload` (hashing them) and keeps none: verification only."""

    kind = "verify"
    archived = False

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        return None

    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:  # pragma: no cover - never saved
        raise NotImplementedError

    @classmethod
    def materialize(cls, source: IO[bytes], staging: Path, uri: str) -> None:
        while source.read(WRITE_PIECE):
            pass

    @classmethod
    def publish(cls, staging: Path, workspace: Path) -> Path:
        return workspace


def hash_object(loc: Location, digest: str, size_hint: int | None, progress: Progress = NO_PROGRESS
                ) -> tuple[int, str]:
    """The size and ``digest`` (hex) of the object at ``loc``, every byte read (on local disk by positional
    reads, elsewhere with the parallel ranged reads of :func:`read_payload`), nothing kept. ``progress`` counts
    the bytes read. FileNotFoundError when there is no such object (or it was deleted while it was read)."""
    seen: list[tuple[int, str]] = []
    if loc.is_local:
        def local(deadline: Deadline) -> None:
            progress.restart()
            with loc.open_read(deadline=deadline) as raw:
                fd = raw.fileno()
                size = os.fstat(fd).st_size
                progress.set_total(size)
                on_read = progress.update if progress.active else None
                if digest == PAYLOAD_PIECES:  # each piece read and hashed on a core of its own
                    seen.append(pieces_of_file(fd, size, on_read))
                    return
                hasher = streaming_hash(digest)  # sha256 and BLAKE3 beside the reads, on a thread of their own
                hashed = digest_by_reading(fd, size, hasher, on_read, keep=True)
                seen.append((hashed, str(hasher.hexdigest())))

        loc.run(local, action="verify")
        return seen[-1]
    scratch = Path(tempfile.mkdtemp(prefix="taskpoint-verify-"))
    try:
        found = read_payload(loc, scratch, lambda head, size: _Discard,
                             lambda kind, size, hexdigest: seen.append((size, hexdigest)), digest,
                             size_hint=size_hint, progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if found is None:
        raise FileNotFoundError(f"{loc.uri} does not exist")
    return seen[-1]
