"""The process-wide pools (taskpoint.executors): lanes bound each operation, share the threads fairly, cancel
what they queued, report errors; sizes come from the environment; a forked child gets working pools."""

from __future__ import annotations

import os
import threading
import time

import pytest

from taskpoint.executors import CPU, CPU_THREADS_ENV, IO, IO_THREADS_ENV, SharedPool, threads_from_env

WAIT = 30  # seconds a test waits for something that should happen at once (never reached when it works)


def _pool(threads: int, monkeypatch: pytest.MonkeyPatch) -> SharedPool:
    monkeypatch.setenv("TASKPOINT_TEST_THREADS", str(threads))
    return SharedPool("test", "TASKPOINT_TEST_THREADS", lambda: 1)


def test_a_lane_keeps_at_most_its_width_in_flight_and_uses_all_of_it(monkeypatch):
    pool = _pool(8, monkeypatch)
    lane = pool.lane(3)
    lock, running, most = threading.Lock(), [0], [0]
    together = threading.Barrier(3, timeout=WAIT)  # passes only when three tasks run at once

    def task(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        together.wait()
        with lock:
            running[0] -= 1
        return i * i

    with lane:
        assert list(lane.map(task, range(30))) == [i * i for i in range(30)]
    assert most[0] == 3


def test_two_lanes_share_the_pool_and_a_long_queue_does_not_starve_the_other(monkeypatch):
    """A lane with many tasks queued takes its width of the threads; another lane's task runs on the next
    thread that frees, not after the first lane's whole queue."""
    pool = _pool(2, monkeypatch)
    busy, quick = pool.lane(2), pool.lane(1)
    gate, order = threading.Event(), []

    def slow(i: int) -> None:
        gate.wait(WAIT)
        order.append(f"slow{i}")

    jobs = [busy.submit(slow, i) for i in range(20)]
    other = quick.submit(order.append, "quick")
    gate.set()
    other.result(timeout=WAIT)
    for job in jobs:
        job.result(timeout=WAIT)
    assert order.index("quick") <= 2  # after at most the two tasks that held the threads


def test_the_environment_sets_the_sizes_and_a_bad_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(IO_THREADS_ENV, "5")
    monkeypatch.setenv(CPU_THREADS_ENV, " ")
    assert IO.threads == 5
    assert CPU.threads == (len(os.sched_getaffinity(0)) or 1)
    assert threads_from_env("TASKPOINT_UNSET_FOR_TEST", 64) == 64
    for bad in ("0", "-3", "2.5", "many"):
        monkeypatch.setenv(IO_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=IO_THREADS_ENV):
            _ = IO.threads
    pool = _pool(3, monkeypatch)
    monkeypatch.setenv("TASKPOINT_TEST_THREADS", "zero")
    lane = pool.lane(1)
    for job in [lane.submit(int) for _ in range(3)]:  # the pool starts, and refuses, on first use: every task
        with pytest.raises(ValueError, match="TASKPOINT_TEST_THREADS"):
            job.result(timeout=WAIT)
    lane.shutdown(wait=True)  # nothing is left running


@pytest.mark.e2e("forks a child")
def test_a_forked_child_runs_tasks_on_pools_of_its_own():
    """The parent's pool threads do not exist in a forked child (a save process forked from a trainer): the
    child's first task starts new ones instead of waiting forever for the dead ones."""
    assert IO.lane(4).submit(threading.get_ident).result(timeout=WAIT)  # the parent's threads are started
    assert CPU.lane(2).submit(threading.get_ident).result(timeout=WAIT)
    pid = os.fork()
    if pid == 0:  # the child: exits 0 when both pools work
        code = 1
        try:
            with IO.lane(4) as io_lane, CPU.lane(2) as cpu_lane:
                ok = list(io_lane.map(abs, [-1, -2, -3])) == [1, 2, 3] and cpu_lane.submit(sum, [1, 2]).result() == 3
            code = 0 if ok else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's tasks never ran")


def test_cancel_drops_the_queued_tasks_and_lets_the_running_one_finish(monkeypatch):
    pool = _pool(4, monkeypatch)
    lane = pool.lane(1)
    gate, ran = threading.Event(), []
    first = lane.submit(lambda: (gate.wait(WAIT), ran.append("first")))
    queued = [lane.submit(ran.append, i) for i in range(5)]
    assert lane.cancel() == 5
    assert all(job.cancelled() for job in queued)
    gate.set()
    first.result(timeout=WAIT)
    lane.shutdown(wait=True)
    assert ran == ["first"]
    with pytest.raises(RuntimeError):
        lane.submit(int)


def test_errors_reach_the_caller_and_the_lane_goes_on(monkeypatch):
    pool = _pool(2, monkeypatch)
    lane = pool.lane(1)

    def fail(x: int) -> int:
        raise ValueError(f"bad {x}")

    with pytest.raises(ValueError, match="bad 7"):
        lane.submit(fail, 7).result(timeout=WAIT)
    with pytest.raises(ValueError, match="bad 1"):
        list(lane.map(fail, [1, 2, 3]))
    assert lane.submit(sum, [2, 3]).result(timeout=WAIT) == 5  # the failures freed their slots


def test_a_task_that_submits_to_its_own_pool_cannot_deadlock_it(monkeypatch):
    """On a pool of one thread, a task waiting for another task of the same pool would wait forever: a task
    submitted from the pool's own thread runs at once in that thread."""
    pool = _pool(1, monkeypatch)

    def outer() -> int:
        return pool.lane(2).submit(sum, [20, 22]).result(timeout=WAIT)

    assert pool.lane(1).submit(outer).result(timeout=WAIT) == 42
