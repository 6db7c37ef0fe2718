"""``taskpoint.ctx()`` inside a Flyte 2 task, with a stand-in for the ``flyte`` module (the real one runs in
tests/e2e/test_flyte_bridge.py): what the context takes from ``flyte.ctx()``, when it is not Flyte's, and how long
its workspace lives."""

from __future__ import annotations

import gc
import shutil
import sys
import types
from dataclasses import dataclass, field

import pytest

import taskpoint


@dataclass
class _Action:
    name: str
    run_name: str


@dataclass
class _FlyteCheckpoint:
    remote_destination: str
    remote_source: str | None

    __hash__ = object.__hash__  # as flyte.Checkpoint: one per attempt, compared by identity


@dataclass
class _FlyteTask:
    checkpoint: _FlyteCheckpoint | None
    mode: str = "remote"
    attempt_number: int = 0
    action: _Action = field(default_factory=lambda: _Action("a0", "run-7"))

    def __bool__(self) -> bool:
        return True


@pytest.fixture
def flyte(monkeypatch):
    """A ``flyte`` module in ``sys.modules`` whose ``ctx()`` returns what the test sets."""
    module = types.ModuleType("flyte")
    module.current = None  # type: ignore[attr-defined]
    module.ctx = lambda: module.current  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flyte", module)
    for name in ("TASKPOINT_CHECKPOINT_PATH", "TASKPOINT_ROOT", "TASKPOINT_RUN_NAME", "TASKPOINT_ACTION_NAME"):
        monkeypatch.delenv(name, raising=False)
    return module


def test_outside_a_flyte_task_there_is_no_context(flyte):
    flyte.current = None
    assert taskpoint.ctx() is None
    flyte.current = _FlyteTask(checkpoint=None)  # a task without checkpoint locations
    assert taskpoint.ctx() is None


def test_on_a_cluster_the_context_takes_flytes_locations_attempt_and_names(flyte, tmp_path, caplog):
    taskpoint.Checkpoint(tmp_path / "1" / "ckpt").save_sync(b"attempt 1")
    shutil.copy2(tmp_path / "1" / "ckpt", tmp_path / "copy")
    flyte.current = _FlyteTask(_FlyteCheckpoint(str(tmp_path / "2" / "ckpt"), str(tmp_path / "1" / "ckpt")),
                               attempt_number=1)
    context = taskpoint.ctx()
    assert (context.run_name, context.action_name, context.attempt) == ("run-7", "a0", 2)
    assert context.checkpoint.remote_destination == str(tmp_path / "2" / "ckpt")
    assert context.checkpoint.load_sync().read_bytes() == b"attempt 1"  # verified by its own record
    assert taskpoint.ctx() is context and context.checkpoints is None
    # Only a local run's source is a copy of the destination: elsewhere no other record vouches for a source.
    flyte.current = _FlyteTask(_FlyteCheckpoint(str(tmp_path / "1" / "ckpt"), str(tmp_path / "copy")))
    assert taskpoint.ctx().checkpoint.load_sync().read_bytes() == b"attempt 1"
    assert "loaded unverified" in caplog.text


def test_the_workspace_goes_when_flyte_drops_the_attempts_checkpoint(flyte, tmp_path):
    taskpoint.Checkpoint(tmp_path / "1").save_sync(b"state")
    flyte.current = _FlyteTask(_FlyteCheckpoint(str(tmp_path / "2"), str(tmp_path / "1")))
    workspace = taskpoint.ctx().checkpoint.load_sync().parent
    assert workspace.is_dir()
    flyte.current = None  # the attempt ended: Flyte drops its task context and checkpoint
    gc.collect()
    assert not workspace.exists()


def test_a_running_taskpoint_task_is_its_own_context_inside_a_flyte_task(flyte, tmp_path):
    flyte.current = _FlyteTask(_FlyteCheckpoint(str(tmp_path / "flyte"), None))

    @taskpoint.task(retries=0, root=str(tmp_path / "root"))
    def inner() -> str:
        return taskpoint.ctx().checkpoint.remote_destination

    assert inner().startswith(str(tmp_path / "root"))
    assert taskpoint.ctx().checkpoint.remote_destination == str(tmp_path / "flyte")
