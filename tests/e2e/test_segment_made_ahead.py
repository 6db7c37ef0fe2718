"""The staging segment made ahead (issue 43): a manager that resumes with ``async_save=True``, whose newest step is a
staged kind's (a state dict, a PyTree), makes its ready segment when it is made, at that step's size, so that its first
background save copies into allocated pages as a later save does. Nothing is made ahead without such a step or past
``max_staging_bytes``; a save made while the segment is made waits for it and takes it; the segment is freed at
``close()``, by the save process when the trainer is SIGKILLed before any save, and by the next save when the save
process is."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path

import pytest

from helpers import count_segment_creations, process_gone, wait_until
from helpers import staged_segments as _segments
from taskpoint import CheckpointManager
from taskpoint.manager import staging
from taskpoint.manager.segment_files import part_paths

torch = pytest.importorskip("torch")
from taskpoint.torch import StateDict, load_state_dict_sync  # noqa: E402
from test_ready_segment import kill_trainer_holding_a_segment  # noqa: E402
from test_staged_saves import TIMEOUT, _assert_same, _state  # noqa: E402


@pytest.fixture
def creations(monkeypatch) -> list[int]:
    """The sizes of the segments created from now on."""
    return count_segment_creations(monkeypatch)


def _saved_before(directory: Path, state: dict) -> None:
    """Step 1 of ``state`` saved blocking by a manager before, as a process before this one did."""
    with CheckpointManager(directory, preemption=False) as m:
        m.save(StateDict(state), 1)


def _prestarted(m: CheckpointManager) -> bool:
    """Whether the manager's start of its save process (and of its segment made ahead) is over."""
    return m._background.saver is not None and not any(
        thread.name == "taskpoint-saver-start" for thread in threading.enumerate())


def _plan_size(state: dict) -> int:
    from taskpoint.torch._staged import Plan

    return Plan(state).size


def test_a_manager_that_resumes_makes_its_first_segment_ahead_and_its_first_save_copies_into_it(tmp_path, creations):
    directory = tmp_path / "ckpts"
    _saved_before(directory, _state(1))
    creations.clear()
    with CheckpointManager(directory, async_save=True, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m), TIMEOUT)
        ahead = m._background.staging.ready
        assert ahead is not None and creations == [ahead.size] and ahead.size >= _plan_size(_state(2))
        allocated = sum(os.stat(path).st_blocks * 512 for path in part_paths(ahead.path))  # of all its files
        assert allocated >= ahead.size  # its pages allocated: none left for the copy
        saver = m._background.saver.pid
        assert _segments(os.getpid(), saver) == [ahead.path]  # named for the save process
        assert m._background.staging.budget.held == ahead.size
        m.save(StateDict(_state(2)), 2)
        m.wait_until_finished()
        assert len(creations) == 1  # the first save made none
        ready = m._background.staging.ready
        assert ready.path == ahead.path and ready.size == _plan_size(_state(2))  # resized to the state
        _assert_same(load_state_dict_sync(m, 2, mmap=True), _state(2))
    assert _segments(os.getpid(), saver) == []


def test_nothing_is_made_ahead_without_a_staged_newest_step_past_the_staging_bound_or_with_dedup(tmp_path, creations):
    with CheckpointManager(tmp_path / "fresh", async_save=True, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m), TIMEOUT)
        assert m._background.staging.ready is None
    with CheckpointManager(tmp_path / "bytes", preemption=False) as m:
        m.save(b"x" * 100_000, 1)
    with CheckpointManager(tmp_path / "bytes", async_save=True, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m), TIMEOUT)
        assert m._background.staging.ready is None  # bytes: only a state dict's or a PyTree's step
    _saved_before(tmp_path / "bound", _state(1))
    bound = _plan_size(_state(1)) // 2
    with CheckpointManager(tmp_path / "bound", async_save=True, max_staging_bytes=bound, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m), TIMEOUT)
        assert m._background.staging.ready is None and m._background.staging.budget.held == 0
    with CheckpointManager(tmp_path / "bound", async_save=True, dedup=True, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m), TIMEOUT)
        assert m._background.staging.ready is None  # its saves are chunked, never staged
    with CheckpointManager(tmp_path / "bound", preemption=False) as m:  # no async_save: no save process ahead
        assert m._background.saver is None and m._background.staging.ready is None
    assert creations == []


