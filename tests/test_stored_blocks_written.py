"""A stored member is written as deflate stored blocks of its own making (a header and a view of the data per
block, joined once; zlib's level 0 before), and the writer hands its member buffer to the pool without copying
it: every gzip reader still reads the stream, and a caller that reuses its buffer after ``write`` returns changes
nothing already written."""

from __future__ import annotations

import gzip
import io
import struct
import zlib

import numpy as np
import pytest
from isal import igzip

from taskpoint.format import pgzip


def weights(n_bytes: int, seed: int = 0) -> bytes:
    """float32 N(0, 0.02): stored by the writer (they compress to about 0.93 of their size)."""
    return np.random.default_rng(seed).normal(0, 0.02, (n_bytes + 3) // 4).astype(np.float32).tobytes()[:n_bytes]


def stored_blocks(member: bytes) -> list[tuple[int, int]]:
    """(BFINAL, LEN) of each stored block of a labelled member (raises on a block of another kind)."""
    body, pos, blocks = memoryview(member)[20:-8], 0, []
    while pos < len(body):
        first, length, nlength = struct.unpack_from("<BHH", body, pos)
        assert first in (0, 1) and length == nlength ^ 0xFFFF, f"not a stored block at {pos}"
        blocks.append((first, length))
        pos += 5 + length
    return blocks


@pytest.mark.parametrize("size", [2 * pgzip.PROBE_SIZE + 1, 0xFFFF * 3, 0xFFFF * 3 + 1, pgzip.MEMBER_SIZE])
def test_a_stored_member_is_blocks_of_65535_bytes_the_last_one_final_read_by_every_reader(size):
    data = weights(size, seed=size)
    member = pgzip.member(data, pgzip.isal_level(None), store=True)
    blocks = stored_blocks(member)
    assert [length for _, length in blocks] == [min(0xFFFF, size - i) for i in range(0, size, 0xFFFF)]
    assert [first for first, _ in blocks] == [0] * (len(blocks) - 1) + [1]
    assert gzip.decompress(member) == data
    assert zlib.decompress(member, 31) == data
    assert igzip.decompress(member) == data
    assert pgzip.open_member(member) == data


def test_a_caller_reusing_its_buffer_after_write_changes_nothing_written():
    """The writer keeps no view of what it is given: a training loop's reused bytearray, rewritten after each
    ``write``, comes out as it was at each write."""
    sink = io.BytesIO()
    writer = pgzip.ParallelGzipWriter(sink, store=True)
    buffer, expected = bytearray(1 << 20), []
    for i in range(9):  # two and a quarter members
        buffer[:] = weights(len(buffer), seed=i)
        writer.write(buffer)
        expected.append(bytes(buffer))
        buffer[:] = bytes(len(buffer))  # reused at once, before the member is compressed or stored
    writer.close()
    assert gzip.decompress(sink.getvalue()) == b"".join(expected)
    assert [plain for _, plain in writer.written] == [pgzip.MEMBER_SIZE, pgzip.MEMBER_SIZE, 1 << 20]
