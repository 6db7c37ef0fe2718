"""Background saves of bytes staged in shared memory (issue 43): the save process writes the payload step a blocking
save writes, from the segment; a SIGKILL of the trainer right after ``save()`` returned loses nothing, one of the
save process in the middle of its write commits nothing and leaves its segment to the next manager."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from _staged_kills import kill_save_process_mid_write, kill_trainer_after_return
from helpers import staged_segments
from taskpoint import CheckpointManager

LOCAL_AND_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
#: The save process's grace after its trainer died (it commits within it): generous for a loaded machine.
GRACE_SECONDS = 120


def _data(seed: int, size: int = 6 << 20) -> bytes:
    """``size`` bytes that differ from one seed to the next, in every block."""
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def _refuse_here(*args, **kwargs):
    raise AssertionError("the bytes were written from the trainer's process")


def _restored(manager: CheckpointManager, step: int) -> bytes:
    return Path(manager.restore(step)).read_bytes()


@LOCAL_AND_S3
def test_background_bytes_are_staged_and_written_by_the_save_process_as_a_blocking_save_writes_them(
        store, monkeypatch):
    """The trainer's writer is broken on purpose; the bytearray is changed at once after save() returned."""
    data = bytearray(_data(1))
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, async_save=True) as m:
        m.save(bytes(data), 1, blocking=True)
        with monkeypatch.context() as patched:
            patched.setattr("taskpoint.manager.kinds.payload.write_payload", _refuse_here)
            m.save(data, 2)
            data[:8] = b"changed!"  # the segment is the save process's now: this changes nothing saved
            m.wait_until_finished()
        blocking, background = m.describe(1), m.describe(2)
        assert (background.kind, background.payload_kind, background.codec) == ("payload", "bytes", "raw")
        assert (background.kind, background.payload_kind, background.codec) == \
            (blocking.kind, blocking.payload_kind, blocking.codec)
        assert (background.size, background.blake3) == (blocking.size, blocking.blake3)
        assert _restored(m, 2) == _data(1)
        assert m.verify(2).healthy
        saver = m._background.saver.pid
    assert staged_segments(os.getpid(), saver) == []  # freed once written (or kept for a next save until close)


_TRAINER = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]  # this module, and the helpers it imports
    from test_staged_bytes import _data
    from taskpoint import CheckpointManager

    m = CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]), async_save=True, preemption=False)
    data = bytearray(_data(1))
    m.save(data, 1)
    print(m._background.saver.pid, flush=True)
    while True:  # training: the buffer changes at once
        data[:8] = b"changed!"
        data[-8:] = b"changed!"
""")


@pytest.mark.slow
@LOCAL_AND_S3
def test_a_trainer_killed_right_after_a_staged_bytes_save_returned_loses_nothing(store):
    uri = store.url("ckpts")
    trainer, helper = kill_trainer_after_return(
        _TRAINER, [uri, json.dumps(store.fs_options), str(Path(__file__).parent)], GRACE_SECONDS, 0.0)
    with CheckpointManager(uri, storage_options=store.storage_options) as m:
        assert m.latest_step() == 1 and m.describe(1).payload_kind == "bytes"
        assert _restored(m, 1) == _data(1)
    assert staged_segments(trainer, helper) == []


def _saved(step: int) -> bytearray:
    """What the trainers save as ``step``."""
    return bytearray(_data(step))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_save_process_killed_in_the_middle_of_a_bytes_write_commits_nothing_and_its_segment_is_freed(s3_server):
    """The upload of step 2's object is held by the proxy; the trainer is SIGKILLed, then its save process while it
    writes: step 2 is not committed, step 1 restores, and the next manager's save process frees the segment."""
    uri = f"s3://taskpoint-tests/held-staged-bytes-{os.getpid()}-{time.monotonic_ns()}/ckpts"
    kill_save_process_mid_write("test_staged_bytes:_saved", s3_server, uri, "payload-", lambda m: _check_restored(m, 1))


def _check_restored(manager: CheckpointManager, step: int) -> None:
    assert _restored(manager, step) == _data(step)
