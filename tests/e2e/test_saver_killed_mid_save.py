"""A save process SIGKILLed in the middle of a staged save while its trainer lives (issue 43), beside another process
that sweeps dead owners' segments every few milliseconds (as another manager on the machine does): the save fails
with an error that names the step and how the save process ended, nothing of it is committed, the previous step
restores, the next save is written by a new save process, and no segment is left.

Before, the trainer wrote the step itself from the segment when it found it, and raised "removed while the save was
in flight" when a sweep had taken it first: which of the two happened was a race."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from _fault_proxy import fault_proxy
from _staged_kills import HELD_TIMEOUT, TIMEOUT
from helpers import own_staging_folder, process_gone, staged_segments, wait_until
from taskpoint import CheckpointError, CheckpointManager
from taskpoint.workspace import how_it_ended

torch = pytest.importorskip("torch")
from taskpoint.torch import load_state_dict_sync  # noqa: E402
from test_staged_saves import _assert_same, _saved, _state  # noqa: E402

#: The sweeper: ``sweep_dead_segments()`` every 5 ms until its stdin closes (or, a bound, 900 s pass); it prints
#: ``ready`` once it has swept once, and each segment it removes.
_SWEEPER = textwrap.dedent("""
    import os, select, sys, time
    from taskpoint.manager.staging import sweep_dead_segments

    end = time.monotonic() + 900
    sweep_dead_segments()
    print("ready", flush=True)
    while time.monotonic() < end and not select.select([sys.stdin], [], [], 0.005)[0]:
        for path in sweep_dead_segments():
            print(path.name, flush=True)
""")


@contextlib.contextmanager
def _sweeper() -> Iterator[subprocess.Popen[str]]:
    """A process sweeping dead owners' segments beside the test, stopped (its stdin closed) at the end."""
    sweeper = subprocess.Popen([sys.executable, "-c", _SWEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert sweeper.stdout.readline().strip() == "ready"
        yield sweeper
    finally:
        sweeper.stdin.close()
        try:
            sweeper.wait(TIMEOUT)
        finally:
            sweeper.kill()
            sweeper.wait()
            sweeper.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_save_process_killed_mid_write_fails_the_save_clearly_and_the_next_save_works(s3_server):
    uri = f"s3://taskpoint-tests/killed-mid-save-{os.getpid()}-{time.monotonic_ns()}/ckpts"
    held: list[str] = []

    def hold(method: str, path: str) -> bool:
        if method in ("PUT", "POST") and "/ckpt-2/state-" in path:
            held.append(path)
            return True
        return False

    # the sweeper sweeps only this test's own folder: a sweep of the shared one every 5 ms would race the tests
    # beside it that count on a dead owner's segment staying until they sweep
    with own_staging_folder(), fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy, _sweeper():
        proxy.hold = hold
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        with CheckpointManager(uri, storage_options=options, async_save=True, preemption=False) as m:
            m.save(_saved(1), 1, blocking=True)
            m.save(_saved(2), 2)
            killed = m._background.saver
            # the save process is in the middle of its write (after importing torch at nice +10)
            assert wait_until(lambda: held, HELD_TIMEOUT)
            assert staged_segments(killed.pid), "the save process holds the segment while it writes"
            os.kill(killed.pid, signal.SIGKILL)
            with pytest.raises(CheckpointError) as raised:
                m.wait_until_finished()
            message = str(raised.value)
            assert f"save process (pid {killed.pid}) died: killed by SIGKILL" in message, message
            assert "ckpt-2" in message and "background save of step 2" in message, message
            assert staged_segments(os.getpid(), killed.pid) == [], "the failed save's segment is freed"
            assert m.steps() == [1]
            _assert_same(load_state_dict_sync(m, 1, mmap=True), _state(1))

            m.save(_saved(3), 3)
            m.wait_until_finished()
            new = m._background.saver
            assert new is not None and new.pid != killed.pid
            assert m.steps() == [1, 3]
            _assert_same(load_state_dict_sync(m, 3, mmap=True), _state(3))
        assert process_gone(new.pid, TIMEOUT)
        assert staged_segments(os.getpid(), killed.pid, new.pid) == []


def test_how_a_process_ended_is_said_by_its_signal_or_status_and_a_running_one_is_still_ending():
    exits = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert how_it_ended(exits, TIMEOUT) == "exit status 3"
    runs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert how_it_ended(runs, 0.01) == "still ending"
        runs.send_signal(signal.SIGTERM)
        assert how_it_ended(runs, TIMEOUT) == "killed by SIGTERM"
    finally:
        runs.kill()
        runs.wait()
