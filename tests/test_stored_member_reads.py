"""Reading stored gzip members: a member made only of deflate's stored blocks is served as views of its blocks'
data, never inflated and never copied on its way to the extracted files, and still checked against its CRC32 and
ISIZE; a malformed block header is refused like the inflater would refuse it, as CheckpointCorruptError on a
restore. Compressed members are inflated as before."""

from __future__ import annotations

import io
import os
import struct
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from helpers import make_tree, snapshot
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager, UnsafeArchiveError
from taskpoint.format import pgzip
from taskpoint.storage.streams import OrderedFutureReader

HEADER = 20  # a labelled member's header: its total length is the last 4 bytes
TRAILER = 8
BLOCK = struct.Struct("<BHH")  # BFINAL and BTYPE 00 padded to a byte, LEN, NLEN


def weights(n_bytes: int, seed: int = 0) -> bytes:
    """float32 N(0, 0.02): stored by a step's writer, since it barely compresses."""
    return np.random.default_rng(seed).normal(0, 0.02, n_bytes // 4).astype(np.float32).tobytes()


def text(n_bytes: int) -> bytes:
    return b"".join(f"step {i} loss {1 / (i + 1):.6f}\n".encode() for i in range(n_bytes // 20))[:n_bytes]


def labelled(data: bytes) -> bytearray:
    """``data`` as a step's writer writes it: members that do not compress stored, the others compressed."""
    sink = io.BytesIO()
    writer = pgzip.ParallelGzipWriter(sink, store=True)
    writer.write(data)
    writer.close()
    return bytearray(sink.getvalue())


def members(stream: bytes) -> list[tuple[int, int, bool]]:
    """(offset, length, stored) of each member: stored ones start with a stored block."""
    out, pos = [], 0
    while pos < len(stream):
        length = pgzip.labelled_length(bytes(stream[pos:pos + HEADER]))
        assert length is not None
        out.append((pos, length, stream[pos + HEADER] <= 1))
        pos += length
    return out


def blocks(stream: bytes, offset: int) -> list[int]:
    """The offsets of the stored blocks of the member at ``offset``, the final one last."""
    out, pos = [], offset + HEADER
    while True:
        out.append(pos)
        first, length, _ = BLOCK.unpack_from(stream, pos)
        if first == 1:
            return out
        pos += BLOCK.size + length


def relabel(stream: bytearray, offset: int) -> None:
    """Make the label of the member at ``offset`` say that it runs to the end of ``stream`` (its only member)."""
    stream[offset + HEADER - 4:offset + HEADER] = (len(stream) - offset).to_bytes(4, "little")


def read_all(stream: bytes) -> bytes:
    with pgzip.ParallelGzipReader(io.BytesIO(bytes(stream))) as reader:
        return reader.read()


@pytest.fixture
def inflated(monkeypatch) -> list[int]:
    """The first byte of every deflate stream inflated: 0 or 1 starts with a stored block, which must not be."""
    seen: list[int] = []
    inflate = pgzip._inflate

    def spy(data: bytes | memoryview, limit: int) -> bytes:
        seen.append(memoryview(data)[0] if len(data) else -1)
        return inflate(data, limit)

    monkeypatch.setattr(pgzip, "_inflate", spy)
    return seen


def test_a_stream_of_stored_members_reads_back_without_inflating(inflated):
    data = weights(3 * pgzip.MEMBER_SIZE + (1 << 20))
    stream = labelled(data)
    assert all(stored for _, _, stored in members(stream))
    assert read_all(stream) == data
    assert inflated == []


def test_stored_and_compressed_members_read_back_and_only_the_compressed_ones_are_inflated(inflated):
    size = pgzip.MEMBER_SIZE
    data = weights(size) + text(2 * size) + weights(size, 1) + os.urandom(size // 3)
    stream = labelled(data)
    kinds = [stored for _, _, stored in members(stream)]
    assert kinds == [True, False, False, True, True]
    assert read_all(stream) == data
    assert len(inflated) == 2 and all(first > 1 for first in inflated)
    assert pgzip.open_member(bytes(stream[:members(stream)[1][0]])) == data[:size]  # an indexed subset's path


def test_read_view_hands_out_views_of_the_members_that_stay_valid_after_later_reads():
    data = weights(2 * pgzip.MEMBER_SIZE) + text(1 << 20)
    views = []
    with pgzip.ParallelGzipReader(io.BytesIO(bytes(labelled(data)))) as reader:
        while view := reader.read_view(100_000):
            assert isinstance(view, memoryview) and view.readonly and len(view) <= 100_000
            views.append(view)
    assert len(views[0].obj) > pgzip.MEMBER_SIZE  # a slice of the stored member itself, not a copy
    assert b"".join(views) == data


def test_a_read_returns_as_much_of_a_stored_member_as_asked_not_one_block():
    data = weights(2 * pgzip.MEMBER_SIZE)
    with pgzip.ParallelGzipReader(io.BytesIO(bytes(labelled(data)))) as reader:
        assert reader.read(pgzip.MEMBER_SIZE) == data[:pgzip.MEMBER_SIZE]
        assert reader.read(10) == data[pgzip.MEMBER_SIZE:pgzip.MEMBER_SIZE + 10]


def _flip_data(s: bytearray, at: int, final: int) -> None:
    s[at + BLOCK.size + 1000] ^= 0x10


def _nlen(s: bytearray, at: int, final: int) -> None:
    s[at + 3] ^= 0x01


def _truncated(s: bytearray, at: int, final: int) -> None:
    del s[final:-TRAILER]  # the member ends after a block that is not its last
    relabel(s, 0)


def _longer_than_member(s: bytearray, at: int, final: int) -> None:
    _, length, _ = BLOCK.unpack_from(s, final)
    BLOCK.pack_into(s, final, 1, length + 100, (length + 100) ^ 0xFFFF)


def _no_final_block(s: bytearray, at: int, final: int) -> None:
    s[final] = 0


def _isize(s: bytearray, at: int, final: int) -> None:
    s[-4:] = (int.from_bytes(s[-4:], "little") - 1).to_bytes(4, "little")


def _garbage_after_final(s: bytearray, at: int, final: int) -> None:
    s[-TRAILER:-TRAILER] = b"\0" * 7
    relabel(s, 0)


DAMAGE: dict[str, tuple[Callable[[bytearray, int, int], None], str]] = {
    "flipped-data-byte": (_flip_data, "CRC32"),
    "len-not-complement-of-nlen": (_nlen, "lengths do not match"),
    "truncated-member": (_truncated, "truncated"),
    "block-longer-than-member": (_longer_than_member, "runs past the end"),
    "no-final-block": (_no_final_block, "truncated"),
    "wrong-isize": (_isize, "CRC32 or length"),
    "garbage-after-final-block": (_garbage_after_final, "garbage"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_stored_member_is_refused_by_its_own_checks_without_inflating(damage, inflated):
    stream = labelled(weights(pgzip.MEMBER_SIZE))
    starts = blocks(stream, 0)
    damage_fn, message = DAMAGE[damage]
    damage_fn(stream, starts[len(starts) // 2], starts[-1])
    with pytest.raises(pgzip.GzipFormatError, match=message):
        read_all(stream)
    assert inflated == []


def save_tree(folder: Path) -> Path:
    make_tree(folder)
    (folder / "model.bin").write_bytes(weights(9 << 20))  # stored members, one shared with the tar headers
    (folder / "nested" / "train.log").write_bytes(text(3 << 20))  # compressed members
    (folder / "odd.bin").write_bytes(weights(4 << 20, 2)[:(4 << 20) - 333])  # not a multiple of 512
    (folder / "empty.bin").write_bytes(b"")
    return folder


def test_a_restore_through_the_views_gives_identical_files(tmp_path, monkeypatch, inflated):
    """From a store other than local disk (memory://), the files' data are views of the stored members (a step
    on local disk is copied by the kernel instead: tests/test_restore_from_file.py)."""
    source = save_tree(tmp_path / "run")
    views = []
    read_view = OrderedFutureReader.read_view

    def counting(self: OrderedFutureReader, n: int) -> memoryview:
        views.append(n)
        return read_view(self, n)

    monkeypatch.setattr(OrderedFutureReader, "read_view", counting)
    with CheckpointManager(f"memory://tp-{uuid.uuid4().hex}/steps") as m:
        m.save(source, 1)
        restored = m.restore(1, into=tmp_path / "out")
    assert snapshot(restored) == snapshot(source)
    assert len(views) > (13 << 20) // (128 << 10)  # the files' data went through read_view
    assert inflated and all(first > 1 for first in inflated)  # the log's members only


def test_a_bad_stored_block_header_in_a_step_is_corrupt_and_the_older_step_survives(tmp_path, inflated):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(save_tree(tmp_path / "a"), 1)
        m.save(save_tree(tmp_path / "b"), 2)
        (payload,) = (tmp_path / "steps" / "ckpt-2").glob("payload-*")
        data = bytearray(payload.read_bytes())
        offset = next(offset for offset, _, stored in members(data) if stored)
        _nlen(data, blocks(data, offset)[3], 0)
        payload.write_bytes(bytes(data))
        with pytest.raises(CheckpointCorruptError, match="step 2"):
            m.restore(2, into=tmp_path / "out2")
        assert snapshot(m.restore(1, into=tmp_path / "out1")) == snapshot(tmp_path / "a")
    assert all(first > 1 for first in inflated)


def hostile_tar(entries: list[tuple[str, bytes | None, str]]) -> bytes:
    """A tar of (name, data, symlink target) entries, data large enough to fill stored members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, target in entries:
            info = tarfile.TarInfo(name)
            if target:
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return buf.getvalue()


@pytest.mark.parametrize("case", ["dot-dot", "through-a-symlink"])
def test_a_hostile_archive_of_stored_members_is_refused_on_the_view_path(tmp_path, case, inflated):
    good = ("ok.bin", weights(6 << 20), "")
    hostile = ([("../evil.bin", weights(5 << 20, 1), "")] if case == "dot-dot"
               else [("up", None, ".."), ("up/evil.bin", weights(5 << 20, 1), "")])
    stream = labelled(hostile_tar([good, *hostile]))
    assert sum(stored for _, _, stored in members(stream)) >= 2
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "ckpt").write_bytes(bytes(stream))
    workspace = tmp_path / "ws" / "inner"
    workspace.mkdir(parents=True)
    with pytest.raises(UnsafeArchiveError), Checkpoint(tmp_path / "dest", tmp_path / "store" / "ckpt",
                                                       workspace=workspace) as cp:
        cp.load_sync()
    assert os.listdir(workspace) == []
    assert not (tmp_path / "ws" / "evil.bin").exists() and not (tmp_path / "evil.bin").exists()
    assert inflated == []
