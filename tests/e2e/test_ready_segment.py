"""The ready segment of staged saves (issue 43): the save process keeps the segment it wrote, and the manager's next
staged save copies into it instead of reserving a new one. It is reused (one creation for many saves), resized to a
state of another size, counted against ``max_staging_bytes``, never written while the save process still reads it,
freed at ``close()``, and freed when the trainer or the save process is SIGKILLed between saves."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from helpers import ORPHAN_EXIT_SLACK, count_segment_creations, process_gone, wait_until
from taskpoint import CheckpointManager

torch = pytest.importorskip("torch")
from taskpoint.torch import StateDict, load_state_dict_sync  # noqa: E402
from test_staged_saves import GRACE_SECONDS, TIMEOUT, _assert_same, _segments, _state  # noqa: E402


@pytest.fixture
def creations(monkeypatch) -> list[int]:
    """The sizes of the segments created from now on."""
    return count_segment_creations(monkeypatch)


def _plan_size(state: dict) -> int:
    from taskpoint.torch._staged import Plan

    return Plan(state).size


def test_later_staged_saves_reuse_the_segment_the_first_one_created_and_close_frees_it(tmp_path, creations):
    with CheckpointManager(tmp_path / "ckpts", async_save=True, preemption=False) as m:
        paths, inodes = [], []
        for step in (1, 2, 3):
            m.save(StateDict(_state(step)), step)
            m.wait_until_finished()
            ready = m._background.staging.ready
            assert ready is not None and ready.size == _plan_size(_state(step))
            paths.append(ready.path)
            inodes.append(os.stat(ready.path).st_ino)
        saver = m._background.saver.pid
        assert creations == [_plan_size(_state(1))]  # one segment for the three saves
        assert len(set(paths)) == 1 and len(set(inodes)) == 1
        assert _segments(os.getpid(), saver) == [paths[0]]
        assert m._background.staging.budget.held == _plan_size(_state(3))
        for step in (1, 2, 3):
            _assert_same(load_state_dict_sync(m, step, mmap=True), _state(step))
    assert _segments(os.getpid(), saver) == []
    assert m._background.staging.ready is None and m._background.staging.budget.held == 0


def test_a_state_of_another_size_resizes_the_ready_segment_instead_of_creating_one(tmp_path, creations):
    small, large = _state(1, floats=1 << 16), _state(2, floats=1 << 18)
    with CheckpointManager(tmp_path / "ckpts", async_save=True, preemption=False) as m:
        for step, state in ((1, small), (2, large), (3, small)):
            m.save(StateDict(state), step)
            m.wait_until_finished()
            ready = m._background.staging.ready
            assert ready.size == os.stat(ready.path).st_size == _plan_size(state)
            assert m._background.staging.budget.held == ready.size
        assert creations == [_plan_size(small)]
        _assert_same(load_state_dict_sync(m, 2), _state(2, floats=1 << 18))
        _assert_same(load_state_dict_sync(m, 3), _state(1, floats=1 << 16))


def _resident(pid: int, path: Path) -> int:
    """The bytes of ``path`` resident in process ``pid``'s mappings of it."""
    resident, inside = 0, False
    with open(f"/proc/{pid}/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            if not line[0].isupper():  # a mapping's first line: its addresses
                inside = path.name in line
            elif inside and line.startswith("Rss:"):
                resident += int(line.split()[1]) * 1024
    return resident


def test_the_ready_segment_counts_against_max_staging_bytes(tmp_path, caplog):
    """A bound with room for one state: every save is staged into the one segment; a state past the bound is saved
    blocking and frees the ready segment, so the staging never holds more than the bound."""
    state = _state(1, floats=1 << 16)
    limit = _plan_size(state) + 4096
    with caplog.at_level(logging.INFO, logger="taskpoint"), \
            CheckpointManager(tmp_path / "ckpts", max_staging_bytes=limit, preemption=False) as m:
        held: list[int] = []
        staging_memory = m._background.staging
        for step in (1, 2, 3):
            state["epoch"] = step
            m.save(StateDict(state), step, blocking=False)
            held.append(staging_memory.budget.held)  # the segment the save process writes now
            m.wait_until_finished()
            held.append(staging_memory.budget.held)  # the ready one
        assert held == [_plan_size(state)] * 6 and max(held) <= limit
        assert not any("exceed max_staging_bytes" in record.getMessage() for record in caplog.records)
        ready, saver = staging_memory.ready.path, m._background.saver.pid
        assert _resident(saver, ready) > 0  # the save process keeps it mapped for the next save
        m.save(StateDict(_state(4, floats=1 << 18)), 4, blocking=False)  # past the bound: blocking
        assert m.steps() == [1, 2, 3, 4]
        assert staging_memory.ready is None and staging_memory.budget.held == 0
        assert _resident(saver, ready) == 0  # freed, although that process still maps it
        assert _segments(os.getpid(), m._background.saver.pid) == []
        _assert_same(load_state_dict_sync(m, 4), _state(4, floats=1 << 18))
    assert any("exceed max_staging_bytes" in record.getMessage() for record in caplog.records)


def test_a_save_made_while_the_save_process_still_reads_the_segment_waits_and_both_steps_restore(tmp_path):
    """The save process is stopped (SIGSTOP) before step 2 is handed over, so it has still to read the segment; step
    3's save, made meanwhile from another thread, waits, and does not copy into it before the process has written
    step 2 and handed it back."""
    with CheckpointManager(tmp_path / "ckpts", async_save=True, preemption=False) as m:
        m.save(StateDict(_state(1)), 1)
        m.wait_until_finished()  # a ready segment, and a warm save process
        saver = m._background.saver.pid
        os.kill(saver, signal.SIGSTOP)
        try:
            state = _state(2)
            m.save(StateDict(state), 2)  # returns: the request is in the pipe
            for tensor in (state["model"]["weight"], state["half"]):
                tensor.mul_(3)  # the caller's tensors: changing them changes nothing saved
            third = threading.Thread(target=m.save, args=(StateDict(_state(3)), 3))
            third.start()
            third.join(0.5)
            assert third.is_alive(), "step 3's save returned while step 2 was not written"
        finally:
            os.kill(saver, signal.SIGCONT)
        third.join(TIMEOUT)
        assert not third.is_alive()
        m.wait_until_finished()
        for step in (1, 2, 3):
            _assert_same(load_state_dict_sync(m, step, mmap=True), _state(step))
        assert _segments(os.getpid(), saver) == [m._background.staging.ready.path]


def _mapped_here(path: Path) -> bool:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return any(path.name in line for line in maps)


def test_a_save_process_killed_between_saves_leaves_a_segment_that_the_next_save_sweeps(tmp_path, creations):
    with CheckpointManager(tmp_path / "ckpts", async_save=True, preemption=False) as m:
        m.save(StateDict(_state(1)), 1)
        m.wait_until_finished()
        dead, ready = m._background.saver.pid, m._background.staging.ready.path
        assert not _mapped_here(ready)  # the trainer writes it by pwrite, and maps it not even then
        os.kill(dead, signal.SIGKILL)
        assert process_gone(dead, TIMEOUT)
        assert ready.exists()  # named for the dead save process: the sweep's, and no save's
        m.save(StateDict(_state(2)), 2)
        m.wait_until_finished()
        assert not ready.exists() and not _mapped_here(ready)  # swept, and unmapped here: its memory is back
        assert len(creations) == 2
        alive = m._background.saver.pid
        assert alive != dead and _segments(os.getpid(), alive) == [m._background.staging.ready.path]
        _assert_same(load_state_dict_sync(m, 2, mmap=True), _state(2))
    assert _segments(os.getpid(), alive) == []


_TRAINER = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[2], sys.argv[2] + "/.."]  # test_staged_saves, and the helpers it imports
    from test_staged_saves import _state
    from taskpoint import CheckpointManager
    from taskpoint.torch import StateDict

    m = CheckpointManager(sys.argv[1], async_save=True, preemption=False)
    m.save(StateDict(_state(1)), 1)
    m.wait_until_finished()
    print(m._background.saver.pid, m._background.staging.ready.path, flush=True)
    sys.stdin.readline()  # killed here
