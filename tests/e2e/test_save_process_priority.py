"""The save process runs ``NICENESS`` lower in CPU priority than the trainer, except while the trainer waits for it:
then a lower priority yields nothing to the trainer, and any other work on the machine would starve the save the
trainer waits for (a training loop's next ``save()`` stalled for minutes beside CPU burners). A real save process,
held with SIGSTOP while the trainer waits on it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import pytest

from helpers import wait_until
from taskpoint import CheckpointManager
from taskpoint.manager import background
from taskpoint.manager.saver import NICENESS

TIMEOUT = 60


def niceness(pid: int) -> set[int]:
    """The niceness of each thread of process ``pid``."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        found.add(int(stat.rpartition(")")[2].split()[16]))  # field 19 of stat: nice
    return found


def permitted_to_raise() -> bool:
    """Whether this process may lower a niceness (``CAP_SYS_NICE``): what raising the save process needs."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, own - 1)
    except PermissionError:
        return False
    os.setpriority(os.PRIO_PROCESS, 0, own)
    return True


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads' niceness from /proc")
@pytest.mark.skipif(not permitted_to_raise(), reason="raising the save process's priority needs CAP_SYS_NICE")
def test_the_save_process_runs_at_the_trainers_priority_only_while_the_trainer_waits_for_it(tmp_path, monkeypatch,
                                                                                               caplog):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setattr(background, "WAIT_LOG_SECONDS", 0.05)  # the wait's log line, every 0.05 s here
    caplog.set_level(logging.INFO, logger="taskpoint")
    with CheckpointManager(tmp_path / "ckpts") as manager:
        manager.save(b"first" * 1000, 1, blocking=False)
        manager.wait_until_finished()
        saver = manager._background.saver
        assert saver is not None and saver.alive()
        assert own + NICENESS in niceness(saver.pid)  # while the trainer trains
        os.kill(saver.pid, signal.SIGSTOP)  # the save of step 2 cannot finish while the trainer waits for it
        try:
            manager.save(b"second" * 1000, 2, blocking=False)  # returns once the request is in the pipe
            waiter = threading.Thread(target=manager.wait_until_finished)
            waiter.start()
            assert wait_until(lambda: niceness(saver.pid) == {own}, TIMEOUT), niceness(saver.pid)
            line = f"for the background save of step 2 (save process pid {saver.pid}, at this process's CPU priority"
            assert wait_until(lambda: any(line in record.getMessage() for record in caplog.records), TIMEOUT), (
                caplog.text)  # the wait says so while it lasts
            assert waiter.is_alive()
        finally:
            os.kill(saver.pid, signal.SIGCONT)
        waiter.join(TIMEOUT)
        assert not waiter.is_alive()
        assert niceness(saver.pid) == {own + NICENESS}  # the trainer trains again
        assert manager.steps() == [1, 2]
        assert manager.restore(2).read_bytes() == b"second" * 1000
