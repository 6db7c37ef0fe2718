"""Background saves from the manager's helper process: where the work runs, and what happens when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from helpers import make_tree, process_gone, snapshot
from taskpoint import CheckpointManager, StorageError
from taskpoint.manager import saver as _saver

LOCAL_AND_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
TIMEOUT = 60


def manager(store, **kwargs) -> CheckpointManager:
    return CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, **kwargs)


def _refuse_here(*args, **kwargs):
    raise AssertionError("the payload was written from the caller's process")


@LOCAL_AND_S3
def test_background_payloads_are_written_by_the_helper_process(store, tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree", big=1 << 20)
    weights = tmp_path / "w.bin"
    weights.write_bytes(os.urandom(200_000))
    # The caller's own writer is broken on purpose: every background payload must go through the child.
    monkeypatch.setattr("taskpoint.manager.background.write_payload", _refuse_here)
    with manager(store) as m:
        for step, data in ((1, tree), (2, weights), (3, bytearray(b"abc" * 1000))):
            m.save(data, step, blocking=False)
            m.wait_until_finished()
        pid = m._background.saver.pid
        assert m._background.saver.alive()
        assert snapshot(m.restore(1)) == snapshot(tree)
        assert m.restore(2).read_bytes() == weights.read_bytes()
        assert m.restore(3).read_bytes() == b"abc" * 1000
        assert m.steps() == [1, 2, 3]
    assert process_gone(pid, TIMEOUT)  # close() ends it


def test_background_process_false_and_memory_urls_use_a_thread(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(_saver.SaverProcess, "__init__", lambda self: started.append(1) or None)
    for directory, options in ((tmp_path / "off", {"background_process": False}),
                               (f"memory://{uuid.uuid4().hex}/ckpts", {})):
        with CheckpointManager(directory, **options) as m:
            m.save(b"x" * 100, 1, blocking=False)
            m.wait_until_finished()
            assert m.restore(1).read_bytes() == b"x" * 100
    assert started == []


def test_an_error_in_the_helper_process_keeps_its_type_and_tells_where(s3_store):
    m = CheckpointManager(f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/ckpts",
                          storage_options=s3_store.storage_options)
    m.save(b"x", 1, blocking=False)
    with pytest.raises(StorageError, match="does not exist") as info:
        m.wait_until_finished()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "raised in taskpoint's save process" in notes and "step 1" in notes
    m.close()


@LOCAL_AND_S3
def test_a_helper_killed_in_the_middle_of_a_save_loses_nothing(store, tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree", big=2 << 20)
    real = _saver.SaverProcess.store_payload
    killed = []

    def kill_then_write(self, *args, **kwargs):
        if not killed:  # a real SIGKILL of the real child, at the moment its request is about to be sent
            os.kill(self.pid, signal.SIGKILL)
            self._process.wait(TIMEOUT)
            killed.append(self.pid)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_saver.SaverProcess, "store_payload", kill_then_write)
    with manager(store) as m:
        with pytest.warns(RuntimeWarning, match="died"):
            m.save(tree, 1, blocking=False)
            m.wait_until_finished()
        assert m.steps() == [1]
        assert snapshot(m.restore(1)) == snapshot(tree)
        m.save(b"after", 2, blocking=False)  # a new helper takes the next save
        m.wait_until_finished()
        assert m._background.saver.pid != killed[0]
        assert m.restore(2).read_bytes() == b"after"


def test_a_helper_that_cannot_start_falls_back_to_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with CheckpointManager(tmp_path / "ckpts") as m:
        with pytest.warns(RuntimeWarning, match="could not start its save process"):
            m.save(b"x", 1, blocking=False)
            m.wait_until_finished()
        m.save(b"y", 2, blocking=False)  # no second attempt, no second warning
        m.wait_until_finished()
        assert [m.restore(s).read_bytes() for s in (1, 2)] == [b"x", b"y"]


def test_the_helper_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from taskpoint import CheckpointManager
        m = CheckpointManager({str(tmp_path / "ckpts")!r})
        m.save(b"x", 1, blocking=False)
        m.wait_until_finished()
        print(m._background.saver.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(parent.stdout.readline())
        os.kill(helper, 0)  # alive while its parent is
        parent.kill()
        parent.wait(TIMEOUT)
        assert process_gone(helper, TIMEOUT), "the save process outlived its killed parent"
    finally:
        parent.kill()
        parent.wait(TIMEOUT)
    assert CheckpointManager(tmp_path / "ckpts").steps() == [1]


def test_a_payload_that_does_not_pickle_is_refused_before_anything_is_sent(tmp_path):
    import threading

    from taskpoint.payloads import DirectoryPayload
    from taskpoint.storage import Location

    class Locked(DirectoryPayload):
        def __init__(self, path):
            super().__init__(path)
            self.lock = threading.Lock()  # locks do not pickle

    saver = _saver.SaverProcess()
    try:
        with pytest.raises(_saver.NotTransferable):
            saver.store_payload(Location(str(tmp_path / "x")), Locked(tmp_path), "gzip", None)
        assert saver.alive()
        assert not (tmp_path / "x").exists()
    finally:
        saver.close()


def test_a_pytree_background_save_is_written_by_the_helper_as_a_pytree_step(tmp_path, recwarn):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from taskpoint.jax import PyTree, load_pytree_sync

    tree = {"w": jnp.arange(12.0).reshape(3, 4), "step": 7}
    with CheckpointManager(tmp_path / "ckpts") as m:
        m.save(PyTree(tree), 1, blocking=False)
        m.wait_until_finished()
        with open(f"/proc/{m._background.saver.pid}/maps") as f:
            assert "jaxlib" in f.read()  # Orbax wrote the staged arrays there
        assert m.describe(1).kind == "jax.pytree"
        restored = load_pytree_sync(m.restore(1))
    assert restored["step"] == 7 and (restored["w"] == tree["w"]).all()
    assert [w for w in recwarn if issubclass(w.category, RuntimeWarning)] == []


def test_snapshots_that_killed_processes_left_are_swept_by_a_later_background_save(tmp_path):
    from taskpoint import workspace
    from taskpoint.manager import background as _manager

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    host = workspace.host_tag()
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(TIMEOUT)  # a pid with no process behind it any more
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    old = time.time() - workspace.LEFTOVER_GRACE_SECONDS - 60

    def leftover(name: str, age: float | None = old):
        folder = scratch / name
        (folder / "tree").mkdir(parents=True)
        (folder / "tree" / "weights.bin").write_bytes(b"w" * 1000)
        if age is not None:
            os.utime(folder, (age, age))
        return folder

    dead = leftover(f"{_manager.SNAPSHOT_PREFIX}{host}-{finished.pid}-abc")
    young_dead = leftover(f"{_manager.SNAPSHOT_PREFIX}{host}-{finished.pid}-def", age=None)
    alive = leftover(f"{_manager.SNAPSHOT_PREFIX}{host}-{sleeper.pid}-ghi")
    other_host = leftover(f"{_manager.SNAPSHOT_PREFIX}00000000-{finished.pid}-jkl")
    not_ours = leftover("taskpoint-snapshot-by-hand")
    try:
        saved = tmp_path / "saved.bin"  # a file is snapshotted (bytes are staged in shared memory instead)
        saved.write_bytes(b"x")
        with CheckpointManager(tmp_path / "ckpts", snapshot_dir=scratch) as m:
            m.save(saved, 1, blocking=False)
            m.wait_until_finished()
        assert not dead.exists()
        assert young_dead.exists() and alive.exists() and other_host.exists() and not_ours.exists()
    finally:
        sleeper.kill()
        sleeper.wait(TIMEOUT)


# -- a trainer killed after save(blocking=False) returned ------------------------------------------------------
# (tests/reliability/handover.py kills trainers at delays of 0 to 1 s after the return; these two pin the
# moments in between that a delay rarely hits)

_KILLED_AT_ITS_COMMIT = textwrap.dedent("""
    import os, signal, sys
    import taskpoint
    from taskpoint.storage import Location

    real = Location.write_small

    def die_at_the_commit(self, data, *args, **kwargs):  # a real SIGKILL once the helper has answered
        if self.uri.endswith("/ckpt-1/taskpoint.json"):
            print(m._background.saver.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, data, *args, **kwargs)

    Location.write_small = die_at_the_commit
    m = taskpoint.CheckpointManager(sys.argv[1], snapshot_dir=sys.argv[2], preemption=False)
    m.save(b"committed by the helper", 1, blocking=False)
    m.wait_until_finished()