def test_a_save_made_while_the_segment_is_made_ahead_waits_for_it_and_takes_it(tmp_path, creations, monkeypatch):
    directory = tmp_path / "ckpts"
    _saved_before(directory, _state(1))
    creations.clear()
    release, reserve = threading.Event(), staging.Segment.reserve

    def held_back(segment):  # the pages' allocation, held until the save below is under way
        assert release.wait(TIMEOUT)
        reserve(segment)

    monkeypatch.setattr(staging.Segment, "reserve", held_back)
    with CheckpointManager(directory, async_save=True, preemption=False) as m:
        assert wait_until(lambda: m._background.staging._making, TIMEOUT)
        first = threading.Thread(target=m.save, args=(StateDict(_state(2)), 2))
        first.start()
        first.join(0.5)
        assert first.is_alive(), "the first save returned before the segment made ahead was ready"
        release.set()
        first.join(TIMEOUT)
        assert not first.is_alive()
        m.wait_until_finished()
        assert len(creations) == 1  # the one made ahead, which the save took
        assert _segments(os.getpid(), m._background.saver.pid) == [m._background.staging.ready.path]
        _assert_same(load_state_dict_sync(m, 2, mmap=True), _state(2))


def test_a_save_process_killed_before_the_first_save_leaves_its_segment_to_that_save(tmp_path, creations):
    directory = tmp_path / "ckpts"
    _saved_before(directory, _state(1))
    with CheckpointManager(directory, async_save=True, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m) and m._background.staging.ready is not None, TIMEOUT)
        dead, ahead = m._background.saver.pid, m._background.staging.ready.path
        os.kill(dead, signal.SIGKILL)
        assert process_gone(dead, TIMEOUT)
        m.save(StateDict(_state(2)), 2)
        m.wait_until_finished()
        assert not ahead.exists()  # named for the dead save process: freed, not written into
        alive = m._background.saver.pid
        assert alive != dead and _segments(os.getpid(), alive) == [m._background.staging.ready.path]
        _assert_same(load_state_dict_sync(m, 2, mmap=True), _state(2))
    assert _segments(os.getpid(), dead, alive) == []


_TRAINER = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [sys.argv[2], sys.argv[2] + "/.."]  # test_staged_saves, and the helpers it imports
    from taskpoint import CheckpointManager
    import taskpoint.torch  # noqa: F401  (the state dict kind, staged)

    m = CheckpointManager(sys.argv[1], async_save=True, preemption=False)
    while m._background.staging.ready is None:
        time.sleep(0.01)
    print(m._background.saver.pid, m._background.staging.ready.path, flush=True)
    sys.stdin.readline()  # killed here
""")


def test_a_trainer_killed_before_its_first_save_has_the_segment_made_ahead_freed_by_its_save_process(tmp_path):
    directory = tmp_path / "ckpts"
    _saved_before(directory, _state(1))
    kill_trainer_holding_a_segment(_TRAINER, directory)


def test_a_pytree_step_makes_the_segment_ahead_too(tmp_path, creations):
    jax = pytest.importorskip("jax")
    import numpy as np

    from taskpoint.jax import PyTree, load_pytree_sync

    tree = {"w": jax.numpy.arange(1 << 16, dtype=jax.numpy.float32), "b": np.ones(300, dtype=np.int64), "n": 3}
    directory = tmp_path / "ckpts"
    with CheckpointManager(directory, preemption=False) as m:
        m.save(PyTree(tree), 1)
    creations.clear()
    with CheckpointManager(directory, async_save=True, preemption=False) as m:
        assert wait_until(lambda: _prestarted(m), TIMEOUT)
        ahead = m._background.staging.ready
        assert ahead is not None and creations == [ahead.size] and ahead.size >= (1 << 18) + 300 * 8
        m.save(PyTree(tree), 2)
        m.wait_until_finished()
        assert len(creations) == 1 and m._background.staging.ready.path == ahead.path
        restored = load_pytree_sync(m, step=2)
        assert np.array_equal(restored["w"], tree["w"]) and np.array_equal(restored["b"], tree["b"])
        assert restored["n"] == 3
