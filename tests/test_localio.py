"""Local writes start their writeback early and keep their pages cached (taskpoint.storage.localio)."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from taskpoint.storage import localio as _localio


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_starts_through_sync_file_range_on_linux(tmp_path, monkeypatch):
    assert _localio.start_writeback is not None
    calls = []
    real = _localio.start_writeback
    monkeypatch.setattr(_localio, "start_writeback", lambda *a: (calls.append(a), real(*a)))
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: pytest.fail("the pages were dropped (posix_fadvise)"))
    data = os.urandom(1 << 20) * 80  # 80 MiB: two kicks of 32 MiB
    path = tmp_path / "f"
    with open(path, "wb", buffering=0) as raw:
        out = _localio.EarlyWriteback(raw)
        for start in range(0, len(data), 4 << 20):  # as a save writes: a kick once 32 MiB more were written
            out.write(data[start:start + (4 << 20)])
        out.flush()
        os.fsync(raw.fileno())
    assert path.read_bytes() == data
    kicks = [(start, length) for _, start, length in calls]
    # Contiguous stretches of at least 32 MiB from the start, the rest left to the fsync.
    assert len(kicks) == 2 and kicks[0][0] == 0 and kicks[1][0] == sum(kicks[0])
    assert all(length >= 32 << 20 for _, length in kicks) and sum(kicks[1]) <= len(data)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_sync_file_range_reports_a_bad_descriptor_without_raising(tmp_path):
    # A failed kick only leaves the work to the fsync that follows: it must never fail the save.
    assert _localio.start_writeback is not None
    _localio.start_writeback(-1, 0, 4096)
    assert ctypes.get_errno() == 9  # EBADF: the call reached the kernel