""")

_KILLED_WHILE_IDLE = textwrap.dedent("""
    import sys, time
    import taskpoint

    m = taskpoint.CheckpointManager(sys.argv[1], snapshot_dir=sys.argv[2], preemption=False)
    m.save(sys.argv[3], 1, blocking=False)
    m.wait_until_finished()  # committed; the snapshot is kept for the next save of the folder
    print(m._background.saver.pid, flush=True)
    time.sleep(120)
""")


def _run_until_killed(script: str, *args: str) -> int:
    """Run ``script`` until it is SIGKILLed (by itself, or by us once it printed its helper's pid); that pid."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(proc.stdout.readline())
        proc.kill()
        assert proc.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()
    return helper


def test_a_trainer_killed_between_the_helpers_answer_and_its_own_commit_loses_nothing(tmp_path):
    """The helper answers once the payload is stored, and the trainer then writes the manifest: a trainer
    killed at that moment leaves the commit to the helper, whose duty ends only when the trainer says done."""
    helper = _run_until_killed(_KILLED_AT_ITS_COMMIT, str(tmp_path / "ckpts"), str(tmp_path))
    assert process_gone(helper, TIMEOUT)
    with CheckpointManager(tmp_path / "ckpts") as m:
        assert m.steps() == [1]
        assert m.restore(1).read_bytes() == b"committed by the helper"
    assert list(tmp_path.glob("taskpoint-snapshot-*")) == []  # the helper removed the snapshot folder


def test_an_idle_helper_removes_the_snapshot_its_killed_trainer_kept(tmp_path):
    tree = make_tree(tmp_path / "tree", big=1 << 20)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    helper = _run_until_killed(_KILLED_WHILE_IDLE, str(tmp_path / "ckpts"), str(scratch), str(tree))
    assert process_gone(helper, TIMEOUT)
    assert list(scratch.iterdir()) == []
    with CheckpointManager(tmp_path / "ckpts") as m:
        assert snapshot(m.restore(1)) == snapshot(tree)
