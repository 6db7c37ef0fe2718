"""Deflate's stored blocks (RFC 1951, 3.2.4): data that does not compress, written as it is and read back
without inflating, from memory or, by positional reads of their headers, from a file.

A stored block that starts on a byte boundary is a header (BFINAL in bit 0 and BTYPE 00 in bits 1-2, padded to a
byte; LEN; NLEN, its one's complement) and LEN bytes of data, so a stream of them can be cut into the spans that
hold its data without reading the data: :mod:`.pgzip` serves them as views of a member, :mod:`.filegzip` has the
kernel copy them from the stored file.
"""

from __future__ import annotations

import struct
from collections.abc import Callable


class GzipFormatError(ValueError):
    """The stream is not valid gzip, or a member fails its CRC or length check."""


# The header of a stored block that starts on a byte boundary: BFINAL (bit 0) and BTYPE 00 (bits 1-2) padded to a
# byte, then LEN and NLEN, its one's complement (RFC 1951, 3.2.4).
_STORED_BLOCK = struct.Struct("<BHH")
#: Bytes of a stored block's header.
STORED_HEADER = _STORED_BLOCK.size
#: Most data one stored block holds (its LEN is 16 bits).
_STORED_MAX = 0xFFFF


def stored_blocks(data: memoryview) -> list[bytes | memoryview]:
    """``data`` as raw deflate stored blocks (no compression; valid for every inflater): each block's header and
    a view of its data, so that the member is copied once, when it is joined. zlib's level 0 copied every byte
    through its window first (1.25 ms of CPU per 4 MiB member here, against 0.16 for its CRC32: 0.3 CPU-s of a
    1 GiB directory step's save)."""
    parts: list[bytes | memoryview] = []
    for start in range(0, len(data), _STORED_MAX):  # some data: _body stores only members above 2 probes
        length = min(_STORED_MAX, len(data) - start)
        parts += (_STORED_BLOCK.pack(start + length == len(data), length, length ^ 0xFFFF),
                  data[start:start + length])
    return parts


def stored_spans(header_at: Callable[[int], bytes | memoryview], length: int) -> list[tuple[int, int]] | None:
    """Where the data of a raw deflate stream of ``length`` bytes made only of stored blocks lies, as (offset,
    length) spans, from ``header_at(offset)`` (up to 5 bytes of the stream from there: a memory view, or a
    positional read of a file); None when it holds a block of another kind (or padding bits that zlib never
    writes), which inflate then reads. GzipFormatError for a stored block whose LEN is not the complement of its
    NLEN or that runs past the end, a stream without a final block, and bytes after the final one."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        head = header_at(pos) if pos < length else b""
        if pos + STORED_HEADER > length:
            if head and head[0] > 1:
                return None
            raise GzipFormatError("deflate stream is truncated or followed by garbage")
        first, size, nsize = _STORED_BLOCK.unpack_from(head)
        if first > 1:
            return None
        if size != nsize ^ 0xFFFF:
            raise GzipFormatError("a stored deflate block's lengths do not match (LEN is not the complement of NLEN)")
        start, pos = pos + STORED_HEADER, pos + STORED_HEADER + size
        if pos > length:
            raise GzipFormatError("a stored deflate block runs past the end of its gzip member")
        if size:
            spans.append((start, size))
        if first == 1:
            if pos != length:
                raise GzipFormatError("deflate stream is truncated or followed by garbage")
            return spans
