"""Compression codecs for directory archives: gzip (default, any gzip reader can open it), zstd, none.

Each codec wraps a binary sink for writing and a binary source for reading. Readers verify the codec's own
checksums to the end of the stream (gzip CRC32 and length of every member, zstd frame checksums), so a
flipped byte or a cut-off object is an error rather than silently short data. Readers hand out the
decompressed bytes in bounded pieces, so memory stays bounded whatever a stream claims (see :mod:`.pgzip`
and :data:`ZSTD_MAX_WINDOW`); what the archive may expand to on disk is bounded by the extraction.
"""

from __future__ import annotations

import gzip
import io
import zlib
from abc import ABC, abstractmethod
from typing import IO, ClassVar

import zstandard
from isal import igzip, isal_zlib

from ..errors import CheckpointCorruptError
from .filegzip import FileGzipReader
from .pgzip import GzipFormatError, ParallelGzipReader, ParallelGzipWriter, isal_level, labelled_length, open_member

#: Size of the blocks the codecs hand to their compressors and to storage.
BLOCK_SIZE = 1 << 20

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_TAR_MAGIC_OFFSET = 257
#: Largest zstd window a reader accepts (zstd's own default limit, 128 MiB; what level 22 writes): the memory
#: one zstd reader may use. A frame asking for more is refused as damaged.
ZSTD_MAX_WINDOW = 1 << 27


