"""Gzip on every core: independent members, each labelled with its own length, compressed and inflated in parallel.

A stream is a series of standard gzip members (RFC 1952), so every gzip reader (``gzip``, ``tar xz``,
Flyte) reads it as one file. Each member holds up to :data:`MEMBER_SIZE` bytes of input compressed on its
own (no shared dictionary), and carries in its header's extra field a ``TP`` subfield with the member's
total length, as BGZF does. A reader that knows the label can cut the stream into members without
inflating it, and inflate them on several threads; any other gzip stream is inflated sequentially.

Whatever a stream says, a reader's memory stays bounded: a labelled member longer than
:data:`MAX_MEMBER_LENGTH`, or whose trailer (ISIZE) claims more than :data:`MEMBER_SIZE` bytes, is refused
before it is read or inflated, and a member is inflated into at most ISIZE + 1 bytes, so one that inflates
beyond what its trailer says fails at once. A member made only of stored blocks (what the writer's ``store``
writes for data that does not compress) is not inflated at all: its blocks' data is served as views of the
member, checked against the same CRC32 and ISIZE.

Uses ISA-L (``isal``, a dependency), which releases the GIL while it works.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import queue
import struct
import threading
from collections.abc import Callable
from typing import IO, Any

from isal import isal_zlib as _z

from ..executors import CPU
from ..storage.streams import OrderedFutureReader, read_up_to
from .stored import STORED_HEADER, stored_blocks, stored_spans
from .stored import GzipFormatError as GzipFormatError  # the error of every gzip reader, raised here too

#: Input bytes per member: large enough that headers and lost dictionary cost nothing, small enough to
#: keep memory bounded (members in flight x 2 x this).
MEMBER_SIZE = 4 << 20
_SUBFIELD = b"TP"
# magic, CM=deflate, FLG=FEXTRA, MTIME=0, XFL=0, OS=255 (unknown), XLEN=8, "TP", LEN=4
_HEADER = struct.Struct("<2sBBIBBH2sHI")
HEADER_SIZE = _HEADER.size  # 20
_TRAILER = struct.Struct("<II")
TRAILER_SIZE = _TRAILER.size  # 8
#: Longest labelled member a reader accepts: deflate adds only a few bytes per block to the
#: :data:`MEMBER_SIZE` bytes of input a member holds, even when they do not compress (a generous bound).
MAX_MEMBER_LENGTH = MEMBER_SIZE + (MEMBER_SIZE >> 6) + 4096


def _workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _deflate(data: bytes | memoryview, level: int) -> bytes:
    return _z.compress(data, level, wbits=-15)


def _raw_inflater() -> Any:
    return _z.decompressobj(wbits=-15)


crc32: Callable[[Any, int], int] = _z.crc32
DEFAULT_LEVEL = 2  # ISA-L's levels run 0-3


def isal_level(level: int | None) -> int:
    """zlib's 1-9 scale mapped onto ISA-L's: 1-3, 4-6 and 7-9 become 1, 2 and 3."""
    return DEFAULT_LEVEL if level is None else (0 if level == 0 else min(3, (level + 2) // 3))


def _inflate(data: bytes | memoryview, limit: int) -> bytes:
    """One raw deflate stream, inflated into at most ``limit`` bytes: a member that says less is corrupt."""
    d = _raw_inflater()
    out: bytes = d.decompress(data, limit + 1)
    if len(out) > limit:
        raise GzipFormatError(f"gzip member inflates to more than the {limit} bytes its trailer says")
    if not d.eof or d.unused_data:
        raise GzipFormatError("deflate stream is truncated or followed by garbage")
    return out


#: Bytes from the middle of a member that are compressed first to judge whether the member compresses.
PROBE_SIZE = 64 << 10
#: A member whose probe compresses to more than this fraction of its size is stored (deflate's stored blocks):
#: float32 weights compress to about 0.93 of their size at about 100-350 MB/s a core, while a stored member
#: costs a copy to write and none to read: its blocks' data is served as views of the member, checked against
#: its CRC32 (docs/performance.md, "Where the time goes").
STORE_ABOVE = 0.9


def _body(data: memoryview, level: int) -> list[bytes | memoryview]:
    """The raw deflate stream of one member, in parts: compressed, unless a probe of its middle says it barely
    would."""
    if len(data) > 2 * PROBE_SIZE:
        start = (len(data) - PROBE_SIZE) // 2
        if len(_deflate(data[start:start + PROBE_SIZE], level)) > STORE_ABOVE * PROBE_SIZE:
            return stored_blocks(data)
    return [_deflate(data, level)]


def member(data: bytes | bytearray | memoryview, level: int, store: bool = False) -> bytes:
    """One labelled gzip member holding ``data``; with ``store``, stored rather than compressed when a probe
    says it does not compress."""
    view = memoryview(data).cast("B")
    body = _body(view, level) if store else [_deflate(view, level)]
    total = HEADER_SIZE + sum(map(len, body)) + _TRAILER.size
    header = _HEADER.pack(b"\x1f\x8b", 8, 4, 0, 0, 255, 8, _SUBFIELD, 4, total)
    return b"".join((header, *body, _TRAILER.pack(crc32(view, 0) & 0xFFFFFFFF, len(view) & 0xFFFFFFFF)))


def trailer(rest: bytes | memoryview) -> tuple[int, int]:
    """The CRC32 and ISIZE of the member whose last bytes are ``rest``; GzipFormatError when it is too short, or
    ISIZE claims more than :data:`MEMBER_SIZE`."""
    if len(rest) < _TRAILER.size:
        raise GzipFormatError("gzip member is truncated")
    crc, isize = _TRAILER.unpack_from(rest, len(rest) - _TRAILER.size)
    if isize > MEMBER_SIZE:
        raise GzipFormatError(f"a labelled gzip member says it holds {isize} bytes, more than the {MEMBER_SIZE} "
                              "that taskpoint puts in one")
    return int(crc), int(isize)


def member_data(rest: bytes | memoryview, stored_crc: bool = True) -> list[bytes | memoryview]:
    """The plain bytes of one labelled member from what follows its header (its deflate stream and trailer), in
    pieces: a member of stored blocks as views of ``rest`` (no inflate, no copy), any other inflated into at most
    its ISIZE bytes; checked by its ISIZE and CRC32 (GzipFormatError), a stored one's CRC32 only if ``stored_crc``."""
    view = memoryview(rest)
    crc, isize = trailer(view)
    body = view[:-_TRAILER.size]
    spans = stored_spans(lambda pos: body[pos:pos + STORED_HEADER], len(body))
    check_crc = spans is None or stored_crc
    pieces: list[bytes | memoryview] = ([_inflate(body, isize)] if spans is None
                                        else [body[start:start + n] for start, n in spans])
    check = 0
    for piece in pieces if check_crc else ():
        check = crc32(piece, check)
    if (check_crc and check & 0xFFFFFFFF != crc) or sum(map(len, pieces)) != isize:
        raise GzipFormatError("gzip member fails its CRC32 or length check")
    return pieces


