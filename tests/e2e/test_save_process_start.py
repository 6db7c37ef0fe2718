"""A manager's save process is not waited for as it starts (issue 43): the first background save of a manager that
did not start it ahead blocks for a spawn, not for a Python start; a save process that exits with an error before it
is ready is not started again; and one whose trainer died before it started still serves the request in its pipe."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

from helpers import ORPHAN_EXIT_SLACK, process_gone
from taskpoint import CheckpointManager
from taskpoint.manager import saver as _saver

TIMEOUT = 120
#: A child that starts the save process's loop only once ``sys.argv[2]`` exists: a Python start that takes as long
#: as the test says.
_HELD_CHILD = ("import os, sys, time\n"
               "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
               "from taskpoint.manager.saver_child import serve; serve(int(sys.argv[1]))")


@pytest.fixture
def held_start(tmp_path, monkeypatch):
    """The flag file whose creation lets the manager's save process start."""
    flag = tmp_path / "start"
    real = _saver.subprocess.Popen

    def popen(args, **kwargs):
        if args[1:3] == ["-c", _saver._CHILD]:
            args = [args[0], "-c", _HELD_CHILD, args[3], str(flag)]
        return real(args, **kwargs)

    monkeypatch.setattr(_saver.subprocess, "Popen", popen)
    return flag


def _returns(call) -> bool:
    """Whether ``call()`` returns within TIMEOUT seconds (on a thread: a call that hangs fails the test only)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    return not thread.is_alive()


def test_a_first_background_save_returns_before_its_save_process_has_started(tmp_path, held_start):
    with CheckpointManager(tmp_path / "ckpts") as m:
        assert _returns(lambda: m.save(b"first", 1, blocking=False)), "save() waited for the save process to start"
        saver = m._background.saver
        assert saver is not None and not saver.started
        held_start.touch()
        m.wait_until_finished()
        assert saver.started and m._background.saver is saver  # written by the save process, not a fallback
        assert m.restore(1).read_bytes() == b"first"


def test_a_save_process_that_exits_before_it_is_ready_is_not_started_again(tmp_path, monkeypatch):
    monkeypatch.setattr(_saver, "_CHILD", "import sys; sys.exit(3)")
    with CheckpointManager(tmp_path / "ckpts") as m:
        with pytest.warns(RuntimeWarning, match="died"):  # the first save is written from this process
            m.save(b"x", 1, blocking=False)
            m.wait_until_finished()
        with pytest.warns(RuntimeWarning, match="could not start its save process .*exited with code 3"):
            m.save(b"y", 2, blocking=False)
            m.wait_until_finished()
        assert m._background.saver is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no third attempt, no third warning
            m.save(b"z", 3, blocking=False)
            m.wait_until_finished()
        assert [m.restore(step).read_bytes() for step in (1, 2, 3)] == [b"x", b"y", b"z"]


_TRAINER = textwrap.dedent("""
    import sys
    from taskpoint import CheckpointManager
    from taskpoint.manager import saver

    real = saver.subprocess.Popen

    def popen(args, **kwargs):  # the save process starts only once the test creates sys.argv[2]
        if args[1:3] == ["-c", saver._CHILD]:
            args = [args[0], "-c", sys.argv[3], args[3], sys.argv[2]]
        return real(args, **kwargs)

    saver.subprocess.Popen = popen
    m = CheckpointManager(sys.argv[1], preemption=False)
    m.save(b"first", 1, blocking=False)
    print(m._background.saver.pid, flush=True)
    sys.stdin.readline()
""")


def test_a_trainer_killed_before_its_save_process_started_loses_nothing(tmp_path):
    """The first background save returned with its save process not started yet; the trainer is SIGKILLed; the
    save process then starts with its parent gone, and still serves the request in its pipe."""
    flag, uri = tmp_path / "start", str(tmp_path / "ckpts")
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, uri, str(flag), _HELD_CHILD], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        helper = int(trainer.stdout.readline() or "0")
        assert helper, "the trainer did not return from its save"
        trainer.kill()
        assert trainer.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        trainer.kill()
        trainer.wait(TIMEOUT)
    flag.touch()
    assert process_gone(helper, TIMEOUT + ORPHAN_EXIT_SLACK), "the save process outlived its grace"
    with CheckpointManager(uri) as m:
        assert m.steps() == [1] and m.restore(1).read_bytes() == b"first"
