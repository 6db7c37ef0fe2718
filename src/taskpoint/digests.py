"""The digests of stored objects, and the cryptographic ones computed behind a stream on a thread of their own.

sha256 (the manifests of older payload steps) runs at about 1.15 GB/s per core here, as slow as writing the bytes
to local disk, and BLAKE3 (payload steps now) at about 3.9 GB/s, so a save (or a restore) that hashes each piece on
the thread that writes (or reads) it still pays for both. hashlib and blake3 release the GIL while they hash a
large piece, so :class:`HashBehind` hands the pieces to a thread of its own and the hash runs beside the copy on
a second core; the digest is whole once :meth:`HashBehind.hexdigest` returns. A payload step's object is hashed
by pieces (:class:`PayloadPieces`, the file sets' engine) so too; a verify of local disk, which reads the page
cache faster than one core's BLAKE3, hashes the pieces on every core (:func:`pieces_of_file`). CRC32 (single
checkpoints: ISA-L, about 10 GB/s) stays on the stream's thread, where it costs little.
"""

from __future__ import annotations

import functools
import hashlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .executors import CPU
from .format.fileset import (
    PIECE_HASH,
    PIECE_HASHES,
    PIECES_DIGEST_PREFIX,
    PieceHasher,
    file_hasher,
    piece_spans,
)
from .format.pgzip import crc32
from .format.pieces import PAYLOAD_PIECES
from .storage import digest_by_reading