def open_member(blob: bytes) -> bytes:
    """One labelled member's plain bytes (:func:`member_data`), checked against its CRC32 and length."""
    if len(blob) < HEADER_SIZE + _TRAILER.size:
        raise GzipFormatError("gzip member is truncated")
    return b"".join(member_data(memoryview(blob)[HEADER_SIZE:]))


def labelled_length(head: bytes) -> int | None:
    """The length of the member starting ``head`` when it carries taskpoint's label, else None."""
    if len(head) < HEADER_SIZE:
        return None
    magic, cm, flg, _mtime, _xfl, _os, xlen, sub, sublen, total = _HEADER.unpack_from(head)
    if magic != b"\x1f\x8b" or cm != 8 or flg != 4 or xlen != 8 or sub != _SUBFIELD or sublen != 4:
        return None
    return int(total)


def member_length(head: bytes) -> int:
    """The length of the member of a labelled stream that starts ``head``; GzipFormatError for a label missing
    (or data after the end of the stream) or out of bounds."""
    total = labelled_length(head)
    if total is None or total < HEADER_SIZE + _TRAILER.size:
        raise GzipFormatError("gzip member without taskpoint's length label in a labelled stream, or data after "
                              "the end of the stream")
    if total > MAX_MEMBER_LENGTH:
        raise GzipFormatError(f"a gzip member's label says it is {total} bytes long, more than a taskpoint member "
                              f"can be ({MAX_MEMBER_LENGTH})")
    return total


