"""A sweep of deduplicated chunks that dies (SIGKILL) or stops (SIGSTOP) in the middle of removing: the next save
waits for it a bounded time far below the grace (its lock's heartbeat, not the grace, bounds the wait), says what it
waits for, and commits a step that restores; a stopped sweep, once continued, removes nothing more.

The sweeper is tests/_sweep_worker.py, a real process running the library's own gc(), halted at a chosen removal;
the managers here keep the default grace of 900 s, so a save that waited for the grace would never end within the
bound the tests poll for.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import WorkerProcess
from taskpoint import CheckpointManager

WORKER = Path(__file__).parents[1] / "_sweep_worker.py"
#: Local disk and SeaweedFS (conditional writes) in make test; moto as well in make reliability.
LOCAL_S3_SEAWEED = pytest.mark.parametrize("store", [
    "local", pytest.param("s3", marks=pytest.mark.campaign("the dead sweeper on moto too (make test: local, Seaweed)")),
    "s3-seaweed"], indirect=True)
#: Files (one chunk each) of every step saved here, and their size.
FILES, SIZE = 12, 48 << 10
#: Chunks the sweeper removes before it halts.
HALT_AT = 5
#: The longest a save may wait for the dead or stopped sweeper here: far below the grace of 900 s, and generous on
#: a busy machine (the wait itself is 5 heartbeat periods, 10 s).
BOUND = 240.0


def content(seed: int) -> dict[str, bytes]:
    return {f"f{i}.bin": random.Random(seed * 1000 + i).randbytes(SIZE) for i in range(FILES)}


def folder(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def manager(store: Any) -> CheckpointManager:
    return CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True, preemption=False,
                             background_process=False)


def restored(mgr: CheckpointManager, step: int) -> dict[str, bytes]:
    out = mgr.restore(step)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def chunk_count(store: Any) -> int:
    with manager(store) as mgr:
        return len(mgr._dedup.chunks.listing())


def sweep_locks(store: Any) -> list[str]:
    with manager(store) as mgr:
        return [name for name in mgr._dedup.chunks.leases() if name.startswith("gc-")]


class Sweeper(WorkerProcess):
    """tests/_sweep_worker.py in a real process: gc() with grace 0, halted after ``HALT_AT`` removals."""

    def __init__(self, store: Any, how: str) -> None:
        super().__init__(WORKER, {"directory": store.url("ckpts"), "options": store.storage_options, "grace": 0,
                                  "at": HALT_AT, "how": how})

    def finish(self) -> tuple[dict[str, Any], str]:
        """SIGCONT, then the sweep's outcome and its log."""
        outcome = self.resume()
        return outcome, self.stderr()


def three_steps_two_deleted(store: Any, tmp_path: Path) -> dict[int, dict[str, bytes]]:
    """Steps 1-3 saved, 1 and 2 deleted: their chunks are what a sweep removes."""
    contents = {step: content(step) for step in (1, 2, 3)}
    with manager(store) as mgr:
        for step, files in contents.items():
            mgr.save(folder(tmp_path / f"in{step}", files), step)
        mgr.delete(1)
        mgr.delete(2)
    return contents


