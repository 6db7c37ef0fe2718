"""Reading part of a stored directory: some of its entries, or one file, with ranged reads of only what holds them.

Two shapes of stored data share one reader of verified pieces: an indexed archive (:mod:`.index`), whose
pieces are the codec's independent members (each checked by the codec: gzip's CRC32 and ISIZE; and, for a step's
object recorded by BLAKE3 pieces (:mod:`.pieces`), read through :class:`CheckedRanges`, by the pieces that hold
it), and a
deduplicated step, whose pieces are chunks (each checked by its sha256, :mod:`taskpoint.manager.chunks`).
:func:`extract_entries` restores entries of an indexed archive through the same safe extraction as a full
load (:func:`~.extract.extract_tar`); :class:`PieceFile` is a seekable read-only file over pieces.
"""

from __future__ import annotations

import bisect
import collections
import io
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import blake3

from ..errors import CheckpointCorruptError
from ..executors import IO
from ..storage.streams import OrderedFutureReader
from .codecs import DECODE_ERRORS, Codec
from .extract import extract_tar
from .fileset import PIECE_HASH, PIECE_SIZE, piece_spans
from .index import TAR_BLOCK, ArchiveIndex, IndexEntry, Span, merged_ranges
from .pieces import piece_damage

#: Reads ``length`` bytes of the stored object from ``start`` (fewer only past its end).
RangeReader = Callable[[int, int], bytes]
#: Members inflated ahead of the one being consumed (memory: this x the member size, plain and compressed).
MEMBERS_AHEAD = 8
#: Checked pieces a :class:`CheckedRanges` keeps for the reads that follow (the members of an archive are 4 MiB
#: of plain bytes, so several in a row lie in one piece): at most this many x :data:`~.fileset.PIECE_SIZE` bytes.
KEPT_PIECES = 4


class MemberReader:
    """Fetches the members of one indexed archive by ranged reads, each verified by its codec before use."""

    def __init__(self, index: ArchiveIndex, codec: Codec, read_range: RangeReader, uri: str,
                 on_read: Callable[[int], None] | None = None) -> None:
        self.index, self.codec, self._read, self.uri, self._on_read = index, codec, read_range, uri, on_read

    def fetch(self, span: Span) -> bytes:
        """The plain bytes of member ``span``; CheckpointCorruptError naming it when it fails its check.
        ``on_read`` (a load's progress) is told of the stored bytes read."""
        blob = self._read(span.stored, span.stored_length)
        if self._on_read is not None:
            self._on_read(len(blob))
        try:
            if len(blob) != span.stored_length:
                raise EOFError(f"the object ends inside it ({len(blob)} of {span.stored_length} bytes)")
            plain = self.codec.open_member(blob)
            if len(plain) != span.plain_length:
                raise ValueError(f"it holds {len(plain)} bytes, its index says {span.plain_length}")
        except (ValueError, *DECODE_ERRORS) as exc:  # type: ignore[misc]
            raise CheckpointCorruptError(
                f"the checkpoint at {self.uri} is damaged: its compressed member {span.index} (bytes {span.stored}-"
                f"{span.stored + span.stored_length - 1}) fails its check ({type(exc).__name__}: {exc}). Restore "
                "an older checkpoint, or save it again.") from exc
        return plain


class _RangesStream(OrderedFutureReader):
    """The plain bytes of some ranges of an indexed archive, in order, then a tar end-of-archive marker: each
    member fetched once (on a pool, :data:`MEMBERS_AHEAD` ahead), only the needed bytes kept."""

    def __init__(self, members: MemberReader, ranges: Sequence[tuple[int, int]], workers: int) -> None:
        super().__init__(IO.lane(workers))
        self._members = members
        self._pieces: list[tuple[Span, list[tuple[int, int]]]] = []
        for start, end in ranges:
            for span in members.index.spans(start, end):
                cut = (max(start, span.plain) - span.plain, min(end, span.plain + span.plain_length) - span.plain)
                if self._pieces and self._pieces[-1][0].index == span.index:
                    self._pieces[-1][1].append(cut)
                else:
                    self._pieces.append((span, [cut]))
        self._next = 0
        self._ended = False

    def _take(self, span: Span, cuts: list[tuple[int, int]]) -> bytes:
        plain = self._members.fetch(span)
        return b"".join(plain[a:b] for a, b in cuts)

    def _fill(self) -> None:
        while self._next < len(self._pieces) and len(self._pending) < MEMBERS_AHEAD:
            span, cuts = self._pieces[self._next]
            self._pending.append(self._pool.submit(self._take, span, cuts))
            self._next += 1
        if self._next == len(self._pieces) and not self._ended:
            self._ended = True
            self._pending.append(self._pool.submit(bytes, 2 * TAR_BLOCK))


def stored_bytes(index: ArchiveIndex, entries: Sequence[IndexEntry]) -> int:
    """The stored bytes :func:`extract_entries` reads for ``entries``: the members that hold them, once each."""
    spans = {s.index: s.stored_length for start, end in merged_ranges(entries) for s in index.spans(start, end)}
    return sum(spans.values())