class ParallelGzipWriter(io.RawIOBase):
    """Compresses what is written into labelled members on a thread pool; a writer thread emits them in order.
    With ``store``, members that do not compress are stored (:data:`STORE_ABOVE`).

    ``close()`` flushes the last member and waits for everything to reach ``sink`` (which stays open). An
    error in a worker or in ``sink`` is raised by the next ``write`` or by ``close``.
    """

    def __init__(self, sink: IO[bytes], level: int | None = None, *, threads: int | None = None,
                 store: bool = False) -> None:
        super().__init__()
        self._sink = sink
        self._level = isal_level(level)
        self._store = store
        self._threads = threads or _workers()
        self._pool = CPU.lane(self._threads)
        self._ordered: queue.Queue[concurrent.futures.Future[bytes] | None] = queue.Queue(self._threads * 2)
        self._buf = bytearray()
        self._members = 0
        #: (compressed length, plain length) of every member written so far, in order: an archive's index.
        self.written: list[tuple[int, int]] = []
        self._error: BaseException | None = None
        self._emitter = threading.Thread(target=self._emit, name="taskpoint-gzip-writer", daemon=True)
        self._emitter.start()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._raise_error()
        view = memoryview(b).cast("B")
        n = view.nbytes
        start = 0
        while start < n:
            room = MEMBER_SIZE - len(self._buf)
            self._buf += view[start:start + room]
            start += room
            if len(self._buf) >= MEMBER_SIZE:
                self._submit()
        return n

    def _submit(self) -> None:
        data, self._buf = self._buf, bytearray()  # handed over whole: nothing writes into it after this
        self._members += 1
        future = self._pool.submit(member, data, self._level, self._store)
        while True:
            self._raise_error()
            try:
                self._ordered.put(future, timeout=0.1)
                return
            except queue.Full:
                continue

    def _emit(self) -> None:
        while True:
            future = self._ordered.get()
            if future is None:
                return
            if self._error is not None:
                future.cancel()
                continue
            try:
                blob = future.result()
                self._sink.write(blob)
                self.written.append((len(blob), _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)[1]))
            except BaseException as exc:  # reported to the producer
                self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._buf or self._members == 0:
                self._submit()
        finally:
            self._stop()
        self._raise_error()

    def abort(self) -> None:
        """Stop without finishing the stream (the caller discards what reached the sink)."""
        if self.closed:
            return
        self._error = self._error or RuntimeError("gzip stream aborted")
        self._buf = bytearray()
        self._stop()

    def _stop(self) -> None:
        """End the writer thread after the members already queued, then the pool, then this stream."""
        self._ordered.put(None)
        self._emitter.join()
        self._pool.shutdown(wait=True, cancel_futures=True)  # this stream's lane; the pool stays
        super().close()


class ParallelGzipReader(OrderedFutureReader):
    """Reads a stream of labelled members, inflating up to 2 x threads of them at once, in order.

    The source is read, and cut into members, on a thread of its own (the *cutter*), which also runs whatever the
    source does as it is read (a restore's :class:`~taskpoint.transfer.HashingReader` hands the bytes to its hash
    thread); the caller's thread only takes inflated members in order, so reading and hashing, inflating and the
    caller's use of the bytes (a tar extraction writing files) overlap. At most 2 x threads members wait inflated
    or inflating, so memory stays bounded. :meth:`close` stops the cutter at a member's boundary, so the source may
    be read on from there (a restore drains it to finish its digest).

    ``hashed``: the caller checks every byte of ``source`` by a cryptographic digest before it uses what was read (a
    manager step's restore, published once its BLAKE3 pieces match), so stored members, whose data are those bytes,
    skip their CRC32 (0.1 CPU-s of a 1 GiB step's 1.3); inflated ones keep it (it checks the inflater's output).
    """

    def __init__(self, source: IO[bytes], *, threads: int | None = None, hashed: bool = False) -> None:
        threads = threads or _workers()
        super().__init__(CPU.lane(threads))
        self._source = source
        self._stored_crc = not hashed
        # Futures of inflated members in order; None at the end; an exception when the cutter failed.
        self._queue: queue.Queue[concurrent.futures.Future[list[bytes | memoryview]] | BaseException | None] = (
            queue.Queue(threads * 2))
        self._stop = threading.Event()
        self._done = False
        self._cutter = threading.Thread(target=self._cut, name="taskpoint-gunzip-cut", daemon=True)
        self._cutter.start()

    def _next_member(self) -> bytes | None:
        """What follows the next member's header (its deflate stream and trailer); None at the end."""
        head = read_up_to(self._source, HEADER_SIZE)
        if not head:
            return None
        total = member_length(head)
        rest = read_up_to(self._source, total - HEADER_SIZE)
        if len(rest) != total - HEADER_SIZE:
            raise EOFError("compressed stream ended inside a member")
        return rest

    def _cut(self) -> None:
        item: concurrent.futures.Future[list[bytes | memoryview]] | BaseException | None
        while not self._stop.is_set():
            try:
                rest = self._next_member()
                item = None if rest is None else self._pool.submit(member_data, rest, self._stored_crc)
            except BaseException as exc:  # handed to the caller's thread, raised by its next read
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not isinstance(item, concurrent.futures.Future):
                return

    def _next_result(self) -> list[bytes | memoryview] | None:
        """The next member's plain bytes (:func:`member_data`), from the cutter's queue; None at the end; the
        cutter's error."""
        if self._done:
            return None
        item = self._queue.get()
        if item is None or isinstance(item, BaseException):
            self._done = True
            if item is not None:
                raise item
            return None
        return item.result()

    def close(self) -> None:
        if not self.closed:
            self._stop.set()
            while self._cutter.is_alive():  # take what it holds so that it sees the stop
                with contextlib.suppress(queue.Empty):
                    self._queue.get(timeout=0.1)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, concurrent.futures.Future):
                    item.cancel()
        super().close()  # the pool, shut down with what it still holds cancelled
