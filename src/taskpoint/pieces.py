"""Files hashed in pieces, the one engine behind every file a step lists by its pieces' digests
(:class:`~taskpoint.format.fileset.FileEntry`): :class:`PieceWriter` hashes a file's pieces on threads while it is
written, :func:`hash_local` hashes local files' pieces on threads once written, and :class:`PieceReader` checks
each piece before a byte of it is returned, for reads of any part of the file.

Why pieces: a state dict's file is written by ``torch.save`` and read by ``torch.load`` in one pass each, and a
single digest of the whole file would cost as much again on each side, in series. With one digest per piece,
the pieces are hashed on other threads while ``torch.save`` goes on serializing (hashlib and blake3 release the
GIL), and a reader fetches and checks the pieces ahead of ``torch.load`` while it parses the ones checked
already: nothing unverified is ever handed to it. New pieces are hashed by BLAKE3
(:data:`~taskpoint.format.fileset.PIECE_HASH`): sha256 of a 256 MiB state dict took 0.23 s of CPU here, 1.7x
the whole of ``torch.load``'s 0.13 s, so on two cores no load that checks every byte by sha256 can come near
``torch.load``; BLAKE3 takes 0.05 s.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .digests import hash_span
from .executors import CPU
from .executors import IO as IO_POOL
from .format.fileset import PIECE_HASH, PIECE_SIZE, FileEntry, PieceHasher, piece_hasher, piece_spans

#: Threads that hash the pieces of one save, or fetch and check those of one read.
WORKERS = 2
#: Threads that hash the pieces of local files at once (:func:`hash_local`: one large file is most of a tree).
LOCAL_WORKERS = 8
#: Writes smaller than this are hashed in the caller's thread (a thread's hand-over costs more).
HASH_ON_THREADS = 1 << 20
#: The bytes at the end of a file whose pieces are checked first: ``torch.load`` reads a zip's directory
#: there before anything else (after its first bytes), about 100 bytes per tensor.
ZIP_TAIL = 1 << 20
#: Local reads at least this large, once every piece checked, are copied by two threads, half each: a copy
#: from the page cache runs at about the speed of one core's sha256, so the reader would copy alone at the end.
SPLIT_READ = 4 << 20


class PieceWriter(io.RawIOBase):
    """A writable file object that writes to ``sink`` in the caller's thread while the pieces (``piece_size``
    bytes each) of what it is given are hashed (by ``piece_hash``, through a
    :class:`~taskpoint.format.fileset.PieceHasher`) on other threads; each :meth:`write` returns once its bytes
    are written and hashed, so nothing is copied or held after (``torch.save`` passes views of the tensors' own
    memory). :meth:`finish` returns the size and the pieces' digests."""

    def __init__(self, sink: IO[bytes], piece_size: int = PIECE_SIZE,
                 on_written: Callable[[int], None] | None = None, *, piece_hash: str = PIECE_HASH) -> None:
        super().__init__()
        self._sink, self._on_written = sink, on_written
        self._hasher = PieceHasher(piece_hash, piece_size)  # ValueError for an unknown hash now
        self._pool = CPU.lane(WORKERS)

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        spans = self._hasher.spans(view)
        if view.nbytes < HASH_ON_THREADS:
            for hasher, span in spans:
                hasher.update(span)
            self._sink.write(view)
        else:
            hashing = [self._pool.submit(hasher.update, span) for hasher, span in spans]
            self._sink.write(view)
            for each in hashing:
                each.result()
        if self._on_written is not None:
            self._on_written(view.nbytes)
        return view.nbytes

    def finish(self) -> tuple[int, list[str]]:
        """The file's size and its pieces' digests (one piece, of no bytes, for an empty file)."""
        self.shutdown()
        entry = self._hasher.entry()
        return entry.size, list(entry.pieces)

    def shutdown(self) -> None:
        """Stop the threads (after :meth:`finish`, or when the save failed)."""
        self._pool.shutdown(wait=True)


