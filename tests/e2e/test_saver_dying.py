"""A save process whose main thread has ended while its other threads still do (a SIGKILLed one, for a while on a
loaded machine) is no longer alive to the manager: a sweep of dead owners' segments already takes it for gone, so a
save that handed it a segment would see that segment swept in flight. The next save starts a new process instead and
does not reuse the ready segment named for the old one."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import pytest

from dying_job import EndMainThread
from helpers import wait_until
from taskpoint import CheckpointManager
from taskpoint.manager.saver import SaverUnavailable
from taskpoint.manager.staging import Segment
from taskpoint.storage import Location
from taskpoint.workspace import process_start

torch = pytest.importorskip("torch")
from taskpoint.torch import StateDict, load_state_dict_sync  # noqa: E402
from test_staged_saves import TIMEOUT, _assert_same, _segments, _state  # noqa: E402


def test_a_save_process_whose_main_thread_ended_is_replaced_and_its_ready_segment_not_reused(tmp_path):
    with CheckpointManager(tmp_path / "ckpts", async_save=True, preemption=False) as m:
        m.save(StateDict(_state(1)), 1)
        m.wait_until_finished()
        dying, ready = m._background.saver, m._background.staging.ready.path
        segment = Segment.create(4096, dying.owner)

        def end_its_main_thread() -> None:
            with contextlib.suppress(SaverUnavailable):  # it never answers: it ends once it hears from us
                dying.store_staged(Location(str(tmp_path / "never" / "taskpoint.json")), str(segment.path),
                                   EndMainThread())

        request = threading.Thread(target=end_its_main_thread, daemon=True)
        request.start()
        assert wait_until(lambda: process_start(dying.pid) == -1, TIMEOUT)  # a zombie in /proc...
        assert dying.exit_code is None  # ...whose other thread runs: poll() does not see it end
        assert not dying.alive()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no save falls back to this process: the save process did it all
            m.save(StateDict(_state(2)), 2)
            m.wait_until_finished()
        request.join(TIMEOUT)
        assert not request.is_alive()
        alive = m._background.saver
        assert alive.pid != dying.pid and dying.exit_code is not None
        assert not ready.exists() and not segment.path.exists()
        assert _segments(os.getpid(), alive.pid) == [m._background.staging.ready.path]
        assert m._background.staging.ready.path.name.startswith(f"taskpoint-stage-{alive.owner}-")
        _assert_same(load_state_dict_sync(m, 2, mmap=True), _state(2))
