"""@task under failure: errors met while ending an attempt, subtasks started from threads, and what a failed
attempt tells on every Python version. Real files, real threads, real background saves; nothing mocked."""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
from pathlib import Path

import pytest

from taskpoint import StorageError, ctx, task

BACKGROUND_IN_A_THREAD = {"async_save": True, "background_process": False}


def _block_step(step: int) -> None:
    """Make the next background save of ``step`` fail for real: its folder's name is taken by a file, so the
    payload cannot be written below it (a StorageError, as from a store that refuses the write)."""
    directory = Path(ctx().checkpoints.directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"ckpt-{step}").write_bytes(b"not a folder")


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


# -- item 6: a failed background save does not stop the retries -------------------------------------------


def test_a_failed_background_save_is_noted_and_the_retry_still_happens(tmp_path, caplog):
    attempts = []

    @task(retries=2, root=str(tmp_path), run_name="bg", checkpoints=BACKGROUND_IN_A_THREAD)
    def train() -> str:
        c = ctx()
        attempts.append(c.attempt)
        if c.attempt == 1:
            _block_step(1)
            c.checkpoints.save(b"progress", 1)  # returns at once; the upload fails in the background
            raise RuntimeError("preempted")
        return "done"

    with caplog.at_level(logging.WARNING, logger="taskpoint"):
        assert train() == "done"
    assert attempts == [1, 2]
    [record] = [r for r in caplog.records if "attempt 1 of 3" in r.getMessage()]
    message = record.getMessage()
    assert "RuntimeError: preempted" in message and "retrying" in message
    assert "ending it also failed: StorageError" in message


def test_the_last_attempts_exception_carries_the_cleanup_error_as_a_note(tmp_path):
    @task(retries=0, root=str(tmp_path), checkpoints=BACKGROUND_IN_A_THREAD)
    def train() -> None:
        _block_step(1)
        ctx().checkpoints.save(b"progress", 1)
        raise ValueError("the task's own error")

    with pytest.raises(ValueError, match="the task's own error") as info:
        train()
    notes = _notes(info.value)
    assert "attempt 1 of 1" in notes
    assert "ending attempt 1 also failed: StorageError" in notes


def test_a_cleanup_error_after_the_attempt_returned_is_raised_not_lost_and_not_retried(tmp_path):
    calls = []

    @task(retries=3, root=str(tmp_path), checkpoints=BACKGROUND_IN_A_THREAD)
    def train() -> str:
        calls.append(ctx().attempt)
        _block_step(1)
        ctx().checkpoints.save(b"final state", 1)
        return "result"

    with pytest.raises(StorageError) as info:
        train()
    assert calls == [1]
    assert "returned, but ending it failed" in _notes(info.value)
    assert "background save of step 1" in str(info.value)  # in the message itself: Python 3.10 shows it


def test_every_failed_attempt_is_logged_with_its_number_and_what_follows(tmp_path, caplog):
    @task(retries=1, root=str(tmp_path), run_name="logged")
    def flaky() -> None:
        raise ConnectionError(f"down in attempt {ctx().attempt}")

    with caplog.at_level(logging.WARNING, logger="taskpoint"), pytest.raises(ConnectionError):
        flaky()
    messages = [r.getMessage() for r in caplog.records if r.name == "taskpoint"]
    assert messages == [
        "taskpoint: attempt 1 of 2 of task 'flaky' (run 'logged') failed: ConnectionError: down in attempt 1; "
        "retrying",
        "taskpoint: attempt 2 of 2 of task 'flaky' (run 'logged') failed: ConnectionError: down in attempt 2; "
        "not retrying",
    ]


# -- item 8: subtasks and plain threads -------------------------------------------------------------------


def _actions(root: Path, run: str) -> list[str]:
    return sorted(p.name for p in (root / run).iterdir())


def test_a_subtask_called_from_a_plain_thread_pool_is_refused_every_time(tmp_path):
    """Its parent cannot be told from a plain worker thread (a sibling subtask may be running): refused with
    a clear error, whatever the timing, instead of an action name that depends on it."""
    started = threading.Barrier(4, timeout=30)

    @task(retries=0)
    def shard(i: int) -> int:
        return i

    def call(i: int) -> str:
        started.wait()  # all four workers call at the same moment
        try:
            shard(i)
        except RuntimeError as exc:
            return str(exc)
        return "ran"

    @task(retries=0, root=str(tmp_path), run_name="pool")
    def parent() -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(call, range(4)))

    for _ in range(3):
        outcomes = parent()
        assert all("does not carry the context" in outcome for outcome in outcomes), outcomes
        assert all("contextvars.copy_context().run" in outcome for outcome in outcomes)
    assert _actions(tmp_path, "pool") == ["parent"]


def test_subtasks_in_threads_that_carry_the_context_get_the_same_names_on_every_run(tmp_path):
    started = threading.Barrier(4, timeout=30)

    def work(i: int) -> str:
        started.wait()  # the four subtasks run at the same time: siblings
        c = ctx()
        c.checkpoint.save_sync(f"shard {i}".encode())
        return c.action_name

    @task(retries=0, root=str(tmp_path), run_name="copied")
    def parent() -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(contextvars.copy_context().run, task(name=f"shard-{i}")(work), i)
                       for i in range(4)]
            return [f.result() for f in futures]

    assert parent() == [f"parent.shard-{i}" for i in range(4)]
    assert _actions(tmp_path, "copied") == ["parent", *(f"parent.shard-{i}" for i in range(4))]
    for i in range(4):
        assert (tmp_path / "copied" / f"parent.shard-{i}" / "1" / "checkpoint").read_bytes() == f"shard {i}".encode()


def test_a_plain_thread_never_sees_a_sibling_subtasks_context(tmp_path):
    """With two sibling subtasks running, a plain thread could belong to either: ctx() there is None rather
    than one of them (whose checkpoint it would then write). Inside a single chain it is the innermost."""
    inside = threading.Barrier(3, timeout=30)
    leave = threading.Event()
    seen: dict[str, object] = {}

    def look(label: str) -> None:
        c = ctx()
        seen[label] = c.action_name if c is not None else None

    @task(retries=0)
    def sibling() -> None:
        inside.wait()
        leave.wait(30)

    @task(retries=0)
    def only_child() -> None:
        t = threading.Thread(target=look, args=("chain",))
        t.start()
        t.join()

    @task(retries=0, root=str(tmp_path), run_name="siblings")
    def parent() -> None:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(contextvars.copy_context().run, sibling) for _ in range(2)]
            inside.wait()  # both siblings are running now
            t = threading.Thread(target=look, args=("siblings",))
            t.start()
            t.join()
            leave.set()
            for f in running:
                f.result()
        only_child()

    parent()
    assert seen == {"siblings": None, "chain": "parent.only_child"}