class Crc32:
    """CRC32 of a stream (ISA-L: ~10 GB/s). With the size, it catches every truncation and every burst of
    damage up to 32 bits for certain, other random damage with probability 1 - 2**-32."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Any) -> None:
        self._crc = crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc & 0xFFFFFFFF:08x}"


class PayloadPieces(PieceHasher):
    """The :data:`~taskpoint.format.pieces.PAYLOAD_PIECES` digest of bytes fed in order: the BLAKE3 of each
    :data:`~taskpoint.format.fileset.PIECE_SIZE` piece, concatenated; the one piece engine of file sets
    (:class:`~taskpoint.format.fileset.PieceHasher`), whose pieces a stream hashes on a thread of its own
    (:func:`streaming_hash`). Against hashing each whole piece on the CPU pool (the engine before it), a save,
    verify and restore of a step took 0.83-0.94x the wall time and 0.85-0.95x the CPU-seconds (paired medians of
    4-12 alternating rounds at 256 MiB and 1 GiB on local disk and memory://, loaded 2-core machine)."""

    def __init__(self) -> None:
        super().__init__(PIECE_HASH)

    def hexdigest(self) -> str:
        return "".join(self.entry().pieces)


def pieces_of_file(fd: int, size: int, on_read: Callable[[int], None] | None = None) -> tuple[int, str]:
    """The bytes read of the first ``size`` of an open local file, and their
    :data:`~taskpoint.format.pieces.PAYLOAD_PIECES` hexdigest: each piece read and hashed by a thread of the CPU
    pool, with positional reads into one small buffer (:func:`~taskpoint.storage.digest_by_reading`), so the bytes
    are hashed while in the CPU's cache. A verify of the bench's 1 GiB step took 0.16 CPU-s so, against 0.22 from a
    memory map hashed in a child process (which a SIGBUS of the map would end alone: the map's page-table work cost
    more than the read's copy, BLAKE3 ran slower on bytes fetched from memory than on cached ones, and the child's
    start added 0.02), and 0.05 to read the bytes once (docs/performance.md). A file truncated meanwhile just reads
    short. ``on_read`` is told of each read, from other threads. The pieces past the file's end (truncated since
    ``size`` was taken) are no pieces: the digest is of the pieces read, as of a file that was that short."""
    lane = CPU.lane(CPU.threads)
    found = list(lane.map(lambda span: hash_span(fd, span[0], span[1], PIECE_HASH, on_read), piece_spans(size)))
    while len(found) > 1 and found[-1][0] == 0:  # a file truncated since its size was taken ends sooner
        found.pop()
    return sum(count for count, _ in found), "".join(digest for _, digest in found)


def hash_span(fd: int, start: int, length: int, piece_hash: str | None,
              on_read: Callable[[int], None] | None = None) -> tuple[int, str]:
    """The bytes read (fewer where the file ends) of ``length`` bytes of the open file ``fd`` from ``start``, and
    their digest by ``piece_hash`` (None: sha256): how every piece of a local file is hashed (``on_read`` is told
    of each read)."""
    hasher = file_hasher(piece_hash)
    return digest_by_reading(fd, length, hasher, on_read, start=start), str(hasher.hexdigest())


#: Digest algorithms for stored objects: BLAKE3 pieces for the payload objects of manager steps and their shards
#: (BLAKE3 for the steps of manifest version 6 and their shards, sha256 for older ones), crc32 for single
#: checkpoints, where it keeps saves and loads at disk speed, and the pieces of a file-set's file (``pieces:blake3``,
#: :attr:`~taskpoint.format.fileset.FileEntry.digest`).
DIGESTS: dict[str, Callable[[], Any]] = {
    "sha256": hashlib.sha256, "blake3": PIECE_HASHES["blake3"], "crc32": Crc32, PAYLOAD_PIECES: PayloadPieces,
    **{f"{PIECES_DIGEST_PREFIX}{name}": functools.partial(PieceHasher, name) for name in PIECE_HASHES}}
#: The digests a stream hashes on a thread of its own (:func:`streaming_hash`).
BEHIND = frozenset({"sha256", "blake3", PAYLOAD_PIECES})

#: Bytes gathered before a batch goes to the hashing thread (fewer hand-overs than one per written piece).
BATCH_BYTES = 4 << 20
#: Batches that may wait for the hashing thread: the memory a save holds beyond its own buffers is at most
#: about ``BATCH_BYTES * (QUEUED_BATCHES + 2)``; a writer that gets that far ahead waits.
QUEUED_BATCHES = 4


class HashBehind:
    """A hash fed on a thread of its own: :meth:`update` keeps the piece (a copy, unless it is immutable
    ``bytes``) and returns; :meth:`hexdigest` waits for every piece handed over. The thread starts with the
    first batch and ends with :meth:`hexdigest`, or when the object is dropped unfinished (a failed save)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._hash = make()
        self._batch: list[bytes] = []
        self._batched = 0
        self._queue: queue.Queue[list[bytes] | None] = queue.Queue(QUEUED_BATCHES)
        self._thread: threading.Thread | None = None
        self._stopper: weakref.finalize[Any, Any] | None = None
        self._digest: str | None = None

    def update(self, data: Any) -> None:
        piece = data if isinstance(data, bytes) else bytes(data)
        self._batch.append(piece)
        self._batched += len(piece)
        if self._batched >= BATCH_BYTES:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_feed, args=(self._hash, self._queue), daemon=True,
                                            name="taskpoint-hash")
            self._thread.start()
            self._stopper = weakref.finalize(self, _stop, self._queue)  # a save dropped midway: the thread ends too
        self._queue.put(self._batch)
        self._batch, self._batched = [], 0

    def hexdigest(self) -> str:
        if self._digest is None:
            if self._thread is None:  # a small object: hashed here, no thread
                for piece in self._batch:
                    self._hash.update(piece)
            else:
                if self._batch:
                    self._queue.put(self._batch)
                self._queue.put(None)
                self._thread.join()
                if self._stopper is not None:
                    self._stopper.detach()
            self._batch = []
            self._digest = str(self._hash.hexdigest())
        return self._digest


def _feed(digest: Any, batches: queue.Queue[list[bytes] | None]) -> None:
    for batch in iter(batches.get, None):
        for piece in batch:
            digest.update(piece)


def _stop(batches: queue.Queue[list[bytes] | None]) -> None:
    """End the hashing thread of a dropped :class:`HashBehind` (its queue may be full: the thread drains it)."""
    batches.put(None)


def streaming_hash(digest: str) -> Any:
    """The hash a stream feeds as it writes or reads: sha256, BLAKE3 and BLAKE3 pieces on a thread of their own
    (:class:`HashBehind`), CRC32 in line."""
    return HashBehind(DIGESTS[digest]) if digest in BEHIND else DIGESTS[digest]()