def within_bound(call: Callable[[], object], what: str) -> None:
    """``call`` on a thread, which must return within BOUND."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"{what} still waits after {BOUND:g} s (the grace is 900 s)"
    assert not isinstance(outcome[0], BaseException), outcome


def save_within_bound(mgr: CheckpointManager, source: Path, step: int) -> None:
    """A blocking save, which must end within BOUND."""
    within_bound(lambda: mgr.save(source, step, blocking=True), f"the save of step {step}")


@LOCAL_S3_SEAWEED
def test_a_save_after_a_sweeper_killed_mid_sweep_waits_a_bounded_time_says_for_what_and_commits(
        store: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The sweeper is SIGKILLed after removing some of the deleted steps' chunks, its lock fresh (renewed until
    the kill). A new manager (grace 900 s) saves step 4 with step 1's content: it warns that it waits for that
    lock, takes the sweeper for dead once its heartbeat stopped, and commits well within BOUND; steps 3 and 4
    restore and verify."""
    contents = three_steps_two_deleted(store, tmp_path)
    before = chunk_count(store)
    sweeper = Sweeper(store, "hang")
    try:
        sweeper.wait_for("removing")
        assert chunk_count(store) == before - HALT_AT  # it is in the middle of removing
        [lock] = sweep_locks(store)
    finally:
        sweeper.kill()
    caplog.set_level(logging.INFO, logger="taskpoint")
    with manager(store) as mgr:
        save_within_bound(mgr, folder(tmp_path / "in4", contents[1]), 4)
        assert mgr.steps() == [3, 4]
        assert restored(mgr, 3) == contents[3] and restored(mgr, 4) == contents[1]
        assert mgr.verify().healthy
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    waits = [m for m in warnings if f"waits for the sweep whose lock is leases/{lock}" in m]
    assert len(waits) == 1 and "ago" in waits[0], warnings  # once, with the lock's age
    assert any(f"takes the sweep leases/{lock} for dead" in m for m in warnings), warnings
    assert sweep_locks(store) == []  # later saves do not wait for it again


@LOCAL_S3_SEAWEED
def test_a_stopped_sweeper_taken_for_dead_removes_nothing_more_once_continued(store: Any, tmp_path: Path) -> None:
    """The sweeper is SIGSTOPped after removing some chunks; a new manager saves steps 4 and 5 reusing every
    chunk of the deleted steps (taking the sweeper for dead after its heartbeat stopped), then the sweeper is
    continued: it stops removing, says why, and every committed step restores and verifies: none names a chunk
    the sweeper removed."""
    contents = three_steps_two_deleted(store, tmp_path)
    sweeper = Sweeper(store, "stop")
    try:
        sweeper.wait_for("stopping", stopped=True)
        with manager(store) as mgr:
            save_within_bound(mgr, folder(tmp_path / "in4", contents[1]), 4)
            save_within_bound(mgr, folder(tmp_path / "in5", contents[2]), 5)
        outcome, log = sweeper.finish()
    finally:
        sweeper.kill()
    assert outcome["event"] == "swept", outcome
    with manager(store) as mgr:
        assert mgr.steps() == [3, 4, 5]
        for step, files in ((3, contents[3]), (4, contents[1]), (5, contents[2])):
            assert restored(mgr, step) == files
        assert mgr.verify().healthy
    assert sum("/chunks/" in uri for uri in outcome["removed"]) == HALT_AT, outcome  # nothing after the stop
    assert f"stops after removing {HALT_AT} of" in log, log


@pytest.mark.parametrize("store", [
    pytest.param("local", marks=pytest.mark.campaign("background saves after a dead sweeper on local disk too")),
    "s3"], indirect=True)
def test_background_saves_after_a_sweeper_killed_mid_sweep_commit_and_the_next_save_goes_on(
        store: Any, tmp_path: Path) -> None:
    """What a trainer resumed after a crash during a sweep does: background saves (through the manager's save
    process) of steps 4 and 5 after the sweeper was SIGKILLed mid-sweep; the second waits for the first, which
    waits for the dead sweep's heartbeat, not the grace: both commit within BOUND and restore."""
    contents = three_steps_two_deleted(store, tmp_path)
    sweeper = Sweeper(store, "hang")
    try:
        sweeper.wait_for("removing")
    finally:
        sweeper.kill()
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                           preemption=False) as mgr:
        def two_saves() -> None:
            mgr.save(folder(tmp_path / "in4", contents[1]), 4, blocking=False)
            mgr.save(folder(tmp_path / "in5", contents[2]), 5, blocking=False)
            mgr.wait_until_finished()

        within_bound(two_saves, "the background saves of steps 4 and 5")
        assert mgr.steps() == [3, 4, 5]
        for step, files in ((3, contents[3]), (4, contents[1]), (5, contents[2])):
            assert restored(mgr, step) == files