class PieceReader(io.RawIOBase):
    """A read-only, seekable file whose pieces are checked against those of its ``entry`` (a file listed whole is
    one piece, by sha256) on threads, ahead of the reads, in :func:`check_order`; a read returns bytes only once every
    piece they lie in has checked, and checks on its own thread those no thread has started on (rather than wait
    behind the pieces queued before them). ``damaged(index)`` is the error a piece that differs raises (the last
    piece also when the file is longer than the entry's size).

    From an object store, ``fetch(start, length)`` returns a piece's bytes, kept until :meth:`close` (the file
    is held in memory once, as a load of the state dict needs it anyway). From local disk, ``fd`` (an open file,
    closed with the reader): the threads hash each piece through a small buffer and keep nothing, and a read
    goes straight from the file into the caller's buffer (one copy, as ``torch.load`` of a path makes); its
    bytes are those the threads hashed, as a committed step's file is never written again; ``name`` is its path.

    ``order``: the pieces to check ahead, in the order the reads will want them (a DCP load's items, by offset);
    by default every piece in :func:`check_order`. A piece left out is checked only if a read reaches it.
    """

    def __init__(self, entry: FileEntry, damaged: Callable[[int], Exception], *,
                 fetch: Callable[[int, int], bytes] | None = None, fd: int | None = None,
                 name: str | None = None, order: list[int] | None = None) -> None:
        super().__init__()
        if (fetch is None) == (fd is None):
            raise ValueError("a PieceReader reads through fetch or from fd, one of them")
        self._piece_hash = entry.hash_name
        piece_hasher(self._piece_hash)  # ValueError for an unknown hash, before any thread starts
        #: The local file's path (``fd``'s), None through ``fetch``; a file object's ``name``.
        self.name = name
        digests, self._piece_size = entry.checked_pieces
        self._size, self._digests = entry.size, list(digests)
        self._fetch, self._fd, self._damaged = fetch, fd, damaged
        self._position = 0
        self._pool = (CPU if fetch is None else IO_POOL).lane(WORKERS)  # hashing a local file, or fetching
        self._order = check_order(self._size, self._piece_size, len(self._digests)) if order is None else order
        futures = {index: self._pool.submit(self._checked, index) for index in self._order}
        # A piece not checked ahead waits as a future no thread runs: the read that reaches it claims it.
        self._pieces = [futures.get(index) or concurrent.futures.Future() for index in range(len(self._digests))]
        self._settled = 0  # how many pieces at the head of the order have been checked

    def _checked(self, index: int) -> bytes:
        """The piece's bytes (b"" from a local file, read again by :meth:`readinto`) once its digest checks. The
        last piece checks also that the file ends where it should: bytes appended to it are damage too."""
        start = index * self._piece_size
        length = min(self._piece_size, self._size - start)
        last = index == len(self._digests) - 1
        if self._fd is not None:
            data, (count, digest) = b"", hash_span(self._fd, start, length, self._piece_hash)
            if count != length or (last and os.fstat(self._fd).st_size != self._size):
                digest = ""
        else:
            assert self._fetch is not None
            data = self._fetch(start, length + last)  # one byte past the end of the last piece: there is none
            hasher = piece_hasher(self._piece_hash)
            hasher.update(data)
            digest = hasher.hexdigest() if len(data) == length else ""
        if digest != self._digests[index]:
            raise self._damaged(index)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        want = min(out.nbytes, max(0, self._size - self._position))
        if want == 0:
            return 0
        first, last = self._position // self._piece_size, (self._position + want - 1) // self._piece_size
        if self._fd is not None:
            for index in range(first, last + 1):
                self._claim(index)
            for index in range(first, last + 1):
                self._pieces[index].result()  # the piece's error when it did not check
            if want >= SPLIT_READ and self._all_checked():  # the threads are idle: one copies half
                half = want // 2
                other = self._pool.submit(_read_into, self._fd, out[half:want], self._position + half)
                done = _read_into(self._fd, out[:half], self._position)
                rest = other.result()
                done += rest if done == half else 0
            else:
                done = _read_into(self._fd, out[:want], self._position)
        else:
            done = 0
            for index in range(first, last + 1):
                data = memoryview(self._piece(index))
                within = self._position + done - index * self._piece_size
                take = min(want - done, len(data) - within)
                out[done:done + take] = data[within:within + take]
                done += take
        self._position += done
        return done

    def _claim(self, index: int) -> None:
        """Check the piece on this thread if no thread has started on it yet (its result, or its error, kept
        in its place)."""
        if self._pieces[index].cancel():
            future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
            try:
                future.set_result(self._checked(index))
            except Exception as exc:
                future.set_exception(exc)
            self._pieces[index] = future

    def _piece(self, index: int) -> bytes:
        """The piece's checked bytes (its error if it differs), checked on this thread if none started on it."""
        self._claim(index)
        return self._pieces[index].result()

    def _all_checked(self) -> bool:
        while self._settled < len(self._order) and self._pieces[self._order[self._settled]].done():
            self._settled += 1
        return self._settled == len(self._order)

    def verify_all(self) -> int:
        """Wait for every piece to check (raising the first piece's error); the size."""
        self.verify_span(0, self._size)
        return self._size

    def verify_span(self, start: int, length: int) -> None:
        """Wait for the pieces that hold ``length`` bytes from ``start`` to check, raising the first one's error
        (the piece at ``start`` at least: an empty file has one piece, of no bytes)."""
        first = min(start // self._piece_size, len(self._pieces) - 1)
        last = min(max(start + length - 1, start) // self._piece_size, len(self._pieces) - 1)
        for index in range(first, last + 1):
            self._piece(index)

    def close(self) -> None:
        if not self.closed:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pieces = []
            if self._fd is not None:
                os.close(self._fd)
        super().close()


def check_order(size: int, piece_size: int, count: int) -> list[int]:
    """The order the ``count`` pieces of a file of ``size`` bytes are checked in: first those that hold its
    last :data:`ZIP_TAIL` bytes (a zip's directory, which ``torch.load`` reads after the file's first bytes),
    the last first, then the others from the start, as ``torch.load`` reads the tensors."""
    tail = range(min(max(0, size - ZIP_TAIL) // piece_size, count - 1), count) if count else range(0)
    return [*reversed(tail), *range(tail.start)]


def _read_into(fd: int, out: memoryview, start: int) -> int:
    """Read the open file ``fd`` from ``start`` into ``out`` until it is full or the file ends; the count."""
    done = 0
    while done < out.nbytes and (count := os.preadv(fd, [out[done:]], start + done)):
        done += count
    return done


#: How :func:`hash_local` hashes a file: ``(size, piece hash, piece size)``, the piece hash None for one sha256 of
#: the whole file.
HashPlan = tuple[int, str | None, int]


def hash_local(root: Path, plan: dict[str, HashPlan], *, sync: bool = False,
               on_read: Callable[[int], None] | None = None) -> dict[str, FileEntry]:
    """The entries of files below ``root`` (``plan[rel]``: how each is hashed): a file listed by pieces is hashed
    piece by piece on all of :data:`LOCAL_WORKERS` threads at once, any other by sha256, whole and one byte past
    its size (a longer file then differs); an entry of size -1 for a missing file, which differs from any
    recorded. Each file is read through one open fd; with ``sync``, fsynced too (a commit is about to name it).
    ``on_read(n)`` is told of the bytes read."""
    fds: dict[str, int] = {}
    try:
        tasks: list[tuple[str, int, int]] = []
        for rel, (size, piece_hash, piece_size) in plan.items():
            try:
                fds[rel] = os.open(root / rel, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            spans = piece_spans(size, piece_size) if piece_hash is not None else [(0, size + 1)]
            tasks += [(rel, start, length) for start, length in spans]

        def hashed(task: tuple[str, int, int]) -> tuple[int, str]:
            rel, start, length = task
            count, digest = hash_span(fds[rel], start, length, plan[rel][1])
            if on_read is not None:
                on_read(count)
            return count, digest

        with concurrent.futures.ThreadPoolExecutor(min(LOCAL_WORKERS, max(1, len(tasks)))) as pool:
            done = list(pool.map(hashed, tasks))
            if sync:
                list(pool.map(os.fsync, fds.values()))
        found: dict[str, list[tuple[int, str]]] = {}
        for (rel, _, _), result in zip(tasks, done, strict=True):
            found.setdefault(rel, []).append(result)
        entries = {}
        for rel, (_, piece_hash, piece_size) in plan.items():
            if rel not in fds:
                entries[rel] = FileEntry(-1, "")
            elif piece_hash is not None:
                entries[rel] = FileEntry.of_pieces(os.fstat(fds[rel]).st_size, [digest for _, digest in found[rel]],
                                                   piece_hash, piece_size)
            else:
                entries[rel] = FileEntry(*found[rel][0])
        return entries
    finally:
        for fd in fds.values():
            os.close(fd)