class _NonClosing(io.RawIOBase):
    """A writable view of a sink that survives ``close()`` of the codec stream wrapped around it."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._sink.write(b)
        return memoryview(b).nbytes

    def flush(self) -> None:
        pass


class Codec(ABC):
    """A compression format for archives. Subclasses are stateless; one instance serves all callers."""

    name: ClassVar[str]

    @abstractmethod
    def writer(self, sink: IO[bytes], level: int | None) -> IO[bytes]:
        """A stream that compresses into ``sink``; closing it finishes the stream but leaves ``sink`` open."""

    @abstractmethod
    def reader(self, source: IO[bytes], head: bytes = b"", *, hashed: bool = False) -> IO[bytes]:
        """A stream of the decompressed bytes of ``source`` (whose first bytes are ``head``, not yet consumed);
        checksums are verified up to the end. ``hashed``: the caller checks every byte of ``source`` against a
        cryptographic digest before it uses what it read, so a codec may leave out checks of those same bytes
        (gzip's stored members, :class:`~.pgzip.ParallelGzipReader`)."""

    def file_reader(self, fd: int, size: int, head: bytes) -> IO[bytes] | None:
        """A stream of the decompressed bytes of the first ``size`` bytes of the open local file ``fd`` (whose
        first bytes are ``head``), read by offset, whose ``copy_into(fd, n)`` writes what it can to a file in the
        kernel; None for a codec (or stream) without one. For a caller that checks every byte of the file against
        a cryptographic digest before it uses what it read, like ``reader(hashed=True)``."""
        return None

    @abstractmethod
    def matches(self, head: bytes) -> bool:
        """True when ``head`` (the first bytes of an object) starts a stream of this codec."""

    @abstractmethod
    def compress(self, data: bytes | memoryview, level: int | None) -> bytes:
        """``data`` compressed alone into one blob (a chunk of a deduplicated step), at the level :meth:`writer`
        would use for the same ``level``."""

    @abstractmethod
    def decompress(self, blob: bytes, size: int) -> bytes:
        """The plain bytes of a blob :meth:`compress` made (or another tool, in the same format), which should be
        ``size`` long; the caller checks that they are."""

    def members(self, writer: IO[bytes]) -> list[tuple[int, int]] | None:
        """The independent members a closed :meth:`writer` wrote, as (compressed length, plain length) in order,
        each of which :meth:`open_member` inflates alone: what an archive's index locates files in. None for a
        codec whose stream cannot be cut so (the archive then gets no index)."""
        return None

    def open_member(self, blob: bytes) -> bytes:
        """The plain bytes of one member :meth:`members` listed, verified by the codec's own check; a
        :data:`DECODE_ERRORS` error when damaged."""
        raise NotImplementedError(f"codec {self.name!r} writes no independent members")


class GzipCodec(Codec):
    """Standard gzip, compressed and inflated on every core (see :mod:`.pgzip`); any gzip reader opens it.

    ISA-L (same format, about 20x faster than zlib). ``level`` uses
    zlib's 1-9 scale; ISA-L maps 1-3, 4-6 and 7-9 to its levels 1, 2 and 3 (:func:`~.pgzip.isal_level`, the
    one mapping: archives and the chunks of deduplicated steps alike). Streams written by other tools
    (Flyte, ``tar czf``) are inflated sequentially.
    """

    name = "gzip"

    def __init__(self, store_incompressible: bool = False) -> None:
        #: Whether members that do not compress are stored (a manager's steps; never a single Checkpoint's).
        self.store_incompressible = store_incompressible

    def writer(self, sink: IO[bytes], level: int | None) -> IO[bytes]:
        return ParallelGzipWriter(sink, level, store=self.store_incompressible)  # type: ignore[return-value]

    def reader(self, source: IO[bytes], head: bytes = b"", *, hashed: bool = False) -> IO[bytes]:
        if labelled_length(head) is not None:
            return ParallelGzipReader(source, hashed=hashed)  # type: ignore[return-value]
        from isal import igzip_threaded  # on first use: only streams other tools wrote need it

        return igzip_threaded.open(  # type: ignore[no-any-return,no-untyped-call]
            source, "rb", threads=1, block_size=BLOCK_SIZE
        )

    def file_reader(self, fd: int, size: int, head: bytes) -> IO[bytes] | None:
        """Labelled streams only (:class:`~.filegzip.FileGzipReader`: stored members copied by the kernel)."""
        if labelled_length(head) is None:
            return None
        return FileGzipReader(fd, size)  # type: ignore[return-value]

    def matches(self, head: bytes) -> bool:
        return head.startswith(_GZIP_MAGIC)

    def members(self, writer: IO[bytes]) -> list[tuple[int, int]] | None:
        written = getattr(writer, "written", None)
        return list(written) if written is not None else None

    def open_member(self, blob: bytes) -> bytes:
        """One labelled member, inflated and checked against its CRC32 and ISIZE (:func:`~.pgzip.open_member`)."""
        return open_member(blob)

    def compress(self, data: bytes | memoryview, level: int | None) -> bytes:
        return bytes(igzip.compress(data, isal_level(level)))

    def decompress(self, blob: bytes, size: int) -> bytes:
        return bytes(igzip.decompress(blob))  # type: ignore[no-untyped-call]


class ZstdCodec(Codec):
    """Zstandard with frame checksums, compressed on all cores."""

    name = "zstd"

    #: The level of ``level=None``: zstd's fastest positive level.
    DEFAULT_LEVEL = 1

    def writer(self, sink: IO[bytes], level: int | None) -> IO[bytes]:
        compressor = zstandard.ZstdCompressor(level=self._level(level), write_checksum=True, threads=-1)
        return compressor.stream_writer(_NonClosing(sink), closefd=False)  # type: ignore[arg-type]

    def reader(self, source: IO[bytes], head: bytes = b"", *, hashed: bool = False) -> IO[bytes]:
        decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        return decompressor.stream_reader(source, read_across_frames=True, closefd=False)

    def matches(self, head: bytes) -> bool:
        return head.startswith(_ZSTD_MAGIC)

    def _level(self, level: int | None) -> int:
        return self.DEFAULT_LEVEL if level is None else level

    def compress(self, data: bytes | memoryview, level: int | None) -> bytes:
        compressor = zstandard.ZstdCompressor(level=self._level(level), write_content_size=True)
        return bytes(compressor.compress(data))

    def decompress(self, blob: bytes, size: int) -> bytes:
        decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        return bytes(decompressor.decompress(blob, max_output_size=size))


class NoCodec(Codec):
    """A plain, uncompressed tar."""

    name = "none"

    def writer(self, sink: IO[bytes], level: int | None) -> IO[bytes]:
        return io.BufferedWriter(_NonClosing(sink), buffer_size=BLOCK_SIZE)  # type: ignore[type-var]

    def reader(self, source: IO[bytes], head: bytes = b"", *, hashed: bool = False) -> IO[bytes]:
        return source

    def matches(self, head: bytes) -> bool:
        return head[_TAR_MAGIC_OFFSET : _TAR_MAGIC_OFFSET + 5] == b"ustar"

    def compress(self, data: bytes | memoryview, level: int | None) -> bytes:
        return bytes(data)

    def decompress(self, blob: bytes, size: int) -> bytes:
        return blob


CODECS: dict[str, Codec] = {c.name: c for c in (GzipCodec(), ZstdCodec(), NoCodec())}

#: Exceptions that decoders raise on damaged input; they all mean "corrupt checkpoint".
DECODE_ERRORS: tuple[type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile, GzipFormatError,
                                                  isal_zlib.error, zstandard.ZstdError)  # type: ignore[assignment]


#: The gzip of a manager's directory steps: members that do not compress (weights) are stored, read back without
#: inflating (docs/performance.md). Still gzip, named so in records: every reader, Flyte's too, opens it.
STEP_GZIP = GzipCodec(store_incompressible=True)


def step_codec(name: str | None) -> Codec:
    """The codec of a manager's directory steps for ``codec=name`` (None: gzip, storing what does not compress)."""
    return STEP_GZIP if name is None or name == "gzip" else get_codec(name)


def get_codec(name: str) -> Codec:
    """The codec called ``name``; a ValueError lists the known ones."""
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}")
    return CODECS[name]


def detect_codec(head: bytes, uri: str) -> Codec:
    """The codec of an archive from its first bytes (at least 262 of them, or the whole object)."""
    for codec in CODECS.values():
        if codec.matches(head):
            return codec
    raise CheckpointCorruptError(
        f"the checkpoint at {uri} is not a gzip, zstd or tar archive; it was damaged or written by "
        "something else. Save a new checkpoint, or load an older one."
    )


def holds_tar(head: bytes) -> bool:
    """True when ``head`` starts a tar archive, plain or compressed; for objects whose kind is not recorded."""
    if CODECS["zstd"].matches(head):
        return True
    if CODECS["gzip"].matches(head):
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, 512)
        except zlib.error:
            return False
    return CODECS["none"].matches(head)


__all__ = ["BLOCK_SIZE", "CODECS", "DECODE_ERRORS", "STEP_GZIP", "Codec", "detect_codec", "get_codec", "holds_tar",
           "step_codec"]
