"""What a save process owes a trainer that died (issue 43): a request left in its pipe counts as work, so that its
watchdog does not end it before the request is read; and the segments named for it go when it leaves."""

from __future__ import annotations

import os

from taskpoint import workspace
from taskpoint.manager import staging
from taskpoint.manager.saver import pickled, write_message
from taskpoint.manager.saver_child import _Duty


def test_a_request_unread_in_the_pipe_or_being_handled_is_pending_work():
    read_end, write_end = os.pipe()
    try:
        duty = _Duty(read_end)
        assert not duty.pending()
        with os.fdopen(os.dup(write_end), "wb") as stream:
            write_message(stream, pickled(("a request", 1)))
        assert duty.pending()  # sent just before the trainer died: nobody read it yet
        duty.handling.set()
        os.read(read_end, 1 << 16)
        assert duty.pending()  # read, not served yet
        duty.take(None, ())
        duty.handling.clear()
        assert duty.pending()  # served: its step is not committed
        duty.end()
        assert not duty.pending()
    finally:
        os.close(read_end)
        os.close(write_end)


def test_leaving_frees_the_segments_named_for_this_process_and_no_others(tmp_path):
    mine = workspace.owner_tag(os.getpid())
    other = f"{mine.split('-')[0]}-{os.getppid()}-{workspace.process_start(os.getppid())}"
    ours = [staging.Segment.create(4096, mine, tmp_path) for _ in range(2)]
    theirs = staging.Segment.create(4096, other, tmp_path)
    for segment in (*ours, theirs):
        segment.unmap()
    assert sorted(staging.free_owned_segments(mine, tmp_path)) == sorted(segment.path for segment in ours)
    assert [path.name for path in tmp_path.iterdir()] == [theirs.path.name]
