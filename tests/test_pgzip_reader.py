"""The parallel gzip reader: members cut from the stream on a thread of their own and inflated on others, handed
out in order; a close stops at a member's boundary (a restore reads the rest into its digest), and an error of
the stream reaches the caller's thread."""

from __future__ import annotations

import io
import os

import pytest

from taskpoint.format import pgzip


def labelled(data: bytes) -> bytes:
    sink = io.BytesIO()
    writer = pgzip.ParallelGzipWriter(sink, store=True)
    writer.write(data)
    writer.close()
    return sink.getvalue()


def boundaries(stream: bytes) -> list[int]:
    """The offset where each member of ``stream`` ends."""
    ends, pos = [], 0
    while pos < len(stream):
        length = pgzip.labelled_length(stream[pos:pos + 32])
        assert length is not None
        pos += length
        ends.append(pos)
    return ends


def test_members_come_out_in_order_whatever_thread_inflated_them():
    data = os.urandom(3 * pgzip.MEMBER_SIZE) + b"log line\n" * 500_000 + os.urandom(1000)
    with pgzip.ParallelGzipReader(io.BytesIO(labelled(data)), threads=3) as reader:
        assert reader.read() == data


def test_a_close_before_the_end_leaves_the_source_at_a_members_boundary():
    data = os.urandom(10 * pgzip.MEMBER_SIZE)  # more than the reader takes ahead with 2 threads (1 + 4 + 1)
    stream = labelled(data)
    source = io.BytesIO(stream)
    reader = pgzip.ParallelGzipReader(source, threads=2)
    assert reader.read(10) == data[:10]
    reader.close()
    stopped = source.tell()
    assert stopped in boundaries(stream)[:-1]  # cut ahead of the reader, but not to the end: bounded
    assert source.read() == stream[stopped:]  # the rest is there for the caller to read on


def test_a_stream_cut_inside_a_member_raises_on_the_callers_thread_after_the_whole_members():
    data = os.urandom(2 * pgzip.MEMBER_SIZE)
    stream = labelled(data)
    cut = stream[:boundaries(stream)[0] + 100]
    with pgzip.ParallelGzipReader(io.BytesIO(cut)) as reader:
        assert reader.read(pgzip.MEMBER_SIZE) == data[:pgzip.MEMBER_SIZE]
        with pytest.raises(EOFError, match="ended inside a member"):
            reader.read()


def test_a_member_without_the_label_is_refused():
    stream = labelled(os.urandom(1000)) + b"\x1f\x8b\x08\x00" + bytes(16)
    with pgzip.ParallelGzipReader(io.BytesIO(stream)) as reader, pytest.raises(pgzip.GzipFormatError):
        reader.read()