def extract_entries(members: MemberReader, entries: Sequence[IndexEntry], staging: Path, *,
                    max_expand: int | None = None) -> None:
    """Extract ``entries`` (in archive order, :meth:`ArchiveIndex.select`) of the indexed archive below
    ``staging`` with the checks of a full load, fetching each member that holds them once."""
    stream = _RangesStream(members, merged_ranges(entries), min(8, os.cpu_count() or 1))
    try:
        extract_tar(stream, staging, members.uri, max_expand=max_expand)  # type: ignore[arg-type]
    finally:
        stream.close()


class PieceFile(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes stored as pieces: piece ``i`` starts at ``starts[i]`` of a
    plain stream and ``fetch(i)`` returns it verified; the file is the stream's bytes from ``offset``. The last
    piece read is kept, so sequential reads fetch each piece once."""

    def __init__(self, starts: Sequence[int], fetch: Callable[[int], bytes], offset: int, size: int,
                 name: str) -> None:
        super().__init__()
        self._starts, self._fetch, self._offset, self._size = list(starts), fetch, offset, size
        self.name = name
        self._pos = 0
        self._cached: tuple[int, bytes] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence!r}")
        if base + offset < 0:
            raise OSError(22, f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def _piece(self, i: int) -> bytes:
        if self._cached is None or self._cached[0] != i:
            self._cached = (i, self._fetch(i))
        return self._cached[1]

    def _prefetch(self, first: int, last: int) -> dict[int, bytes]:
        """Pieces ``first`` to ``last`` that a read needs, fetched :data:`MEMBERS_AHEAD` at a time in parallel
        (a large read costs what the pieces cost together, not one after the other)."""
        todo = [i for i in range(first, last + 1) if self._cached is None or self._cached[0] != i]
        if len(todo) < 2:
            return {}
        with IO.lane(min(MEMBERS_AHEAD, len(todo))) as pool:
            return dict(zip(todo, pool.map(self._fetch, todo), strict=True))

    def readinto(self, buf: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        view = memoryview(buf).cast("B")
        want = min(len(view), self._size - self._pos)
        done = 0
        fetched: dict[int, bytes] = {}
        while done < want:
            at = self._offset + self._pos + done
            i = bisect.bisect_right(self._starts, at) - 1
            if i not in fetched:
                end = bisect.bisect_right(self._starts, self._offset + self._pos + want - 1) - 1
                fetched = self._prefetch(i, min(end, i + MEMBERS_AHEAD - 1))
            if i in fetched:
                self._cached = (i, fetched[i])
            piece = self._piece(i)
            lo = at - self._starts[i]
            n = min(want - done, len(piece) - lo)
            if n <= 0:
                raise CheckpointCorruptError(f"{self.name}: piece {i} is shorter than its index says")
            view[done:done + n] = piece[lo:lo + n]
            done += n
        self._pos += done
        return done

    def readall(self) -> bytes:
        out = bytearray(max(0, self._size - self._pos))
        n = self.readinto(out)
        return bytes(out[:n])


def open_pieces(raw: PieceFile) -> io.BufferedReader:
    """``raw`` buffered, as ``open(path, "rb")`` returns a file: what ``torch.load`` and ``safetensors`` read."""
    return io.BufferedReader(raw, buffer_size=1 << 20)


class CheckedRanges:
    """A :data:`RangeReader` of an object of ``size`` bytes recorded by ``pieces``: each read widened to the whole
    pieces it covers, each piece checked against its BLAKE3 before any of its bytes are used
    (CheckpointCorruptError naming the piece, ``where`` the object lies and its ``name``). Safe to call from several
    threads: a piece is read once while it is kept (:data:`KEPT_PIECES`), however many readers want it."""

    def __init__(self, read: RangeReader, pieces: tuple[str, ...], size: int, where: str, name: str) -> None:
        self._read, self._pieces, self._where, self._name, self._size = read, pieces, where, name, size
        self._spans = piece_spans(size)
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[int, Future[bytes]] = collections.OrderedDict()

    def __call__(self, start: int, length: int) -> bytes:
        first, last = start // PIECE_SIZE, (start + max(length, 1) - 1) // PIECE_SIZE
        held = b"".join(self._piece(i) for i in range(first, min(last, len(self._spans) - 1) + 1))
        at = start - first * PIECE_SIZE
        return held[at:at + length]

    def _piece(self, i: int) -> bytes:
        with self._lock:
            slot = self._kept.get(i)
            mine = slot is None
            if slot is None:
                slot = self._kept[i] = Future()
                while len(self._kept) > KEPT_PIECES:
                    self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(i)
        if mine:
            try:
                slot.set_result(self._checked(i))
            except BaseException as exc:
                with self._lock:
                    self._kept.pop(i, None)
                slot.set_exception(exc)
        return slot.result()  # another reader's read of this piece: bounded by that read's own storage deadline

    def _checked(self, i: int) -> bytes:
        start, length = self._spans[i]
        data = self._read(start, length)
        if len(data) != length or blake3.blake3(data).hexdigest() != self._pieces[i]:
            raise CheckpointCorruptError(
                f"{piece_damage(self._where, i, PIECE_SIZE, self._size, PIECE_HASH, name=self._name)} "
                f"({len(data)} of {length} bytes read). Restore an older step (fallback=True), or save it again.")
        return data