""")


def kill_trainer_holding_a_segment(trainer_script: str, directory: Path) -> None:
    """Start ``trainer_script`` (given ``directory`` and this folder; it prints its save process's pid and the path
    of the segment it holds, then waits), SIGKILL it, and check that its save process ends and frees the segment."""
    trainer = subprocess.Popen([sys.executable, "-c", trainer_script, str(directory), str(Path(__file__).parent)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TASKPOINT_GRACE_SECONDS": str(GRACE_SECONDS)})
    try:
        pid, path = trainer.stdout.readline().split()  # the trainer's wait is bounded by the test's timeout
        helper, segment = int(pid), Path(path)
        assert segment.exists()
        trainer.kill()
        assert trainer.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        trainer.kill()
        trainer.wait(TIMEOUT)
        trainer.stdin.close()
        trainer.stdout.close()
    assert process_gone(helper, GRACE_SECONDS + ORPHAN_EXIT_SLACK), "the save process outlived its trainer"
    assert wait_until(lambda: not segment.exists())
    assert _segments(trainer.pid, helper) == []


def test_a_trainer_killed_between_saves_has_its_ready_segment_freed_by_its_save_process(tmp_path):
    kill_trainer_holding_a_segment(_TRAINER, tmp_path / "ckpts")
    with CheckpointManager(tmp_path / "ckpts") as m:
        _assert_same(load_state_dict_sync(m, 1, mmap=True), _state(1))
