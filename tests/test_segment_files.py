"""A staging segment of several files (issue 43: a fresh segment's pages are allocated under its file's lock, so that a
segment of one file is allocated on one core): one file per thread that fills it, each but the last a whole number of
pages, mapped at consecutive addresses so that its readers see one buffer; made, filled, resized, taken over, swept
and freed as one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers import no_such_pid
from taskpoint.manager import segment_files, staging
from taskpoint.manager.segment_files import MIN_PART, part_count, part_path, part_paths, part_sizes, spread
from taskpoint.manager.staging import Segment
from taskpoint.workspace import host_tag, owner_tag

PAGE = os.sysconf("SC_PAGE_SIZE")


def _mapped_here(path: Path) -> list[str]:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return [line for line in maps if path.name in line]


@pytest.fixture
def three_files(monkeypatch):
    """New segments are made of three files, whatever this machine's number of cores."""
    monkeypatch.setattr(staging, "part_count", lambda size, threads: 3)


def test_a_segment_is_one_file_per_thread_of_at_least_min_part_bytes_each():
    assert part_count(MIN_PART, 2) == 1 and part_count(2 * MIN_PART - 1, 8) == 1
    assert part_count(2 * MIN_PART, 2) == 2 and part_count(256 * MIN_PART, 2) == 2
    assert part_count(256 * MIN_PART, 64) == segment_files.MAX_PARTS
    assert part_count(0, 4) == 1
    sizes = part_sizes(10 * PAGE + 5, 3)
    assert sum(sizes) == 10 * PAGE + 5 and sizes[0] == sizes[1] == 4 * PAGE
    assert part_sizes(2, 3) == [2, 0, 0]  # a segment that shrank keeps its files, the last ones empty


def test_a_large_segment_is_made_of_files_filled_across_their_ends_and_read_as_one_buffer(tmp_path, three_files):
    size = 5 * PAGE + 100
    segment = Segment.create(size, folder=tmp_path)
    paths = part_paths(segment.path)
    assert paths == [segment.path, part_path(segment.path, 1), part_path(segment.path, 2)]
    assert [os.stat(path).st_size for path in paths] == [2 * PAGE, 2 * PAGE, PAGE + 100]
    assert all(os.stat(path).st_blocks == 0 for path in paths)  # no page taken before the copy
    data = os.urandom(size - 10)
    segment.fill([(10, data), (0, b"head")])
    stored = b"".join(path.read_bytes() for path in paths)
    assert stored == b"head" + bytes(6) + data
    reader = Segment(segment.path, size)  # as the save process maps it
    view = np.frombuffer(reader.buffer, dtype=np.uint8)
    assert view.tobytes() == stored
    across = np.frombuffer(reader.buffer, dtype=np.uint8, count=64, offset=2 * PAGE - 32)  # across two files
    assert across.tobytes() == stored[2 * PAGE - 32:2 * PAGE + 32]
    view[0] = 7  # the mapping is shared: a write there is in the file
    assert segment.path.read_bytes()[0] == 7
    reader.unmap()
    assert across.tobytes() == stored[2 * PAGE - 32:2 * PAGE + 32]  # a view left keeps the mapping until it goes
    assert _mapped_here(segment.path)
    del view, across
    assert not _mapped_here(segment.path)
    segment.free()
    assert list(tmp_path.iterdir()) == []


def test_writes_are_split_where_a_file_ends_and_taken_in_turn_across_the_files():
    data = memoryview(bytes(range(10)))
    writes = spread([(0, data[:4]), (4, data[4:10]), (10, memoryview(b"xy"))], [4, 4, 4])
    assert [(file, at, bytes(chunk)) for file, at, chunk in writes] == [
        (0, 0, bytes(range(4))), (1, 0, bytes(range(4, 8))), (2, 0, bytes([8, 9])), (2, 2, b"xy")]
    writes = spread([(0, memoryview(bytes(8))), (8, memoryview(bytes(8)))], [8, 8])
    assert [(file, at) for file, at, _ in writes] == [(0, 0), (1, 0)]  # one thread a file, as they take them
    assert [(file, at, len(chunk)) for file, at, chunk in spread([(6, memoryview(bytes(9)))], [4, 4])] == [
        (1, 2, 9)]  # past the last file's end: to the last file (which pwrite extends)


def test_resize_keeps_its_files_and_a_reused_segment_is_filled_and_read_whole(tmp_path, three_files):
    segment = Segment.create(6 * PAGE, folder=tmp_path)
    segment.fill([(0, os.urandom(6 * PAGE))])
    segment.resize(3 * PAGE + 1)
    assert [os.stat(path).st_size for path in part_paths(segment.path)] == [2 * PAGE, PAGE + 1, 0]
    data = os.urandom(3 * PAGE + 1)
    segment.fill([(0, data)])
    assert bytes(Segment(segment.path, segment.size).buffer) == data
    segment.resize(9 * PAGE)
    assert segment.size == segment_files.stored_size(segment.path) == 9 * PAGE
    segment.free()
    assert list(tmp_path.iterdir()) == []


def test_a_segment_taken_over_keeps_all_its_files_and_a_sweep_or_its_owner_frees_them(tmp_path, three_files):
    theirs = f"{host_tag()}-{no_such_pid()}-7"
    dead = Segment.create(4 * PAGE, theirs, tmp_path)
    dead.fill([(0, b"x" * 4 * PAGE)])
    found = Segment.find(dead.path)
    assert found == dead.path
    mine = Segment.adopt(found)
    assert mine.path.name.startswith(f"{staging.SEGMENT_PREFIX}{owner_tag(os.getpid())}-")
    assert mine.size == 4 * PAGE and bytes(mine.buffer) == b"x" * 4 * PAGE
    assert sorted(tmp_path.iterdir()) == sorted(part_paths(mine.path)) and len(part_paths(mine.path)) == 3
    assert Segment.find(dead.path) == mine.path  # found under its new owner's name
    assert staging.sweep_dead_segments(tmp_path) == []  # its owner runs: kept
    mine.unmap()
    mine_files = part_paths(mine.path)
    other = part_paths(Segment.create(4 * PAGE, theirs, tmp_path).path)  # a dead owner's: swept, every file of it
    assert len(other) == 3 and sorted(staging.sweep_dead_segments(tmp_path)) == sorted(other)
    assert sorted(staging.free_owned_segments(owner_tag(os.getpid()), tmp_path)) == sorted(mine_files)
    assert list(tmp_path.iterdir()) == []
